"""Per-round (multi-turn) mismatch against a plain-Python reference on crafted inputs, properties and bad input
(the shared contracts are in test_contracts.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opbc_metrics import OPBCCollection, PerRoundMismatch
from opbc_metrics import functional as F
from opbc_metrics.collection import DEFAULT_SECTIONS
from opbc_metrics.functional.per_round import DEFAULT_ROUND_CAPACITY, per_round_keys
from opbc_metrics.testing import assert_no_host_sync
from tests.data import concat_batches, logprobs_numpy, metric_values, multi_turn_batch, round_batches
from tests.reference import P, assert_rounds_close, per_round_reference


# --- reference comparisons --------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", [1, 16])  # 3: the harness
@pytest.mark.parametrize("seed", range(3))
def test_matches_reference(capacity, seed):
    batches = [multi_turn_batch(seed=10 * seed + i, batch=3 + i, seq=20 + 10 * i) for i in range(3)]
    got = metric_values(PerRoundMismatch(capacity=capacity), *batches)
    want = per_round_reference(*logprobs_numpy(concat_batches(batches)), capacity=capacity)
    assert want[P + "total_rounds"] >= 3
    assert_rounds_close(got, want)
    rounds = int(want[P + "total_rounds"])
    present = [k for k in per_round_keys(capacity) if "overflow" not in k or rounds > capacity]
    present = [k for k in present if not k.startswith(P + "round_") or int(k.split("_")[2]) < rounds]
    assert list(got) == present


def test_worst_round_in_overflow_reports_the_capacity_index():
    b = multi_turn_batch(seed=4, drift=0.5)
    want = per_round_reference(*logprobs_numpy(b), capacity=2)
    assert want[P + "max_round_diff"] == 2.0  # drift grows with the round: the pooled deep rounds win
    assert_rounds_close(metric_values(PerRoundMismatch(capacity=2), b), want)


def test_verl_docstring_example():
    # verl's _find_contiguous_segments example: rounds (0, 4), (9, 12), (17, 20).
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0]])
    idx = F.round_index(mask)[0].tolist()
    assert idx == [0] * 4 + [-1] * 5 + [1] * 3 + [-1] * 5 + [2] * 3 + [-1] * 3
    trainer = torch.zeros(1, 23, dtype=torch.float64)
    rollout = -torch.arange(23, dtype=torch.float64)[None] / 10
    out = {k: v.item() for k, v in F.per_round_mismatch(trainer, rollout, mask, capacity=4).items()}
    assert out[P + "total_rounds"] == 3
    assert out[P + "round_1_abs_diff_mean"] == pytest.approx((0.9 + 1.0 + 1.1) / 3)
    assert out[P + "round_2_token_count"] == 3 and P + "round_3_token_count" not in out  # round 3 never occurred
    assert out[P + "max_round_diff"] == 2 and out[P + "max_diff_value"] == pytest.approx(1.8)


def test_float32_inputs():
    b = multi_turn_batch(seed=5, dtype=torch.float32)
    want = per_round_reference(*logprobs_numpy(b))
    assert_rounds_close(metric_values(PerRoundMismatch(), b), want, rel=2e-6, abs_tol=1e-6)


def test_nonfinite_tokens_stay_in_their_round_but_not_in_its_mean():
    b = multi_turn_batch(seed=6)
    row = int(torch.argmax((F.round_index(b["response_mask"]) >= 1).sum(1)))
    cols = (F.round_index(b["response_mask"])[row] == 1).nonzero().flatten().tolist()
    b["rollout_logprobs"][row, cols[0]] = float("-inf")
    b["trainer_logprobs"][row, cols[-1]] = float("nan")
    b["rollout_logprobs"][0, :] = torch.where(b["response_mask"][0] == 0, float("nan"), b["rollout_logprobs"][0])
    got = metric_values(PerRoundMismatch(), b)
    want = per_round_reference(*logprobs_numpy(b))
    assert_rounds_close(got, want)
    assert all(math.isfinite(v) for v in got.values())
    clean = metric_values(PerRoundMismatch(), multi_turn_batch(seed=6))
    assert _counts(got) == _counts(clean) and got[P + "total_rounds"] == clean[P + "total_rounds"]
    assert got[P + "round_1_abs_diff_mean"] != clean[P + "round_1_abs_diff_mean"]


def test_all_nonfinite_round_does_not_compete():
    mask = torch.tensor([[1, 1, 0, 1]])
    trainer = torch.tensor([[-1.0, -1.0, 0.0, float("nan")]], dtype=torch.float64)
    rollout = torch.tensor([[-1.5, -1.0, 0.0, -1.0]], dtype=torch.float64)
    out = {k: v.item() for k, v in F.per_round_mismatch(trainer, rollout, mask, capacity=2).items()}
    assert out[P + "round_1_token_count"] == 1 and P + "round_1_abs_diff_mean" not in out  # no mean, not a 0
    assert out[P + "max_round_diff"] == 0 and out[P + "max_diff_value"] == 0.25
    # The round without a valid token first, the only round with one at mean 0: that round is the max, not round 0.
    mask = torch.tensor([[1, 0, 1, 1]])
    trainer = torch.tensor([[float("nan"), 0.0, -1.0, -2.0]], dtype=torch.float64)
    rollout = torch.tensor([[-1.0, 0.0, -1.0, -2.0]], dtype=torch.float64)
    out = {k: v.item() for k, v in F.per_round_mismatch(trainer, rollout, mask, capacity=2).items()}
    assert out[P + "round_0_token_count"] == 1 and P + "round_0_abs_diff_mean" not in out
    assert out[P + "round_1_abs_diff_mean"] == 0
    assert out[P + "max_round_diff"] == 1 and out[P + "max_diff_value"] == 0


def test_round_without_a_finite_token_in_the_window_has_no_mean():
    """The audit's case: round 1 all NaN has a token count but no mean key (a 0 would be made up), in the metric
    and in a collection; a later batch that gives the round a finite token brings its mean back."""
    mask = torch.tensor([[1, 0, 1]])
    trainer = torch.tensor([[-1.0, -1.0, float("nan")]], dtype=torch.float64)
    rollout = torch.tensor([[-1.5, -1.0, -1.0]], dtype=torch.float64)
    batch = {"trainer_logprobs": trainer, "rollout_logprobs": rollout, "response_mask": mask}
    m = PerRoundMismatch(capacity=4)
    m.update(batch)
    out = {k: v.item() for k, v in m.compute().items()}
    assert out[P + "round_1_token_count"] == 1 and P + "round_1_abs_diff_mean" not in out
    assert out[P + "round_0_abs_diff_mean"] == 0.5 and out[P + "max_round_diff"] == 0
    c = OPBCCollection()
    c.update(batch)
    assert P + "round_1_abs_diff_mean" not in c.compute() and c.compute()[P + "round_1_token_count"] == 1
    m.update(dict(batch, trainer_logprobs=torch.tensor([[-1.0, -1.0, -3.0]], dtype=torch.float64)))
    out = {k: v.item() for k, v in m.compute().items()}
    assert out[P + "round_1_abs_diff_mean"] == 2.0 and out[P + "max_round_diff"] == 1
    # every token non-finite: no mean and no worst round in the functional either (the metric has no keys)
    nan = F.per_round_mismatch(trainer.fill_(float("nan")), rollout, mask)
    assert set(nan) == {P + "total_rounds", P + "round_0_token_count", P + "round_1_token_count"}


def test_missing_mask_and_empty_time_dim():  # no valid token / no update: the harness's no-data contract
    b = multi_turn_batch(seed=7)
    no_mask = metric_values(PerRoundMismatch(capacity=2), {k: v for k, v in b.items() if k != "response_mask"})
    assert no_mask[P + "total_rounds"] == 1 and no_mask[P + "round_0_token_count"] == b["response_mask"].numel()
    t0 = {k: v[:, :0] for k, v in b.items()}
    assert metric_values(PerRoundMismatch(capacity=2), t0) == {}


# --- collection -------------------------------------------------------------------------------------
def test_default_collection_includes_per_round():
    assert "per_round" in DEFAULT_SECTIONS
    batches = [multi_turn_batch(seed=9), multi_turn_batch(seed=10, batch=2, seq=13)]
    metrics = OPBCCollection()
    out = metric_values(metrics, *batches)
    want = per_round_reference(*logprobs_numpy(concat_batches(batches)))
    assert_rounds_close({k: v for k, v in out.items() if k.startswith(P)}, want)
    assert len(metrics.keys_produced) == len(set(metrics.keys_produced))
    # Every key is there except those of the optional-input members (router, agent, endpoint), which saw
    # none of their fields, and those of rounds no sequence reached.
    silent = ("moe/", "agent/", "endpoint/")
    rounds = int(out[P + "total_rounds"])
    absent = {P + f"round_{i}_{s}" for i in range(rounds, DEFAULT_ROUND_CAPACITY)
              for s in ("abs_diff_mean", "token_count")}
    if rounds <= DEFAULT_ROUND_CAPACITY:
        absent |= {P + "overflow_abs_diff_mean", P + "overflow_token_count"}
    assert set(out) == {k for k in metrics.keys_produced if not k.startswith(silent)} - absent


# --- properties -------------------------------------------------------------------------------------
def _counts(out):
    return [v for k, v in out.items() if k.endswith("_token_count")]


@given(round_batches(), st.integers(1, 4))
def test_property_matches_reference_counts_sum_to_the_mask_and_equal_logprobs(batch, capacity):
    same = metric_values(PerRoundMismatch(capacity=3), dict(batch, rollout_logprobs=batch["trainer_logprobs"].clone()))
    if same:  # equal logprobs: zero mismatch in every round
        assert all(v == 0.0 for k, v in same.items() if k.endswith("_abs_diff_mean"))
        assert same[P + "max_diff_value"] == 0.0
        assert same[P + "max_round_diff"] == (0.0 if (batch["response_mask"] != 0).any() else -1.0)
    got = metric_values(PerRoundMismatch(capacity=capacity), batch)
    valid = (batch["response_mask"] != 0) & torch.isfinite(batch["trainer_logprobs"] - batch["rollout_logprobs"])
    if not valid.any():  # no valid token: no keys
        assert got == {}
        return
    assert_rounds_close(got, per_round_reference(*logprobs_numpy(batch), capacity=capacity), rel=1e-9, abs_tol=1e-12)
    assert sum(_counts(got)) == (batch["response_mask"] != 0).sum().item()
    t = batch["response_mask"].shape[1]
    assert 0 <= got[P + "total_rounds"] <= (t + 1) // 2
    means = [v for k, v in got.items() if k.endswith("_abs_diff_mean")]
    assert all(0.0 <= m <= got[P + "max_diff_value"] for m in means)
    assert -1 <= got[P + "max_round_diff"] <= capacity
    for i in range(capacity):  # rounds beyond the longest sequence's have no keys
        assert (P + f"round_{i}_token_count" in got) == (i < got[P + "total_rounds"])


# --- contracts --------------------------------------------------------------------------------------
def test_default_collection_helpers_and_empty_shapes_never_sync():
    b = multi_turn_batch(seed=11, dtype=torch.float32)
    with assert_no_host_sync():
        OPBCCollection().update(b)
        F.round_index(b["response_mask"])
        PerRoundMismatch().update({k: v[:, :0] for k, v in b.items()})
        PerRoundMismatch().update({k: v[:0] for k, v in b.items()})


@pytest.mark.parametrize(
    "change,field",
    [
        (lambda b: b.update(response_mask=b["response_mask"][:, :-1]), "response_mask"),
        (lambda b: b.update(response_mask=b["response_mask"][:, :, None]), "response_mask"),
        (lambda b: b.pop("trainer_logprobs"), "trainer_logprobs"),
        (lambda b: b.update(rollout_logprobs=b["rollout_logprobs"][:-1]), "rollout_logprobs"),
        (lambda b: b.update(rollout_logprobs=b["rollout_logprobs"].long()), "rollout_logprobs"),
    ],
)
def test_bad_input_names_the_field(change, field):
    b = multi_turn_batch(seed=12)
    change(b)
    with pytest.raises(ValueError, match=field):
        PerRoundMismatch().update(b)


def test_bad_arguments():
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="capacity"):
            PerRoundMismatch(capacity=bad)
    with pytest.raises(ValueError, match="response_mask"):
        F.round_index(torch.ones(4))


def test_chunks_give_the_statistics_of_the_whole_batch(monkeypatch):
    """The kernel goes in row blocks (here 2 rows, a partial last block): the same counts, and sums that differ
    by float64 rounding only (the blocks' sums are added in another order)."""
    import opbc_metrics.functional.mismatch as fm
    import opbc_metrics.functional.per_round as fpr
    from opbc_metrics.batch import as_view

    batch = multi_turn_batch(seed=5, batch=5, seq=30)
    batch["trainer_logprobs"][1, 2] = float("nan")
    whole = fpr._per_round_update(as_view(batch), 3)
    monkeypatch.setattr(fm, "_BLOCK_TOKENS", 60)
    chunked = fpr._per_round_update(as_view(batch), 3)
    assert set(chunked) == set(whole)
    for key, value in whole.items():
        if key == "sum_abs":
            torch.testing.assert_close(chunked[key], value, rtol=1e-13, atol=0.0)
        else:
            assert torch.equal(chunked[key], value), key


def test_keys_only_for_rounds_that_occurred():
    """Single-turn data gets round 0 only, no overflow keys; overflow keys appear once a sequence overflows."""
    single = {"trainer_logprobs": torch.zeros(2, 5), "rollout_logprobs": torch.full((2, 5), -0.1),
              "response_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])}
    m = PerRoundMismatch()
    m.update(single)
    assert sorted(m.compute()) == sorted([P + "total_rounds", P + "round_0_abs_diff_mean", P + "round_0_token_count",
                                          P + "max_round_diff", P + "max_diff_value"])
    deep = dict(single, response_mask=torch.tensor([[1, 0, 1, 0, 1], [1, 1, 1, 1, 1]]))  # 3 rounds
    m = PerRoundMismatch(capacity=2)
    m.update(deep)
    out = m.compute()
    assert P + "overflow_token_count" in out and out[P + "overflow_token_count"].item() == 1.0
    assert P + "round_1_token_count" in out and P + "round_2_token_count" not in out
