"""Multi-process gloo tests: synced values equal the single-process values on the concatenated data,
and a whole collection syncs with a constant number of collectives."""

from __future__ import annotations

import math

import pytest
import torch

from tests.data import concat_batches, make_batch
from tests.ddp import count_collectives, run_distributed

# Uneven shards: rank 0 gets two batches of different shapes, rank 1 one batch with an empty row;
# in the third scenario rank 1 has no valid token at all.
SHARDS = {
    "uneven": [
        [dict(batch=5, seq=12, seed=1), dict(batch=3, seq=30, seed=2)],
        [dict(batch=2, seq=7, seed=3, empty_rows=1)],
    ],
    "rank_without_valid_tokens": [
        [dict(batch=4, seq=16, seed=4, heavy_tail=True, drift=2.0)],
        [dict(batch=3, seq=9, seed=5, empty_rows=3)],
    ],
}


def _shard_batches(specs):
    return [make_batch(dtype=torch.float64, **s) for s in specs]


def _collection_worker(rank, world_size, scenario):

    from opbc_metrics import OPBCCollection

    metrics = OPBCCollection()
    for b in _shard_batches(SHARDS[scenario][rank]):
        metrics.update(b)

    with count_collectives() as calls:
        out = metrics.compute()
    # compute() restores the local (unsynced) states, so accumulation can go on.
    local_tokens = metrics["InputHealth"].tokens.item()
    return {k: v.item() for k, v in out.items()}, calls["n"], local_tokens


def _single_metric_worker(rank, world_size, scenario):
    from opbc_metrics.mismatch import MISMATCH_METRICS

    out = {}
    batches = _shard_batches(SHARDS[scenario][rank])
    for cls in MISMATCH_METRICS:
        m = cls()
        for b in batches:
            m.update(b)
        out.update({k: v.item() for k, v in m.compute_dict().items()})
    return out


@pytest.mark.parametrize("scenario", sorted(SHARDS))
def test_collection_sync_equals_single_process(scenario):
    from opbc_metrics import OPBCCollection

    results = run_distributed(_collection_worker, world_size=2, args=(scenario,))
    single = OPBCCollection()
    all_batches = [b for specs in SHARDS[scenario] for b in _shard_batches(specs)]
    single.update(concat_batches(all_batches))
    expected = {k: v.item() for k, v in single.compute().items()}
    local_tokens = [sum(b["response_mask"].sum().item() for b in _shard_batches(specs)) for specs in SHARDS[scenario]]
    assert [r[2] for r in results] == local_tokens
    for values, n_collectives, _ in results:
        assert n_collectives <= 4, f"{n_collectives} collectives (3 reductions + the layout check)"
        for key, want in expected.items():
            assert math.isclose(values[key], want, rel_tol=1e-9, abs_tol=1e-12), (key, values[key], want)
    # Both ranks hold the same global values.
    assert results[0][0] == results[1][0]


@pytest.mark.parametrize("scenario", sorted(SHARDS))
def test_each_metric_alone_syncs_exactly(scenario):
    from opbc_metrics import OPBCCollection

    results = run_distributed(_single_metric_worker, world_size=2, args=(scenario,))
    single = OPBCCollection()
    for specs in SHARDS[scenario]:
        for b in _shard_batches(specs):
            single.update(b)
    expected = {k: v.item() for k, v in single.compute().items()}
    for values in results:
        assert set(values) <= set(expected)
        for key, want in ((k, expected[k]) for k in values):
            assert math.isclose(values[key], want, rel_tol=1e-9, abs_tol=1e-12), (key, values[key], want)


def _mean_of_means_worker(rank, world_size):
    """The peers' bug, shown: averaging per-rank ESS differs from the global ESS we report."""
    import torch.distributed as dist

    from opbc_metrics import ImportanceSamplingESS
    from opbc_metrics.functional import importance_ess

    b = make_batch(batch=4, seq=16, seed=20 + rank, drift=0.5 + 2.0 * rank, dtype=torch.float64)
    m = ImportanceSamplingESS()
    m.update(b)
    global_value = m.compute()
    mean_of_means = importance_ess(b["trainer_logprobs"], b["rollout_logprobs"], b["response_mask"])
    dist.all_reduce(mean_of_means)
    return global_value.item(), (mean_of_means / world_size).item()


def test_global_ess_is_not_the_mean_of_rank_means():
    from opbc_metrics.functional import importance_ess

    results = run_distributed(_mean_of_means_worker, world_size=2)
    batches = [make_batch(batch=4, seq=16, seed=20 + r, drift=0.5 + 2.0 * r, dtype=torch.float64) for r in range(2)]
    cat = concat_batches(batches)
    truth = importance_ess(cat["trainer_logprobs"], cat["rollout_logprobs"], cat["response_mask"]).item()
    for global_value, mean_of_means in results:
        assert global_value == pytest.approx(truth, rel=1e-12)
        assert abs(mean_of_means - truth) > 1e-3
