"""Hypothesis properties of the training metrics: bounds and monotonicity (chunking and order invariance:
test_contracts.py)."""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from opbc_metrics import training as M
from opbc_metrics.functional import perf as P
from opbc_metrics.functional import training as FT
from opbc_metrics.functional import validation as FV
from tests import training_reference as TR
from tests.data import make_training_batch
from tests.harness import VALIDATION

batch_params = st.tuples(st.integers(1, 7), st.integers(1, 9), st.integers(0, 10_000), st.integers(0, 2))


@given(batch_params, st.floats(0.0, 0.9), st.floats(0.0, 2.0), st.floats(1.01, 10.0), st.floats(0.01, 3.0))
def test_fractions_and_bounds(params, low, high, c, spread):
    b, t, seed, empty = params
    batch = make_training_batch(batch=b, seq=t, seed=seed, empty_rows=min(empty, b))
    g = torch.Generator().manual_seed(seed)
    batch["policy_logprobs"] = (batch["old_logprobs"] + torch.randn(b, t, generator=g, dtype=torch.float64) * spread
                                ).clamp(max=0.0)
    mask = batch["response_mask"] != 0
    if not mask.any():  # no valid token: no values to bound (forward returns None)
        assert M.PolicyClipFraction()(batch) is None
        return
    out = M.PolicyClipFraction(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)(batch)
    neg = ((batch["advantages"] < 0) & mask).sum() / mask.sum().clamp_min(1)
    assert 0.0 <= out["actor/pg_clipfrac"] <= 1.0
    assert 0.0 <= out["actor/pg_clipfrac_lower"] <= neg + 1e-12
    for est in ("k2", "k3"):
        assert M.PPOKL(estimator=est)(batch) >= 0
    explained = M.ExplainedVariance()(batch)  # None with one token: sample variances need two
    assert (explained is None) == (int(mask.sum()) < 2) and (explained is None or explained <= 1.0)
    ent = M.PolicyEntropy(from_logits=True)(batch)
    assert 0.0 <= ent <= math.log(batch["logits"].shape[-1]) + 1e-9
    dpo = M.DPOMetrics()(batch)
    assert dpo["loss/dpo"] >= 0 and 0 <= dpo["rewards/accuracy"] <= 1
    rm = M.RewardModelMetrics()(batch)
    assert rm["rm/loss"] >= 0 and 0 <= rm["rm/accuracy"] <= 1
    r = M.ResponseLength(max_response_length=4)(batch)
    assert 0 <= r["response_length/clip_ratio"] <= 1
    assert r["response_length/min"] <= r["response_length/mean"] <= r["response_length/max"]
    assert 0 <= M.AbortedRatio()(batch) <= 1
    adv = M.AdvantageStats()(batch)
    assert adv["critic/advantages/std"] >= 0
    assert adv["critic/advantages/min"] <= adv["critic/advantages/mean"] <= adv["critic/advantages/max"]


@given(st.integers(1, 80), st.data())
def test_pass_at_k_is_monotone_in_k_and_c_and_bounded(n, data):
    c = data.draw(st.integers(0, n))
    ks = list(range(1, n + 1))
    values = [FV.pass_at_k(torch.tensor([float(n)]), torch.tensor([float(c)]), k).item() for k in ks]
    assert all(0.0 <= v <= 1.0 for v in values)
    assert all(a <= b + 1e-12 for a, b in itertools.pairwise(values))
    assert math.isclose(values[0], c / n, rel_tol=1e-12, abs_tol=1e-15)  # pass@1 = c / n
    k = data.draw(st.integers(1, n))
    by_c = FV.pass_at_k(torch.full((n + 1,), float(n)), torch.arange(n + 1, dtype=torch.float64), k)
    assert (by_c[1:] >= by_c[:-1] - 1e-12).all()
    assert by_c[0] == 0.0 and by_c[-1] == 1.0


