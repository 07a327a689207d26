"""Peak extra memory of one collection update, relative to the size of its inputs.

Run: ``python benchmarks/peak_memory.py B T [SECTION ...]`` (default sections when none are named).
Linux only: resets the process's peak RSS (``/proc/self/clear_refs``) after the inputs exist, runs
one update, and reads ``VmHWM``. One collection per process, so the peaks do not mix.

With glibc, every allocation of 128 KiB or more is mapped fresh and unmapped when freed (a fixed
``M_MMAP_THRESHOLD``), and freed heap is trimmed before the measurement: otherwise an update's
temporaries reuse memory the process already holds and the peak RSS misses them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable

import torch

from opbc_metrics import OPBCCollection


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def fixed_malloc() -> ctypes.CDLL | None:
    """Fix glibc's mmap threshold (call first in the measuring process): freed large temporaries are then
    unmapped, not kept for reuse, so the peak RSS sees every temporary of the measured call."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    return libc


def peak_extra_bytes(run: Callable[[], object], libc: ctypes.CDLL | None) -> int:
    """Peak resident memory that ``run()`` adds, in bytes: the heap trimmed, the peak RSS reset to the
    current RSS, then ``run()``. Warm ``run``'s code paths up before, with a small input."""
    if libc is not None:
        libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to the current RSS
    before = _status_kb("VmRSS")
    run()
    return (_status_kb("VmHWM") - before) * 1024


def main() -> None:
    libc = fixed_malloc()
    b, t = int(sys.argv[1]), int(sys.argv[2])
    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand(b, t, generator=g) * 3.0
    rollout = (trainer + 0.05 * torch.randn(b, t, generator=g)).clamp(max=0.0)
    mask = torch.arange(t)[None, :] < torch.randint(t // 2, t + 1, (b,), generator=g)[:, None]
    sections = sys.argv[3:]
    metrics = OPBCCollection(sections=sections) if sections else OPBCCollection()
    metrics.update(trainer_logprobs=trainer[:2], rollout_logprobs=rollout[:2], response_mask=mask[:2])  # warm-up
    input_bytes = sum(x.numel() * x.element_size() for x in (trainer, rollout, mask))
    extra = peak_extra_bytes(lambda: metrics.update(trainer_logprobs=trainer, rollout_logprobs=rollout,
                                                    response_mask=mask), libc)
    what = "+".join(sections) if sections else "default sections"
    print(f"update ({what}) at {b}x{t}: inputs {input_bytes / 2**20:.1f} MiB, "
          f"peak extra memory {extra / 2**20:.1f} MiB = {extra / input_bytes:.1f}x the inputs")


if __name__ == "__main__":
    main()
