"""Float32 inputs near on-policy: every mismatch key within 1e-5 relative (or 1e-12 absolute) of the float64
result on the same float32 numbers, at drifts 1e-4, 1e-3 and 1e-2, eager, compiled and over DDP.

The reference is NumPy in float64 (tests/reference.py, plus the top-1% histogram sketch below), fed the
float32 inputs converted exactly to float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from opbc_metrics import OPBCCollection
from opbc_metrics.functional.mismatch import DEFAULT_TOP_MASS_BINS
from tests.ddp import run_distributed
from tests.reference import mismatch_reference

DRIFTS = (1e-4, 1e-3, 1e-2)
RTOL, ATOL = 1e-5, 1e-12
TOP_MASS = "opbc/is/top_1pct_gradient_mass"


def near_on_policy(drift: float, batch: int = 16, seq: int = 2048, seed: int = 0) -> dict[str, torch.Tensor]:
    """float32 logprobs of a response and a rollout that differs by ``drift`` nats (std) per token."""
    g = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(batch, seq, generator=g) * 3.0
    rollout = (trainer + drift * torch.randn(batch, seq, generator=g)).clamp(max=0.0)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    return {"trainer_logprobs": trainer, "rollout_logprobs": rollout, "response_mask": mask}


def sketch_reference(trainer, rollout, mask, clamp=20.0, bins=DEFAULT_TOP_MASS_BINS, fraction=0.01) -> float:
    """The documented top-1% sketch in float64: log-weights binned over [-C, C], the top k valued at bin centres."""
    valid = mask & np.isfinite(trainer) & np.isfinite(rollout)
    rc = np.clip((trainer - rollout)[valid], -clamp, clamp)
    index = np.minimum(np.floor((rc + clamp) * (bins / (2 * clamp))).astype(np.int64), bins - 1)
    counts = np.bincount(index, minlength=bins)[::-1].astype(np.float64)
    centres = (-clamp + (2 * clamp / bins) * (np.arange(bins) + 0.5))[::-1]
    k = max(1, math.floor(fraction * rc.size))
    take = np.minimum(np.maximum(k - (np.cumsum(counts) - counts), 0.0), counts)
    return float((take * np.exp(centres)).sum() / np.exp(rc).sum())


def float64_reference(batch: dict[str, torch.Tensor]) -> dict[str, float]:
    args = [batch[k].double().numpy() if k != "response_mask" else batch[k].numpy()
            for k in ("trainer_logprobs", "rollout_logprobs", "response_mask")]
    ref = mismatch_reference(*args)
    ref[TOP_MASS] = sketch_reference(*args)
    return ref


def worst_errors(out: dict[str, float], ref: dict[str, float]) -> list[tuple[float, str]]:
    """Keys outside the tolerance, as (relative error, key)."""
    bad = []
    for key, want in ref.items():
        got = out[key]
        if not math.isclose(got, want, rel_tol=RTOL, abs_tol=ATOL):
            bad.append((abs(got - want) / max(abs(want), 1e-300), key))
    return sorted(bad, reverse=True)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("drift", DRIFTS)
def test_float32_keys_match_float64_near_on_policy(drift, compiled):
    batch = near_on_policy(drift)
    metrics = OPBCCollection(sections=["mismatch"], compiled=compiled)
    # Two updates: the window's sums merge across updates as across ranks.
    half = batch["trainer_logprobs"].shape[0] // 2
    for rows in (slice(0, half), slice(half, None)):
        metrics.update({k: v[rows] for k, v in batch.items()})
    out = {k: v.item() for k, v in metrics.compute().items()}
    ref = float64_reference(batch)
    assert ref["opbc/kl/chi2_token"] != 0 and ref["opbc/kl/k3"] > 0  # the cancelling keys carry signal
    assert worst_errors(out, ref) == []


def _rank_worker(rank, world_size, drift):
    batch = near_on_policy(drift)
    rows = batch["trainer_logprobs"].shape[0] // world_size
    metrics = OPBCCollection(sections=["mismatch"])
    metrics.update({k: v[rank * rows : (rank + 1) * rows] for k, v in batch.items()})
    return {k: v.item() for k, v in metrics.compute().items()}


def test_float32_keys_match_float64_over_ddp():
    for drift in DRIFTS:
        results = run_distributed(_rank_worker, world_size=2, args=(drift,))
        ref = float64_reference(near_on_policy(drift))
        for out in results:
            assert worst_errors(out, ref) == [], drift
