"""No made-up values, for batches that carry a metric's fields but no valid data.

Every exported metric class gets batches that hold its required fields with nothing valid in them, in each way its
fields allow (response_mask all 0, zero-length tensors, empty lists, all weights / loss_tokens 0, val_mask all
False, NaN-only sample metrics, singleton groups where a group statistic needs two samples, ...). Alone, the metric
raises NoDataError (or a ValueError naming the bad input) and ``forward`` returns None; in an OPBCCollection (its
section, or ``metrics=[...]``) none of its keys appear, in ``compute`` and in ``forward``. Where only some keys lack
data (a sample std of one value, a scheduler name never given, tool-call times not passed), exactly those keys are
left out and the others are reported.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import opbc_metrics as O
from opbc_metrics import OPBCCollection
from opbc_metrics.controller import OPBCController
from opbc_metrics.functional.perf import TransformerFlops
from opbc_metrics.metric import NoDataError
from opbc_metrics.mismatch import MISMATCH_METRICS, InputHealth
from tests.data import make_batch, make_router_batch, make_training_batch, make_validation_batch

F64, LONG = torch.float64, torch.long


@dataclass(frozen=True)
class Case:
    """One metric and one batch without valid data (for ``absent``: without data for those keys only)."""

    id: str
    make: Callable[[], O.OPBCMetric]
    batch: Callable[[], dict]
    section: str | None  # the collection section holding the metric; None: OPBCCollection(metrics=[make()])
    options: dict = field(default_factory=dict)  # section_options of that section (the metric's settings)
    absent: tuple[str, ...] | None = None  # None: no key at all; else only these keys are left out
    raises: bool = False  # bad input: a ValueError (naming the field), in update or compute

    def collection(self) -> OPBCCollection:
        if self.section is None:
            return OPBCCollection(metrics=[self.make()])
        return OPBCCollection(sections=[self.section], section_options={self.section: self.options} if self.options
                              else None)


def empty(dtype: torch.dtype = F64, *shape: int) -> torch.Tensor:
    return torch.zeros(0, *shape, dtype=dtype)


# -- builders: valid batches from tests/data, emptied ---------------------------------------------------------------
def logprobs(mask: torch.Tensor | None = None, b: int = 2, t: int = 3) -> dict:
    out = make_batch(batch=b, seq=t, seed=1, dtype=F64)
    del out["group_ids"]
    return out if mask is None else {**out, "response_mask": mask}


def logprobs_all_masked(dtype: torch.dtype = LONG) -> dict:
    return logprobs(torch.zeros(2, 3, dtype=dtype))


def logprobs_no_sequence() -> dict:
    return {k: v[:0] for k, v in logprobs().items()}


def logprobs_no_token() -> dict:
    return {k: v[:, :0] for k, v in logprobs().items()}


def logprobs_nan_on_valid() -> dict:
    out = logprobs(torch.ones(2, 3, dtype=LONG))
    return {**out, "trainer_logprobs": torch.full((2, 3), math.nan, dtype=F64)}


def logprobs_one_token() -> dict:
    mask = torch.zeros(2, 3, dtype=LONG)
    mask[1, 1] = 1
    return logprobs(mask)


LOGPROB_BATCHES = {"mask_all_0": logprobs_all_masked, "mask_all_false": lambda: logprobs_all_masked(torch.bool),
                   "zero_sequences": logprobs_no_sequence, "zero_tokens": logprobs_no_token,
                   "nan_on_every_valid_token": logprobs_nan_on_valid}


def routing(mask: bool = True) -> dict:
    out = make_router_batch(batch=2, seq=3, layers=2, k=2, experts=4)
    return {**out, "response_mask": torch.zeros(2, 3, dtype=LONG)} if mask else {k: v[:0] for k, v in out.items()}


ASSISTANT = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
RESPONSE = {"object": "chat.completion", "choices": [{"message": {"role": "assistant", "content": "hi"}}]}


def training(*names: str, mask: bool = True) -> Callable[[], dict]:
    """The training fields ``names`` of a valid batch, with every response token masked out."""
    def build() -> dict:
        b = make_training_batch(batch=2, seq=3)
        return {**{n: b[n] for n in names}, **({"response_mask": torch.zeros(2, 3, dtype=LONG)} if mask else {})}
    return build


def per_sequence_masked(name: str) -> Callable[[], dict]:
    return lambda: {name: torch.ones(2, dtype=F64), "response_mask": torch.zeros(2, 3, dtype=LONG)}


def validation(name: str, *, mask: bool) -> Callable[[], dict]:
    def build() -> dict:
        b = make_validation_batch(prompts=2, n=4, sources=("gsm8k", "math"))
        if mask:
            return {name: b[name], "data_sources": b["data_sources"], "val_mask": torch.zeros(2, 4, dtype=torch.bool)}
        return {name: b[name][:0], "data_sources": []}
    return build


def decisions(masked: bool) -> Callable[[], dict]:
    def build() -> dict:
        t = torch.full((2, 3), -1.0)
        if masked:
            out = OPBCController(track_budget=False).step(trainer_logprobs=t, rollout_logprobs=t - 0.1,
                                                          group_ids=torch.tensor([0, 1]),
                                                          response_mask=torch.zeros(2, 3, dtype=LONG))
        else:
            out = OPBCController(track_budget=False).step(trainer_logprobs=t[:0], rollout_logprobs=t[:0],
                                                          group_ids=torch.zeros(0, dtype=LONG))
        return {"opbc_decisions": out}
    return build


FLOPS = {"flops": TransformerFlops(active_params=1e9, num_layers=1, attention_dim=8), "peak_flops": 1e12}
EMPTY_LENGTHS = {"prompt_lengths": empty(LONG), "response_lengths": empty(LONG)}
SCALARS = {"ActorLoss": "actor_loss", "PolicyGradientLoss": "pg_loss", "EntropyLoss": "entropy_loss",
           "KLLoss": "kl_loss", "CriticLoss": "critic_loss",  # weighted by loss_tokens
           "KLCoef": "kl_coef", "ActorGradNorm": "actor_grad_norm", "ActorLR": "actor_lr", "CriticLR": "critic_lr",
           "RMGradNorm": "rm_grad_norm"}
WEIGHTED = ("ActorLoss", "PolicyGradientLoss", "EntropyLoss", "KLLoss", "CriticLoss")
TOOL_KEYS = tuple(f"timing_s/agent_loop/tool_calls/{s}" for s in ("min", "max", "mean"))


def _cases() -> list[Case]:
    cases: list[Case] = []

    def add(id: str, make: Callable[[], O.OPBCMetric], batch: Callable[[], dict], section: str | None,
            options: dict | None = None, **kw: Any) -> None:
        cases.append(Case(id, make, batch, section, options or {}, **kw))

    # mismatch (InputHealth is the input accounting: it always reports, see below) and per_round
    for cls in [*(c for c in MISMATCH_METRICS if c is not InputHealth), O.PerRoundMismatch]:
        section = "per_round" if cls is O.PerRoundMismatch else "mismatch"
        for name, build in LOGPROB_BATCHES.items():
            add(f"{cls.__name__}-{name}", cls, build, section)
    add("ProbabilityDiff-one_token", O.ProbabilityDiff, logprobs_one_token, "mismatch",
        absent=("opbc/prob/pearson", "opbc/prob/diff_std"))
    # moe
    for cls in (O.RouterFlipRate, O.RouterSetDisagreement):
        add(f"{cls.__name__}-mask_all_0", cls, routing, "moe")
        add(f"{cls.__name__}-zero_sequences", cls, lambda: routing(mask=False), "moe")
        add(f"{cls.__name__}-zero_layers", cls, lambda: {k: torch.zeros(2, 3, 0, 2, dtype=LONG) for k in
                                                         ("rollout_experts", "trainer_experts")}, "moe", raises=True)
    # agent
    for cls in O.AGENT_METRICS:
        add(f"{cls.__name__}-no_pairs", cls, lambda: {"trajectory_pairs": []}, "agent")
        add(f"{cls.__name__}-no_assistant_step", cls, lambda: {"trajectory_pairs": [([], [])]}, "agent", raises=True)
    add("ToolChoiceDisagreementRate-no_tool_call", O.ToolChoiceDisagreementRate,
        lambda: {"trajectory_pairs": [(ASSISTANT, ASSISTANT)]}, "agent")
    add("FirstDivergenceStep-none_diverged", O.FirstDivergenceStep,
        lambda: {"trajectory_pairs": [(ASSISTANT, ASSISTANT)]}, "agent",
        absent=("agent/trajectory/first_divergence_step_mean", "agent/trajectory/first_divergence_step_min"))
    # endpoint
    for cls in O.ENDPOINT_METRICS:
        add(f"{cls.__name__}-no_responses", cls, lambda: {"endpoint_responses": []}, "endpoint")
        add(f"{cls.__name__}-no_responses_with_requests", cls,
            lambda: {"endpoint_responses": [], "endpoint_requests": []}, "endpoint")
        add(f"{cls.__name__}-no_choice", cls, lambda: {"endpoint_responses": [{**RESPONSE, "choices": []}]},
            "endpoint", raises=True)
    # rollout
    r = "rollout"
    masked_rewards = {"rewards": torch.ones(2, 3, dtype=F64), "response_mask": torch.zeros(2, 3, dtype=LONG)}
    add("RolloutRewardStats-empty", O.RolloutRewardStats, lambda: {"rewards": empty()}, r)
    add("RolloutRewardStats-tokens_masked", O.RolloutRewardStats, lambda: dict(masked_rewards), r)
    add("RolloutAdvantageStats-empty", O.RolloutAdvantageStats, lambda: {"advantages": empty()}, r)
    add("RolloutAdvantageStats-tokens_masked", O.RolloutAdvantageStats,
        lambda: {"advantages": torch.ones(2, 3, dtype=F64), "response_mask": torch.zeros(2, 3, dtype=LONG)}, r)
    add("PromptTokenStats-empty", O.PromptTokenStats, lambda: {"prompt_lengths": empty(LONG),
                                                               "group_ids": empty(LONG)}, r)
    add("CompletionTokenStats-empty", O.CompletionTokenStats, lambda: {"response_lengths": empty(LONG)}, r)
    add("TotalTokenStats-empty", O.TotalTokenStats, lambda: dict(EMPTY_LENGTHS), r)
    add("OffPolicySteps-empty", O.OffPolicySteps, lambda: {"policy_lag": empty(LONG)}, r)
    one = {O.RolloutRewardStats: ("rewards", "reward"), O.RolloutAdvantageStats: ("advantages", "advantage"),
           O.PromptTokenStats: ("prompt_lengths", "tokens_prompt"),
           O.CompletionTokenStats: ("response_lengths", "tokens_completion"), O.OffPolicySteps: ("policy_lag",
                                                                                                "off_policy_steps")}
    for cls, (name, prefix) in one.items():  # the sample std (n - 1) of one value
        add(f"{cls.__name__}-one_sample_std", cls, lambda name=name: {name: torch.tensor([3.0])}, r,
            absent=(f"rollout/{prefix}/std",))
    add("TotalTokenStats-one_sample_std", O.TotalTokenStats,
        lambda: {"prompt_lengths": torch.tensor([3]), "response_lengths": torch.tensor([4])}, r,
        absent=("rollout/tokens_total/std",))
    add("RolloutRewardGini-empty", O.RolloutRewardGini, lambda: {"rewards": empty(), "group_ids": []}, r)
    add("RolloutRewardGini-tokens_masked", O.RolloutRewardGini,
        lambda: {**masked_rewards, "group_ids": torch.tensor([0, 0])}, r)
    for cls in (O.CompletionLengthGini, O.CompletionLengthMaxMedianRatio, O.CompletionLengthCV):
        add(f"{cls.__name__}-empty", cls, lambda: {"response_lengths": empty(LONG), "group_ids": empty(LONG)}, r)
    add("CompletionLengthCV-singleton_groups", O.CompletionLengthCV,
        lambda: {"response_lengths": torch.tensor([3, 4]), "group_ids": torch.tensor([0, 1])}, r)
    add("CompletionLengthCV-mean_0", O.CompletionLengthCV,
        lambda: {"response_lengths": torch.tensor([0, 0]), "group_ids": torch.tensor([0, 0])}, r)
    add("CompletionLengthMaxMedianRatio-median_0", O.CompletionLengthMaxMedianRatio,
        lambda: {"response_lengths": torch.tensor([0, 0, 5, 0, 0]), "group_ids": torch.tensor([0, 0, 0, 1, 1])}, r)
    add("StopReasonLengthPct-empty_list", O.StopReasonLengthPct, lambda: {"stop_reasons": []}, r)
    add("StopReasonLengthPct-empty_tensor", O.StopReasonLengthPct, lambda: {"stop_reasons": empty(LONG)}, r)
    add("DiscardedRollouts-empty", O.DiscardedRollouts, lambda: {"discard_reasons": []}, r)
    add("DiscardedRollouts-none_discarded", O.DiscardedRollouts, lambda: {"discard_reasons": torch.tensor([0, 0])},
        r, absent=("rollout/discarded/max_async_pct", "rollout/discarded/zero_advantage_pct",
                   "rollout/discarded/zero_advantage_all_zero", "rollout/discarded/zero_advantage_all_positive",
                   "rollout/discarded/zero_advantage_reward_mean"))
    add("DiscardedRolloutStats-empty", O.DiscardedRolloutStats,
        lambda: {"discard_reasons": empty(LONG), "response_lengths": empty(LONG)}, r)
    add("DiscardedRolloutStats-none_discarded", O.DiscardedRolloutStats,
        lambda: {"discard_reasons": torch.tensor([0, 0]), "response_lengths": torch.tensor([3, 4]),
                 "group_ids": torch.tensor([0, 0]), "stop_reasons": ["stop", "length"]}, r)
    add("DiscardedRolloutStats-one_discarded", O.DiscardedRolloutStats,
        lambda: {"discard_reasons": torch.tensor([1, 0]), "response_lengths": torch.tensor([3, 4])}, r,
        absent=("rollout/discarded/tokens_completion/std", "rollout/discarded/tokens_completion/group_gini_mean",
                "rollout/discarded/tokens_completion/group_max_median_ratio_mean",
                "rollout/discarded/stop_reason/length_pct"))
    add("DiscardedRolloutStats-median_0", O.DiscardedRolloutStats,
        lambda: {"discard_reasons": torch.tensor([1, 1]), "response_lengths": torch.tensor([0, 0]),
                 "group_ids": torch.tensor([0, 0])}, r,
        absent=("rollout/discarded/tokens_completion/group_max_median_ratio_mean",))
    names = {"sample_metric_names": ["a", "b"]}

    def samples(a: list[float], b: list[float] | None = None, ids: list[int] | None = None) -> Callable[[], dict]:
        metrics = {"a": torch.tensor(a, dtype=F64), **({} if b is None else {"b": torch.tensor(b, dtype=F64)})}
        return lambda: {"sample_metrics": metrics, "group_ids": torch.tensor(ids or [0] * len(a))}

    def make_samples() -> O.OPBCMetric:
        return O.SampleMetricStats(["a", "b"])

    add("SampleMetricStats-nan_only", make_samples, samples([math.nan, math.nan]), r, names)
    add("SampleMetricStats-nan_only_both", make_samples, samples([math.nan], [math.nan]), r, names)
    add("SampleMetricStats-empty", make_samples, lambda: {"sample_metrics": {"a": empty()}, "group_ids": empty(LONG)},
        r, names)
    add("SampleMetricStats-no_name_reported", make_samples,
        lambda: {"sample_metrics": [{}, {}], "group_ids": torch.tensor([0, 1])}, r, names)
    add("SampleMetricStats-one_name_nan", make_samples, samples([math.nan, math.nan], [1.0, 2.0]), r, names,
        absent=tuple(f"sample_metrics/a/{s}" for s in ("mean", "std", "min", "max", "group_gini_mean")))
    add("SampleMetricStats-one_sample_std", make_samples, samples([1.0, math.nan], [1.0, 2.0], [0, 1]), r, names,
        absent=("sample_metrics/a/std",))
    # training: trainer scalars
    t = "training"
    for name, fld in SCALARS.items():
        cls = getattr(O, name)
        add(f"{name}-empty_list", cls, lambda fld=fld: {fld: []}, t)
        add(f"{name}-empty_tensor", cls, lambda fld=fld: {fld: empty()}, t)
        if name in WEIGHTED:
            add(f"{name}-loss_tokens_0", cls, lambda fld=fld: {fld: [1.0, 2.0], "loss_tokens": [0, 0]}, t)
            add(f"{name}-loss_tokens_0_tensor", cls,
                lambda fld=fld: {fld: torch.tensor([1.0, 2.0]), "loss_tokens": torch.tensor([0, 0])}, t)
    add("LRSchedulerState-no_name", O.LRSchedulerState, lambda: {"lr_scheduler": {}}, t)
    add("LRSchedulerState-empty_list", O.LRSchedulerState, lambda: {"lr_scheduler": {"last_lr": []}}, t)
    # (defect fixed: a declared name never given in the window was reported as 0.0)
    add("LRSchedulerState-name_not_given", lambda: O.LRSchedulerState(names=("last_lr", "step")),
        lambda: {"lr_scheduler": {"last_lr": 1e-6}}, t, {"lr_scheduler_names": ("last_lr", "step")},
        absent=("lr_scheduler/step",))
    add("LRSchedulerState-name_given_empty", lambda: O.LRSchedulerState(names=("last_lr", "step")),
        lambda: {"lr_scheduler": {"last_lr": [1e-6], "step": []}}, t, {"lr_scheduler_names": ("last_lr", "step")},
        absent=("lr_scheduler/step",))
    # training: token statistics
    add("PolicyEntropy-mask_all_0", O.PolicyEntropy, training("entropies"), t)
    add("PolicyEntropy-zero_sequences", O.PolicyEntropy,
        lambda: {"entropies": empty(F64, 3), "response_mask": empty(LONG, 3)}, t)
    add("PolicyEntropy-logits_mask_all_0", lambda: O.PolicyEntropy(from_logits=True), training("logits"), t,
        {"entropy_from_logits": True})
    for cls in (O.PPOKL, O.ApproxKL):
        add(f"{cls.__name__}-mask_all_0", cls, training("policy_logprobs", "old_logprobs"), t)
        add(f"{cls.__name__}-zero_sequences", cls,
            lambda: {"policy_logprobs": empty(F64, 3), "old_logprobs": empty(F64, 3)}, t)
    add("PolicyClipFraction-mask_all_0", O.PolicyClipFraction,
        training("policy_logprobs", "old_logprobs", "advantages"), t)
    add("PolicyClipFraction-zero_sequences", O.PolicyClipFraction,
        lambda: {"policy_logprobs": empty(F64, 3), "old_logprobs": empty(F64, 3), "advantages": empty()}, t)
    for cls, name in ((O.ValueStats, "values"), (O.ReturnStats, "returns"), (O.AdvantageStats, "advantages")):
        add(f"{cls.__name__}-mask_all_0", cls, training(name), t)
        add(f"{cls.__name__}-per_sequence_mask_all_0", cls, per_sequence_masked(name), t)
        add(f"{cls.__name__}-empty", cls, lambda name=name: {name: empty()}, t)
    for cls, name in ((O.RewardStats, "rewards"), (O.ScoreStats, "scores")):
        add(f"{cls.__name__}-aborted_sequences", cls, per_sequence_masked(name), t)
        add(f"{cls.__name__}-empty", cls, lambda name=name: {name: empty()}, t)
    add("RewardStats-token_rewards_masked", O.RewardStats, training("rewards"), t)
    add("ExplainedVariance-mask_all_0", O.ExplainedVariance, training("values", "returns"), t)
    add("ExplainedVariance-one_token", O.ExplainedVariance,
        lambda: {"values": torch.tensor([[1.0, 2.0]]), "returns": torch.tensor([[1.0, 3.0]]),
                 "response_mask": torch.tensor([[1, 0]])}, t)
    # training: lengths, turns, preferences, validation
    add("ResponseLength-empty", lambda: O.ResponseLength(4), lambda: {"response_lengths": empty(LONG)}, t,
        {"max_response_length": 4})
    add("ResponseLength-empty_list", O.ResponseLength, lambda: {"response_lengths": []}, t)
    add("PromptLength-empty", lambda: O.PromptLength(4), lambda: {"prompt_lengths": empty(LONG)}, t,
        {"max_prompt_length": 4})
    add("AbortedRatio-empty", O.AbortedRatio, lambda: {"response_lengths": []}, t)
    add("NumTurns-empty", O.NumTurns, lambda: {"num_turns": empty(LONG)}, t)
    add("NumTurns-empty_list", O.NumTurns, lambda: {"num_turns": []}, t)
    add("DPOMetrics-empty", O.DPOMetrics, lambda: {k: empty() for k in (
        "policy_chosen_logps", "policy_rejected_logps", "reference_chosen_logps", "reference_rejected_logps")}, t)
    add("RewardModelMetrics-empty", O.RewardModelMetrics,
        lambda: {"chosen_scores": empty(), "rejected_scores": empty()}, t)
    val = {"data_sources": ["gsm8k", "math"], "n_samples": 4, "ks": [1, 4]}
    for cls, name in ((O.ValidationAccuracy, "val_acc"), (O.ValidationReward, "val_rewards")):
        def make(cls=cls) -> O.OPBCMetric:
            return cls(["gsm8k", "math"], 4, [1, 4])
        add(f"{cls.__name__}-val_mask_all_false", make, validation(name, mask=True), t, val)
        add(f"{cls.__name__}-zero_prompts", make, validation(name, mask=False), t, val)
        at_k = "acc/pass@4" if cls is O.ValidationAccuracy else "reward/best@4"
        add(f"{cls.__name__}-k_not_reached", make, lambda name=name: {
            name: torch.ones(1, 4, dtype=F64), "data_sources": ["gsm8k"],
            "val_mask": torch.tensor([[True, False, False, False]])}, t, val,
            absent=(f"val-aux/gsm8k/{at_k}", *(k for k in make().keys if "/math/" in k)))
    add("ValidationTurns-val_mask_all_false", O.ValidationTurns,
        lambda: {"val_num_turns": torch.ones(2, 2, dtype=LONG), "val_mask": torch.zeros(2, 2, dtype=torch.bool)}, t)
    add("ValidationTurns-empty", O.ValidationTurns, lambda: {"val_num_turns": empty(LONG)}, t)
    # training: load balance, timing, performance
    add("GlobalSeqlen-empty", O.GlobalSeqlen, lambda: dict(EMPTY_LENGTHS), t)
    add("GlobalSeqlen-empty_rank_ids", lambda: O.GlobalSeqlen(world_size=2),
        lambda: {**EMPTY_LENGTHS, "rank_ids": empty(LONG)}, t, {"world_size": 2})
    add("StageTiming-no_stage_timed", O.StageTiming, lambda: {"timing_s": {}}, t)
    add("StageTiming-lengths_only", O.StageTiming,
        lambda: {"prompt_lengths": torch.tensor([3]), "response_lengths": torch.tensor([4])}, t)
    add("StageTiming-empty_lengths", O.StageTiming, lambda: dict(EMPTY_LENGTHS), t)
    add("Throughput-no_stage_timed", O.Throughput, lambda: {"timing_s": {}, **EMPTY_LENGTHS}, t)
    add("Throughput-lengths_only", O.Throughput,
        lambda: {"prompt_lengths": torch.tensor([3]), "response_lengths": torch.tensor([4])}, t)

    def mfu() -> O.OPBCMetric:
        return O.ModelFlopsUtilization(**FLOPS)

    add("ModelFlopsUtilization-no_stage_timed", mfu, lambda: {"timing_s": {}}, t, FLOPS)
    add("ModelFlopsUtilization-timed_without_lengths", mfu, lambda: {"timing_s": {"update_actor": 1.0}}, t, FLOPS)
    add("ModelFlopsUtilization-timed_empty_lengths", mfu,
        lambda: {"timing_s": {"update_actor": 1.0}, **EMPTY_LENGTHS}, t, FLOPS)
    add("ModelFlopsUtilization-lengths_only", mfu,
        lambda: {"prompt_lengths": torch.tensor([3]), "response_lengths": torch.tensor([4])}, t, FLOPS)
    add("AgentLoopTiming-empty", O.AgentLoopTiming, lambda: {"agent_generate_s": empty()}, t)
    add("AgentLoopTiming-empty_lists", O.AgentLoopTiming, lambda: {"agent_generate_s": [], "agent_tool_calls_s": []},
        t)
    # (defect fixed: without tool-call times the tool_calls keys read 0.0)
    add("AgentLoopTiming-no_tool_times", O.AgentLoopTiming, lambda: {"agent_generate_s": [1.0, 2.0]}, t,
        absent=TOOL_KEYS)
    add("AgentLoopTiming-no_tool_times_tensor", O.AgentLoopTiming,
        lambda: {"agent_generate_s": torch.tensor([1.0, 2.0])}, t, absent=TOOL_KEYS)
    add("AgentLoopSlowest-empty", O.AgentLoopSlowest, lambda: {"agent_generate_s": empty()}, t)
    add("AgentLoopSlowest-empty_lists", O.AgentLoopSlowest,
        lambda: {"agent_generate_s": [], "agent_tool_calls_s": []}, t)
    # controller budget (no section: a collection of the metric)
    for cls in (O.DecisionGroupShare, O.DecisionTokenShare, O.DecisionReasonCount, O.CorrectionTokenShare):
        add(f"{cls.__name__}-no_group", cls, decisions(masked=False), None)
    for cls in (O.DecisionTokenShare, O.CorrectionTokenShare):
        add(f"{cls.__name__}-no_response_token", cls, decisions(masked=True), None)
    return cases


CASES = _cases()


def _alone(case: Case) -> dict[str, torch.Tensor] | None:
    """The metric's keys after one update (None: NoDataError)."""
    metric = case.make()
    metric.update(case.batch())
    try:
        return metric.as_dict(metric.compute())
    except NoDataError:
        return None


