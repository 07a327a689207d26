"""Budget metrics of the OPBC on 2 gloo ranks: the synced values equal one process stepping through every
rank's batches, with uneven shards and a rank that decides no group at all."""

from __future__ import annotations

import math

import pytest
import torch

from tests.data import make_batch
from tests.ddp import count_collectives, run_distributed

# Rank 0: two batches of different shapes; rank 1: one batch, then an empty one (no group) in scenario
# "uneven"; in "idle_rank" rank 1 never steps.
SHARDS = {
    "uneven": [
        [dict(batch=9, seq=14, seed=1, drift=1.5, heavy_tail=True), dict(batch=5, seq=30, seed=2, drift=0.2)],
        [dict(batch=6, seq=7, seed=3, empty_rows=1, drift=3.0, heavy_tail=True), dict(batch=0, seq=7, seed=4)],
    ],
    "idle_rank": [
        [dict(batch=8, seq=16, seed=5, drift=2.0, heavy_tail=True)],
        [],
    ],
}


def _batches(specs):
    out = []
    for spec in specs:
        b = make_batch(dtype=torch.float64, **spec) if spec["batch"] else None
        if b is None:
            b = {"trainer_logprobs": torch.zeros(0, spec["seq"], dtype=torch.float64),
                 "rollout_logprobs": torch.zeros(0, spec["seq"], dtype=torch.float64),
                 "response_mask": torch.zeros(0, spec["seq"], dtype=torch.int64),
                 "group_ids": torch.zeros(0, dtype=torch.int64)}
        n = b["group_ids"].shape[0]
        g = torch.Generator().manual_seed(spec["seed"])
        b["group_ids"] = torch.randint(0, 4, (n,), generator=g) * 1000 + spec["seed"]
        b["policy_lag"] = torch.randint(0, 10, (n,), generator=g)
        out.append(b)
    return out


def _worker(rank, world_size, scenario, preset):

    from opbc_metrics.controller import OPBCController

    controller = OPBCController(preset)
    for b in _batches(SHARDS[scenario][rank]):
        controller.step(b)
    with count_collectives() as calls:
        out = controller.compute_budget()
    local = controller.budget["DecisionGroupShare"].groups.item()
    return {k: v.item() for k, v in out.items()}, calls["n"], local


@pytest.mark.parametrize("scenario,preset", [("uneven", "masked_is"), ("idle_rank", "truncated_is")])
def test_budget_metrics_sync_exactly(scenario, preset):
    from opbc_metrics.controller import OPBCController

    results = run_distributed(_worker, world_size=2, args=(scenario, preset))
    single = OPBCController(preset)
    for specs in SHARDS[scenario]:
        for b in _batches(specs):
            single.step(b)
    expected = {k: v.item() for k, v in single.compute_budget().items()}
    assert expected["opbc/decision/num_groups"] > 0
    assert sum(expected[f"opbc/decision/group_share/{a}"] for a in
               ("train", "train_with_correction", "replay", "quarantine", "reject")) == pytest.approx(1.0)
    local_groups = []
    for values, n_collectives, local in results:
        assert n_collectives <= 4  # 3 reductions + the layout check
        local_groups.append(local)
        for key, want in expected.items():
            assert math.isclose(values[key], want, rel_tol=1e-12, abs_tol=1e-12), (key, values[key], want)
    assert sum(local_groups) == expected["opbc/decision/num_groups"]  # states were restored after the sync
    assert results[0][0] == results[1][0]
