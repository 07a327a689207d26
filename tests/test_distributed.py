"""The peers' bug, shown on two gloo ranks: the mean of per-rank means is not the global value we report.
(Synced values of every metric equal one process on the concatenated data: test_contracts.py.)"""

from __future__ import annotations

import pytest
import torch

from tests.data import concat_batches, make_batch
from tests.ddp import run_distributed


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