def _check_keys(case: Case, got: dict[str, torch.Tensor] | None, where: str) -> None:
    got = got or {}
    if case.absent is None:
        assert not got, f"{where}: values without data: {got}"
    else:
        made_up = {k: got[k] for k in case.absent if k in got}
        assert not made_up, f"{where}: values without data: {made_up}"
        assert got, f"{where}: the keys with data are missing too"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_no_value_without_valid_data(case: Case) -> None:
    keys = set(case.make().keys)
    collection = case.collection()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (unread-field warnings of the collections)
        if case.raises:
            with pytest.raises(ValueError):
                _alone(case)
            with pytest.raises(ValueError):
                case.make()(case.batch())
            with pytest.raises(ValueError):
                collection.update(case.batch())
                collection.compute()
            return
        _check_keys(case, _alone(case), "compute")
        metric = case.make()
        _check_keys(case, metric.as_dict(metric(case.batch())), "forward")
        own = case.collection()
        _check_keys(case, {k: v for k, v in own(case.batch()).items() if k in keys}, "collection forward")
        collection.update(case.batch())
        _check_keys(case, {k: v for k, v in collection.compute().items() if k in keys}, "collection compute")


# compute() of a metric without any data raises NoDataError and forward() returns None; Throughput and
# ModelFlopsUtilization, whose compute decides per key which inputs the window holds, included (they returned {}).
WHOLE = [pytest.param(c, id=c.id) for c in CASES if c.absent is None and not c.raises]


