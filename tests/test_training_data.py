"""Synthetic training batches for the training-metric tests (every field of the training section); no tests."""

from __future__ import annotations

import torch


def make_training_batch(batch: int = 6, seq: int = 12, vocab: int = 7, seed: int = 0, empty_rows: int = 0,
                        dtype: torch.dtype = torch.float64) -> dict:
    """All training-section fields for ``batch`` sequences; right-padded response mask; ``empty_rows``
    sequences have no response token (aborted)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    lengths = torch.randint(1, seq + 1, (batch,), generator=g)
    lengths[:empty_rows] = 0
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).to(torch.int64)
    old = -torch.rand(batch, seq, generator=g, dtype=torch.float64) * 3.0
    new = old + torch.randn(batch, seq, generator=g, dtype=torch.float64) * 0.3
    logits = randn(batch, seq, vocab, scale=2.0)
    rewards = torch.zeros(batch, seq, dtype=torch.float64)
    rewards[torch.arange(batch), (lengths - 1).clamp_min(0)] = torch.randint(0, 2, (batch,), generator=g).double()
    return {
        "policy_logprobs": new.to(dtype),
        "old_logprobs": old.to(dtype),
        "response_mask": mask,
        "advantages": randn(batch, seq),
        "values": randn(batch, seq, scale=2.0) + 1.0,
        "returns": randn(batch, seq, scale=2.0) + 1.5,
        "rewards": rewards.to(dtype),
        "scores": randn(batch),
        "logits": logits,
        "entropies": torch.rand(batch, seq, generator=g, dtype=torch.float64).to(dtype) * 2.0,
        "prompt_lengths": torch.randint(5, 40, (batch,), generator=g),
        "response_lengths": lengths.clone(),
        "num_turns": torch.randint(1, 6, (batch,), generator=g),
        "policy_chosen_logps": randn(batch, scale=3.0) - 20.0,
        "policy_rejected_logps": randn(batch, scale=3.0) - 22.0,
        "reference_chosen_logps": randn(batch, scale=3.0) - 21.0,
        "reference_rejected_logps": randn(batch, scale=3.0) - 21.0,
        "chosen_scores": randn(batch) + 0.5,
        "rejected_scores": randn(batch),
        "agent_generate_s": torch.rand(batch, generator=g, dtype=torch.float64) * 10.0,
        "agent_tool_calls_s": torch.rand(batch, generator=g, dtype=torch.float64) * 3.0,
    }


SCALARS = ("actor_loss", "pg_loss", "entropy_loss", "kl_loss", "kl_coef", "actor_grad_norm", "actor_lr",
           "critic_loss", "critic_lr", "rm_grad_norm")


def make_scalars(n: int = 2, seed: int = 0) -> dict:
    """Trainer scalars: ``n`` observations each (lists of floats) and ``loss_tokens`` weights."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = {name: (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 0.5).tolist() for name in SCALARS}
    out["loss_tokens"] = torch.randint(10, 500, (n,), generator=g).tolist()
    return out


def concat_training(batches: list[dict]) -> dict:
    """Concatenate along the batch dim, right-padding the time dim (dim 1) with masked zeros."""
    out: dict = {}
    seq = max(b["response_mask"].shape[1] for b in batches)
    for b in batches:
        for k, v in b.items():
            if isinstance(v, torch.Tensor) and v.ndim >= 2:
                pad = [0, 0] * (v.ndim - 2) + [0, seq - v.shape[1]]
                v = torch.nn.functional.pad(v, pad, value=0)
            out.setdefault(k, []).append(v)
    return {k: torch.cat(v) if isinstance(v[0], torch.Tensor) else [x for part in v for x in part]
            for k, v in out.items()}
