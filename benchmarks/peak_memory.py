"""Peak extra memory of one collection update, relative to the size of its inputs.

Run: ``python benchmarks/peak_memory.py B T [SECTION ...]`` (default sections when none are named).
Linux only: resets the process's peak RSS (``/proc/self/clear_refs``) after the inputs exist, runs
one update, and reads ``VmHWM``. One collection per process, so the peaks do not mix.
"""

from __future__ import annotations

import sys

import torch

from opbc_metrics import OPBCCollection


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def main() -> None:
    b, t = int(sys.argv[1]), int(sys.argv[2])
    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand(b, t, generator=g) * 3.0
    rollout = (trainer + 0.05 * torch.randn(b, t, generator=g)).clamp(max=0.0)
    mask = torch.arange(t)[None, :] < torch.randint(t // 2, t + 1, (b,), generator=g)[:, None]
    sections = sys.argv[3:]
    metrics = OPBCCollection(sections=sections) if sections else OPBCCollection()
    metrics.update(trainer_logprobs=trainer[:2], rollout_logprobs=rollout[:2], response_mask=mask[:2])  # warm-up
    input_bytes = sum(x.numel() * x.element_size() for x in (trainer, rollout, mask))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to the current RSS
    before = _status_kb("VmRSS")
    metrics.update(trainer_logprobs=trainer, rollout_logprobs=rollout, response_mask=mask)
    peak = _status_kb("VmHWM")
    extra = (peak - before) * 1024
    what = "+".join(sections) if sections else "default sections"
    print(f"update ({what}) at {b}x{t}: inputs {input_bytes / 2**20:.1f} MiB, "
          f"peak extra memory {extra / 2**20:.1f} MiB = {extra / input_bytes:.1f}x the inputs")


if __name__ == "__main__":
    main()
