"""The rollout-group metrics against the independent reference, plus properties and contracts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opbc_metrics import OPBCCollection
from opbc_metrics import rollout as M
from opbc_metrics.functional import rollout as R
from opbc_metrics.testing import assert_no_host_sync
from tests.data import NAMES, concat_batches, groups_batch, make_rollouts, metric_values, rollout_groups
from tests.reference import (
    gini_pairwise,
    gini_sorted_rank,
    group_gini_mean,
    group_max_median_mean,
    rollout_reference,
    zero_advantage_reference,
)


def collection(**kwargs) -> OPBCCollection:
    return OPBCCollection(M.rollout_metrics(NAMES, **kwargs))


def assert_matches(out: dict, ref: dict, rtol: float = 1e-9, atol: float = 1e-12) -> None:
    """``out`` has exactly the keys the reference gives a value (a key without one would be made up), each close."""
    assert set(out) == {key for key, want in ref.items() if want is not None}, set(out) ^ set(ref)
    for key, want in ref.items():
        if want is None:  # the reference has no value (e.g. no group with a ratio): no key either
            assert key not in out, (key, out[key])
            continue
        got = float(out[key])
        assert math.isclose(got, want, rel_tol=rtol, abs_tol=atol), (key, got, want)


# --- reference ------------------------------------------------------------------------------------
def test_token_level_batches_match_reference():  # per-sample batches: the harness
    batches = [make_rollouts(groups=3 + s, seed=s, first_id=s, tokens=True) for s in range(3)]
    out = metric_values(collection(), *batches)
    ref = rollout_reference(concat_batches(batches), NAMES)
    assert set(ref) == set(out)
    assert_matches(out, ref)


def test_token_level_fields_are_reduced_per_sample():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0], [5.0, 5.0, 5.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, 4.0, 100.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    r = R.reward_stats(rewards, mask)  # sums 1, 2; the third row has no response token: no reward, not 0
    assert [v.item() for v in r.values()] == pytest.approx([1.5, 2**-0.5, 1.0, 2.0])
    a = R.advantage_stats(adv, mask)  # means 1, 1; the empty third row is left out
    assert [v.item() for v in a.values()] == [1.0, 0.0, 1.0, 1.0]
    # without a mask every token counts
    assert R.reward_stats(rewards)["rollout/reward/max"].item() == 15.0


# --- Gini -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "values,expected",
    [([1, 1, 1], 0.0), ([0, 0, 0, 1], 0.75), ([1, 2, 3, 4], 0.25), ([5], 0.0), ([0, 0], 0.0), ([-3, 1], 0.0),
     ([1, 3], 0.25)],  # no value: a ValueError (tests/test_functional_empty.py)
)
def test_gini_known_values(values, expected):
    assert R.gini(torch.tensor(values, dtype=torch.float64)).item() == pytest.approx(expected, abs=1e-15)


def _gini_exact(values) -> float:
    """The population Gini from its definition, sum_i sum_j |x_i - x_j| / (2 n^2 mean), in exact rationals."""
    from fractions import Fraction

    x = [Fraction(v) for v in values]
    total = sum(x)
    if total <= 0:
        return 0.0
    return float(sum(abs(a - b) for a in x for b in x) / (2 * len(x) * total))


@pytest.mark.parametrize(
    "values", [[0.0, 2.2e-309], [0.0, 0.0, 5e-324], [1e-310, 3e-310], [0.0, 1e308, 1.5e308], [1e-300, 1e300]]
)
def test_gini_of_subnormal_and_huge_values(values):
    """Scale invariance down to subnormals and up to the float64 limit: [0, a] has Gini 1/2 for any a > 0."""
    got = R.gini(torch.tensor(values, dtype=torch.float64)).item()
    assert got == pytest.approx(_gini_exact(values), rel=1e-12)
    groups = M.RolloutRewardGini()
    n = len(values)
    groups.update(rewards=torch.tensor(values * 2, dtype=torch.float64), group_ids=torch.tensor([0] * n + [1] * n))
    assert groups.compute().item() == pytest.approx(_gini_exact(values), rel=1e-12)


def test_group_ids_are_arbitrary():
    """Negative, huge, non-contiguous ints, strings and NumPy object arrays all give the same groups."""
    x = torch.tensor([1.0, 0.0, 3.0, 3.0, 2.0, 0.0, 7.0])
    compact = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    want = R.group_gini(x, compact).item()
    assert want == pytest.approx(group_gini_mean(compact.tolist(), x.numpy()))
    for ids in (torch.tensor([-9, -9, 2**40, 2**40, 5, 5, -1]), ["u1", "u1", "u7", "u7", "x", "x", "y"],
                np.array(["u1", "u1", "u7", "u7", "x", "x", "y"], dtype=object), np.array([4, 4, 3, 3, 2, 2, 1])):
        assert R.group_gini(x, ids).item() == pytest.approx(want, rel=1e-14)
        assert R.group_max_median_ratio(x, ids).item() == pytest.approx(group_max_median_mean(compact.tolist(), x))


def test_max_median_ratio_as_telescope_without_a_floor():
    # [0, 2]: median 1, ratio 2 (a 1-token floor would give 2 / 1.5)
    assert R.group_max_median_ratio(torch.tensor([0, 2]), torch.zeros(2, dtype=torch.long)).item() == 2.0
    ids = torch.tensor([0, 0, 0, 1, 1])
    # group 0: [0, 0, 6] has median 0: no ratio, left out (a floor would give 6); group 1: [3, 3] -> 1
    assert R.group_max_median_ratio(torch.tensor([0, 0, 6, 3, 3]), ids).item() == 1.0
    assert group_max_median_mean(ids.tolist(), [0, 0, 6, 3, 3]) == 1.0
    # even-sized group: median is the mean of the two middle values, (2 + 4) / 2
    assert R.group_max_median_ratio(torch.tensor([1, 2, 4, 9]), torch.zeros(4, dtype=torch.long)).item() == 3.0


def test_telescope_examples_by_hand():
    # prompt groups of 2 and 1 with prompts of 55 and 329 tokens: each prompt once, mean 192
    metric = M.PromptTokenStats()
    metric.update(prompt_lengths=torch.tensor([55, 55, 329]), group_ids=["a", "a", "b"])
    assert metric.compute()["rollout/tokens_prompt/mean"].item() == 192.0
    # CV per group: [10, 30] -> sample std 14.142 / 20; [5] has none; [0, 0] has mean 0: left out
    cv = M.CompletionLengthCV()
    cv.update(response_lengths=torch.tensor([10, 30, 5, 0, 0]), group_ids=torch.tensor([1, 1, 2, 3, 3]))
    assert cv.compute().item() == pytest.approx(math.sqrt(200) / 20)


@pytest.mark.parametrize("field", ["rewards", "advantages", "response_lengths", "policy_lag"])
def test_per_sample_field_of_another_length_than_the_sequences_names_it(field):
    b = make_rollouts(groups=3, seed=2)
    n = len(b["group_ids"])
    batch = {**b, "trainer_logprobs": torch.zeros(n, 4), "rollout_logprobs": torch.zeros(n, 4)}
    batch[field] = torch.cat([b[field], b[field][:1]])  # B + 1 entries against B sequences
    with pytest.raises(ValueError, match=f"`{field}` has {n + 1} entries but the batch has {n} sequences"):
        collection()(batch)


def test_split_group_counts_as_two_groups():
    """The documented assumption: a group must arrive whole in one update. A split group is two groups."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    ids = torch.tensor([5, 5, 5, 5])
    whole, split = M.RolloutRewardGini(), M.RolloutRewardGini()
    whole.update(rewards=rewards, group_ids=ids)
    split.update(rewards=rewards[:2], group_ids=ids[:2])
    split.update(rewards=rewards[2:], group_ids=ids[2:])
    assert whole.compute().item() == pytest.approx(gini_pairwise([1, 0, 0, 0])) == 0.75
    assert split.compute().item() == pytest.approx((gini_pairwise([1, 0]) + gini_pairwise([0, 0])) / 2) == 0.25


