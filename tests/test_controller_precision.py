"""The controller's per-group weight statistics near on-policy: float32 inputs against a float64 reference.

What moves near on-policy is ``1 - ESS``, ``E[w^2] - 1`` and ``E[w] - 1`` (about drift^2 and drift): each
must be within 1e-5 relative (or 1e-12 absolute) of the float64 value computed on the same float32 numbers,
at drifts 1e-4, 1e-3 and 1e-2, in one pass and in row chunks. The reference is NumPy in float64, written
from the definitions (w = exp(clamp(r, -C, C)) over valid tokens, ESS = (sum w)^2 / (N sum w^2); per
sequence w_i = exp(clamp(sum_t r_t, -C, C))), in ``math.fsum`` so that it is exact to double rounding.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from opbc_metrics import OPBCController
from opbc_metrics.functional import controller as FC

DRIFTS = (1e-4, 1e-3, 1e-2)
RTOL, ATOL = 1e-5, 1e-12
CLAMP = 20.0


def near_on_policy(drift: float, batch: int = 16, seq: int = 2048, group_size: int = 4, seed: int = 0):
    """float32 logprobs that differ by ``drift`` nats (std) per token; groups of ``group_size`` rows."""
    g = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(batch, seq, generator=g) * 3.0
    rollout = (trainer + drift * torch.randn(batch, seq, generator=g)).clamp(max=0.0)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    groups = torch.arange(batch) // group_size
    return {"trainer_logprobs": trainer, "rollout_logprobs": rollout, "response_mask": mask, "group_ids": groups}


def group_reference(batch) -> dict[int, dict[str, float]]:
    """Per group, in float64 from the float32 numbers: the parts of the weight statistics that move."""
    t = batch["trainer_logprobs"].double().numpy()
    r = batch["rollout_logprobs"].double().numpy()
    mask = batch["response_mask"].numpy()
    groups = batch["group_ids"].numpy()
    out = {}
    for g in sorted(set(groups.tolist())):
        rows = np.flatnonzero(groups == g)
        w = [math.exp(min(max(t[i, j] - r[i, j], -CLAMP), CLAMP)) for i in rows for j in np.flatnonzero(mask[i])]
        seq_w = [math.exp(min(max(math.fsum((t[i] - r[i])[mask[i]]), -CLAMP), CLAMP)) for i in rows]
        ref = {}
        for name, ws in (("token", w), ("seq", seq_w)):
            n, s1, s2 = len(ws), math.fsum(ws), math.fsum(x * x for x in ws)
            # 1 - ESS = (N sum w^2 - (sum w)^2) / (N sum w^2) = sum (w - mean)^2 / sum w^2
            mean = s1 / n
            ref[f"{name}_one_minus_ess"] = math.fsum((x - mean) ** 2 for x in ws) / s2
            if name == "token":
                ref["second_moment_minus_1"] = math.fsum(x * x - 1.0 for x in ws) / n
                ref["weight_mean_minus_1"] = math.fsum(x - 1.0 for x in ws) / n
        out[g] = ref
    return out


def controller_values(batch) -> dict[int, dict[str, float]]:
    out = OPBCController(track_budget=False).evaluate(batch)
    return {
        d.group_id: {
            "token_one_minus_ess": 1.0 - d.report.ess,
            "seq_one_minus_ess": 1.0 - d.report.seq_ess,
            "second_moment_minus_1": d.report.second_moment - 1.0,
            "weight_mean_minus_1": d.report.weight_mean - 1.0,
        }
        for d in out.decisions
    }


def relative_errors(got, want) -> list[tuple[float, int, str]]:
    bad = []
    for g, ref in want.items():
        for key, value in ref.items():
            error = abs(got[g][key] - value)
            if error > ATOL and error > RTOL * abs(value):
                bad.append((error / abs(value), g, key))
    return sorted(bad, reverse=True)


@pytest.mark.parametrize("chunked", [False, True], ids=["one_pass", "row_chunks"])
@pytest.mark.parametrize("drift", DRIFTS)
def test_group_weight_statistics_match_float64_near_on_policy(drift, chunked, monkeypatch):
    batch = near_on_policy(drift)
    if chunked:  # 4 rows per chunk: the bounded-memory path sums the same statistics chunk by chunk
        monkeypatch.setattr(FC, "CHUNK_TOKENS", 4 * 2048)
        assert len(FC.row_chunks(FC.BatchView(batch))) == 4
    want = group_reference(batch)
    assert all(ref["token_one_minus_ess"] > 0 for ref in want.values())
    assert relative_errors(controller_values(batch), want) == []


def test_group_weight_statistics_in_float64_inputs_agree_with_float32():
    """The same numbers given as float64: the float32 path's values are those of the float64 path."""
    batch = near_on_policy(1e-3)
    batch64 = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    assert relative_errors(controller_values(batch), controller_values(batch64)) == []
