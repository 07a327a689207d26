"""Float32 inputs near on-policy against a float64 reference on the same float32 numbers, at drifts 1e-4, 1e-3
and 1e-2: every mismatch key (eager, compiled and over DDP), and what moves in the controller's per-group weight
statistics (``1 - ESS``, ``E[w^2] - 1`` and ``E[w] - 1``, about drift^2 and drift; in one pass and in row
chunks), each within 1e-5 relative (or 1e-12 absolute).

The references are NumPy in float64, fed the float32 inputs converted exactly: tests/reference.py plus the
top-1% histogram sketch below, and per group the definitions (w = exp(clamp(r, -C, C)) over valid tokens,
ESS = (sum w)^2 / (N sum w^2); per sequence w_i = exp(clamp(sum_t r_t, -C, C))) in ``math.fsum`` so that they
are exact to double rounding.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from opbc_metrics import OPBCCollection, OPBCController
from opbc_metrics.functional import controller as FC
from opbc_metrics.functional.mismatch import DEFAULT_TOP_MASS_BINS
from tests.data import logprobs_numpy
from tests.ddp import run_distributed
from tests.reference import mismatch_reference

DRIFTS = (1e-4, 1e-3, 1e-2)
RTOL, ATOL = 1e-5, 1e-12
CLAMP = 20.0
TOP_MASS = "opbc/is/top_1pct_gradient_mass"


def near_on_policy(drift: float, batch: int = 16, seq: int = 2048, seed: int = 0) -> dict[str, torch.Tensor]:
    """float32 logprobs of a response and a rollout that differs by ``drift`` nats (std) per token."""
    g = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(batch, seq, generator=g) * 3.0
    rollout = (trainer + drift * torch.randn(batch, seq, generator=g)).clamp(max=0.0)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    return {"trainer_logprobs": trainer, "rollout_logprobs": rollout, "response_mask": mask}


def errors(got: dict, want: dict) -> list[tuple[float, str]]:
    """Values outside the tolerance, as (relative error, key), worst first."""
    bad = [(abs(got[k] - v) / max(abs(v), 1e-300), k) for k, v in want.items()
           if abs(got[k] - v) > ATOL and abs(got[k] - v) > RTOL * abs(v)]
    return sorted(bad, reverse=True)


# -- the mismatch keys ---------------------------------------------------------------------------------------
def sketch_reference(trainer, rollout, mask, clamp=CLAMP, bins=DEFAULT_TOP_MASS_BINS, fraction=0.01) -> float:
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
    ref = mismatch_reference(*logprobs_numpy(batch))
    ref[TOP_MASS] = sketch_reference(*logprobs_numpy(batch))
    return ref


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
    assert errors(out, ref) == []


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
            assert errors(out, ref) == [], drift


# -- the controller's per-group weight statistics ------------------------------------------------------------
def grouped(drift: float) -> dict[str, torch.Tensor]:
    return {**near_on_policy(drift), "group_ids": torch.arange(16) // 4}


def group_reference(batch) -> dict[tuple[int, str], float]:
    """Per (group, statistic), in float64 from the float32 numbers: the parts of the weight statistics that move."""
    t, r, mask = logprobs_numpy(batch)
    groups = batch["group_ids"].numpy()
    out = {}
    for g in sorted(set(groups.tolist())):
        rows = np.flatnonzero(groups == g)
        w = [math.exp(min(max(t[i, j] - r[i, j], -CLAMP), CLAMP)) for i in rows for j in np.flatnonzero(mask[i])]
        seq_w = [math.exp(min(max(math.fsum((t[i] - r[i])[mask[i]]), -CLAMP), CLAMP)) for i in rows]
        for name, ws in (("token", w), ("seq", seq_w)):
            n, s2 = len(ws), math.fsum(x * x for x in ws)
            # 1 - ESS = (N sum w^2 - (sum w)^2) / (N sum w^2) = sum (w - mean)^2 / sum w^2
            mean = math.fsum(ws) / n
            out[g, f"{name}_one_minus_ess"] = math.fsum((x - mean) ** 2 for x in ws) / s2
        out[g, "second_moment_minus_1"] = math.fsum(x * x - 1.0 for x in w) / len(w)
        out[g, "weight_mean_minus_1"] = math.fsum(x - 1.0 for x in w) / len(w)
    return out


def controller_values(batch) -> dict[tuple[int, str], float]:
    out = {}
    for d in OPBCController(track_budget=False).evaluate(batch).decisions:
        r = d.report
        values = {"token_one_minus_ess": 1.0 - r.ess, "seq_one_minus_ess": 1.0 - r.seq_ess,
                  "second_moment_minus_1": r.second_moment - 1.0, "weight_mean_minus_1": r.weight_mean - 1.0}
        out.update({(d.group_id, k): v for k, v in values.items()})
    return out


@pytest.mark.parametrize("chunked", [False, True], ids=["one_pass", "row_chunks"])
@pytest.mark.parametrize("drift", DRIFTS)
def test_group_weight_statistics_match_float64_near_on_policy(drift, chunked, monkeypatch):
    batch = grouped(drift)
    if chunked:  # 4 rows per chunk: the bounded-memory path sums the same statistics chunk by chunk
        monkeypatch.setattr(FC, "CHUNK_TOKENS", 4 * 2048)
        assert len(FC.row_chunks(FC.BatchView(batch))) == 4
    want = group_reference(batch)
    assert all(v > 0 for (_, name), v in want.items() if name == "token_one_minus_ess")
    assert errors(controller_values(batch), want) == []


def test_group_weight_statistics_in_float64_inputs_agree_with_float32():
    """The same numbers given as float64: the float32 path's values are those of the float64 path."""
    batch = grouped(1e-3)
    batch64 = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    assert errors(controller_values(batch), controller_values(batch64)) == []
