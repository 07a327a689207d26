"""Which keys a window reports: a sample std needs two values (no key with one, as Pearson), the other sample-std
keys of the library behave alike, and the top-1% mass's exact mode is reachable from a collection."""

from __future__ import annotations

import math

import pytest
import torch

from opbc_metrics import OPBCCollection
from opbc_metrics.metric import NoDataError
from opbc_metrics.mismatch import ImportanceWeightStd, ProbabilityDiff, TopGradientMass
from opbc_metrics.testing import assert_no_host_sync
from tests.data import make_batch, metric_values

DIFF_STD = "opbc/prob/diff_std"
TOP = "opbc/is/top_1pct_gradient_mass"
ONE = {"trainer_logprobs": torch.tensor([[-0.5]]), "rollout_logprobs": torch.tensor([[-0.7]])}
OTHER = {"trainer_logprobs": torch.tensor([[-2.0]]), "rollout_logprobs": torch.tensor([[-1.5]])}


# -- defect 1: the sample std of one value is undefined: no key ----------------------------------------------------
def test_one_token_window_has_no_diff_std_in_the_collection():
    c = OPBCCollection()
    c.update(ONE)
    out = c.compute()
    assert DIFF_STD not in out and "opbc/prob/pearson" not in out
    assert out["opbc/prob/abs_diff_mean"].item() == pytest.approx(math.exp(-0.5) - math.exp(-0.7), rel=1e-6)
    assert out["opbc/input/num_tokens"].item() == 1.0


def test_one_token_window_has_no_diff_std_alone_and_in_forward():
    assert DIFF_STD not in metric_values(ProbabilityDiff(), ONE)
    assert DIFF_STD not in OPBCCollection(sections=["mismatch"])(ONE)  # the batch's own value
    assert DIFF_STD not in ProbabilityDiff()(**ONE)


def test_two_tokens_over_two_updates_bring_diff_std_back_as_torch_std():
    c = OPBCCollection(sections=["mismatch"])
    c.update(ONE)
    c.update(OTHER)
    p = torch.tensor([ONE["trainer_logprobs"].item(), OTHER["trainer_logprobs"].item()], dtype=torch.float64).exp()
    q = torch.tensor([ONE["rollout_logprobs"].item(), OTHER["rollout_logprobs"].item()], dtype=torch.float64).exp()
    assert c.compute()[DIFF_STD].item() == pytest.approx(torch.std((p - q).abs()).item(), rel=1e-5)


def test_one_valid_token_among_masked_ones_has_no_diff_std():
    batch = make_batch(batch=3, seq=4, seed=2)
    mask = torch.zeros(3, 4, dtype=torch.int64)
    mask[1, 2] = 1
    metric = ProbabilityDiff()
    with assert_no_host_sync():
        metric.update({**batch, "response_mask": mask})
    assert DIFF_STD not in metric.compute()


def test_the_rollout_sections_sample_stds_leave_their_key_out_for_one_sample():
    """The rollout section's per-step std (sample std, n - 1, as Telescope) is absent for one sample (unchanged:
    this documents it next to diff_std)."""
    c = OPBCCollection(sections=["rollout"])
    c.update({"rewards": torch.tensor([1.0]), "advantages": torch.tensor([0.5]),
              "prompt_lengths": torch.tensor([3]), "response_lengths": torch.tensor([4])})
    out = c.compute()
    for prefix in ("rollout/reward", "rollout/advantage", "rollout/tokens_prompt", "rollout/tokens_completion",
                   "rollout/tokens_total"):
        assert f"{prefix}/mean" in out and f"{prefix}/std" not in out, prefix


# -- defect 3: the top-1% mass's exact mode from a collection ------------------------------------------------------
def test_section_options_exact_gives_the_collections_top_mass_member_the_exact_mode():
    batches = [make_batch(batch=4, seq=9, seed=s, dtype=torch.float64, drift=1.0, heavy_tail=True) for s in range(2)]
    exact = OPBCCollection(section_options={"mismatch": {"exact": True}})
    sketch = OPBCCollection()
    member = exact[TOP]
    assert isinstance(member, TopGradientMass) and member.exact and member.error_bound == 0.0
    assert not sketch[TOP].exact
    # every other member unchanged: the same members, classes and settings but the top-1% one
    for a, b in zip(exact.members(), sketch.members(), strict=True):
        assert type(a) is type(b)
        if not isinstance(a, TopGradientMass):
            assert a.config() == b.config()
    for b in batches:
        exact.update(b)
        sketch.update(b)
    got, approx = exact.compute(), sketch.compute()
    alone = TopGradientMass(exact=True)
    for b in batches:
        alone.update(b)
    assert got[TOP].item() == pytest.approx(alone.compute().item(), rel=1e-12)
    assert set(got) == set(approx)
    for key in set(got) - {TOP}:
        assert got[key].item() == approx[key].item(), key
    assert got[TOP].item() == pytest.approx(approx[TOP].item(), rel=member.error_bound or 3e-3)