def test_zero_advantage_mask_and_discard_reasons():
    rng = np.random.default_rng(3)
    for _ in range(30):
        b = int(rng.integers(1, 20))
        ids = rng.integers(-3, 4, b) * 11
        r = rng.integers(0, 2, b).astype(np.float64)
        got = R.zero_advantage_mask(torch.tensor(r), torch.tensor(ids))
        assert got.tolist() == zero_advantage_reference(r, ids.tolist())
        adv = rng.choice([0.0, 1e-10, 5e-10, 2e-9, 0.5], size=b)  # around the 1e-9 tolerance
        got = R.zero_advantage_mask(torch.tensor(r), torch.tensor(ids), advantages=torch.tensor(adv))
        assert got.tolist() == zero_advantage_reference(r, ids.tolist(), adv.tolist())
    # a group of one is never discarded for zero advantage
    codes = R.discard_reasons(torch.tensor([1.0, 1.0, 0.0, 1.0, 3.0]), ["a", "a", "b", "b", "c"],
                              policy_lag=torch.tensor([0, 9, 9, 0, 0]), max_off_policy_steps=4)
    assert codes.tolist() == [2, 1, 1, 0, 0]
    # advantages decide when given: equal rewards with different advantages are kept
    codes = R.discard_reasons(torch.tensor([1.0, 1.0, 0.0, 1.0]), [0, 0, 1, 1],
                              advantages=torch.tensor([0.1, -0.1, 0.0, 0.0]))
    assert codes.tolist() == [0, 0, 2, 2]
    codes = R.discard_reasons(torch.tensor([1.0, 1.0]), [0, 0], discard_group_zero_advantage=False)
    assert codes.tolist() == [0, 0]
    # [B, T] rewards are summed under the mask first: both sums are 1 -> zero advantage
    tok = torch.tensor([[1.0, 5.0], [0.5, 0.5]])
    assert R.zero_advantage_mask(tok, [0, 0], torch.tensor([[1, 0], [1, 1]])).tolist() == [True, True]
    assert R.zero_advantage_mask(torch.tensor([0.0, 0.1]), [0, 0], atol=0.2).tolist() == [True, True]
    with pytest.raises(ValueError, match="max_off_policy_steps"):
        R.discard_reasons(torch.ones(2), [0, 0], policy_lag=torch.zeros(2))


