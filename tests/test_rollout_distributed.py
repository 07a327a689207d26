"""Rollout metrics on 2 gloo processes: synced values equal the single-process values on the concatenated
data (uneven shards, a rank with an empty batch), a constant number of collectives, and deferred
bad-value errors raised on every rank alike. One spawned run covers every check (the machine is small)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.data import NAMES, concat_batches, make_rollouts
from tests.ddp import count_collectives, run_distributed
from tests.reference import rollout_reference

# Whole prompt groups per rank, uneven: rank 0 gets two batches of different sizes, rank 1 one batch
# and one empty batch (B = 0). Group ids are disjoint across ranks (a group lives on one rank).
SHARDS = [
    [dict(groups=5, seed=1, first_id=1), dict(groups=2, seed=2, first_id=2)],
    [dict(groups=3, seed=3, first_id=3), dict(groups=3, seed=4, first_id=4, empty=True)],
]


def _batches(specs):
    out = []
    for spec in specs:
        spec = dict(spec)
        empty = spec.pop("empty", False)
        b = make_rollouts(**spec)
        if empty:
            b = {k: ({n: c[:0] for n, c in v.items()} if k == "sample_metrics" else v[:0]) for k, v in b.items()}
        out.append(b)
    return out


def _worker(rank, world_size):

    from opbc_metrics import OPBCCollection
    from opbc_metrics.rollout import RolloutRewardGini, SampleMetricStats, chart_ranges, rollout_metrics

    batches = _batches(SHARDS[rank])
    metrics = OPBCCollection(rollout_metrics(NAMES, reward_min=0.0))
    alone = [SampleMetricStats(NAMES), RolloutRewardGini()]  # each syncs itself in its own compute()
    for b in batches:
        metrics.update(b)
        for m in alone:
            m.update(b)

    with count_collectives() as calls:
        out = metrics.compute()
    alone_out = {}
    for m in alone:
        alone_out.update(m.compute_dict())
    local_count = metrics["RolloutRewardStats"].count.item()  # compute() restored the local states

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
    return (
        {k: v.item() for k, v in out.items()},
        {k: v.item() for k, v in alone_out.items()},
        calls["n"],
        local_count,
        chart_ranges(metrics),
        error,
    )


def test_rollout_metrics_sync_exactly():
    from opbc_metrics import OPBCCollection
    from opbc_metrics.rollout import rollout_metrics

    results = run_distributed(_worker, world_size=2, timeout=180)
    shards = [_batches(specs) for specs in SHARDS]
    flat = [b for shard in shards for b in shard]
    single = OPBCCollection(rollout_metrics(NAMES))
    single.update(concat_batches(flat))
    expected = {k: v.item() for k, v in single.compute().items()}
    ref = rollout_reference(concat_batches(flat), NAMES)
    for key, want in ref.items():
        assert math.isclose(expected[key], want, rel_tol=1e-9, abs_tol=1e-12), (key, expected[key], want)

    local_counts = [float(sum(b["rewards"].shape[0] for b in shard)) for shard in shards]
    assert [r[3] for r in results] == local_counts
    all_rewards = torch.cat([b["rewards"] for b in flat])
    for values, alone, n_collectives, _, ranges, error in results:
        assert n_collectives <= 4, n_collectives  # 3 reductions + the layout check
        assert set(values) == set(expected)
        for key, want in expected.items():
            assert math.isclose(values[key], want, rel_tol=1e-9, abs_tol=1e-12), (key, values[key], want)
        for key, got in alone.items():
            assert math.isclose(got, expected[key], rel_tol=1e-9, abs_tol=1e-12), (key, got, expected[key])
        # chart ranges after compute(): declared lower bound, global observed upper bound, on every rank
        assert ranges["rollout/reward/max"] == pytest.approx((0.0, all_rewards.max().item()))
        assert error is not None and "response_lengths" in error
    assert results[0][0] == results[1][0]
    assert results[0][4] == results[1][4]