@pytest.mark.parametrize("case", WHOLE)
def test_compute_raises_no_data_error_and_forward_returns_none(case: Case) -> None:
    metric = case.make()
    metric.update(case.batch())
    with pytest.raises(NoDataError):
        metric.compute()
    assert metric.compute_dict() == {}
    assert case.make()(case.batch()) is None


def test_input_health_reports_only_its_zero_counts():
    """InputHealth is the input accounting: its keys (opbc/input/*) report the zero counts of a window without
    valid tokens (allowed: no metric value)."""
    metric = InputHealth()
    metric.update(logprobs_all_masked())
    out = metric.compute()
    assert all(k.startswith("opbc/input/") for k in out)
    assert out["opbc/input/num_tokens"].item() == 0.0


# -- the optional fields of the slowest sample, and logits without a vocabulary ------------------------------------
def test_agent_loop_slowest_without_optional_fields_reports_no_zeros():
    metric = O.AgentLoopSlowest()
    metric.update(agent_generate_s=[1.0, 2.0])
    out = metric.compute()
    assert "timing_s/agent_loop/slowest/generate_sequences" in out
    assert not {"timing_s/agent_loop/slowest/tool_calls", "timing_s/agent_loop/slowest/prompt_length",
                "timing_s/agent_loop/slowest/response_length"} & set(out)