def test_exact_option_state_dict_round_trips_and_refuses_a_sketch_checkpoint():
    batch = make_batch(batch=3, seq=6, seed=4, dtype=torch.float64)
    a = OPBCCollection(section_options={"mismatch": {"exact": True}})
    a.update(batch)
    b = OPBCCollection(section_options={"mismatch": {"exact": True}})
    b.merge_state(a)
    assert b.compute()[TOP].item() == a.compute()[TOP].item()
    with pytest.raises(ValueError, match="exact"):
        OPBCCollection().merge_state(a)


def _exact_worker(rank, world_size):
    c = OPBCCollection(section_options={"mismatch": {"exact": True}})
    c.update(make_batch(batch=3, seq=7 + 4 * rank, seed=10 + rank, dtype=torch.float64, drift=1.0))
    return {k: v.item() for k, v in c.compute().items() if v.numel() == 1}


def test_exact_option_over_two_ranks_equals_one_process_on_all_the_data():
    from tests.ddp import run_distributed

    results = run_distributed(_exact_worker, world_size=2, timeout=180)
    whole = OPBCCollection(section_options={"mismatch": {"exact": True}})
    for rank in range(2):
        whole.update(make_batch(batch=3, seq=7 + 4 * rank, seed=10 + rank, dtype=torch.float64, drift=1.0))
    want = whole.compute()[TOP].item()
    assert results[0] == results[1]
    assert results[0][TOP] == pytest.approx(want, rel=1e-12)


def test_other_mismatch_options_still_reach_every_member():
    # (an unknown option is still refused, with or without exact)
    with pytest.raises(ValueError, match="unexpected_option"):
        OPBCCollection(section_options={"mismatch": {"exact": True, "unexpected_option": 1}})


# -- defect 4: the documented float32 limits of the moment-based stds ----------------------------------------------
@pytest.mark.parametrize("cls", [ImportanceWeightStd, ProbabilityDiff])
def test_the_std_docstrings_state_their_float32_limit(cls):
    doc = " ".join(cls.__doc__.split())
    assert "float32" in doc and "float64" in doc and "x^2" in doc


def test_the_documented_float32_example_is_what_the_metric_gives():
    """weight_std of two tokens both clamped at w = e^20: not 0 with float32 inputs, 0 with float64 ones."""
    for dtype, want in ((torch.float32, None), (torch.float64, 0.0)):
        m = ImportanceWeightStd()
        m.update(trainer_logprobs=torch.zeros(1, 2, dtype=dtype),
                 rollout_logprobs=torch.tensor([[-25.0, -30.0]], dtype=dtype))
        value = m.compute().item()
        assert value == want if want is not None else value > 1e3


# -- a trainer scalar weighted by loss_tokens: observations over no token have no mean ------------------------------
@pytest.mark.parametrize("as_tensor", [False, True])
def test_a_loss_over_zero_tokens_has_no_key(as_tensor):
    from opbc_metrics.training import ActorLoss

    tokens = torch.tensor([0, 0]) if as_tensor else [0, 0]
    metric = ActorLoss()
    metric.update(actor_loss=torch.tensor([1.0, 2.0]) if as_tensor else [1.0, 2.0], loss_tokens=tokens)
    with pytest.raises(NoDataError):
        metric.compute()
    collection = OPBCCollection(sections=["training"])
    collection.update({"actor_loss": [1.0, 2.0], "loss_tokens": tokens})
    assert "actor/loss" not in collection.compute()
    collection.update({"actor_loss": [3.0], "loss_tokens": [10]})  # a loss over tokens brings the key back
    assert collection.compute()["actor/loss"].item() == 3.0


def test_a_non_finite_loss_over_zero_tokens_is_still_refused():
    from opbc_metrics.training import ActorLoss

    metric = ActorLoss()
    metric.update(actor_loss=torch.tensor([float("nan")]), loss_tokens=torch.tensor([0]))
    with pytest.raises(ValueError, match="actor_loss"):
        metric.compute()