def test_stop_reason_encodings():
    assert R.stop_reason_length_pct(torch.tensor([True, False, False, False])).item() == 25.0
    assert R.stop_reason_length_pct(torch.tensor([3, 3, 1, 0]), length_code=3).item() == 50.0
    assert R.stop_reason_length_pct(["length", None, "tool_calls", "completed"]).item() == 25.0  # verl: completed
    assert R.stop_reason_length_pct(np.array(["length", "stop"])).item() == 50.0
    metric = M.StopReasonLengthPct(length_code=7)
    metric.update(stop_reasons=torch.tensor([7, 1]))
    metric.update(stop_reasons=["length", "length", "stop"])  # strings: "length" maps to length_code
    assert metric.compute().item() == pytest.approx(300 / 5)


def test_unknown_stop_reasons_raise_naming_the_field_and_accepted_values():
    """Unknown strings raise in update (a host list); unknown int codes are counted without a sync and raise at
    compute, in the collection and in DiscardedRolloutStats; the functional names the codes at once."""
    for bad in (["LENGTH", "stop"], ["max_tokens"]):
        with pytest.raises(ValueError, match=r"stop_reasons.*unknown reason '(LENGTH|max_tokens)'.*'length'"):
            R.stop_reason_length_pct(bad)
        with pytest.raises(ValueError, match="stop_reasons"):
            collection().update(stop_reasons=bad)
    with pytest.raises(ValueError, match=r"stop_reasons.*\[-1, 7\]; accepted: \[0, 1, 2\]"):
        R.stop_reason_length_pct(torch.tensor([7, -1, 1]))
    assert R.stop_reason_length_pct(torch.tensor([3, 0, 1, 2]), length_code=3).item() == 25.0  # 1: a known code
    metrics = collection()
    with assert_no_host_sync():
        metrics.update(stop_reasons=torch.tensor([7, -1]))
    with pytest.raises(ValueError, match=r"stop_reasons.*2 invalid.*\[0, 1, 2\]"):
        metrics.compute()
    discarded = M.DiscardedRolloutStats()
    discarded.update(discard_reasons=torch.tensor([1, 0]), response_lengths=torch.tensor([3, 4]),
                     stop_reasons=torch.tensor([1, 5]))
    with pytest.raises(ValueError, match=r"stop_reasons.*1 invalid"):
        discarded.compute()
    with pytest.raises(ValueError, match="stop_reasons"):
        R.discarded_rollout_stats(torch.tensor([1, 0]), torch.tensor([3, 4]), stop_reasons=torch.tensor([1, 5]))


