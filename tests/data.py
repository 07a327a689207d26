"""Synthetic batches for tests: drifting logprobs, ragged masks, heavy tails."""

from __future__ import annotations

import torch


def make_batch(
    batch: int = 6,
    seq: int = 20,
    seed: int = 0,
    drift: float = 0.3,
    dtype: torch.dtype = torch.float32,
    heavy_tail: bool = False,
    empty_rows: int = 0,
) -> dict[str, torch.Tensor]:
    """Trainer/rollout logprobs with a right-padded response mask; ``empty_rows`` rows are all masked."""
    g = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(batch, seq, generator=g, dtype=torch.float64) * 4.0
    if heavy_tail:
        # Pareto-like tails: a Gaussian divided by U^(2/3) has tail index 1.5.
        u = torch.rand(batch, seq, generator=g, dtype=torch.float64).clamp_min(1e-12)
        noise = torch.randn(batch, seq, generator=g, dtype=torch.float64) / u ** (2 / 3) * drift
    else:
        noise = torch.randn(batch, seq, generator=g, dtype=torch.float64) * drift
    rollout = (trainer - noise).clamp(max=0.0)  # logprobs are <= 0
    lengths = torch.randint(1, seq + 1, (batch,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).to(torch.int64)
    if empty_rows:
        mask[:empty_rows] = 0
    group_ids = torch.arange(batch) // 2
    return {
        "trainer_logprobs": trainer.to(dtype),
        "rollout_logprobs": rollout.to(dtype),
        "response_mask": mask,
        "group_ids": group_ids,
    }


def concat_batches(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate batches along the batch dim, right-padding the time dim with masked tokens."""
    seq = max(b["trainer_logprobs"].shape[1] for b in batches)
    out: dict[str, list[torch.Tensor]] = {}
    for b in batches:
        for k, v in b.items():
            if v.ndim >= 2:
                pad = seq - v.shape[1]
                v = torch.nn.functional.pad(v, (0, pad), value=0)
            out.setdefault(k, []).append(v)
    return {k: torch.cat(v) for k, v in out.items()}
