"""Training metrics against the independent references, plus contracts: no host sync, errors, state."""

from __future__ import annotations

import io
import math
import warnings

import numpy as np
import pytest
import torch

from opbc_metrics import OPBCCollection
from opbc_metrics.functional import perf as P
from opbc_metrics.functional import training as FT
from opbc_metrics.functional import validation as FV
from opbc_metrics.testing import assert_no_host_sync
from opbc_metrics.training import (
    PPOKL,
    AbortedRatio,
    ActorGradNorm,
    ActorLoss,
    AdvantageStats,
    ApproxKL,
    DPOMetrics,
    ExplainedVariance,
    GlobalSeqlen,
    ModelFlopsUtilization,
    NumTurns,
    PolicyClipFraction,
    PolicyEntropy,
    PromptLength,
    ResponseLength,
    ReturnStats,
    RewardModelMetrics,
    RewardStats,
    ScoreStats,
    StageTimer,
    StageTiming,
    Throughput,
    ValidationAccuracy,
    ValidationReward,
    ValidationTurns,
    ValueStats,
    training_metrics,
)
from tests.data import SCALARS, concat_batches, make_scalars, make_training_batch
from tests.training_reference import (
    ref_best_at_k,
    ref_clipfrac,
    ref_dpo,
    ref_entropy,
    ref_explained_var,
    ref_karmarkar_karp_sums,
    ref_kl,
    ref_lengths,
    ref_pass_at_k,
    ref_rm,
    ref_sequence_stats,
    ref_token_stats,
    ref_transformer_active_params,
    ref_validation,
)

RTOL = 1e-9


def close(a, b, rtol=RTOL, atol=1e-12):
    return math.isclose(float(a), float(b), rel_tol=rtol, abs_tol=atol)


def _np(t):
    return t.double().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


BATCHES = [make_training_batch(seed=s, batch=5 + s, seq=8 + 3 * s, empty_rows=s % 2) for s in range(3)]
ALL = concat_batches(BATCHES)


def _fed(metric, batches=BATCHES, **extra):
    for b in batches:
        metric.update(dict(b, **extra))
    return metric


# --- actor ------------------------------------------------------------------------------------------
def test_trainer_scalars_weighted_and_unweighted_means():
    steps = [make_scalars(n=1 + s % 3, seed=s) for s in range(4)]
    metrics = OPBCCollection(metrics=training_metrics())
    for s in steps:
        metrics.update(s)
    out = metrics.compute()
    weighted = {"actor_loss", "pg_loss", "entropy_loss", "kl_loss", "critic_loss"}
    keys = {"actor_loss": "actor/loss", "pg_loss": "actor/pg_loss", "entropy_loss": "actor/entropy_loss",
            "kl_loss": "actor/kl_loss", "kl_coef": "actor/kl_coef", "actor_grad_norm": "actor/grad_norm",
            "actor_lr": "actor/lr", "critic_loss": "critic/loss", "critic_lr": "critic/lr",
            "rm_grad_norm": "rm/grad_norm"}
    for name in SCALARS:
        xs = [x for s in steps for x in s[name]]
        ws = [w for s in steps for w in s["loss_tokens"]] if name in weighted else [1.0] * len(xs)
        want = sum(x * w for x, w in zip(xs, ws)) / sum(ws)
        assert close(out[keys[name]], want), name


def test_trainer_scalars_accept_tensors_and_numbers():
    m = ActorGradNorm()
    m.update(actor_grad_norm=torch.tensor(2.0))
    m.update(actor_grad_norm=4)
    m.update(actor_grad_norm=torch.tensor([6.0, 8.0]))
    assert m.compute().item() == 5.0


def test_entropy_matches_reference_from_entropies_and_logits():
    m = _fed(PolicyEntropy())
    assert close(m.compute(), ref_entropy(_np(ALL["entropies"]), _np(ALL["response_mask"])))
    m = _fed(PolicyEntropy(from_logits=True, temperature=0.7))
    want = ref_entropy(mask=_np(ALL["response_mask"]), logits=_np(ALL["logits"]), temperature=0.7)
    assert close(m.compute(), want, rtol=1e-6)


