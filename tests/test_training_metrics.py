"""Training metrics: what the harness (tests/harness.py) does not cover: other settings against the references,
edge cases, the helpers (pass@k, partitions, FLOPs, the stage timer), the collection, and bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opbc_metrics import OPBCCollection
from opbc_metrics import training as M
from opbc_metrics.functional import perf as P
from opbc_metrics.functional import training as FT
from opbc_metrics.functional import validation as FV
from opbc_metrics.testing import assert_no_host_sync
from tests import training_reference as TR
from tests.data import concat_batches, make_scalars, make_training_batch, make_validation_batch, metric_values

RTOL = 1e-9


def close(a, b, rtol=RTOL, atol=1e-12):
    return math.isclose(float(a), float(b), rel_tol=rtol, abs_tol=atol)


def _np(t):
    return t.double().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


BATCHES = [make_training_batch(seed=s, batch=5 + s, seq=8 + 3 * s, empty_rows=s % 2) for s in range(3)]
ALL = concat_batches(BATCHES)


def _wide(sequence_advantages=False):
    """Wider ratios, so that both clips and the dual clip fire; optionally one advantage per sequence."""
    out = []
    for b in BATCHES:
        g = torch.Generator().manual_seed(b["scores"].numel())
        noise = torch.randn(b["old_logprobs"].shape, generator=g, dtype=torch.float64) * 0.8
        out.append(dict(b, policy_logprobs=(b["old_logprobs"] + noise).clamp(max=0.0),
                        advantages=b["scores"] if sequence_advantages else b["advantages"]))
    return out


def _clip(low, high, c, sequence_advantages):
    def reference(cat):
        fields = ("policy_logprobs", "old_logprobs", "advantages", "response_mask")
        want = TR.ref_clipfrac(*(_np(cat[f]) for f in fields), low, high, c)
        assert 0 < want[0] < 1 and want[1] > 0  # both fire: the check is not vacuous
        return {"actor/pg_clipfrac": want[0], "actor/pg_clipfrac_lower": want[1]}

    return pytest.param(lambda: M.PolicyClipFraction(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c),
                        reference, _wide(sequence_advantages), RTOL,
                        id=f"clipfrac-{low}-{high}-{c}-{'sequence' if sequence_advantages else 'token'}")


def _kl(make, key, estimator):
    return pytest.param(make, lambda c: {key: TR.ref_kl(*(_np(c[f]) for f in ("policy_logprobs", "old_logprobs",
                                                                              "response_mask")), estimator)},
                        BATCHES, RTOL, id=f"{key}-{estimator}")


# The harness (tests/harness.py) checks one setting of each metric; these are the others.
VARIANTS = [
    pytest.param(lambda: M.PolicyEntropy(from_logits=True, temperature=0.7),
                 lambda c: {"actor/entropy": TR.ref_entropy(mask=_np(c["response_mask"]), logits=_np(c["logits"]),
                                                         temperature=0.7)}, BATCHES, 1e-6, id="entropy-logits-t0.7"),
    *(_kl(lambda e=e: M.PPOKL(estimator=e), "actor/ppo_kl", e) for e in ("k2", "k3")),
    _kl(M.ApproxKL, "actor/approx_kl", "k3"),
    *(_clip(*args, seq) for args in ((0.2, 0.2, 3.0), (0.1, 0.28, 1.5), (0.0, 0.05, 1.01)) for seq in (False, True)),
    pytest.param(lambda: M.DPOMetrics(beta=0.5, label_smoothing=0.2), lambda c: dict(zip(FT.DPO_KEYS, TR.ref_dpo(
        *(_np(c[f]) for f in FT.DPO_FIELDS), beta=0.5, label_smoothing=0.2).values())), BATCHES, RTOL, id="dpo"),
    pytest.param(M.ResponseLength, lambda c: {f"response_length/{k}": v for k, v in
                                            TR.ref_lengths(_np(c["response_lengths"])).items()}, BATCHES, RTOL,
                 id="response-length-no-max"),
]


@pytest.mark.parametrize("make,reference,batches,rtol", VARIANTS)
def test_configured_variants_match_reference(make, reference, batches, rtol):
    out = metric_values(make(), *batches)
    want = reference(concat_batches(batches))
    assert set(out) == set(want)
    for key, value in want.items():
        assert close(out[key], value, rtol=rtol), key


# --- actor ------------------------------------------------------------------------------------------
def test_trainer_scalars_accept_tensors_and_numbers():
    m = M.ActorGradNorm()
    m.update(actor_grad_norm=torch.tensor(2.0))
    m.update(actor_grad_norm=4)
    m.update(actor_grad_norm=torch.tensor([6.0, 8.0]))
    assert m.compute().item() == 5.0


def test_entropy_from_logits_is_numerically_safe():
    logits = torch.tensor([[[1e4, 0.0, -1e4], [0.0, float("-inf"), float("-inf")], [3.0, 3.0, float("-inf")]]])
    h = FT.entropy_from_logits(logits)
    assert torch.isfinite(h).all()
    assert h[0, 0].item() == pytest.approx(0.0, abs=1e-30)
    assert h[0, 1].item() == 0.0
    assert h[0, 2].item() == pytest.approx(math.log(2))
    bf = FT.entropy_from_logits(torch.zeros(2, 3, 8, dtype=torch.bfloat16))
    assert bf.dtype == torch.float32 and torch.allclose(bf, torch.full((2, 3), math.log(8)))


def test_policy_kl_clamps_huge_log_ratios():
    new = torch.tensor([[0.0, -50.0]], dtype=torch.float64)
    old = torch.tensor([[-50.0, 0.0]], dtype=torch.float64)
    assert FT.policy_kl(new, old, estimator="k3").item() == pytest.approx(TR.ref_kl(new, old, None, "k3"))
    assert math.isfinite(FT.policy_kl(new, old, estimator="k3").item())


def test_clipfrac_boundaries_zero_advantage_and_unit_ratio():
    old = torch.full((1, 4), -6.0, dtype=torch.float64)
    new = torch.tensor([[-1.0, -11.0, -6.0, -6.0]], dtype=torch.float64)  # ratios e^5, e^-5, 1, 1

    def fractions(new, adv):
        got = FT.pg_clipfrac(new, old, torch.tensor(adv))
        return got["actor/pg_clipfrac"].item(), got["actor/pg_clipfrac_lower"].item()

    assert fractions(new, [[0.0] * 4]) == fractions(old, [[1.0, -1.0, 2.0, -2.0]]) == (0.0, 0.0)  # A = 0, rho = 1
    want = TR.ref_clipfrac(new.numpy(), old.numpy(), [[1.0, -1.0, -1.0, 0.0]])
    assert fractions(new, [[1.0, -1.0, -1.0, 0.0]]) == want == (0.5, 0.0)
    assert fractions(new, [[-1.0, 1.0, 0.0, 0.0]]) == (0.0, 0.25)


# --- critic -----------------------------------------------------------------------------------------
def test_sequence_level_advantages_broadcast_over_tokens():
    b = make_training_batch(seed=3)
    adv = b["scores"]
    out = FT.critic_stats("advantages", adv, b["response_mask"])
    want = TR.ref_token_stats(_np(adv), _np(b["response_mask"]), with_std=True)
    assert close(out["critic/advantages/mean"], want["mean"]) and close(out["critic/advantages/std"], want["std"])
    out = FT.critic_stats("advantages", adv)  # no mask: once per sequence
    assert close(out["critic/advantages/mean"], float(adv.mean()))


def test_explained_variance_of_constant_and_offset_data():
    r = torch.tensor([[2.0, 2.0, 2.0]])
    assert FT.explained_variance(r, r).item() == 1.0
    # Var(R) = 0: verl's epsilon is the whole denominator, 1 - Var(R - V) / 1e-5 (sample variance: 1/3)
    assert FT.explained_variance(r + torch.tensor([[0.0, 1.0, 0.0]]), r).item() == pytest.approx(1 - (1 / 3) / 1e-5)
    # a large common offset: raw moments in float64 still give the right answer
    v, ret = ALL["values"] + 1e4, ALL["returns"] + 1e4
    got = FT.explained_variance(v, ret, ALL["response_mask"]).item()
    assert got == pytest.approx(TR.ref_explained_var(_np(v), _np(ret), _np(ALL["response_mask"])), rel=1e-6)


@pytest.mark.parametrize("scale", [1.0, 1e-2, 3e-3, 1e-4])
def test_explained_variance_is_verls_formula_with_its_epsilon(scale):
    """verl's compute_data_metrics: 1 - torch.var(R - V) / (torch.var(R) + 1e-5) (sample variances), which the
    epsilon pulls toward 1 when Var(R) is near or under 1e-5."""
    g = torch.Generator().manual_seed(int(1 / scale))
    ret = 1.0 + scale * torch.randn(8, 6, generator=g, dtype=torch.float64)
    val = ret + 0.5 * scale * torch.randn(8, 6, generator=g, dtype=torch.float64)
    verl = 1.0 - torch.var(ret - val) / (torch.var(ret) + 1e-5)
    metric = M.ExplainedVariance()
    metric.update(values=val[:4], returns=ret[:4])
    metric.update(values=val[4:], returns=ret[4:])
    assert metric.compute().item() == pytest.approx(verl.item(), rel=1e-9, abs=1e-9)
    assert FT.explained_variance(val, ret).item() == pytest.approx(verl.item(), rel=1e-9, abs=1e-9)


# --- DPO / RM ---------------------------------------------------------------------------------------
def test_reward_model_accepts_reward_head_scores():
    out = FT.reward_model_metrics(ALL["chosen_scores"][:, None], ALL["rejected_scores"][:, None])  # [B, 1]
    assert close(out["rm/loss"], TR.ref_rm(_np(ALL["chosen_scores"]), _np(ALL["rejected_scores"]))["loss"])


# --- validation ---------------------------------------------------------------------------------------
def test_validation_unknown_source_raises_or_goes_to_other():
    b = {"val_acc": torch.tensor([[1.0], [0.0]]), "data_sources": ["gsm8k", "hellaswag"]}
    with pytest.raises(ValueError, match=r"data_sources.*hellaswag"):
        M.ValidationAccuracy(["gsm8k"]).update(b)
    m = M.ValidationAccuracy(["gsm8k"], allow_other=True)
    m.update(b)
    out = m.compute()
    assert out["val-core/gsm8k/acc/mean@1"] == 1.0 and out["val-core/other/acc/mean@1"] == 0.0


def test_validation_source_without_prompts_has_no_keys():
    """A declared source no prompt of the window came from is not 0% accurate: it has no keys (nor has an @k
    that no prompt had k valid samples for)."""
    for metric in (M.ValidationAccuracy(["gsm8k", "math"], n_samples=2, ks=[1, 2]),
                   M.ValidationReward(["gsm8k", "math"], n_samples=2, ks=[1, 2])):
        field = "val_acc" if isinstance(metric, M.ValidationAccuracy) else "val_rewards"
        metric.update({field: torch.tensor([[1.0, 0.0], [0.0, 1.0]]), "data_sources": ["gsm8k", "math"],
                       "val_mask": torch.tensor([[True, True], [True, False]])})  # math: one valid sample
        metric.update({field: torch.tensor([[0.0, 0.0]]), "data_sources": "gsm8k"})
        keys = set(metric.compute())
        kind = "acc" if field == "val_acc" else "reward"
        at = "pass" if kind == "acc" else "best"
        assert {k for k in keys if "/math/" in k} == {f"val-{'core' if kind == 'acc' else 'aux'}/math/{kind}/mean@2",
                                                      f"val-aux/math/{kind}/{at}@1"}, keys
        assert f"val-aux/gsm8k/{kind}/{at}@2" in keys
    c = OPBCCollection(sections=["training"], section_options={"training": {"data_sources": ["gsm8k", "math"]}})
    c.update(val_acc=torch.tensor([[1.0], [0.0]]), data_sources="gsm8k")
    out = c.compute()
    assert out["val-core/gsm8k/acc/mean@1"] == 0.5 and not [k for k in out if "/math/" in k]


@pytest.mark.parametrize("n", [1, 2, 7, 64, 200])
def test_pass_at_k_product_form_is_exact_and_stable(n):
    cs = sorted({0, 1, n // 3, n // 2, n - 1, n})
    for k in sorted(k for k in {1, 2, max(1, n // 4), max(1, n // 2), n} if k <= n):
        got = FV.pass_at_k(torch.full((len(cs),), float(n)), torch.tensor(cs, dtype=torch.float64), k)
        for c, g in zip(cs, got.tolist()):
            assert g == pytest.approx(TR.ref_pass_at_k(n, c, k), rel=1e-10, abs=1e-12), (n, c, k)
    assert torch.isnan(FV.pass_at_k(torch.tensor([2.0]), torch.tensor([1.0]), 3)).all()


def test_best_at_k_matches_exact_reference():
    g = torch.Generator().manual_seed(5)
    vals = torch.randn(4, 9, generator=g, dtype=torch.float64)
    vals[0, 1] = vals[0, 4]  # tie
    valid = torch.ones_like(vals, dtype=torch.bool)
    valid[2, 5:] = False
    for k in (1, 3, 9):
        got = FV.best_at_k(vals, valid, k)
        for p in range(4):
            row = vals[p][valid[p]].tolist()
            if len(row) < k:
                assert math.isnan(got[p])
            else:
                assert got[p].item() == pytest.approx(TR.ref_best_at_k(row, k), rel=1e-10)


# --- load balance -------------------------------------------------------------------------------------
def test_global_seqlen_driver_mode_matches_reference():
    g = torch.Generator().manual_seed(3)
    for world, n, algo in ((4, 16, "karmarkar_karp"), (3, 10, "karmarkar_karp"), (2, 7, "lpt")):
        prompt = torch.randint(10, 100, (n,), generator=g)
        resp = torch.randint(0, 3000, (n,), generator=g)
        ranks = torch.randint(0, world, (n,), generator=g)
        m = M.GlobalSeqlen(world_size=world, algorithm=algo)
        m.update(prompt_lengths=prompt, response_lengths=resp, rank_ids=ranks)
        out = m.compute()
        total = (prompt + resp).tolist()
        loads = [sum(t for t, r in zip(total, ranks.tolist()) if r == j) for j in range(world)]
        assert out["global_seqlen/min"] == min(loads) and out["global_seqlen/max"] == max(loads)
        assert out["global_seqlen/minmax_diff"] == max(loads) - min(loads)
        assert close(out["global_seqlen/mean"], sum(total) / world)
        sums = (TR.ref_karmarkar_karp_sums if algo == "karmarkar_karp" else TR.ref_lpt_sums)(total, world)
        assert out["global_seqlen/balanced_min"] == sums[0] and out["global_seqlen/balanced_max"] == sums[-1]
        assert out["global_seqlen/balanced_max"] >= sum(total) / world - 1e-9


def test_partitions_are_exact_covers_with_equal_counts():
    g = torch.Generator().manual_seed(11)
    for _ in range(10):
        n, k = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
        lengths = torch.randint(0, 1000, (n,), generator=g).tolist()
        for algo in P.PARTITION_ALGORITHMS:
            for equal in (True, False):
                parts = P.partition(lengths, k, algo, equal)
                assert len(parts) == k and sorted(i for p in parts for i in p) == list(range(n))
                if equal:
                    assert max(map(len, parts)) - min(map(len, parts)) <= 1
        assert sorted(P.partition_loads(lengths, k)) == TR.ref_karmarkar_karp_sums(lengths, k)
        assert sorted(P.partition_loads(lengths, k, equal_size=False)) == TR.ref_karmarkar_karp_sums(lengths, k, False)
        for equal in (True, False):
            assert sorted(P.partition_loads(lengths, k, "lpt", equal)) == TR.ref_lpt_sums(lengths, k, equal)


def test_global_seqlen_overflow_is_exact_in_totals_and_warns():
    m = M.GlobalSeqlen(world_size=1, max_seqlen=100)
    m.update(prompt_lengths=torch.tensor([10, 10]), response_lengths=torch.tensor([50, 500]))
    with pytest.warns(UserWarning, match="max_seqlen"):
        out = m.compute()
    assert out["global_seqlen/max"] == 570 and out["global_seqlen/balanced_max"] == 570


def test_seqlen_balance_functional_matches_class():
    lengths = [900, 800, 100, 200, 300, 300]
    f = P.seqlen_balance(lengths, 2)
    m = M.GlobalSeqlen(world_size=2)
    m.update(prompt_lengths=torch.zeros(6, dtype=torch.long), response_lengths=torch.tensor(lengths),
             rank_ids=torch.tensor([0, 0, 0, 1, 1, 1]))
    assert {k: v.item() for k, v in m.compute().items()} == f


def test_transformer_flops_from_config_matches_reference():
    dense = dict(hidden=4096, layers=32, heads=32, vocab=128256, inter=14336, kv_heads=8)
    f = P.TransformerFlops.from_config(hidden_size=4096, num_layers=32, num_heads=32, vocab_size=128256,
                                       intermediate_size=14336, num_kv_heads=8)
    assert f.active_params == TR.ref_transformer_active_params(**dense)
    assert 7.0e9 < f.active_params < 7.6e9  # Llama-3-8B without the embedding table
    moe = P.TransformerFlops.from_config(hidden_size=2048, num_layers=24, num_heads=16, vocab_size=151936,
                                         num_kv_heads=4, head_dim=128, num_experts=60, experts_per_token=4,
                                         moe_intermediate_size=1408, shared_experts=4, count_embedding=True)
    assert moe.active_params == TR.ref_transformer_active_params(2048, 24, 16, 151936, 0, 4, 128, 60, 4, 1408, 4, True)
    assert P.TransformerFlops(1.0, 1, 8, causal=True).forward_flops(0, 10) == 4 * 8 * 10 / 2


def test_peak_flops_table_and_overrides():
    table = {"NVIDIA H200": 989e12, "NVIDIA H20": 148e12, "NVIDIA B200": 2.25e15, "NVIDIA A100-SXM4-80GB": 312e12,
             "NVIDIA L40S": 362.05e12, "NVIDIA H100 PCIe": 756e12}
    assert {name: P.peak_flops(name) for name in table} == table
    assert P.peak_flops("my-chip", {"my-chip": 1.0}) == 1.0
    with pytest.raises(ValueError, match="peak_flops"):
        P.peak_flops("NVIDIA A10")
    flops = P.TransformerFlops(1e9, 1, 1)
    assert M.ModelFlopsUtilization(flops, peak_flops=5e14).peak == 5e14
    with pytest.raises(ValueError, match="peak_flops"):
        M.ModelFlopsUtilization(flops, peak_flops=-1.0)


def test_stage_timer_measures_and_feeds_the_metric():
    timer = M.StageTimer(stages=("gen", "step"))
    with timer("step"), timer.time("gen"):
        sum(range(1000))
    timer.record("gen", 1.0)
    t = timer.pop()
    assert t["gen"] >= 1.0 and t["step"] >= 0.0 and timer.timings == {}
    m = M.StageTiming(stages=("gen", "step"))
    m.update(timing_s=t)
    assert close(m.compute()["timing_s/gen"], t["gen"])
    with pytest.raises(ValueError, match="unknown stage"), timer("nope"):
        pass
    with pytest.raises(ValueError, match="seconds"):
        timer.record("gen", -1.0)


def _values(metric):
    return {k: v.item() for k, v in metric.compute_dict().items()}


def test_stages_not_timed_in_the_window_have_no_keys():
    """verl's compute_timing_metrics reports the stages of timing_raw only: a stage no step timed is not a
    0-second stage, and a figure per token needs tokens."""
    lengths = {"prompt_lengths": torch.tensor([10, 20]), "response_lengths": torch.tensor([30, 40])}
    timing, throughput = M.StageTiming(), M.Throughput(num_gpus=1)
    mfu = M.ModelFlopsUtilization(P.TransformerFlops(1e9, 2, 64), peak_flops=1e15)
    for m in (timing, throughput, mfu):
        m.update(timing_s={"gen": 1.5})
    assert _values(timing) == {"timing_s/gen": 1.5}  # no tokens: no timing_per_token_ms
    assert _values(throughput) == {} and _values(mfu) == {}  # no step time, no tokens
    for m in (timing, throughput, mfu):
        m.update(timing_s={"gen": 2.5, "update_actor": 1.0}, **lengths)  # a second step, with its sequences
    assert _values(timing) == pytest.approx({"timing_s/gen": 2.0, "timing_s/update_actor": 1.0,
                                             "timing_per_token_ms/gen": 2000.0 / 35.0,
                                             "timing_per_token_ms/update_actor": 1000.0 / 50.0})
    assert _values(throughput) == {"perf/total_num_tokens": 50.0}  # per step over 2 steps; no step time
    assert set(_values(mfu)) == {"perf/mfu/actor"}  # old_log_prob (actor_infer) never timed
    throughput.update(timing_s={"step": 4.0})
    assert _values(throughput) == pytest.approx({"perf/total_num_tokens": 100.0 / 3, "perf/time_per_step": 4.0,
                                                 "perf/throughput": 100.0 / 3 / 4.0})


def test_stage_timing_decides_on_the_synced_states_of_all_ranks(monkeypatch):
    """A stage one rank timed is reported by every rank, with that rank's time; the other rank's steps
    without it do not count as 0 s (merge_state folds a rank's states like the sync's sum does)."""
    import opbc_metrics.training._base as base

    ranks = [M.StageTiming(stages=("gen", "ref"), world_size=2) for _ in range(2)]
    for rank, (m, timing) in enumerate(zip(ranks, ({"gen": 1.0}, {"gen": 3.0, "ref": 0.5}), strict=True)):
        monkeypatch.setattr(base, "dist_rank_world", lambda group=None, rank=rank: (rank, 2))
        m.update(timing_s=timing)
        m.update(timing_s={"gen": 1.0})
    ranks[0].merge_state(ranks[1])
    assert _values(ranks[0]) == {"timing_s/gen": 2.0, "timing_s/ref": 0.5}


def test_global_seqlen_of_a_batch_without_sequences_has_no_keys():
    empty = {"prompt_lengths": torch.zeros(0, dtype=torch.long), "response_lengths": torch.zeros(0, dtype=torch.long)}
    m = M.GlobalSeqlen(world_size=2)
    m.update(empty)
    assert m.compute_dict() == {}
    c = OPBCCollection(sections=["training"])
    c.update(empty)
    assert not [k for k in c.compute() if k.startswith("global_seqlen/")]
    m.update(prompt_lengths=torch.tensor([5]), response_lengths=torch.tensor([0]))  # data, even a 0 workload rank
    assert _values(m)["global_seqlen/min"] == 0.0 and _values(m)["global_seqlen/max"] == 5.0


# --- agent loop slowest, LR scheduler, huge values ---
FIELDS = ("agent_generate_s", "agent_tool_calls_s", "prompt_lengths", "response_lengths")


def _batch(samples):
    return {name: torch.tensor([s[i] for s in samples], dtype=torch.float64) for i, name in enumerate(FIELDS)}


sample = st.tuples(st.floats(0, 100, width=32), st.floats(0, 100, width=32), st.integers(0, 4096),
                   st.integers(0, 4096))


@given(st.lists(sample, min_size=0, max_size=30), st.integers(1, 4))
def test_slowest_matches_reference_in_chunks_and_merged(samples, n_chunks):
    whole, chunked, merged = M.AgentLoopSlowest(), M.AgentLoopSlowest(), M.AgentLoopSlowest()
    if samples:
        whole.update(_batch(samples))
    parts = [samples[i::n_chunks] for i in range(n_chunks)]
    ordered = [samples[len(samples) * i // n_chunks: len(samples) * (i + 1) // n_chunks] for i in range(n_chunks)]
    for part in ordered:
        if part:
            chunked.update(_batch(part))
    for part in parts:  # states built apart, then merged (the single-controller pattern)
        if part:
            worker = M.AgentLoopSlowest()
            worker.update(_batch(part))
            merged.merge_state(worker)
    want = TR.ref_slowest(samples)
    for metric in (whole, chunked, merged):
        if not samples:  # no data: no key
            assert metric.compute_dict() == {}
            continue
        got = [v.item() for v in metric.compute_dict().values()]
        totals = [s[0] + s[1] for s in samples]
        if totals and totals.count(max(totals)) > 1:  # ties: any slowest sample is a right answer
            assert got[0] + got[1] == pytest.approx(max(totals))
        else:
            assert got == pytest.approx(want)


def test_slowest_optional_fields():
    metric = M.AgentLoopSlowest()
    with assert_no_host_sync():
        metric.update(agent_generate_s=torch.tensor([1.0, 3.0]))
        metric.update(agent_generate_s=torch.zeros(0))
    # (fields the batch did not carry: no key, not 0)
    assert {k: v.item() for k, v in metric.compute().items()} == {"timing_s/agent_loop/slowest/generate_sequences": 3.0}


def test_slowest_bad_input_names_the_field():
    with pytest.raises(ValueError, match="agent_tool_calls_s"):
        M.AgentLoopSlowest().update(agent_generate_s=[1.0, 2.0], agent_tool_calls_s=[1.0])
    metric = M.AgentLoopSlowest()
    metric.update(agent_generate_s=torch.tensor([1.0, -2.0]))
    with pytest.raises(ValueError, match="agent_generate_s"):
        metric.compute()
    with pytest.raises(ValueError, match="agent_generate_s"):
        M.AgentLoopSlowest().update(response_lengths=[3])


def test_lr_scheduler_state_reference_and_contracts():
    metric = M.LRSchedulerState(names=("last_lr", "step"))
    observed = [{"last_lr": 1e-6, "step": 1}, {"last_lr": [2e-6, 4e-6]}, {"step": torch.tensor(3.0)}]
    for obs in observed:
        metric.update(lr_scheduler=obs)
    out = metric.compute()
    assert out["lr_scheduler/last_lr"].item() == pytest.approx((1e-6 + 2e-6 + 4e-6) / 3)
    assert out["lr_scheduler/step"].item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="lr_scheduler"):
        metric.update(lr_scheduler={"momentum": 0.9})
    with pytest.raises(ValueError, match="lr_scheduler"):
        metric.update(lr_scheduler=0.1)
    with pytest.raises(ValueError, match="names"):
        M.LRSchedulerState(names=("a/b",))
    with assert_no_host_sync():
        metric.update(lr_scheduler={"last_lr": torch.tensor(1e-6)})


@pytest.mark.parametrize("scale", [1e150, 1e200, 1e300])
def test_critic_statistics_of_huge_finite_values_are_finite(scale):
    base = np.array([1.0, -2.0, 3.0, 0.5, 1.5])
    adv = torch.tensor(base * scale)[None, :]
    metric = M.AdvantageStats()
    metric.update(advantages=adv[:, :2], response_mask=torch.ones(1, 2))
    metric.update(advantages=adv[:, 2:], response_mask=torch.ones(1, 3))
    out = metric.compute()
    assert out["critic/advantages/mean"].item() == pytest.approx(base.mean() * scale, rel=1e-12)
    assert out["critic/advantages/std"].item() == pytest.approx(base.std() * scale, rel=1e-12)  # population, as verl
    rewards = M.RewardStats()
    rewards.update(rewards=torch.tensor(base * scale))
    assert rewards.compute()["critic/rewards/mean"].item() == pytest.approx(base.mean() * scale, rel=1e-12)
    error = np.array([0.1, -0.1, 0.0, 0.2, -0.2])
    ev = FT.explained_variance(torch.tensor((base + error) * scale)[None, :], torch.tensor(base * scale)[None, :])
    assert ev.item() == pytest.approx(1 - error.var() / base.var(), rel=1e-9)


# --- contracts ------------------------------------------------------------------------------------------
def _all_metrics():
    return M.training_metrics(max_response_length=10, max_prompt_length=30, data_sources=("gsm8k", "math", "aime"),
                            n_samples=6, ks=(1, 2), flops=P.TransformerFlops(1e9, 4, 64), peak_flops=1e15,
                            world_size=1)


def _full_batch(seed=0):
    b = make_training_batch(seed=seed, batch=4, seq=9)
    b.update(make_scalars(2, seed))
    b.update(make_validation_batch(4, n=6, seed=seed), val_mask=torch.ones(4, 6, dtype=torch.bool))
    # every default stage timed (a stage no step timed has no key)
    b["timing_s"] = {**dict.fromkeys(P.DEFAULT_STAGES, 0.1), "gen": 1.0, "update_actor": 0.5, "old_log_prob": 0.2,
                     "step": 2.0}
    b["rank_ids"] = torch.zeros(4, dtype=torch.long)
    return b


def test_collection_keys_are_unique_and_cover_the_glossary():
    collection = OPBCCollection(metrics=_all_metrics())
    keys = collection.keys_produced
    assert len(keys) == len(set(keys))
    out = collection(_full_batch())
    assert set(out) == set(keys)
    seed_keys = ["actor/loss", "actor/pg_loss", "actor/entropy_loss", "actor/kl_loss", "actor/kl_coef",
                 "actor/grad_norm", "actor/entropy", "actor/approx_kl", "actor/ppo_kl", "actor/pg_clipfrac",
                 "actor/lr", "critic/lr", "critic/loss", "critic/value/mean", "critic/advantages/mean",
                 "critic/advantages/std", "critic/rewards/mean", "response_length/mean", "response_length/max",
                 "response_length/clip_ratio", "prompt_length/mean", "prompt_length/clip_ratio",
                 "response/aborted_ratio", "loss/dpo", "rewards/chosen", "rewards/rejected", "rewards/margins",
                 "rewards/accuracy", "rm/loss", "rm/accuracy", "rm/reward_margin", "rm/grad_norm", "num_turns/min",
                 "num_turns/max", "num_turns/mean", "global_seqlen/min", "global_seqlen/max",
                 "global_seqlen/minmax_diff", "global_seqlen/balanced_min", "global_seqlen/balanced_max",
                 "global_seqlen/mean", "timing_s/step", "timing_s/gen", "timing_s/reward", "timing_s/old_log_prob",
                 "timing_s/ref", "timing_s/adv", "timing_s/update_actor", "timing_s/update_critic",
                 "timing_s/update_weights", "timing_per_token_ms/gen", "timing_per_token_ms/ref",
                 "timing_per_token_ms/adv", "timing_per_token_ms/update_actor", "perf/total_num_tokens",
                 "perf/time_per_step", "perf/throughput", "perf/mfu/actor_infer", "perf/mfu/actor",
                 "val-core/gsm8k/acc/mean@6", "val-aux/gsm8k/reward/mean@6", "val-aux/num_turns/mean",
                 "timing_s/agent_loop/generate_sequences/max", "timing_s/agent_loop/tool_calls/mean",
                 "timing_s/agent_loop/slowest/generate_sequences", "lr_scheduler/last_lr"]
    assert not set(seed_keys) - set(keys)


def test_training_section_in_the_collection():
    from opbc_metrics.collection import DEFAULT_SECTIONS, SECTIONS

    assert "training" in SECTIONS and "training" not in DEFAULT_SECTIONS
    out = OPBCCollection(sections=["training"], max_response_length=8)(_full_batch())
    assert "response_length/clip_ratio" in out and "actor/ppo_kl" in out
    mixed = OPBCCollection(sections=["mismatch", "training"],
                           section_options={"training": {"data_sources": ["gsm8k", "math", "aime"], "n_samples": 6}})
    batch = _full_batch()
    batch["trainer_logprobs"], batch["rollout_logprobs"] = batch["old_logprobs"], batch["old_logprobs"] - 0.1
    out = mixed(batch)
    assert "opbc/is/ess" in out and "val-core/math/acc/mean@6" in out and "critic/vf_explained_var" in out


# --- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("metric,fields,match", [
    (M.ResponseLength, {"response_lengths": [3, -1]}, r"`response_lengths`.*negative"),
    (M.ActorLoss, {"actor_loss": float("nan")}, r"`actor_loss`.*NaN"),
    (M.ActorLoss, {"actor_loss": [1.0, 2.0], "loss_tokens": [1]}, "`loss_tokens`"),
    (M.ActorLoss, {"actor_loss": "high"}, "`actor_loss`"),
])
def test_host_inputs_are_checked_at_once(metric, fields, match):
    with pytest.raises(ValueError, match=match):
        metric().update(**fields)


NEGATIVE = {"response_lengths": torch.tensor([3, -1]), "prompt_lengths": torch.tensor([-2, 5]),
            "num_turns": torch.tensor([1, -4]), "val_num_turns": torch.tensor([[1, -4]]),
            "agent_generate_s": torch.tensor([1.0, -2.0])}


def _nonfinite(field, value):
    b = make_training_batch(seed=1)
    b[field][0, 0], b["response_mask"][0, 0] = value, 1
    return b


@pytest.mark.parametrize("metric,batch,field", [
    *((metric, NEGATIVE, field) for metric, field in (
        (M.ResponseLength(), "response_lengths"), (M.PromptLength(), "prompt_lengths"),
        (M.AbortedRatio(), "response_lengths"), (M.NumTurns(), "num_turns"),
        (M.GlobalSeqlen(world_size=1), "response_lengths"), (M.ValidationTurns(), "val_num_turns"),
        (M.AgentLoopTiming(), "agent_generate_s"))),
    (M.PolicyEntropy(), _nonfinite("entropies", float("nan")), "entropies"),
    (M.ExplainedVariance(), _nonfinite("values", float("inf")), "returns"),
])
def test_bad_tensor_values_raise_at_compute_naming_the_field(metric, batch, field):
    metric.update(batch)  # no host sync: counted, not checked
    with pytest.raises(ValueError, match=f"`{field}`"):
        metric.compute()


@pytest.mark.parametrize(
    "metric,change,field",
    [
        (M.PPOKL(), lambda b: b.update(old_logprobs=b["old_logprobs"][:, :-1]), "old_logprobs"),
        (M.PPOKL(), lambda b: b.update(response_mask=b["response_mask"][:, :-1]), "response_mask"),
        (M.PPOKL(), lambda b: b.pop("policy_logprobs"), "policy_logprobs"),
        (M.PolicyClipFraction(), lambda b: b.update(advantages=b["advantages"][:-1]), "advantages"),
        (M.ValueStats(), lambda b: b.update(values=b["values"][None]), "values"),
        (M.ExplainedVariance(), lambda b: b.update(values=b["values"][:, :-1]), "values"),
        (M.DPOMetrics(), lambda b: b.update(policy_rejected_logps=b["policy_rejected_logps"][:-1]),
         "policy_rejected_logps"),
        (M.RewardModelMetrics(), lambda b: b.update(chosen_scores=b["chosen_scores"][:, None].expand(-1, 2)),
         "chosen_scores"),
        (M.ResponseLength(), lambda b: b.update(response_lengths=b["response_lengths"][None]), "response_lengths"),
        (M.GlobalSeqlen(world_size=2), lambda b: b.update(prompt_lengths=b["prompt_lengths"][:-1]), "prompt_lengths"),
        (M.GlobalSeqlen(world_size=2), lambda b: b.update(rank_ids=torch.zeros(2)), "rank_ids"),
        (M.PolicyEntropy(from_logits=True), lambda b: b.update(logits=b["logits"][0]), "logits"),
        (M.StageTiming(), lambda b: b.update(timing_s={"generate": 1.0}), "timing_s"),
        (M.StageTiming(), lambda b: b.update(timing_s={"gen": float("nan")}), "timing_s"),
        (M.StageTiming(), lambda b: b.update(timing_s=[1.0]), "timing_s"),
        (M.ValidationAccuracy(["gsm8k"], n_samples=2), lambda b: b.update(val_acc=torch.ones(3, 4),
                                                                         data_sources="gsm8k"), "val_acc"),
        (M.ValidationAccuracy(["gsm8k"]), lambda b: b.update(val_acc=torch.ones(3), data_sources=["gsm8k"]),
         "data_sources"),
        (M.ValidationAccuracy(["gsm8k"]), lambda b: b.update(val_acc=torch.ones(1), data_sources=torch.zeros(1)),
         "data_sources"),
    ],
)
def test_bad_input_names_the_field(metric, change, field):
    b = make_training_batch(seed=2)
    b["timing_s"] = {"gen": 1.0}
    change(b)
    with pytest.raises(ValueError, match=f"`{field}`"):
        metric.update(b)


@pytest.mark.parametrize("make", [
    lambda: M.PolicyClipFraction(clip_ratio=1.5), lambda: M.PolicyClipFraction(clip_ratio_c=1.0),
    lambda: M.PPOKL(estimator="k4"), lambda: M.DPOMetrics(beta=0.0), lambda: M.DPOMetrics(label_smoothing=0.5),
    lambda: M.ResponseLength(max_response_length=0), lambda: M.ValidationAccuracy([]),
    lambda: M.ValidationAccuracy(["a", "a"]), lambda: M.ValidationAccuracy(["a"], n_samples=4, ks=[5]),
    lambda: M.ValidationAccuracy(["a//b"]), lambda: M.GlobalSeqlen(world_size=0),
    lambda: M.GlobalSeqlen(algorithm="greedy"), lambda: M.StageTiming(stages=("gen", "gen")),
    lambda: M.StageTiming(stages=("gen",), per_token_stages=("ref",)), lambda: M.Throughput(num_gpus=0),
    lambda: M.ModelFlopsUtilization(P.TransformerFlops(1, 1, 1), stages={"x": ("s", "backward")}, peak_flops=1.0),
    lambda: P.TransformerFlops(0, 1, 1),
])
def test_bad_constructor_arguments(make):
    with pytest.raises(ValueError):
        make()


def test_rank_beyond_capacity_is_a_clear_error(monkeypatch):
    import opbc_metrics.training._base as base

    m = M.StageTiming(world_size=2)
    monkeypatch.setattr(base, "dist_rank_world", lambda group=None: (3, 4))
    with pytest.raises(ValueError, match="rank 3"):
        m.update(timing_s={"gen": 1.0})
