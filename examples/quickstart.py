"""Quickstart: the mismatch metrics of a synthetic batch whose rollout engine drifts from the trainer.

Run: ``python examples/quickstart.py``. The rollout logprobs are the trainer's plus noise that grows
with the step, the way a stale or low-precision rollout engine drifts.
"""

from __future__ import annotations

import torch

from opbc_metrics import OPBCCollection


def drifting_batch(step: int, batch: int = 16, seq: int = 256, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + step)
    trainer = torch.log_softmax(torch.randn(batch, seq, 32, generator=g), dim=-1)[..., 0]
    drift = 0.02 * (1 + step)
    rollout = (trainer + drift * torch.randn(batch, seq, generator=g)).clamp(max=0.0)
    lengths = torch.randint(seq // 4, seq + 1, (batch,), generator=g)
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    return {"trainer_logprobs": trainer, "rollout_logprobs": rollout, "response_mask": mask}


def main() -> dict[str, float]:
    metrics = OPBCCollection()
    for step in range(8):
        metrics.update(drifting_batch(step))
    out = {k: v.item() for k, v in metrics.compute().items()}
    width = max(map(len, out))
    for key, value in out.items():
        print(f"{key:<{width}}  {value: .6g}")
    return out


if __name__ == "__main__":
    main()