def test_entropy_from_logits_is_numerically_safe():
    logits = torch.tensor([[[1e4, 0.0, -1e4], [0.0, float("-inf"), float("-inf")], [3.0, 3.0, float("-inf")]]])
    h = FT.entropy_from_logits(logits)
    assert torch.isfinite(h).all()
    assert h[0, 0].item() == pytest.approx(0.0, abs=1e-30)
    assert h[0, 1].item() == 0.0
    assert h[0, 2].item() == pytest.approx(math.log(2))
    bf = FT.entropy_from_logits(torch.zeros(2, 3, 8, dtype=torch.bfloat16))
    assert bf.dtype == torch.float32 and torch.allclose(bf, torch.full((2, 3), math.log(8)))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_policy_kl_matches_reference(estimator):
    m = _fed(PPOKL(estimator=estimator))
    want = ref_kl(_np(ALL["policy_logprobs"]), _np(ALL["old_logprobs"]), _np(ALL["response_mask"]), estimator)
    assert close(m.compute(), want)
    a = _fed(ApproxKL())
    assert close(a.compute(), ref_kl(_np(ALL["policy_logprobs"]), _np(ALL["old_logprobs"]),
                                     _np(ALL["response_mask"]), "k3"))


def test_policy_kl_clamps_huge_log_ratios():
    new = torch.tensor([[0.0, -50.0]], dtype=torch.float64)
    old = torch.tensor([[-50.0, 0.0]], dtype=torch.float64)
    assert FT.policy_kl(new, old, estimator="k3").item() == pytest.approx(ref_kl(new, old, None, "k3"))
    assert math.isfinite(FT.policy_kl(new, old, estimator="k3").item())


@pytest.mark.parametrize("low,high,c", [(0.2, 0.2, 3.0), (0.1, 0.28, 1.5), (0.0, 0.05, 1.01)])
@pytest.mark.parametrize("adv_shape", ["token", "sequence"])
def test_clipfrac_matches_reference(low, high, c, adv_shape):
    batches = []
    for b in BATCHES:
        b = dict(b)
        g = torch.Generator().manual_seed(b["scores"].numel())
        # wider ratios so that both clips and the dual clip fire
        b["policy_logprobs"] = b["old_logprobs"] + torch.randn(b["old_logprobs"].shape, generator=g,
                                                                dtype=torch.float64) * 0.8
        if adv_shape == "sequence":
            b["advantages"] = b["scores"]
        batches.append(b)
    m = _fed(PolicyClipFraction(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c), batches)
    out = m.compute()
    cat = concat_batches(batches)
    want = ref_clipfrac(_np(cat["policy_logprobs"]), _np(cat["old_logprobs"]), _np(cat["advantages"]),
                        _np(cat["response_mask"]), low, high, c)
    assert 0 < want[0] < 1 and want[1] > 0
    assert close(out["actor/pg_clipfrac"], want[0])
    assert close(out["actor/pg_clipfrac_lower"], want[1])


def test_clipfrac_boundaries_zero_advantage_and_unit_ratio():
    old = torch.zeros(1, 4, dtype=torch.float64)
    new = torch.tensor([[5.0, -5.0, 0.0, 0.0]], dtype=torch.float64)  # ratios e^5, e^-5, 1, 1
    zero_adv = FT.pg_clipfrac(new, old, torch.zeros(1, 4))
    assert zero_adv["actor/pg_clipfrac"] == 0.0 and zero_adv["actor/pg_clipfrac_lower"] == 0.0
    at_one = FT.pg_clipfrac(old, old, torch.tensor([[1.0, -1.0, 2.0, -2.0]]))
    assert at_one["actor/pg_clipfrac"] == 0.0 and at_one["actor/pg_clipfrac_lower"] == 0.0
    want = ref_clipfrac(new.numpy(), old.numpy(), [[1.0, -1.0, -1.0, 0.0]])
    got = FT.pg_clipfrac(new, old, torch.tensor([[1.0, -1.0, -1.0, 0.0]]))
    assert (got["actor/pg_clipfrac"].item(), got["actor/pg_clipfrac_lower"].item()) == want == (0.5, 0.0)
    got = FT.pg_clipfrac(new, old, torch.tensor([[-1.0, 1.0, 0.0, 0.0]]))
    assert (got["actor/pg_clipfrac"].item(), got["actor/pg_clipfrac_lower"].item()) == (0.0, 0.25)


