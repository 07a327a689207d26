"""The mismatch metrics against the independent NumPy reference on crafted inputs, the top-1% sketch, bounds,
bad input, and the blocked kernel (the shared contracts are in test_contracts.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given

from opbc_metrics import ImportanceSamplingESS, OPBCCollection, ProbabilityDiff, TopGradientMass
from opbc_metrics import functional as F
from opbc_metrics.functional.mismatch import sketch_relative_error_bound
from tests.data import concat_batches, logprob_batches, logprobs_numpy, make_batch, metric_values
from tests.reference import DESIGN_KEYS, mismatch_reference
from tests.support import compiled_graphs

# The sketch's documented bound for the default 8192 bins and C = 20.
SKETCH_RTOL = sketch_relative_error_bound()


def _assert_matches_reference(out, ref, rtol, atol, sketch_rtol=SKETCH_RTOL):
    for key, expected in ref.items():
        got = float(out[key])
        tol_r = sketch_rtol * 1.01 + rtol if key == "opbc/is/top_1pct_gradient_mass" else rtol
        assert math.isclose(got, expected, rel_tol=tol_r, abs_tol=atol), (key, got, expected)


def test_collection_produces_every_design_key():
    out = OPBCCollection()(make_batch())
    missing = set(DESIGN_KEYS) - set(out)
    assert not missing


@pytest.mark.parametrize("dtype,rtol,atol", [(torch.float64, 1e-9, 1e-12), (torch.float32, 2e-5, 1e-6)])
@pytest.mark.parametrize("heavy", [False, True])
def test_collection_matches_reference(dtype, rtol, atol, heavy):
    batches = [make_batch(seed=s, dtype=dtype, heavy_tail=heavy, drift=2.0 if heavy else 0.3) for s in range(3)]
    # The reference sees the same (dtype-rounded) numbers as the metric, concatenated.
    ref = mismatch_reference(*logprobs_numpy(concat_batches(batches)))
    _assert_matches_reference(metric_values(OPBCCollection(), *batches), ref, rtol, atol)


def test_large_log_ratios_hit_clamp_and_veto():
    b = make_batch(seed=3, dtype=torch.float64)
    b["rollout_logprobs"][0, 0] = -9999.0  # a finite sentinel from some engines: vetoed, not dropped
    b["rollout_logprobs"][1, 0] = b["trainer_logprobs"][1, 0] - 25.0  # clipped, not vetoed
    b["response_mask"][:2, 0] = 1
    out = OPBCCollection()(b)
    ref = mismatch_reference(*logprobs_numpy(b))
    assert ref["opbc/is/veto_fraction"] > 0 and ref["opbc/is/clipped_fraction"] > ref["opbc/is/veto_fraction"]
    _assert_matches_reference(out, ref, 1e-9, 1e-12)


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_computed_in_float32(in_dtype):
    b = make_batch(seed=4, dtype=in_dtype)
    out = OPBCCollection()(b)
    assert all(v.dtype == torch.float64 for v in out.values())
    ref = mismatch_reference(*logprobs_numpy(b))  # same rounded inputs
    _assert_matches_reference(out, ref, 2e-5, 1e-5)


# --- top-1% sketch --------------------------------------------------------------------------------
@pytest.mark.parametrize("bins", [512, 8192])
@pytest.mark.parametrize("seed", range(4))
def test_top_mass_sketch_within_bound_on_heavy_tails(bins, seed):
    """Tail-index-1.5 log ratios: the sketch is within e^(h/2) - 1 of the exact sort, relative."""
    metric, exact = TopGradientMass(bins=bins), TopGradientMass(exact=True)
    parts = [make_batch(batch=32, seq=256, seed=seed * 10 + i, heavy_tail=True, drift=1.5) for i in range(4)]
    for p in parts:
        metric.update(p)
        exact.update(p)
    sketch, truth = metric.compute().item(), exact.compute().item()
    cat = concat_batches(parts)
    ref = mismatch_reference(*logprobs_numpy(cat))["opbc/is/top_1pct_gradient_mass"]
    assert truth == pytest.approx(ref, rel=1e-6)
    exact_functional = F.top_gradient_mass(cat["trainer_logprobs"], cat["rollout_logprobs"], cat["response_mask"])
    assert exact_functional.item() == pytest.approx(ref, rel=1e-6)
    bound = metric.error_bound
    assert bound == pytest.approx(math.expm1(20.0 / bins))  # e^(h/2) - 1 with h = 2C / bins
    # Bin edges are computed in float32: allow the bound a hair of slack for tokens on an edge.
    assert abs(sketch - truth) <= truth * bound * 1.01 + 1e-12, (sketch, truth, bound)


def test_top_mass_uses_at_least_one_token_and_handles_clamp():
    t = torch.zeros(1, 3, dtype=torch.float64)
    r = torch.tensor([[0.0, 0.0, -50.0]], dtype=torch.float64)  # one weight clamped at e^20
    expected = math.exp(20) / (math.exp(20) + 2)
    assert F.top_gradient_mass(t, r).item() == pytest.approx(expected)
    assert F.top_gradient_mass(t, r, bins=8192).item() == pytest.approx(expected, rel=SKETCH_RTOL)


# --- properties ----------------------------------------------------------------------------------
@given(logprob_batches())
def test_bounds_and_equal_logprobs_on_policy(batch):
    same = OPBCCollection()(dict(batch, rollout_logprobs=batch["trainer_logprobs"].clone()))
    if same["opbc/input/num_sequences"].item() > 0:  # with data: the on-policy values
        assert same["opbc/is/ess"].item() == 1.0 and same["opbc/is/seq_ess"].item() == 1.0
        for key in ("opbc/logprob/abs_diff_max", "opbc/kl/k1", "opbc/kl/k3", "opbc/kl/chi2_token",
                    "opbc/is/clipped_fraction", "opbc/ppl/log_ppl_abs_diff"):
            assert same[key].item() == 0.0, key
    else:
        assert "opbc/is/seq_ess" not in same
    out = OPBCCollection()(batch)
    # A batch without a valid token (sequence) has no token (sequence) statistics at all.
    assert ("opbc/is/ess" in out) == (out["opbc/input/num_tokens"].item() > 0)
    assert ("opbc/is/seq_ess" in out) == (out["opbc/input/num_sequences"].item() > 0)
    if "opbc/is/ess" not in out:
        return
    for key in ("opbc/is/ess", "opbc/is/seq_ess"):
        if key in out:
            assert 0.0 < out[key].item() <= 1.0
    for key in ("opbc/is/clipped_fraction", "opbc/is/veto_fraction", "opbc/is/top_1pct_gradient_mass",
                "opbc/prob/abs_diff_mean", "opbc/prob/abs_diff_max"):
        assert 0.0 <= out[key].item() <= 1.0, key
    assert -1.0 <= out["opbc/prob/pearson"].item() <= 1.0
    assert out["opbc/kl/k3"].item() >= 0 and out["opbc/kl/k2"].item() >= 0
    assert out["opbc/is/veto_fraction"] <= out["opbc/is/clipped_fraction"]
    assert all(torch.isfinite(v).all() for v in out.values())


# --- contracts ------------------------------------------------------------------------------------
def test_nonfinite_tokens_are_counted_and_excluded():
    b = make_batch(seed=2, dtype=torch.float64)
    b["response_mask"][:, 0] = 1
    b["rollout_logprobs"][0, 0] = float("-inf")  # outside top-p in the rollout engine
    b["trainer_logprobs"][1, 0] = float("nan")
    b["rollout_logprobs"][2, -1] = float("nan")  # on a masked token when row 2 is short: ignored
    out = OPBCCollection()(b)
    ref = mismatch_reference(*logprobs_numpy(b))
    assert out["opbc/input/nonfinite_count"].item() == ref["opbc/input/nonfinite_count"] >= 2
    assert all(torch.isfinite(v) for v in out.values())
    _assert_matches_reference(out, ref, 1e-9, 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_tokens_never_count_whatever_their_logprobs(dtype):
    """Validity is mask set and r finite: masked tokens with r = 0 (0 / 0 in the eager kernel), r = +-8,
    NaN or a masked-in -inf must not reach the counts, sums or extremes (values worked out by hand)."""
    inf, nan = float("inf"), float("nan")
    trainer = torch.tensor([[-1.0, -0.5, -1.0, -1.0, -9.0, nan, -inf, -2.0], [-1.0] * 8], dtype=dtype)
    rollout = torch.tensor([[-1.0, -2.5, -1.0, -9.0, -1.0, -1.0, -1.0, -1.5], [-1.25] * 8], dtype=dtype)
    mask = torch.tensor([[1, 1, 0, 0, 0, 0, 1, 1], [1] * 8], dtype=torch.bool)
    s = F.mismatch.token_statistics(trainer, rollout, mask, 20.0, 30.0, 64)
    got = {k: s[k].item() for k in ("n", "n_mask", "sum_r", "sum_abs_r", "min_r", "max_r", "num_seqs", "sum_s")}
    # Row 0: valid r = 0, 2, -0.5; its masked -inf makes it no valid sequence. Row 1: eight r = 0.25.
    assert got == {"n": 11, "n_mask": 12, "sum_r": 3.5, "sum_abs_r": 4.5, "min_r": -0.5, "max_r": 2.0,
                   "num_seqs": 1, "sum_s": 2.0}
    assert s["hist"].sum().item() == 11


def test_mask_defaults_to_all_ones_and_accepts_float_and_bool():
    b = make_batch(seed=7, dtype=torch.float64)
    full = {k: v for k, v in b.items() if k != "response_mask"}
    ones = dict(b, response_mask=torch.ones_like(b["response_mask"], dtype=torch.float32))
    torch.testing.assert_close(OPBCCollection()(full), OPBCCollection()(ones))
    as_bool = dict(b, response_mask=b["response_mask"].bool())
    torch.testing.assert_close(OPBCCollection()(b), OPBCCollection()(as_bool))


@pytest.mark.parametrize(
    "change,field",
    [
        (lambda b: b.pop("trainer_logprobs"), "trainer_logprobs"),
        (lambda b: b.update(rollout_logprobs=b["rollout_logprobs"][:, :-1]), "rollout_logprobs"),
        (lambda b: b.update(trainer_logprobs=b["trainer_logprobs"].long()), "trainer_logprobs"),
        (lambda b: b.update(response_mask=b["response_mask"][:, :-1]), "response_mask"),
        (lambda b: b.update(trainer_logprobs=b["trainer_logprobs"][0]), "trainer_logprobs"),
        (lambda b: b.update(rollout_logprobs=b["rollout_logprobs"].tolist()), "rollout_logprobs"),
    ],
)
def test_bad_input_names_the_field(change, field):
    b = make_batch()
    change(b)
    with pytest.raises(ValueError, match=field):
        OPBCCollection().update(b)


def test_bad_constructor_arguments():
    from opbc_metrics import VetoFraction

    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="clamp"):
            ImportanceSamplingESS(clamp=bad)
        with pytest.raises(ValueError, match="veto"):
            VetoFraction(veto=bad)
    for bad in (1, 2**24 + 1, 2.5, True):
        with pytest.raises(ValueError, match="bins"):
            TopGradientMass(bins=bad)
        with pytest.raises(ValueError, match="bins"):
            F.top_gradient_mass(torch.zeros(1, 2), torch.zeros(1, 2), bins=bad)
    with pytest.raises(ValueError, match="sections"):
        OPBCCollection(sections=["nope"])


def test_clamp_and_veto_are_constructor_arguments():
    b = make_batch(seed=9, dtype=torch.float64, heavy_tail=True, drift=5.0)
    out = OPBCCollection(clamp=5.0, veto=8.0)(b)
    ref = mismatch_reference(*logprobs_numpy(b), clamp=5.0, veto=8.0)
    assert ref["opbc/is/clipped_fraction"] > 0
    _assert_matches_reference(out, ref, 1e-9, 1e-12, sketch_rtol=sketch_relative_error_bound(5.0))


def _kernel_inputs(batch):
    return batch["trainer_logprobs"], batch["rollout_logprobs"], batch["response_mask"].bool()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_eager_blocks_and_cached_plans_give_the_statistics_of_one_block(monkeypatch, dtype):
    """Blocks of 3 rows (a partial last block: two block shapes, two cached plans), run twice so the plans are
    reused, and with the optional groups toggled (a plan per group set): the statistics of one whole-batch block."""
    import opbc_metrics.functional.mismatch as fm

    batch = make_batch(batch=7, seq=50, seed=4, dtype=dtype, heavy_tail=True, drift=2.0)
    batch["trainer_logprobs"][2, 3] = float("nan")
    batch["rollout_logprobs"][5, 0] = float("-inf")
    args = (*_kernel_inputs(batch), 20.0, 30.0, 64)
    one_block = fm.token_statistics(*args)
    monkeypatch.setattr(fm, "_BLOCK_TOKENS", 150)
    fm.release_workspaces()
    prob_keys = ("sum_q", "sum_dp", "sum_abs_pq", "sum_qq", "sum_dp2", "sum_qdp", "max_abs_pq")
    results = []
    for prob, hist in ((True, True), (True, True), (False, False), (True, True)):
        blocked = fm.token_statistics(*args, prob=prob, hist=hist)
        results.append((blocked, {key: value.clone() for key, value in blocked.items()}))
        for key, value in one_block.items():
            if (key in prob_keys and not prob) or (key == "hist" and not hist):
                assert torch.all(blocked[key] == 0), key  # skipped groups read 0
                continue
            # Per-sequence sums and extremes do not depend on the blocking; block partial sums of products do.
            torch.testing.assert_close(blocked[key], value, rtol=1e-6, atol=0.0, msg=key)
        if hist:
            assert torch.equal(blocked["hist"], one_block["hist"])
    # Another batch of the same shape reuses the per-call buffers: earlier results must not change.
    fm.token_statistics(args[1], args[0], *args[2:])
    for returned, kept in results:
        for key, value in kept.items():
            torch.testing.assert_close(returned[key], value, rtol=0.0, atol=0.0, equal_nan=True, msg=key)
    fm.release_workspaces()
    assert not fm._WORKSPACES.plans and not fm._WORKSPACES.calls


def test_histogram_counts_in_float64_past_float32s_exact_range(monkeypatch):
    """Batches over 2^24 tokens count per block into float64: same counts as the direct float32 path."""
    import opbc_metrics.functional.mismatch as fm

    batch = make_batch(batch=9, seq=40, seed=8, heavy_tail=True, drift=2.0)
    args = (*_kernel_inputs(batch), 20.0, 30.0, 128)
    direct = fm.token_statistics(*args)["hist"]
    monkeypatch.setattr(fm, "_BLOCK_TOKENS", 80)
    monkeypatch.setattr(fm, "_FLOAT32_EXACT_TOKENS", 10)
    per_block = fm.token_statistics(*args)["hist"]
    assert torch.equal(per_block, direct)
    assert per_block.sum().item() == batch["response_mask"].sum().item()


@pytest.mark.parametrize("drift", [1e-3, 2.0])
def test_histogram_copies_count_what_one_histogram_counts(monkeypatch, drift):
    """The eager CPU scatter's copies of the histogram (tokens spread by position) sum to the counts of a
    single histogram, near on-policy (a few bins) and spread out."""
    import opbc_metrics.functional.mismatch as fm

    batch = make_batch(batch=6, seq=70, seed=3, heavy_tail=True, drift=drift)
    batch["response_mask"][1, 40:] = False
    args = (*_kernel_inputs(batch), 20.0, 30.0, 256)
    counts = {}
    for lanes in (1, 3, fm._EAGER_HIST_LANES):
        monkeypatch.setattr(fm, "_EAGER_HIST_LANES", lanes)
        fm.release_workspaces()
        counts[lanes] = fm.token_statistics(*args)["hist"]
    fm.release_workspaces()
    assert counts[1].sum().item() == batch["response_mask"].sum().item()
    assert all(torch.equal(c, counts[1]) for c in counts.values())


def test_l2_cache_size_read_from_sysfs(tmp_path):
    """The block size's cache probe: the level-2 entry's size, 0 where sysfs has none."""
    import opbc_metrics.functional.mismatch as fm

    for index, (level, size) in enumerate([("1", "48K"), ("1", "32K"), ("2", "1024K"), ("3", "32768K")]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "level").write_text(level + "\n")
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert fm._l2_cache_bytes(str(tmp_path)) == 1 << 20
    (tmp_path / "index2" / "size").write_text("2M\n")
    assert fm._l2_cache_bytes(str(tmp_path)) == 2 << 20
    assert fm._l2_cache_bytes(str(tmp_path / "missing")) == 0


def test_weight_std_and_prob_diff_std_match_their_sources_definitions():
    """weight_std: population std of the token IS weights; diff_std: verl's probs_diff_std, i.e.
    ``torch.std(masked_select(abs(exp(old_log_probs) - exp(rollout_log_probs)), mask))`` (divisor N - 1)."""
    from opbc_metrics import ImportanceWeightStd

    batches = [make_batch(seed=s, dtype=torch.float64, drift=0.3) for s in range(3)]  # chunks: the moments merge
    std, prob = metric_values(ImportanceWeightStd(), *batches), metric_values(ProbabilityDiff(), *batches)
    cat = concat_batches(batches)
    tr, ro, mask = logprobs_numpy(cat)
    valid = (mask != 0) & np.isfinite(tr) & np.isfinite(ro)
    w = np.exp(np.clip(tr - ro, -20.0, 20.0))[valid]
    assert std["opbc/is/weight_std"] == pytest.approx(float(np.sqrt(np.mean((w - w.mean()) ** 2))), rel=1e-9)
    diff = (torch.exp(cat["trainer_logprobs"]) - torch.exp(cat["rollout_logprobs"])).abs()
    verl = torch.std(torch.masked_select(diff, torch.from_numpy(valid)))
    assert prob["opbc/prob/diff_std"] == pytest.approx(verl.item(), rel=1e-9)
    # One token: torch.std is undefined (NaN); the metric reports no key rather than a made-up spread.
    one = {"trainer_logprobs": torch.tensor([[-1.0]]), "rollout_logprobs": torch.tensor([[-2.0]])}
    assert "opbc/prob/diff_std" not in metric_values(ProbabilityDiff(), one)


def test_one_token_window_has_no_pearson_and_no_diff_std():
    """The audit's case: one valid token gave pearson 0.98878 and diff_std 1.03e-05 (rounding noise of the raw
    moments). Pearson and diff_std need two tokens (no key, in the metric and the function). Two tokens over two
    updates (or ranks) bring pearson back."""
    one = {"trainer_logprobs": torch.tensor([[-1.0]]), "rollout_logprobs": torch.tensor([[-1.2]])}
    for out in (metric_values(ProbabilityDiff(), one), {k: v.item() for k, v in F.probability_diff(
            one["trainer_logprobs"], one["rollout_logprobs"]).items()}):
        assert "opbc/prob/pearson" not in out and "opbc/prob/diff_std" not in out
        assert out["opbc/prob/abs_diff_mean"] == pytest.approx(math.exp(-1.0) - math.exp(-1.2), rel=1e-6)
    metrics = OPBCCollection(sections=["mismatch"])
    metrics.update(one)
    assert "opbc/prob/pearson" not in metrics.compute()
    metrics.update({"trainer_logprobs": torch.tensor([[-3.0]]), "rollout_logprobs": torch.tensor([[-2.5]])})
    assert metrics.compute()["opbc/prob/pearson"].item() == pytest.approx(1.0)  # two points: a line


@pytest.mark.parametrize("fn", [F.importance_ess, F.sequence_ess, F.importance_weight_mean,
                                F.importance_weight_second_moment, F.importance_weight_std, F.clipped_fraction,
                                F.veto_fraction, F.top_gradient_mass, F.logprob_diff, F.log_ratio_range,
                                F.sequence_log_ratio, F.kl_estimators, F.chi_square, F.perplexity_gap,
                                F.probability_diff])
def test_functional_entry_points_refuse_a_batch_without_a_valid_token(fn):
    """An all-zero mask or all-NaN logprobs gave ESS 1.0 (a made-up on-policy value): every public function of the
    section raises a ValueError saying there is no valid token."""
    t = torch.full((2, 4), -1.0)
    r = t - 0.5
    for args in ((t, r, torch.zeros(2, 4)), (torch.full((2, 4), float("nan")), r, None)):
        with pytest.raises(ValueError, match=r"no valid (token|sequence)"):
            fn(*args)
    fn(t, r, torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]]))  # one valid token (and sequence): a value


def test_sequence_functions_need_a_valid_sequence():
    t = torch.full((2, 3), -1.0)
    t[:, 1] = float("nan")  # valid tokens, but every sequence has a non-finite one
    r = t - 0.5
    assert F.importance_ess(t, r).item() == pytest.approx(1.0)  # token-level: the four valid tokens, equal weights
    for fn in (F.sequence_ess, F.sequence_log_ratio, F.perplexity_gap):
        with pytest.raises(ValueError, match="no valid sequence"):
            fn(t, r)
    assert set(F.chi_square(t, r)) == {"opbc/kl/chi2_token"}  # chi2_seq has no sequence: left out, as in the metric


def test_clip_and_veto_thresholds_are_strict():
    """DESIGN: clipped is |r| > C, vetoed |r| > veto. Tokens at exactly C and exactly the veto (either sign) are
    neither; just above, they are (r exact in float64: differences of small integers and halves)."""
    rollout = torch.tensor([[-40.0] * 8], dtype=torch.float64)  # trainer = rollout + r stays <= 0
    r = torch.tensor([[0.0, 20.0, -20.0, 20.5, 30.0, -30.0, 30.5, -30.5]], dtype=torch.float64)
    trainer = rollout + r
    assert torch.equal(trainer - rollout, r)
    want_clipped, want_veto = 5 / 8, 2 / 8  # 20.5, +-30, +-30.5 clipped; +-30.5 vetoed
    assert F.clipped_fraction(trainer, rollout, clamp=20.0).item() == want_clipped
    assert F.veto_fraction(trainer, rollout, veto=30.0).item() == want_veto
    out = OPBCCollection(sections=["mismatch"])({"trainer_logprobs": trainer, "rollout_logprobs": rollout})
    assert out["opbc/is/clipped_fraction"].item() == want_clipped
    assert out["opbc/is/veto_fraction"].item() == want_veto
    # The compiled kernel compares on its own (the fused pass): the same thresholds, a graph compiled for them.
    graphs = compiled_graphs()
    compiled = OPBCCollection(sections=["mismatch"], compiled=True)
    out = compiled({"trainer_logprobs": trainer, "rollout_logprobs": rollout})
    assert compiled_graphs() > graphs
    assert out["opbc/is/clipped_fraction"].item() == want_clipped
    assert out["opbc/is/veto_fraction"].item() == want_veto


def test_pearson_needs_two_tokens_in_the_window_without_a_read_of_its_own():
    """Pearson's "fewer than two tokens" is a key_counts threshold (read with every member's presence), not a
    host read in compute; over two windows it comes and goes with the token count."""
    one = {"trainer_logprobs": torch.tensor([[-1.0, -2.0]]), "rollout_logprobs": torch.tensor([[-1.1, -2.0]]),
           "response_mask": torch.tensor([[1, 0]])}
    single, collection = ProbabilityDiff(), OPBCCollection(sections=["mismatch"])
    for metric, values in ((single, single.compute_dict), (collection, collection.compute)):
        metric.update(one)
        assert "opbc/prob/pearson" not in values()
        metric.update(one)  # two tokens now
        assert "opbc/prob/pearson" in values()


def _empty_input_cases():
    """Every public function of the mismatch, MoE and rollout sections that has no value without data, with empty
    inputs: (function, arguments)."""
    from opbc_metrics.functional import moe as FM
    from opbc_metrics.functional import rollout as FR

    tokens = [(torch.zeros(0, 3), torch.zeros(0, 3)), (torch.zeros(2, 0), torch.zeros(2, 0)),
              (torch.full((2, 3), -1.0), torch.full((2, 3), -1.5), torch.zeros(2, 3))]
    mismatch = [F.importance_ess, F.sequence_ess, F.importance_weight_mean, F.importance_weight_second_moment,
                F.importance_weight_std, F.clipped_fraction, F.veto_fraction, F.top_gradient_mass, F.logprob_diff,
                F.log_ratio_range, F.sequence_log_ratio, F.kl_estimators, F.chi_square, F.perplexity_gap,
                F.probability_diff]
    ids = torch.zeros(0, 3, 2, 2, dtype=torch.long)
    experts = [(ids, ids), (ids[:, :0], ids[:, :0]), (ids.new_zeros(2, 3, 2, 2), ids.new_zeros(2, 3, 2, 2),
                                                      torch.zeros(2, 3))]
    none = torch.tensor([], dtype=torch.long)
    return ([(fn, args) for fn in mismatch for args in tokens]
            + [(fn, args) for fn in (FM.router_flip_rate, FM.router_topk_disagreement_rate) for args in experts]
            + [(FR.stop_reason_length_pct, ([],)), (FR.stop_reason_length_pct, (none,)),
               (FR.group_gini, (torch.tensor([]), none)), (FR.group_gini, (torch.tensor([]), [])),
               (FR.group_length_cv, (none, none)), (FR.group_max_median_ratio, (none, none))])


@pytest.mark.parametrize("fn,args", _empty_input_cases(),
                         ids=lambda v: getattr(v, "__name__", None) or f"{len(v)}_args")
def test_every_functional_entry_point_refuses_empty_input_in_one_message_form(fn, args):
    """The mismatch, MoE and rollout functions each had their own guard and message ("no valid token in the batch:
    ...", "no response token in the batch (...)", "no group with ... in the batch", "`stop_reasons` is empty"). One
    helper now raises for all: the message names the function, what the batch lacks and what to pass."""
    with pytest.raises(ValueError) as err:
        fn(*args)
    msg = str(err.value)
    head = f"{fn.__name__}(): no "
    assert msg.startswith(head) and " in the batch, so there is no value to return" in msg, msg
    assert "; pass " in msg and "`" in msg.split("; pass ", 1)[1], msg  # what to pass names a field
