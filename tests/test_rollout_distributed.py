"""Rollout metrics on 2 gloo processes, what is specific to them: chart ranges after compute() (declared
bound, global observed bound) and deferred bad-value errors raised on every rank alike. (Synced values equal
one process on the concatenated data: test_contracts.py.)"""

from __future__ import annotations

import pytest
import torch

from tests.data import NAMES, make_rollouts
from tests.ddp import run_distributed

# Whole prompt groups per rank, uneven, ids disjoint across ranks (a group lives on one rank).
SHARDS = [[dict(groups=5, seed=1, first_id=1), dict(groups=2, seed=2, first_id=2)],
          [dict(groups=3, seed=3, first_id=3)]]


def _worker(rank, world_size):
    from opbc_metrics import OPBCCollection
    from opbc_metrics.rollout import chart_ranges, rollout_metrics

    metrics = OPBCCollection(rollout_metrics(NAMES, reward_min=0.0))
    for spec in SHARDS[rank]:
        metrics.update(make_rollouts(**spec))
    metrics.compute()

    # A negative length on rank 0 only: the deferred error fires on both ranks (the count is synced).
    bad = OPBCCollection(rollout_metrics())
    b = make_rollouts(groups=2, seed=9, first_id=9)
    if rank == 0:
        b["response_lengths"][0] = -3
    bad.update(b)
    try:
        bad.compute()
        error = None
    except ValueError as err:
        error = str(err)
    return chart_ranges(metrics), error


def test_chart_ranges_and_deferred_errors_agree_across_ranks():
    results = run_distributed(_worker, world_size=2, timeout=180)
    all_rewards = torch.cat([make_rollouts(**spec)["rewards"] for shard in SHARDS for spec in shard])
    for ranges, error in results:
        # declared lower bound, global observed upper bound, on every rank
        assert ranges["rollout/reward/max"] == pytest.approx((0.0, all_rewards.max().item()))
        assert error is not None and "response_lengths" in error
    assert results[0][0] == results[1][0]