def test_agent_loop_slowest_reports_the_fields_the_slowest_samples_batch_carried():
    """The slowest sample comes from a batch without tool-call times: that key is left out (unknown), the lengths its
    batch carried are reported, and another rank's or batch's fields do not fill it in."""
    metric = O.AgentLoopSlowest()
    metric.update(agent_generate_s=[1.0, 2.0], agent_tool_calls_s=[0.5, 0.0], response_lengths=[10, 20])
    metric.update(agent_generate_s=[9.0], response_lengths=[70], prompt_lengths=[5])
    out = {k.split("/")[-1]: v.item() for k, v in metric.compute().items()}
    assert out == {"generate_sequences": 9.0, "prompt_length": 5.0, "response_length": 70.0}
    metric.update(agent_generate_s=[1.0], agent_tool_calls_s=[20.0])  # slower in total: its own fields only
    out = {k.split("/")[-1]: v.item() for k, v in metric.compute().items()}
    assert out == {"generate_sequences": 1.0, "tool_calls": 20.0}


def test_policy_entropy_refuses_logits_without_a_vocabulary():
    metric = O.PolicyEntropy(from_logits=True)
    with pytest.raises(ValueError, match=r"`logits` has shape \(2, 3, 0\): an empty vocabulary"):
        metric.update(logits=torch.zeros(2, 3, 0))


def test_every_exported_metric_class_has_a_case():
    """A new metric class of the library gets its no-data cases here (input accounting, data_counts = (), always
    reports its zero counts)."""
    from opbc_metrics.metric import registered_metrics

    covered = {type(c.make()) for c in CASES}
    missing = [cls.__name__ for cls in registered_metrics() if cls.__module__.startswith("opbc_metrics.")
               and cls.data_counts != () and cls not in covered]
    assert not missing