# --- critic -----------------------------------------------------------------------------------------
def test_critic_statistics_match_reference():
    mask = _np(ALL["response_mask"])
    for cls, name, std in ((ValueStats, "values", False), (ReturnStats, "returns", False),
                           (AdvantageStats, "advantages", True)):
        out = _fed(cls()).compute()
        want = ref_token_stats(_np(ALL[name]), mask, with_std=std)
        prefix = cls.keys[0].rsplit("/", 1)[0]
        for stat, v in want.items():
            assert close(out[f"{prefix}/{stat}"], v), (prefix, stat)
    for cls, name in ((RewardStats, "rewards"), (ScoreStats, "scores")):
        out = _fed(cls()).compute()
        want = ref_sequence_stats(_np(ALL[name]), mask)
        prefix = cls.keys[0].rsplit("/", 1)[0]
        for stat, v in want.items():
            assert close(out[f"{prefix}/{stat}"], v), (prefix, stat)


def test_sequence_level_advantages_broadcast_over_tokens():
    b = make_training_batch(seed=3)
    adv = b["scores"]
    out = FT.critic_stats("advantages", adv, b["response_mask"])
    want = ref_token_stats(_np(adv), _np(b["response_mask"]), with_std=True)
    assert close(out["critic/advantages/mean"], want["mean"]) and close(out["critic/advantages/std"], want["std"])
    out = FT.critic_stats("advantages", adv)  # no mask: once per sequence
    assert close(out["critic/advantages/mean"], float(adv.mean()))


def test_explained_variance_matches_reference():
    m = _fed(ExplainedVariance())
    want = ref_explained_var(_np(ALL["values"]), _np(ALL["returns"]), _np(ALL["response_mask"]))
    assert close(m.compute(), want)
    r = torch.tensor([[2.0, 2.0, 2.0]])
    assert FT.explained_variance(r, r).item() == 1.0
    assert FT.explained_variance(r + torch.tensor([[0.0, 1.0, 0.0]]), r).item() == 0.0
    # a large common offset: raw moments in float64 still give the right answer
    v, ret = ALL["values"] + 1e4, ALL["returns"] + 1e4
    got = FT.explained_variance(v, ret, ALL["response_mask"]).item()
    assert got == pytest.approx(ref_explained_var(_np(v), _np(ret), _np(ALL["response_mask"])), rel=1e-6)


# --- lengths ----------------------------------------------------------------------------------------
def test_lengths_turns_aborted_match_reference():
    out = _fed(ResponseLength(max_response_length=10)).compute()
    for stat, v in ref_lengths(_np(ALL["response_lengths"]), 10).items():
        assert close(out[f"response_length/{stat}"], v), stat
    out = _fed(PromptLength(max_prompt_length=30)).compute()
    for stat, v in ref_lengths(_np(ALL["prompt_lengths"]), 30).items():
        assert close(out[f"prompt_length/{stat}"], v), stat
    assert set(ResponseLength().keys) == {"response_length/mean", "response_length/max", "response_length/min"}
    lengths = _np(ALL["response_lengths"])
    assert close(_fed(AbortedRatio()).compute(), float((lengths == 0).mean()))
    assert (lengths == 0).sum() >= 1
    out = _fed(NumTurns()).compute()
    turns = _np(ALL["num_turns"])
    assert (out["num_turns/min"], out["num_turns/max"]) == (turns.min(), turns.max())
    assert close(out["num_turns/mean"], turns.mean())


# --- DPO / RM ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("beta,ls", [(0.1, 0.0), (0.5, 0.2)])
def test_dpo_matches_reference(beta, ls):
    out = _fed(DPOMetrics(beta=beta, label_smoothing=ls)).compute()
    want = ref_dpo(*(_np(ALL[f]) for f in FT.DPO_FIELDS), beta=beta, label_smoothing=ls)
    for key, name in zip(FT.DPO_KEYS, ("loss", "chosen", "rejected", "margins", "accuracy")):
        assert close(out[key], want[name]), key