def test_an_unknown_stop_reason_has_the_librarys_invalid_value_message():
    """`stop_reason_length_pct` built its own message for unknown int codes ("holds int code(s) [7]; accepted: ...")
    and unknown strings raised another ("holds unknown reason 'LENGTH'; known: ..."), beside the shared form of the
    other bad values: now every unknown stop reason (or discard reason) gives that form, naming the field, the count
    and the values, and what to do, from the functional and from the metric alike."""
    shared = r"^batch field `{}` held {} invalid value\(s\) \({}.*\); fix the input$"
    codes = r"int code\(s\) \[{}\]; accepted: \[{}\]"
    with pytest.raises(ValueError, match=shared.format("stop_reasons", 2, codes.format("-1, 7", "0, 1, 2"))):
        R.stop_reason_length_pct(torch.tensor([7, -1, 1]))
    with pytest.raises(ValueError, match=shared.format("stop_reasons", 1, codes.format("5", "0, 1, 2, 3"))):
        R.stop_reason_length_pct(torch.tensor([3, 5]), length_code=3)
    strings = ["LENGTH", "stop", "max_tokens", "LENGTH", None]
    unknown = shared.format("stop_reasons", 3, r"unknown reasons 'LENGTH', 'max_tokens'; known: \[.*'length'")
    with pytest.raises(ValueError, match=unknown):
        R.stop_reason_length_pct(strings)
    with pytest.raises(ValueError, match=unknown):
        M.StopReasonLengthPct().update(stop_reasons=strings)
    with pytest.raises(ValueError, match=shared.format("stop_reasons", 1, "unknown reason 'LENGTH'; known")):
        R.discarded_rollout_stats(torch.tensor([1]), torch.tensor([3]), stop_reasons=["LENGTH"])
    with pytest.raises(ValueError, match=shared.format("discard_reasons", 1, "unknown reason 'dropped'; known")):
        R.discarded_counts(["dropped", None])
    # the metric's deferred error for int codes has the same form
    metric = M.StopReasonLengthPct()
    metric.update(stop_reasons=torch.tensor([7, 0]))
    with pytest.raises(ValueError, match=shared.format("stop_reasons", 1, r"int codes other than \[0, 1, 2\]")):
        metric.compute()
    # the first bad entry decides which error, as before: a value of the wrong type before an unknown string
    with pytest.raises(ValueError, match="must hold strings, int codes or None, got float"):
        R.stop_reason_length_pct([1.5, "LENGTH"])


def test_zero_dim_and_token_level_rewards_without_response_tokens():
    t = torch.full((2, 4), -1.0)
    metrics = OPBCCollection(sections=["mismatch", "rollout"])
    with pytest.raises(ValueError, match=r"`rewards` must have shape \[B\] or \[B, T\], got \(\)"):
        metrics.update(trainer_logprobs=t, rollout_logprobs=t, rewards=torch.tensor(1.0))
    metrics = collection()  # [B, T] rewards, no response token: no reward keys (as for advantages)
    metrics.update(rewards=torch.rand(4, 6) + 1.0, advantages=torch.rand(4, 6), response_mask=torch.zeros(4, 6))
    assert not [k for k in metrics.compute() if k.startswith(("rollout/reward/", "rollout/advantage/"))]
    mask = torch.zeros(4, 6)
    mask[1, 2:4] = 1
    rewards = torch.rand(4, 6) + 1.0
    metrics.update(rewards=rewards, response_mask=mask)  # one sample with tokens: its reward alone
    out = metrics.compute()
    assert out["rollout/reward/min"].item() == out["rollout/reward/max"].item() == pytest.approx(
        rewards[1, 2:4].sum().item())


# --- properties -----------------------------------------------------------------------------------
nonneg = st.one_of(st.just(0.0), st.floats(1e-6, 1e6))  # no subnormals: the references divide by n^2 mean


@given(st.lists(nonneg, min_size=1, max_size=12), st.floats(1e-3, 1e3))
def test_gini_bounds_and_scale_invariance(values, scale):
    x = torch.tensor(values, dtype=torch.float64)
    g = R.gini(x).item()
    n = len(values)
    assert -1e-12 <= g <= (n - 1) / n + 1e-12
    assert R.gini(x * scale).item() == pytest.approx(g, rel=1e-9, abs=1e-12)
    assert g == pytest.approx(gini_pairwise(values), rel=1e-9, abs=1e-12)
    assert g == pytest.approx(gini_sorted_rank(values), rel=1e-9, abs=1e-12)