@given(st.lists(st.floats(-100, 100, allow_nan=False), min_size=1, max_size=12))
def test_best_at_k_is_monotone_and_between_mean_and_max(values):
    v = torch.tensor([values], dtype=torch.float64)
    valid = torch.ones_like(v, dtype=torch.bool)
    best = [FV.best_at_k(v, valid, k).item() for k in range(1, len(values) + 1)]
    assert math.isclose(best[0], sum(values) / len(values), rel_tol=1e-9, abs_tol=1e-9)
    assert math.isclose(best[-1], max(values), rel_tol=1e-9, abs_tol=1e-9)
    assert all(a <= b + 1e-9 for a, b in itertools.pairwise(best))


@given(VALIDATION.strategy)
def test_validation_pass_at_k_is_bounded(batch):
    metric = VALIDATION.members["ValidationAccuracy"]()
    metric.update(batch)
    for key, value in metric.compute_dict().items():
        assert 0 <= value <= 1, key


@given(st.lists(st.integers(0, 5000), min_size=0, max_size=40), st.integers(1, 6), st.booleans())
def test_balanced_partitions_bracket_the_mean(lengths, k, equal):
    references = {"karmarkar_karp": TR.ref_karmarkar_karp_sums, "lpt": TR.ref_lpt_sums}
    assert set(references) == set(P.PARTITION_ALGORITHMS)
    for algo in P.PARTITION_ALGORITHMS:
        loads = P.partition_loads(lengths, k, algo, equal)
        assert len(loads) == k and math.isclose(sum(loads), sum(lengths))
        if lengths:
            assert min(loads) <= sum(lengths) / k <= max(loads)
            assert sorted(loads) == references[algo](lengths, k, equal)  # the algorithm's own partition
    m = M.GlobalSeqlen(world_size=k)
    if lengths:
        ranks = torch.arange(len(lengths)) % k
        m.update(prompt_lengths=torch.zeros(len(lengths), dtype=torch.long), response_lengths=torch.tensor(lengths),
                 rank_ids=ranks)
    out = {key: v.item() for key, v in m.compute_dict().items()}
    if not lengths:  # no sequence: no keys
        assert out == {}
        return
    assert out["global_seqlen/min"] <= out["global_seqlen/mean"] <= out["global_seqlen/max"]
    assert out["global_seqlen/balanced_min"] <= out["global_seqlen/mean"] + 1e-9
    assert out["global_seqlen/balanced_max"] >= out["global_seqlen/mean"] - 1e-9


@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=2, max_size=30), st.floats(-1e3, 1e3))
def test_explained_variance_at_most_one_and_shift_invariant(returns, shift):  # (one token: a ValueError)
    r = torch.tensor([returns], dtype=torch.float64)
    # values not an affine function of the returns (where any formula in r - v gives the same number)
    values = [x * 0.5 + 1.0 + (i * 7919 % 13) / 13 * (1.0 + abs(x)) for i, x in enumerate(returns)]
    v = torch.tensor([values], dtype=torch.float64)
    ev = FT.explained_variance(v, r).item()
    assert ev <= 1.0
    ev_shift = FT.explained_variance(v + shift, r + shift).item()
    # Raw moments round to about 1e-16 * E[x^2] / Var(x) relative (the docstring's bound), and variances
    # under 1e-12 * E[x^2] read as 0: shift invariance holds where both variances are well conditioned.
    n = len(returns)
    var_r = sum((x - sum(returns) / n) ** 2 for x in returns) / n
    second = max(sum((x + c) ** 2 for x in returns) / n for c in (0.0, shift, 1.0 + shift))
    assume(var_r > 1e-9 * max(second, 1.0))
    assert math.isclose(ev, ev_shift, rel_tol=1e-6, abs_tol=1e-6 + 1e-14 * max(second, 1.0) / var_r)
    # verl's 1 - Var(r - v) / (Var(r) + 1e-5), sample variances (n - 1; one value: 0), in plain Python
    d = [x - y for x, y in zip(returns, values, strict=True)]
    ddof = 1 if n > 1 else 0
    var_d = sum((x - sum(d) / n) ** 2 for x in d) / (n - ddof)
    var_r_sample = var_r * n / (n - ddof)
    scale = max(second, max(y * y for y in values), 1.0) / var_r
    assert math.isclose(ev, 1.0 - var_d / (var_r_sample + 1e-5), rel_tol=1e-6, abs_tol=1e-6 + 1e-13 * scale)