def test_reward_model_matches_reference():
    out = _fed(RewardModelMetrics()).compute()
    want = ref_rm(_np(ALL["chosen_scores"]), _np(ALL["rejected_scores"]))
    for key, name in zip(FT.RM_KEYS, ("loss", "accuracy", "reward_margin")):
        assert close(out[key], want[name]), key
    # [B, 1] scores (a reward head's output) are accepted
    out2 = FT.reward_model_metrics(ALL["chosen_scores"][:, None], ALL["rejected_scores"][:, None])
    assert close(out2["rm/loss"], want["loss"])


# --- validation ---------------------------------------------------------------------------------------
def _val_batches(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    batches = []
    layout = [(3, ["gsm8k", "math", "gsm8k"]), (2, "math"), (4, ["aime", "math", "gsm8k", "aime"])]
    for i, (P_, srcs) in enumerate(layout):
        acc = (torch.rand(P_, n, generator=g) < 0.4 + 0.1 * i).double()
        rew = torch.randn(P_, n, generator=g, dtype=torch.float64).round(decimals=2)
        mask = torch.ones(P_, n, dtype=torch.bool)
        if i == 2:
            mask[0, 3:] = False  # 3 valid samples
            mask[1, :] = False  # no valid sample
        batches.append({"val_acc": acc, "val_rewards": rew, "val_mask": mask, "data_sources": srcs,
                        "val_num_turns": torch.randint(1, 5, (P_, n), generator=g)})
    return batches


def _val_rows(batches, field):
    rows = []
    for b in batches:
        srcs = [b["data_sources"]] * b[field].shape[0] if isinstance(b["data_sources"], str) else b["data_sources"]
        for p, s in enumerate(srcs):
            rows.append((s, b[field][p].tolist(), b["val_mask"][p].tolist()))
    return rows


def test_validation_matches_reference():
    sources, ks = ("gsm8k", "math", "aime"), (1, 2, 4, 6)
    batches = _val_batches()
    acc = ValidationAccuracy(sources, n_samples=6, ks=ks)
    rew = ValidationReward(sources, n_samples=6, ks=ks)
    turns = ValidationTurns()
    for b in batches:
        acc.update(b)
        rew.update(b)
        turns.update(b)
    out = acc.compute()
    want = ref_validation(_val_rows(batches, "val_acc"), sources, 6, ks, "acc")
    assert set(out) == set(want) == set(acc.keys)
    for k, v in want.items():
        assert close(out[k], v), k
    out = rew.compute()
    want = ref_validation(_val_rows(batches, "val_rewards"), sources, 6, ks, "reward")
    assert set(out) == set(want)
    for k, v in want.items():
        assert close(out[k], v), k
    vals = [x for b in batches for x in b["val_num_turns"][b["val_mask"]].tolist()]
    out = turns.compute()
    assert out["val-aux/num_turns/max"] == max(vals) and out["val-aux/num_turns/min"] == min(vals)
    assert close(out["val-aux/num_turns/mean"], sum(vals) / len(vals))


def test_validation_unknown_source_raises_or_goes_to_other():
    b = {"val_acc": torch.tensor([[1.0], [0.0]]), "data_sources": ["gsm8k", "hellaswag"]}
    with pytest.raises(ValueError, match=r"data_sources.*hellaswag"):
        ValidationAccuracy(["gsm8k"]).update(b)
    m = ValidationAccuracy(["gsm8k"], allow_other=True)
    m.update(b)
    out = m.compute()
    assert out["val-core/gsm8k/acc/mean@1"] == 1.0 and out["val-core/other/acc/mean@1"] == 0.0


@pytest.mark.parametrize("n", [1, 2, 7, 64, 200])
def test_pass_at_k_product_form_is_exact_and_stable(n):
    cs = sorted({0, 1, n // 3, n // 2, n - 1, n})
    for k in sorted(k for k in {1, 2, max(1, n // 4), max(1, n // 2), n} if k <= n):
        got = FV.pass_at_k(torch.full((len(cs),), float(n)), torch.tensor(cs, dtype=torch.float64), k)
        for c, g in zip(cs, got.tolist()):
            assert g == pytest.approx(ref_pass_at_k(n, c, k), rel=1e-10, abs=1e-12), (n, c, k)
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
                assert got[p].item() == pytest.approx(ref_best_at_k(row, k), rel=1e-10)


# --- load balance -------------------------------------------------------------------------------------
def test_global_seqlen_driver_mode_matches_reference():
    g = torch.Generator().manual_seed(3)
    for world, n, algo in ((4, 16, "karmarkar_karp"), (3, 10, "karmarkar_karp"), (2, 7, "lpt")):
        prompt = torch.randint(10, 100, (n,), generator=g)
        resp = torch.randint(0, 3000, (n,), generator=g)
        ranks = torch.randint(0, world, (n,), generator=g)
        m = GlobalSeqlen(world_size=world, algorithm=algo)
        m.update(prompt_lengths=prompt, response_lengths=resp, rank_ids=ranks)
        out = m.compute()
        total = (prompt + resp).tolist()
        loads = [sum(t for t, r in zip(total, ranks.tolist()) if r == j) for j in range(world)]
        assert out["global_seqlen/min"] == min(loads) and out["global_seqlen/max"] == max(loads)
        assert out["global_seqlen/minmax_diff"] == max(loads) - min(loads)
        assert close(out["global_seqlen/mean"], sum(total) / world)
        if algo == "karmarkar_karp":
            sums = ref_karmarkar_karp_sums(total, world)
        else:
            sums = sorted(P.partition_loads(total, world, "lpt"))
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
        assert sorted(P.partition_loads(lengths, k)) == ref_karmarkar_karp_sums(lengths, k)
        assert sorted(P.partition_loads(lengths, k, equal_size=False)) == ref_karmarkar_karp_sums(lengths, k, False)


def test_global_seqlen_overflow_is_exact_in_totals_and_warns():
    m = GlobalSeqlen(world_size=1, max_seqlen=100)
    m.update(prompt_lengths=torch.tensor([10, 10]), response_lengths=torch.tensor([50, 500]))
    with pytest.warns(UserWarning, match="max_seqlen"):
        out = m.compute()
    assert out["global_seqlen/max"] == 570 and out["global_seqlen/balanced_max"] == 570


def test_seqlen_balance_functional_matches_class():
    lengths = [900, 800, 100, 200, 300, 300]
    f = P.seqlen_balance(lengths, 2)
    m = GlobalSeqlen(world_size=2)
    m.update(prompt_lengths=torch.zeros(6, dtype=torch.long), response_lengths=torch.tensor(lengths),
             rank_ids=torch.tensor([0, 0, 0, 1, 1, 1]))
    assert {k: v.item() for k, v in m.compute().items()} == f


# --- timing and performance -------------------------------------------------------------------------
def test_stage_timing_throughput_mfu_match_hand_formulas():
    steps = [({"gen": 2.0, "update_actor": 1.0, "old_log_prob": 0.5, "step": 4.0}, [100, 50], [300, 700]),
             ({"gen": 4.0, "update_actor": 3.0, "step": 8.0}, [20], [80])]
    flops = P.TransformerFlops(active_params=7e9, num_layers=28, attention_dim=3584)
    timing = StageTiming(stages=("gen", "update_actor", "old_log_prob", "step"))
    thr = Throughput(num_gpus=8)
    mfu = ModelFlopsUtilization(flops, accelerator="NVIDIA H100 80GB HBM3", num_gpus=8)
    for t, p, r in steps:
        batch = {"timing_s": t, "prompt_lengths": torch.tensor(p), "response_lengths": torch.tensor(r)}
        for m in (timing, thr, mfu):
            m.update(batch)
    n = len(steps)
    tokens = sum(sum(p) + sum(r) for _, p, r in steps) / n
    resp = sum(sum(r) for _, _, r in steps) / n
    sec = {s: sum(t.get(s, 0.0) for t, _, _ in steps) / n for s in ("gen", "update_actor", "old_log_prob", "step")}
    out = timing.compute()
    for s, v in sec.items():
        assert close(out[f"timing_s/{s}"], v)
    assert close(out["timing_per_token_ms/gen"], 1000 * sec["gen"] / resp)
    assert close(out["timing_per_token_ms/update_actor"], 1000 * sec["update_actor"] / tokens)
    assert "timing_per_token_ms/step" not in out
    out = thr.compute()
    assert close(out["perf/total_num_tokens"], tokens) and close(out["perf/time_per_step"], sec["step"])
    assert close(out["perf/throughput"], tokens / (sec["step"] * 8))
    sq = sum((pi + ri) ** 2 for _, p, r in steps for pi, ri in zip(p, r)) / n
    fwd = 2 * 7e9 * tokens + 4 * 3584 * 28 * sq
    out = mfu.compute()
    assert close(out["perf/mfu/actor"], 3 * fwd / (sec["update_actor"] * 8 * 989e12))
    assert close(out["perf/mfu/actor_infer"], fwd / (sec["old_log_prob"] * 8 * 989e12))


def test_transformer_flops_from_config_matches_reference():
    dense = dict(hidden=4096, layers=32, heads=32, vocab=128256, inter=14336, kv_heads=8)
    f = P.TransformerFlops.from_config(hidden_size=4096, num_layers=32, num_heads=32, vocab_size=128256,
                                       intermediate_size=14336, num_kv_heads=8)
    assert f.active_params == ref_transformer_active_params(**dense)
    assert 7.0e9 < f.active_params < 7.6e9  # Llama-3-8B without the embedding table
    moe = P.TransformerFlops.from_config(hidden_size=2048, num_layers=24, num_heads=16, vocab_size=151936,
                                         num_kv_heads=4, head_dim=128, num_experts=60, experts_per_token=4,
                                         moe_intermediate_size=1408, shared_experts=4, count_embedding=True)
    assert moe.active_params == ref_transformer_active_params(2048, 24, 16, 151936, 0, 4, 128, 60, 4, 1408, 4, True)
    assert P.TransformerFlops(1.0, 1, 8, causal=True).forward_flops(0, 10) == 4 * 8 * 10 / 2


def test_peak_flops_table_and_overrides():
    assert P.peak_flops("NVIDIA H200") == 989e12
    assert P.peak_flops("NVIDIA H20") == 148e12
    assert P.peak_flops("NVIDIA B200") == 2.25e15
    assert P.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert P.peak_flops("NVIDIA L40S") == 362.05e12
    assert P.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert P.peak_flops("my-chip", {"my-chip": 1.0}) == 1.0
    with pytest.raises(ValueError, match="peak_flops"):
        P.peak_flops("NVIDIA A10")
    flops = P.TransformerFlops(1e9, 1, 1)
    assert ModelFlopsUtilization(flops, peak_flops=5e14).peak == 5e14
    with pytest.raises(ValueError, match="peak_flops"):
        ModelFlopsUtilization(flops, peak_flops=-1.0)


def test_agent_loop_timing_matches_reference():
    from opbc_metrics.training import AgentLoopTiming

    out = _fed(AgentLoopTiming()).compute()
    for part, field in (("generate_sequences", "agent_generate_s"), ("tool_calls", "agent_tool_calls_s")):
        for stat, v in ref_lengths(_np(ALL[field])).items():
            assert close(out[f"timing_s/agent_loop/{part}/{stat}"], v), (part, stat)
    m = AgentLoopTiming()
    m.update(agent_generate_s=torch.tensor([1.0, -2.0]))
    with pytest.raises(ValueError, match="`agent_generate_s`"):
        m.compute()


def test_stage_timer_measures_and_feeds_the_metric():
    timer = StageTimer(stages=("gen", "step"))
    with timer("step"), timer.time("gen"):
        sum(range(1000))
    timer.record("gen", 1.0)
    t = timer.pop()
    assert t["gen"] >= 1.0 and t["step"] >= 0.0 and timer.timings == {}
    m = StageTiming(stages=("gen", "step"))
    m.update(timing_s=t)
    assert close(m.compute()["timing_s/gen"], t["gen"])
    with pytest.raises(ValueError, match="unknown stage"), timer("nope"):
        pass
    with pytest.raises(ValueError, match="seconds"):
        timer.record("gen", -1.0)


# --- contracts ------------------------------------------------------------------------------------------
def _all_metrics():
    return training_metrics(max_response_length=10, max_prompt_length=30, data_sources=("gsm8k", "math", "aime"),
                            n_samples=6, ks=(1, 2), flops=P.TransformerFlops(1e9, 4, 64), peak_flops=1e15,
                            world_size=1)


def _full_batch(seed=0):
    b = make_training_batch(seed=seed, batch=4, seq=9)
    b.update({k: torch.tensor(v, dtype=torch.float64) for k, v in make_scalars(2, seed).items()})
    v = _val_batches()[2]
    b.update(v)
    b["timing_s"] = {"gen": 1.0, "update_actor": 0.5, "old_log_prob": 0.2, "step": 2.0}
    b["lr_scheduler"] = {"last_lr": torch.tensor(1e-6, dtype=torch.float64)}
    b["rank_ids"] = torch.zeros(4, dtype=torch.long)
    return b


def test_updates_never_sync_host_and_device():
    b = _full_batch()
    members = _all_metrics()
    collection = OPBCCollection(metrics=_all_metrics())
    for m in [collection, *members, PolicyEntropy(from_logits=True)]:
        with assert_no_host_sync():
            m.update(b)
    gs = GlobalSeqlen(world_size=2)
    with assert_no_host_sync():
        gs.update(prompt_lengths=b["prompt_lengths"], response_lengths=b["response_lengths"])


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


def test_collection_skips_members_whose_fields_are_absent():
    collection = OPBCCollection(metrics=_all_metrics())
    collection.update(actor_loss=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = collection.compute()
    assert out["actor/loss"] == 1.0
    assert all(torch.isfinite(v) for v in out.values())
    assert all(v == 0 for k, v in out.items() if k != "actor/loss")


def test_empty_windows_report_no_keys():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "compute before update" warning either: no data is no value
        for m in _all_metrics():
            assert m.compute_dict() == {}, type(m).__name__


def test_state_dict_round_trip_and_forward():
    parts = [_full_batch(s) for s in range(3)]
    straight = OPBCCollection(metrics=_all_metrics())
    for p in parts:
        straight.update(p)
    first = OPBCCollection(metrics=_all_metrics())
    batch_values = first(parts[0])
    alone = OPBCCollection(metrics=_all_metrics())
    alone.update(parts[0])
    assert {k: v.item() for k, v in batch_values.items()} == {k: v.item() for k, v in alone.compute().items()}
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = OPBCCollection(metrics=_all_metrics())
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    for p in parts[1:]:
        resumed(p)
    a, b = straight.compute(), resumed.compute()
    for k in a:
        assert close(a[k], b[k]), k


# --- bad input ----------------------------------------------------------------------------------------
def test_negative_lengths_in_tensors_raise_at_compute_naming_the_field():
    for metric, field in ((ResponseLength(), "response_lengths"), (PromptLength(), "prompt_lengths"),
                          (AbortedRatio(), "response_lengths"), (NumTurns(), "num_turns"),
                          (GlobalSeqlen(world_size=1), "response_lengths"), (ValidationTurns(), "val_num_turns")):
        b = {"response_lengths": torch.tensor([3, -1]), "prompt_lengths": torch.tensor([-2, 5]),
             "num_turns": torch.tensor([1, -4]), "val_num_turns": torch.tensor([[1, -4]])}
        metric.update(b)  # no host sync: counted, not checked
        with pytest.raises(ValueError, match=f"`{field}`"):
            metric.compute()


def test_host_inputs_are_checked_at_once():
    with pytest.raises(ValueError, match=r"`response_lengths`.*negative"):
        ResponseLength().update(response_lengths=[3, -1])
    with pytest.raises(ValueError, match=r"`actor_loss`.*NaN"):
        ActorLoss().update(actor_loss=float("nan"))
    with pytest.raises(ValueError, match="`loss_tokens`"):
        ActorLoss().update(actor_loss=[1.0, 2.0], loss_tokens=[1])
    with pytest.raises(ValueError, match="`actor_loss`"):
        ActorLoss().update(actor_loss="high")


def test_nonfinite_tensor_values_raise_at_compute():
    b = make_training_batch(seed=1)
    b["entropies"][0, 0] = float("nan")
    b["response_mask"][0, 0] = 1
    m = PolicyEntropy()
    m.update(b)
    with pytest.raises(ValueError, match="`entropies`"):
        m.compute()
    b["values"][0, 0] = float("inf")
    m = ExplainedVariance()
    m.update(b)
    with pytest.raises(ValueError, match="`returns`"):
        m.compute()


@pytest.mark.parametrize(
    "metric,change,field",
    [
        (PPOKL(), lambda b: b.update(old_logprobs=b["old_logprobs"][:, :-1]), "old_logprobs"),
        (PPOKL(), lambda b: b.update(response_mask=b["response_mask"][:, :-1]), "response_mask"),
        (PPOKL(), lambda b: b.pop("policy_logprobs"), "policy_logprobs"),
        (PolicyClipFraction(), lambda b: b.update(advantages=b["advantages"][:-1]), "advantages"),
        (ValueStats(), lambda b: b.update(values=b["values"][None]), "values"),
        (ExplainedVariance(), lambda b: b.update(values=b["values"][:, :-1]), "values"),
        (DPOMetrics(), lambda b: b.update(policy_rejected_logps=b["policy_rejected_logps"][:-1]),
         "policy_rejected_logps"),
        (RewardModelMetrics(), lambda b: b.update(chosen_scores=b["chosen_scores"][:, None].expand(-1, 2)),
         "chosen_scores"),
        (ResponseLength(), lambda b: b.update(response_lengths=b["response_lengths"][None]), "response_lengths"),
        (GlobalSeqlen(world_size=2), lambda b: b.update(prompt_lengths=b["prompt_lengths"][:-1]), "prompt_lengths"),
        (GlobalSeqlen(world_size=2), lambda b: b.update(rank_ids=torch.zeros(2)), "rank_ids"),
        (PolicyEntropy(from_logits=True), lambda b: b.update(logits=b["logits"][0]), "logits"),
        (StageTiming(), lambda b: b.update(timing_s={"generate": 1.0}), "timing_s"),
        (StageTiming(), lambda b: b.update(timing_s={"gen": float("nan")}), "timing_s"),
        (StageTiming(), lambda b: b.update(timing_s=[1.0]), "timing_s"),
        (ValidationAccuracy(["gsm8k"], n_samples=2), lambda b: b.update(val_acc=torch.ones(3, 4),
                                                                         data_sources="gsm8k"), "val_acc"),
        (ValidationAccuracy(["gsm8k"]), lambda b: b.update(val_acc=torch.ones(3), data_sources=["gsm8k"]),
         "data_sources"),
        (ValidationAccuracy(["gsm8k"]), lambda b: b.update(val_acc=torch.ones(1), data_sources=torch.zeros(1)),
         "data_sources"),
    ],
)
def test_bad_input_names_the_field(metric, change, field):
    b = make_training_batch(seed=2)
    b["timing_s"] = {"gen": 1.0}
    change(b)
    with pytest.raises(ValueError, match=f"`{field}`"):
        metric.update(b)


def test_bad_constructor_arguments():
    bad = [
        lambda: PolicyClipFraction(clip_ratio=1.5),
        lambda: PolicyClipFraction(clip_ratio_c=1.0),
        lambda: PPOKL(estimator="k4"),
        lambda: DPOMetrics(beta=0.0),
        lambda: DPOMetrics(label_smoothing=0.5),
        lambda: ResponseLength(max_response_length=0),
        lambda: ValidationAccuracy([]),
        lambda: ValidationAccuracy(["a", "a"]),
        lambda: ValidationAccuracy(["a"], n_samples=4, ks=[5]),
        lambda: ValidationAccuracy(["a//b"]),
        lambda: GlobalSeqlen(world_size=0),
        lambda: GlobalSeqlen(algorithm="greedy"),
        lambda: StageTiming(stages=("gen", "gen")),
        lambda: StageTiming(stages=("gen",), per_token_stages=("ref",)),
        lambda: Throughput(num_gpus=0),
        lambda: ModelFlopsUtilization(P.TransformerFlops(1, 1, 1), stages={"x": ("s", "backward")}, peak_flops=1.0),
        lambda: P.TransformerFlops(0, 1, 1),
    ]
    for make in bad:
        with pytest.raises(ValueError):
            make()


def test_rank_beyond_capacity_is_a_clear_error(monkeypatch):
    import opbc_metrics.training._base as base

    m = StageTiming(world_size=2)
    monkeypatch.setattr(base, "dist_rank_world", lambda group=None: (3, 4))
    with pytest.raises(ValueError, match="rank 3"):
        m.update(timing_s={"gen": 1.0})