@given(rollout_groups())
def test_matches_reference_and_bounds(groups):
    batch = groups_batch(groups)
    out = collection()(batch)
    assert_matches(out, rollout_reference(batch, NAMES), rtol=1e-9, atol=1e-9)
    for key in ("rollout/stop_reason/length_pct", "rollout/discarded/pct"):
        assert 0.0 <= out[key].item() <= 100.0
    for key in ("rollout/reward/group_gini_mean", "rollout/tokens_completion/group_gini_mean",
                "sample_metrics/tool_calls/group_gini_mean", "sample_metrics/format/group_gini_mean"):
        if key.startswith("sample_metrics/") and key not in out:  # no sample reported that metric: no keys
            continue
        assert 0.0 <= out[key].item() < 1.0, key
    ratio = out.get("rollout/tokens_completion/group_max_median_ratio_mean")  # absent: no group has a ratio
    assert ratio is None or ratio.item() >= 1.0
    for prefix in ("rollout/reward", "rollout/advantage", "rollout/tokens_total", "sample_metrics/format"):
        if prefix.startswith("sample_metrics/") and f"{prefix}/mean" not in out:  # not reported: no keys
            continue
        lo, mean, hi = (out[f"{prefix}/{s}"].item() for s in ("min", "mean", "max"))
        assert lo - 1e-12 <= mean <= hi + 1e-12
        if f"{prefix}/std" in out:  # the sample std of values in [lo, hi] is at most (hi - lo) / sqrt(2)
            assert 0.0 <= out[f"{prefix}/std"].item() <= (hi - lo) / math.sqrt(2) + 1e-9
    # keys exist where the reference has data, std only over two samples or more
    std_keys = {k for k in out if k.endswith("/std")}
    assert std_keys == {k for k in rollout_reference(batch, NAMES) if k.endswith("/std")}


@given(st.lists(st.floats(-1e3, 1e3), min_size=2, max_size=30), st.floats(-1e6, 1e6))
def test_std_of_shifted_data(values, shift):
    """Sample std from raw moments: within the documented rounding resolution of numpy's std."""
    x = np.asarray(values) + shift
    got = R.reward_stats(torch.tensor(x))["rollout/reward/std"].item()
    rms = float(np.sqrt((x * x).mean()))
    assert abs(got - x.std(ddof=1)) <= 2e-6 * rms + 1e-12


@pytest.mark.parametrize("scale", [1e150, 1e200, 1e300, 1e307])
def test_large_values_give_finite_statistics(scale):
    x = np.array([1.0, 3.0, 2.0, 0.5, -1.0]) * scale
    metric = M.RolloutRewardStats()
    metric.update(rewards=torch.tensor(x[:2]))
    metric.update(rewards=torch.tensor(x[2:]))
    out = metric.compute()
    assert all(math.isfinite(v.item()) for v in out.values())
    scaled = x / scale  # the reference on scaled data, scaled back
    assert out["rollout/reward/mean"].item() == pytest.approx(scaled.mean() * scale, rel=1e-12)
    assert out["rollout/reward/std"].item() == pytest.approx(scaled.std(ddof=1) * scale, rel=1e-12)
    assert out["rollout/reward/max"].item() == 3.0 * scale


def test_one_sample_has_no_std_key():
    metric = M.RolloutRewardStats()
    metric.update(rewards=torch.tensor([0.5]))
    assert set(metric.compute()) == {"rollout/reward/mean", "rollout/reward/min", "rollout/reward/max"}
    metric.update(rewards=torch.tensor([1.5]))
    assert metric.compute()["rollout/reward/std"].item() == pytest.approx(math.sqrt(0.5))
    out = R.sample_metric_stats({"once": torch.tensor([1.0, float("nan")]), "twice": torch.tensor([1.0, 2.0])})
    assert "sample_metrics/once/std" not in out and "sample_metrics/twice/std" in out


def test_constant_values_have_zero_std():
    for c in (0.7, 1e6 + 0.1, -3.3, 1e-9):
        metric = M.RolloutRewardStats()
        for _ in range(3):
            metric.update(rewards=torch.full((7,), c, dtype=torch.float64))
        assert metric.compute()["rollout/reward/std"].item() == 0.0


