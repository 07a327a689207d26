"""Real gloo ranks: differently configured ranks all raise the same Python error (no backend abort, no
mixed statistics), a window without data gives the same key set on every rank, and the configuration
check costs one fixed-size collective (at most four per compute)."""

from __future__ import annotations

import pytest
import torch

from tests.data import make_batch
from tests.ddp import count_collectives, run_distributed

# rank -> OPBCCollection kwargs (or a metric alone); every scenario differs between rank 0 and rank 1.
MISMATCHED = {
    "num_layers": [{}, {"section_options": {"moe": {"num_layers": 4}}}],
    "clamp": [{"clamp": 20.0}, {"clamp": 5.0}],
    "sections": [{}, {"sections": ("mismatch", "per_round")}],
    "round_capacity": [{}, {"section_options": {"per_round": {"capacity": 3}}}],
    "top_mass_bins": [{}, {"top_mass_bins": 512}],
    "standalone_clamp": [{"alone": 20.0}, {"alone": 5.0}],  # ImportanceSamplingESS(clamp=...) outside a collection
}


def _mismatch_worker(rank, world_size, scenario):
    from opbc_metrics import OPBCCollection
    from opbc_metrics.mismatch import ImportanceSamplingESS
    from opbc_metrics.sync import RankMismatchError

    kwargs = MISMATCHED[scenario][rank]
    metrics = ImportanceSamplingESS(clamp=kwargs["alone"]) if "alone" in kwargs else OPBCCollection(**kwargs)
    metrics.update(make_batch(batch=3, seq=8, seed=rank, dtype=torch.float64))
    before = {k: v.clone() for k, v in metrics.state_dict().items() if isinstance(v, torch.Tensor)}
    with count_collectives() as calls:
        try:
            metrics.compute()
            outcome = ("no error", "")
        except RankMismatchError as err:
            outcome = (type(err).__name__, str(err))
    after = metrics.state_dict()
    unchanged = all(torch.equal(v, after[k]) for k, v in before.items())
    return outcome, calls["n"], unchanged


@pytest.mark.parametrize("scenario", sorted(MISMATCHED))
def test_differently_configured_ranks_raise_the_same_error(scenario):
    results = run_distributed(_mismatch_worker, world_size=2, args=(scenario,), timeout=180)
    (kind0, msg0), n0, unchanged0 = results[0]
    (kind1, msg1), n1, unchanged1 = results[1]
    assert kind0 == kind1 == "RankMismatchError"
    assert msg0 == msg1 and "differently configured" in msg0
    assert n0 == n1 == 1  # the check runs first; no state collective follows
    assert unchanged0 and unchanged1


def _key_set_worker(rank, world_size, data_ranks):
    from opbc_metrics import OPBCCollection

    metrics = OPBCCollection()
    if rank in data_ranks:
        metrics.update(make_batch(batch=4, seq=8, seed=rank, dtype=torch.float64))
    with count_collectives() as calls:
        out = metrics.compute()
    return sorted(out), calls["n"], {k: v.item() for k, v in out.items() if k.startswith("opbc/input/")}


@pytest.mark.parametrize("data_ranks", [(0,), ()], ids=["data_on_rank0_only", "no_data_anywhere"])
def test_key_set_is_decided_on_synced_states(data_ranks):
    results = run_distributed(_key_set_worker, world_size=2, args=(data_ranks,), timeout=180)
    keys0, n0, inputs0 = results[0]
    keys1, n1, inputs1 = results[1]
    assert keys0 == keys1
    assert n0 <= 4 and n1 <= 4
    if data_ranks:
        assert "opbc/is/ess" in keys0 and "opbc/kl/k3" in keys0
        assert inputs0 == inputs1 and inputs0["opbc/input/num_tokens"] > 0
    else:
        assert keys0 == ["opbc/input/nonfinite_count", "opbc/input/num_sequences", "opbc/input/num_tokens"]
        assert set(inputs0.values()) == {0.0}