# --- contracts ------------------------------------------------------------------------------------
def test_token_fields_stop_codes_and_helpers_never_sync():
    b = make_rollouts(groups=6, seed=2, tokens=True)
    b["stop_reasons"] = torch.tensor([1, 0, 2] * (len(b["stop_reasons"]) // 3) + [0] * (len(b["stop_reasons"]) % 3))
    for m in [*[cls() for cls in M.ROLLOUT_METRICS], M.SampleMetricStats(NAMES), collection()]:
        with assert_no_host_sync():
            m.update(b)
    b = make_rollouts(groups=6, seed=3)
    with assert_no_host_sync():
        R.zero_advantage_mask(b["rewards"], b["group_ids"])
        R.discard_reasons(b["rewards"], b["group_ids"], policy_lag=b["prompt_lengths"], max_off_policy_steps=50)


def test_section_in_collection_and_optional_inputs():
    # skipping batches without rollout fields next to mismatch: tests/test_contracts.py
    r = make_rollouts(groups=3, seed=1)
    with pytest.raises(ValueError, match="trainer_logprobs"):
        OPBCCollection(sections=("mismatch", "rollout")).update(r)  # the mismatch members (required inputs) raise
    rollout_only = OPBCCollection(sections=("rollout",))
    rollout_only.update({k: v for k, v in r.items() if k in ("rewards", "group_ids")})
    out = rollout_only.compute()
    assert out["rollout/reward/group_gini_mean"].item() == pytest.approx(
        group_gini_mean(r["group_ids"].tolist(), r["rewards"].numpy()))
    assert not any(k.startswith("sample_metrics/") for k in out)  # needs names: rollout_metrics([...])


def test_list_inputs_per_sample_dicts_and_uids():
    rows = [{"tool_calls": 1, "format": 0.5}, {"tool_calls": 3}, {"format": 1.0}, {}]
    metric = M.SampleMetricStats(NAMES)
    metric.update(sample_metrics=rows, group_ids=["p0", "p0", "p1", "p1"])
    out = metric.compute()
    assert out["sample_metrics/tool_calls/mean"].item() == 2.0
    assert out["sample_metrics/tool_calls/group_gini_mean"].item() == pytest.approx(gini_pairwise([1, 3]))
    assert out["sample_metrics/format/mean"].item() == 0.75
    # format: group p0 [0.5], group p1 [1.0] -> both Gini 0
    assert out["sample_metrics/format/group_gini_mean"].item() == 0.0
    no_gini = M.SampleMetricStats(["x"], group_gini=False)
    no_gini.update(sample_metrics={"x": [1.0, 2.0]})
    assert set(no_gini.compute()) == {f"sample_metrics/x/{s}" for s in ("mean", "std", "min", "max")}


def test_chart_ranges_declared_and_observed():
    metrics = collection(reward_min=-1.0, reward_max=None, metrics_ranges={"format": (0.0, 1.0)})
    assert M.chart_ranges(metrics) == {
        **{f"sample_metrics/format/{s}": (0.0, 1.0) for s in ("mean", "min", "max", "group_gini_mean")},
        "sample_metrics/format/std": (0.0, 1 / math.sqrt(2)),
    }
    a, b2 = (make_rollouts(groups=3, seed=s, missing=False) for s in (4, 5))
    for x in (a, b2):
        metrics.update(x)
        metrics.compute()
        metrics.reset()  # the observed range is the run's: it survives resets
    ranges = M.chart_ranges(metrics)
    seen = torch.cat([a["rewards"], b2["rewards"]])
    assert ranges["rollout/reward/mean"] == (-1.0, seen.max().item())  # declared lo, observed hi
    calls = torch.cat([a["sample_metrics"]["tool_calls"], b2["sample_metrics"]["tool_calls"]])
    assert ranges["sample_metrics/tool_calls/max"] == (calls.min().item(), calls.max().item())
    assert ranges["sample_metrics/format/max"] == (0.0, 1.0)
    lengths = torch.cat([a["response_lengths"], b2["response_lengths"]]).double()
    assert ranges["rollout/tokens_completion/std"] == (0.0, (lengths.max() - lengths.min()).item() / math.sqrt(2))
    assert "rollout/advantage/mean" in ranges and "rollout/stop_reason/length_pct" not in ranges
    assert metrics["RolloutRewardStats"].reward_min == -1.0


# --- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change,field",
    [
        (lambda b: b.update(group_ids=b["group_ids"][:, None]), "group_ids"),
        (lambda b: b.update(group_ids=b["group_ids"][:-1]), "group_ids"),
        (lambda b: b.update(group_ids=b["group_ids"].double()), "group_ids"),
        (lambda b: b.update(group_ids=[[1], [2]]), "group_ids"),
        (lambda b: b.update(response_lengths=b["response_lengths"][:-1]), "response_lengths"),
        (lambda b: b.update(prompt_lengths=b["prompt_lengths"][:, None]), "prompt_lengths"),
        (lambda b: b.update(rewards=b["rewards"][:, None, None]), "rewards"),
        (lambda b: b.update(rewards=b["rewards"].bool()), "rewards"),
        (lambda b: b.update(rewards=b["rewards"].tolist()), "rewards"),
        (lambda b: b.update(advantages=torch.zeros(len(b["group_ids"]), 3), response_mask=torch.ones(2, 2)),
         "response_mask"),
        (lambda b: b["sample_metrics"].update(unknown=b["sample_metrics"]["format"]), "sample_metrics"),
        (lambda b: b["sample_metrics"].update(format=b["sample_metrics"]["format"][:-1]), "sample_metrics"),
        (lambda b: b.update(sample_metrics=[1, 2]), "sample_metrics"),
        (lambda b: b.update(stop_reasons=torch.zeros(len(b["group_ids"]))), "stop_reasons"),
        (lambda b: b.update(stop_reasons=[1.5] * len(b["group_ids"])), "stop_reasons"),
        (lambda b: b.update(discard_reasons=["late"] * len(b["group_ids"])), "discard_reasons"),
        (lambda b: b.update(discard_reasons=torch.ones(len(b["group_ids"]), dtype=torch.bool)), "discard_reasons"),
    ],
)
def test_bad_input_names_the_field(change, field):
    b = make_rollouts(groups=3, seed=0)
    change(b)
    with pytest.raises(ValueError, match=field):
        collection().update(b)


def _token_stats(b):
    return R.token_stats(b["prompt_lengths"], b["response_lengths"])


@pytest.mark.parametrize(
    "change,field,functional",  # the public function of the field: it raises at once
    [
        (lambda b: b["response_lengths"].__setitem__(0, -1), "response_lengths", _token_stats),
        (lambda b: b["prompt_lengths"].__setitem__(1, -5), "prompt_lengths", _token_stats),
        (lambda b: b["rewards"].__setitem__(0, math.nan), "rewards", lambda b: R.reward_stats(b["rewards"])),
        (lambda b: b["advantages"].__setitem__(0, math.inf), "advantages",
         lambda b: R.advantage_stats(b["advantages"])),
        (lambda b: b["sample_metrics"]["format"].__setitem__(0, -math.inf), "sample_metrics.*format",
         lambda b: R.sample_metric_stats(b["sample_metrics"], b["group_ids"])),
        (lambda b: b["discard_reasons"].__setitem__(0, 5), "discard_reasons",
         lambda b: R.discarded_counts(b["discard_reasons"])),
    ],
)
def test_bad_values_raise_at_compute_naming_the_field(change, field, functional):
    """Values cannot be read in update() without a host sync: they are counted and raise at compute()."""
    b = make_rollouts(groups=3, seed=0, missing=False)
    change(b)
    metrics = collection()
    with assert_no_host_sync():
        metrics.update(b)
    with pytest.raises(ValueError, match=field):
        metrics.compute()
    metrics.reset()
    metrics.update(make_rollouts(groups=3, seed=0))
    metrics.compute()  # a reset clears the error
    with pytest.raises(ValueError, match=field):  # the public functions raise at once
        functional(b)


def test_bad_constructor_arguments():
    for match, make in [("value_range", lambda: M.RolloutRewardStats(reward_min=2.0, reward_max=1.0)),
                        ("value_range", lambda: M.RolloutRewardStats(reward_min=math.inf)),
                        ("metrics_ranges", lambda: M.SampleMetricStats(["a"], metrics_ranges={"b": (0, 1)})),
                        ("metrics_ranges", lambda: M.SampleMetricStats(["a"], metrics_ranges={"a": (0, 1, 2)})),
                        *(("names", lambda bad=bad: M.SampleMetricStats(bad)) for bad in (["a/b"], ["a", "a"], [""],
                                                                                            "abc", [3])),
                        ("length_code", lambda: M.StopReasonLengthPct(length_code="length")),
                        ("metrics_ranges", lambda: M.rollout_metrics(metrics_ranges={"a": (0, 1)}))]:
        with pytest.raises(ValueError, match=match):
            make()


def test_each_class_alone():
    """Each class works outside a collection, with just its own fields (a missing one: test_contracts.py)."""
    b = make_rollouts(groups=4, seed=8)
    ref = rollout_reference(b, NAMES)
    fields = {"RolloutRewardStats": "rewards", "RolloutRewardGini": "rewards group_ids",
              "RolloutAdvantageStats": "advantages", "PromptTokenStats": "prompt_lengths group_ids",
              "CompletionTokenStats": "response_lengths", "TotalTokenStats": "prompt_lengths response_lengths",
              "CompletionLengthGini": "response_lengths group_ids", "OffPolicySteps": "policy_lag",
              "CompletionLengthMaxMedianRatio": "response_lengths group_ids",
              "CompletionLengthCV": "response_lengths group_ids", "StopReasonLengthPct": "stop_reasons",
              "DiscardedRolloutStats": "discard_reasons response_lengths group_ids stop_reasons",
              "DiscardedRollouts": "discard_reasons rewards", "SampleMetricStats": "sample_metrics group_ids"}
    for m in [*(cls() for cls in M.ROLLOUT_METRICS), M.SampleMetricStats(NAMES)]:  # every class (KeyError: list it)
        m.update(**{f: b[f] for f in fields[type(m).__name__].split()})
        out = m.compute_dict()
        assert set(out) == set(m.keys)
        assert_matches(out, {k: ref[k] for k in out})


def test_sample_metric_no_sample_reported_has_no_keys():
    """A declared name that no sample reported in the window (absent or all NaN) gets no keys, not a mean of 0;
    the other names keep theirs."""
    metric = M.SampleMetricStats(["a", "b", "c"])
    metric.update(sample_metrics={"a": torch.tensor([1.0, 3.0]), "b": torch.tensor([math.nan, math.nan])},
                  group_ids=torch.tensor([0, 0]))
    out = metric.compute()
    assert {k.split("/")[1] for k in out} == {"a"}
    # (the std within an ulp: its square root reads 1.414213562373095 on an Intel Xeon, sqrt(2) on an AMD EPYC)
    assert out["sample_metrics/a/mean"].item() == 2.0
    assert out["sample_metrics/a/std"].item() == pytest.approx(math.sqrt(2.0), rel=3e-16, abs=0)


def test_functional_length_share_refuses_no_stop_reason():
    from opbc_metrics.functional.rollout import stop_reason_length_pct

    with pytest.raises(ValueError, match="`stop_reasons` is empty"):
        stop_reason_length_pct([])
    assert float(stop_reason_length_pct(["length", "stop"])) == 50.0


def test_two_stop_metrics_with_different_length_codes_share_a_view():
    """The view caches the stop codes; the cache key holds the string table, so a metric with another
    `length_code` does not read the first one's codes (it raised "invalid value(s)" on valid strings)."""
    from opbc_metrics.batch import BatchView

    five, default = M.StopReasonLengthPct(length_code=5), M.StopReasonLengthPct()
    view = BatchView(stop_reasons=["length", "stop"])
    five.update(view)
    default.update(view)
    assert float(five.compute()) == float(default.compute()) == 50.0


def test_functional_group_means_refuse_a_batch_without_a_group():
    """The group functions returned 0 (CV, Gini) or 1 (max/median) for no group: made-up values."""
    none = torch.tensor([], dtype=torch.long)
    for fn, args in ((R.group_length_cv, (none, none)), (R.group_gini, (torch.tensor([]), none)),
                     (R.group_max_median_ratio, (torch.tensor([0, 0]), torch.tensor([1, 1])))):
        with pytest.raises(ValueError, match=r"no group with .* in the batch"):
            fn(*args)
    assert float(R.group_gini(torch.tensor([3.0]), torch.tensor([1]))) == 0.0  # a group of one: Gini 0 (data)
