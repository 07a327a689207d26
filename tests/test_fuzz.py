"""Fuzzing every public ``update()`` with hypothesis: hostile shapes, dtypes, values, layouts and devices.

Targets: every registered metric class (tensor metrics and the host-data agent / endpoint metrics), the
``OPBCCollection`` with the default sections and with every section, the controller's ``step`` (and its
budget metrics), and the verl / TRL adapters feeding a collection. Inputs come from
:mod:`tests.fuzz_strategies`: 0-size and 1x1 batches, mismatched shapes, float16/bfloat16/float32/float64
and ints/bools where floats are expected, NaN, +-inf, the -9999 sentinel, +-1e4 log ratios, the float32
minimum as a mask fill, empty masks and fully masked rows, transposed / strided / expanded tensors, and a
field (or the whole batch) on the ``meta`` device standing in for another device.

Every case must end in one of:

(a) a ``ValueError`` / ``TypeError`` whose message names (in backticks) the field that was made
    structurally invalid, or a field that holds hostile values (deferred value checks raise at
    ``compute()``);
(b) a result whose every value is finite, identical (up to float rounding) for contiguous and
    non-contiguous / broadcast inputs holding the same values.

Anything else (an IndexError or RuntimeError from inside torch, a non-finite value, a host-device sync in
``update()``) fails. For the mismatch section the non-finite tokens must also be *counted*
(``opbc/input/nonfinite_count``) and must not move any other key: the values equal those of the same batch
with those tokens (token keys) or their sequences (sequence keys) masked out. For the controller, a group
with a non-finite response token must be rejected and never reach the loss mask.

Set ``OPBC_FUZZ_REPORT=<path>`` to write the number of generated cases run per target (JSON), and
``OPBC_FUZZ_SCALE=<factor>`` to multiply the number of examples of every test.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import opbc_metrics as M
from opbc_metrics import OPBCCollection, OPBCController
from opbc_metrics.collection import SECTIONS
from opbc_metrics.controller import Action
from opbc_metrics.functional.perf import TransformerFlops
from opbc_metrics.glossary import public_metrics
from opbc_metrics.integrations.trl import trl_to_batch
from opbc_metrics.integrations.verl import verl_to_batch
from opbc_metrics.metric import OPBCMetric
from opbc_metrics.testing import assert_no_host_sync
from tests import fuzz_strategies as S
from tests.verl_data import FakeDataProto

# -- bookkeeping: generated cases per target --------------------------------------------------------------
CASES: dict[str, Counter] = defaultdict(Counter)
# OPBC_FUZZ_SCALE=10 runs ten times the examples of every test (the defaults keep the file under ~90 s).
SCALE = float(os.environ.get("OPBC_FUZZ_SCALE", "1"))


def examples(n: int) -> int:
    return max(1, round(n * SCALE))


@pytest.fixture(scope="module", autouse=True)
def _case_report():
    yield
    path = os.environ.get("OPBC_FUZZ_REPORT")
    if path:
        report = {name: dict(c) for name, c in sorted(CASES.items())}
        report["_total"] = dict(sum(CASES.values(), Counter()))
        with open(path, "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)


def field_named(message: str, names: set[str] | list[str]) -> bool:
    """Whether ``message`` names one of ``names`` in backticks (``\\`name\\``` or ``\\`name[i]...``)."""
    return any(re.search(rf"`{re.escape(n)}[`\[]", message) for n in names)


def assert_finite(out: dict[str, Any], where: str) -> None:
    for key, value in out.items():
        assert isinstance(value, torch.Tensor), (where, key, type(value))
        assert bool(torch.isfinite(value).all()), f"{where}: {key} = {value} is not finite"


def pearson_tolerance(batch: dict[str, Any]) -> float:
    """The documented rounding of ``opbc/prob/pearson`` (raw float32 moments: about ``eps * E[p^2] / Var(p)``),
    from the valid tokens' probabilities, with a generous factor."""
    if "trainer_logprobs" not in batch:
        return 1e-5
    mask, bad = bad_tokens(batch)
    keep = (mask & ~bad).numpy()
    if not keep.any():
        return 1e-5
    p = np.exp(np.minimum(batch["trainer_logprobs"].double().numpy()[keep], 0.0))
    q = np.exp(np.minimum(batch["rollout_logprobs"].double().numpy()[keep], 0.0))
    den = math.sqrt(p.var() * q.var())
    scale = ((p * p).mean() + (q * q).mean()) / den if den > 0 else math.inf
    return 1e-5 + 64 * 2.0**-23 * scale


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], where: str, batch: dict[str, Any]) -> None:
    """Equal key sets and values equal up to float rounding (reductions over other layouts may reorder)."""
    assert set(a) == set(b), where
    for key in a:
        x, y = a[key].double(), b[key].double()
        atol = pearson_tolerance(batch) if key.endswith("/pearson") else 1e-9
        assert torch.allclose(x, y, rtol=1e-5, atol=atol), f"{where}: {key}: {x} vs {y}"


def run_outcome(
    target: str,
    fn: Callable[[dict[str, Any]], dict[str, torch.Tensor]],
    case: S.Case,
    aliases: dict[str, tuple[str, ...]] | None = None,
) -> dict[str, torch.Tensor] | None:
    """Run ``fn(case.batch)`` and check outcome (a) or (b); with a structurally valid batch, also run the
    contiguous twin and check equal results. Returns the output (None when it raised)."""
    aliases = aliases or {}
    allowed = set(case.hostile) | ({case.mutated} if case.mutated else set())
    if case.mutated == "*":  # the whole batch on another device: any field of the batch may be named
        allowed |= set(case.plain)
    named = set(allowed)
    for name in allowed:
        named.update(aliases.get(name, ()))
    try:
        out = fn(case.batch)
    except (ValueError, TypeError) as err:
        CASES[target]["error"] += 1
        msg = str(err)
        assert allowed, f"{target}: a structurally valid, finite batch was refused: {type(err).__name__}: {msg}"
        assert field_named(msg, named), f"{target}: the error does not name any of {sorted(named)}: {msg}"
        if case.mutated is None:  # the same values in contiguous memory: the same refusal
            with pytest.raises(type(err)) as again:
                fn(case.plain)
            assert str(again.value) == msg
        return None
    CASES[target]["ok"] += 1
    assert_finite(out, target)
    if case.mutated is None and case.batch is not case.plain:
        assert_same(out, fn(case.plain), f"{target}: contiguous vs non-contiguous/expanded inputs", case.plain)
    return out


def whole_batch_on_meta(case: S.Case) -> S.Case:
    """The case with every tensor field on the ``meta`` device (the metric's states stay on the CPU)."""
    batch = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in case.batch.items()}
    return S.Case(case.plan, batch, case.plain, "*", case.hostile)


# -- targets: every public metric class, its fields read from the class ----------------------------------
LOGPROBS = ("trainer_logprobs", "rollout_logprobs")
DPO = ("policy_chosen_logps", "policy_rejected_logps", "reference_chosen_logps", "reference_rejected_logps")
AGENT_CLASSES = (M.ToolCallJaccard, M.FirstDivergenceStep, M.AnswerMatchRate, M.ToolChoiceDisagreementRate,
                 M.SoftAnswerMatch, M.TrajectoryStepCounts)
ENDPOINT_CLASSES = (M.TokenIdsCoverage, M.SampledLogprobsCoverage, M.TopLogprobsCoverage, M.SeedSupportCoverage,
                    M.EndpointResponseCount)
MAPPING_CLASSES = {M.LRSchedulerState}  # a mapping field: fuzzed in test_fuzz_lr_scheduler_state
BUDGET_CLASSES = {M.DecisionGroupShare, M.DecisionTokenShare, M.DecisionReasonCount, M.CorrectionTokenShare}
NOT_TENSOR_TARGETS = {*AGENT_CLASSES, *ENDPOINT_CLASSES, *MAPPING_CLASSES, *BUDGET_CLASSES}  # own strategies below
# Per-token fields: a metric reading one also reads an optional response_mask.
TOKEN_FIELDS = {*LOGPROBS, "rollout_experts", "rollout_router_logits", "rewards", "advantages", "entropies", "logits",
                "policy_logprobs", "values", "returns", "scores"}
LENGTHS = ("prompt_lengths", "response_lengths")
# Classes that need settings, and second configurations of some (name -> factory).
SETTINGS: dict[str, Callable[[], OPBCMetric]] = {
    "TopGradientMass(exact)": lambda: M.TopGradientMass(exact=True),
    "PerRoundMismatch": lambda: M.PerRoundMismatch(capacity=2),
    "RouterFlipRate": lambda: M.RouterFlipRate(num_layers=4),
    "RouterFlipRate(logits)": lambda: M.RouterFlipRate(num_layers=4, top_k=2),
    "RouterSetDisagreement(logits)": lambda: M.RouterSetDisagreement(top_k=2),
    "SampleMetricStats": lambda: M.SampleMetricStats(["format", "tool_calls"]),
    "PolicyEntropy(logits)": lambda: M.PolicyEntropy(from_logits=True),
    "ResponseLength": lambda: M.ResponseLength(max_response_length=30),
    "PromptLength": lambda: M.PromptLength(max_prompt_length=30),
    "GlobalSeqlen": lambda: M.GlobalSeqlen(world_size=2, max_seqlen=64),
    "StageTiming": lambda: M.StageTiming(world_size=1),
    "Throughput": lambda: M.Throughput(world_size=1),
    "ModelFlopsUtilization": lambda: M.ModelFlopsUtilization(
        TransformerFlops(active_params=1e9, num_layers=2, attention_dim=64), peak_flops=1e12, world_size=1),
    "AgentLoopSlowest": lambda: M.AgentLoopSlowest(world_size=1),
    "ValidationAccuracy": lambda: M.ValidationAccuracy(["gsm8k", "math"], n_samples=2),
    "ValidationReward": lambda: M.ValidationReward(["gsm8k", "math"], n_samples=2),
}
# Optional fields beyond response_mask (and a loss's weight field), by target name.
OPTIONAL = {
    "RouterFlipRate(logits)": ("rollout_experts",), "RouterSetDisagreement(logits)": ("trainer_experts",),
    "DiscardedRolloutStats": ("group_ids", "stop_reasons"), "GlobalSeqlen": ("rank_ids",),
    "StageTiming": LENGTHS, "Throughput": LENGTHS, "ModelFlopsUtilization": LENGTHS,
    "AgentLoopTiming": ("agent_tool_calls_s",), "AgentLoopSlowest": ("agent_tool_calls_s", *LENGTHS),
    "ValidationAccuracy": ("val_mask",), "ValidationReward": ("val_mask",), "ValidationTurns": ("val_mask",),
}


@dataclass
class Target:
    name: str
    make: Callable[[], OPBCMetric]
    fields: tuple[str, ...]
    optional: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return self.name


def target(name: str, make: Callable[[], OPBCMetric]) -> Target:
    """The fields a metric declares (``required_fields``; the timing metrics read ``timing_s``), and its
    optional ones: ``response_mask`` next to a per-token field, a loss's weight field, :data:`OPTIONAL`."""
    metric = make()
    fields = tuple(metric.required_fields) or ("timing_s",)
    optional = ("response_mask",) if TOKEN_FIELDS & set(fields) else ()
    optional += tuple(filter(None, [getattr(metric, "weight_field", None)])) + OPTIONAL.get(name, ())
    return Target(name, make, fields, optional)


TENSOR_TARGETS = [target(c.__name__, SETTINGS.get(c.__name__, c)) for c in public_metrics()
                  if c not in NOT_TENSOR_TARGETS]
TENSOR_TARGETS += [target(name, make) for name, make in SETTINGS.items() if "(" in name]


def test_every_public_metric_class_is_a_fuzz_target():
    covered = {type(t.make()) for t in TENSOR_TARGETS} | NOT_TENSOR_TARGETS
    missing = sorted(c.__name__ for c in public_metrics() if c not in covered)
    assert not missing, f"public metric classes without a fuzz target: {missing}"
    unbuilt = {t.name: f for t in TENSOR_TARGETS for f in t.fields + t.optional if f not in S.BUILDERS}
    assert not unbuilt, f"fields without a builder in tests/fuzz_strategies.py: {unbuilt}"

_JUNK = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10), st.text(max_size=3), st.none(),
    st.lists(st.floats(-1e3, 1e3), max_size=3), st.just(torch.tensor([float("nan"), 1.0])),
    st.just(torch.ones(2, 2)), st.just(torch.tensor(1e-6, device="meta")),
)


@settings(max_examples=examples(40))
@given(state=st.one_of(st.dictionaries(st.sampled_from(["last_lr", "step", "other"]), _JUNK, max_size=3), _JUNK))
def test_fuzz_lr_scheduler_state(state):
    """A clear error naming `lr_scheduler`, or finite values."""
    metric = M.LRSchedulerState(names=("last_lr", "step"))
    CASES["LRSchedulerState"]["cases"] += 1
    try:
        with assert_no_host_sync():
            metric.update(lr_scheduler=state)
        out = metric.compute_dict()
    except (ValueError, TypeError) as err:
        assert "`lr_scheduler`" in str(err), err
        return
    assert all(torch.isfinite(v).all() for v in out.values())


def _update_compute(target: Target) -> Callable[[dict[str, Any]], dict[str, torch.Tensor]]:
    def run(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        metric = target.make()
        with assert_no_host_sync():
            metric.update(batch)
        return metric.compute_dict()

    return run


@pytest.mark.parametrize("target", TENSOR_TARGETS, ids=repr)
@pytest.mark.filterwarnings("ignore:.*longer than max_seqlen")  # GlobalSeqlen's documented overflow warning
@settings(max_examples=examples(20), suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_metric_update(target: Target, data: st.DataObject):
    plan = data.draw(S.plans(target.fields + target.optional), label="plan")
    case = S.build_case(plan, target.fields, target.optional)
    CASES[target.name]["cases"] += 1
    run_outcome(target.name, _update_compute(target), case)


@pytest.mark.parametrize("target", TENSOR_TARGETS, ids=repr)
def test_every_mutation_of_every_field_and_the_whole_batch_on_meta(target: Target):
    """Deterministic sweep: each structural mutation (extra/missing dim, other size, int/bool/float/complex
    dtype, meta device, list, string, absent) of each field, on a fixed 3x4 batch with every optional
    field present: a clear error naming the field, or finite results. Then every tensor of the batch on
    ``meta`` while the metric's states are on the CPU."""
    plan = S.Plan(seed=7, b=3, t=4, dtype=torch.float32, specials=(), rate=0.0, mask_kind="random")
    run = _update_compute(target)
    fields = target.fields + target.optional
    for name in fields:
        for kind in S.MUTATIONS:
            mutated = S.Plan(**{**plan.__dict__, "mutation": (name, kind)})
            case = S.build_case(mutated, fields)
            CASES[target.name + "/sweep"]["cases"] += 1
            run_outcome(target.name + "/sweep", run, case)
    case = whole_batch_on_meta(S.build_case(S.Plan(**{**plan.__dict__, "seed": 1}), target.fields, target.optional))
    CASES[target.name + "/meta"]["cases"] += 1
    run_outcome(target.name + "/meta", run, case)


# -- the collection: the default sections (with the non-finite accounting checked), and every section -----
MOE_FIELDS = ("rollout_experts", "trainer_experts")
TOKEN_KEYS = (
    "opbc/is/ess", "opbc/is/second_moment", "opbc/is/weight_mean", "opbc/is/top_1pct_gradient_mass",
    "opbc/is/clipped_fraction", "opbc/is/veto_fraction", "opbc/logprob/abs_diff_mean", "opbc/logprob/abs_diff_max",
    "opbc/logprob/diff_mean", "opbc/log_ratio/min", "opbc/log_ratio/max", "opbc/log_ratio/max_abs", "opbc/kl/k1",
    "opbc/kl/k2", "opbc/kl/k3", "opbc/kl/chi2_token", "opbc/prob/abs_diff_mean", "opbc/prob/abs_diff_max",
    "opbc/prob/pearson", "opbc/is/weight_std", "opbc/prob/diff_std", "opbc/input/num_tokens",
)
SEQUENCE_KEYS = (
    "opbc/is/seq_ess", "opbc/sequence/log_ratio_mean", "opbc/sequence/log_ratio_abs_mean",
    "opbc/sequence/log_ratio_max_abs", "opbc/sequence/geo_log_ratio_mean", "opbc/kl/chi2_seq",
    "opbc/ppl/log_ppl_diff", "opbc/ppl/log_ppl_abs_diff", "opbc/ppl/ratio", "opbc/input/num_sequences",
)


def bad_tokens(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(response mask, non-finite response tokens)``: a token whose log ratio is not finite in the documented
    compute dtype (float64 if either side is, else float32), independently of the library."""
    t, r = batch["trainer_logprobs"], batch["rollout_logprobs"]
    dt = torch.float64 if torch.float64 in (t.dtype, r.dtype) else torch.float32
    mask = batch.get("response_mask")
    mask = torch.ones(t.shape, dtype=torch.bool) if mask is None else mask != 0
    return mask, mask & ~torch.isfinite(t.to(dt) - r.to(dt))


def _collection_run(sections: tuple[str, ...], adapter: Callable[[Any], Any] = lambda batch: batch):
    def run(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        metrics = OPBCCollection(sections=sections)
        with assert_no_host_sync():  # neither the adapter nor the update
            metrics.update(adapter(batch))
        return metrics.compute()

    return run


@settings(max_examples=examples(100), suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_collection_default_sections_counts_nonfinite_without_poisoning(data: st.DataObject):
    """OPBCCollection() (mismatch, moe, per_round, agent, endpoint): outcome (a) or (b); with valid
    structure, non-finite tokens are counted in opbc/input/nonfinite_count and every other key equals the
    value of the same batch with those tokens (token keys) or their sequences (sequence keys) masked out."""
    plan = data.draw(S.plans((*LOGPROBS, "response_mask", *MOE_FIELDS)), label="plan")
    case = S.build_case(plan, LOGPROBS, ("response_mask", *MOE_FIELDS))
    CASES["OPBCCollection(default)"]["cases"] += 1
    run = _collection_run(M.collection.DEFAULT_SECTIONS)
    if run_outcome("OPBCCollection(default)", run, case) is None or case.mutated is not None:
        return
    out = run(case.plain)  # the reference twins below are contiguous too: results must be bit-identical
    _assert_nonfinite_accounting(out, case.plain)


def _assert_nonfinite_accounting(out: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    """The non-finite tokens of ``plain`` are counted, and every other key of the default collection's ``out`` is
    that of the same batch without them (token keys) or without their sequences (sequence keys)."""
    mask, bad = bad_tokens(plain)
    assert out["opbc/input/nonfinite_count"].item() == bad.sum().item()
    assert out["opbc/input/num_tokens"].item() == (mask & ~bad).sum().item()
    # Token keys: as if the non-finite tokens were masked out. Sequence keys: as if their sequences were.
    token_masked = dict(plain, response_mask=mask & ~bad)
    row_masked = dict(plain, response_mask=mask & ~bad.any(dim=1, keepdim=True))
    for keys, twin in ((TOKEN_KEYS, token_masked), (SEQUENCE_KEYS, row_masked)):
        ref = OPBCCollection(sections=("mismatch",))
        ref.update(twin)
        expected = ref.compute()
        for key in keys:  # a key is missing exactly when its twin saw no data either
            assert (key in out) == (key in expected), key
            if key in expected:
                assert torch.equal(out[key], expected[key]), (key, out[key], expected[key])
    # per_round: every response token (finite or not) is in exactly one round's count (no valid token: no keys).
    counts = [v.item() for k, v in out.items() if k.startswith("per_round/") and k.endswith("token_count")]
    assert sum(counts) == (mask.sum().item() if (mask & ~bad).any() else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nonfinite_tokens_beside_clean_rows_are_counted_without_poisoning(dtype):
    """The fuzz test above on a fixed batch that surely has what it checks (its draws rarely do: a few of 100):
    NaN, +inf and -inf response tokens in some rows, clean rows beside them, a masked-out NaN."""
    g = torch.Generator().manual_seed(21)
    trainer = -torch.rand(5, 16, generator=g, dtype=torch.float64) * 3
    rollout = (trainer - torch.randn(5, 16, generator=g, dtype=torch.float64) * 0.3).clamp(max=0.0)  # logprobs <= 0
    mask = torch.ones(5, 16, dtype=torch.bool)
    mask[:, 13:] = False
    mask[4, 2:6] = False  # row 4: two rounds
    trainer[1, 3], rollout[2, 5], trainer[2, 9] = float("nan"), float("inf"), float("-inf")
    trainer[3, 14] = float("nan")  # masked out: not counted, row 3 stays clean
    plain = {"trainer_logprobs": trainer.to(dtype), "rollout_logprobs": rollout.to(dtype), "response_mask": mask}
    out = _collection_run(M.collection.DEFAULT_SECTIONS)(plain)
    assert out["opbc/input/nonfinite_count"].item() == 3
    _assert_nonfinite_accounting(out, plain)


ALL_OPTIONAL = (
    "response_mask", *MOE_FIELDS, "group_ids", "rewards", "advantages", "values", "returns", "prompt_lengths",
    "response_lengths", "stop_reasons", "discard_reasons", "policy_logprobs", "old_logprobs", "entropies",
    "actor_loss", "loss_tokens", "actor_grad_norm", "num_turns", "timing_s", "agent_generate_s",
)


@settings(max_examples=examples(60), suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_collection_every_section(data: st.DataObject):
    """Every section at once, with random subsets of the optional fields of the rollout and training
    sections: outcome (a) or (b)."""
    plan = data.draw(S.plans((*LOGPROBS, *ALL_OPTIONAL)), label="plan")
    case = S.build_case(plan, LOGPROBS, ALL_OPTIONAL)
    CASES["OPBCCollection(all sections)"]["cases"] += 1
    run_outcome("OPBCCollection(all sections)", _collection_run(tuple(SECTIONS)), case)


# -- the controller: step / evaluate, its trainer outputs, decisions and budget metrics -------------------
CONTROLLER_OPTIONAL = ("response_mask", "policy_lag", *MOE_FIELDS, "rollout_token_ids", "trainer_token_ids")
CONTROLLER_BUILDERS = {"group_ids": S.int_group_ids, "policy_lag": S.lag_or_number}
_REPORT_FLOATS = ("ess", "seq_ess", "second_moment", "weight_mean", "clipped_fraction", "veto_fraction",
                  "max_abs_log_ratio", "seq_log_ratio_mean", "seq_log_ratio_abs_mean", "seq_log_ratio_max_abs",
                  "geo_log_ratio_mean", "top_1pct_gradient_mass")


def _controller_run(case: S.Case) -> Callable[[dict[str, Any]], dict[str, torch.Tensor]]:
    def run(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        controller = OPBCController("default")
        with assert_no_host_sync():
            out = controller.step(batch)
        decisions = out.decisions  # the one device-to-host copy
        assert out.loss_mask.dtype == torch.bool and out.weights.shape == out.loss_mask.shape
        if case.mutated is None:
            assert out.loss_mask.shape == batch["trainer_logprobs"].shape
        assert bool(torch.isfinite(out.weights).all()) and bool((out.weights >= 0).all())
        assert not bool(out.weights[~out.loss_mask].any()), "a weight outside the loss mask"
        if case.mutated is None:
            mask, bad = bad_tokens(batch)
            assert not bool((out.loss_mask & ~(mask & ~bad)).any()), "a masked or non-finite token reached the loss"
            ids = batch["group_ids"].tolist()
            bad_groups = {g for g, row in zip(ids, bad.any(dim=1).tolist()) if row}
            lag_hostile = "policy_lag" in case.hostile
            for d in decisions:
                if d.group_id in bad_groups:
                    assert d.action is Action.REJECT and "non_finite" in [r.value for r in d.reasons], d
                for name in _REPORT_FLOATS:  # None exactly when the group had nothing to measure it on
                    value = getattr(d.report, name)
                    seq = name.startswith(("seq_", "geo_"))
                    measured = d.report.num_valid_sequences if seq else d.report.num_tokens
                    assert (value is None) == (measured == 0), (name, d.report)
                    assert value is None or math.isfinite(value), (name, d.report)
                flip = d.report.router_flip_rate
                assert flip is None or 0.0 <= flip <= 1.0, d.report
                lag = d.report.policy_lag
                assert lag is None or math.isfinite(lag) or lag_hostile, d.report
        budget = controller.compute_budget()
        return {**budget, "loss_mask": out.loss_mask.double(), "weights": out.weights.double(),
                "row_action": out.row_action.double()}

    return run


@settings(max_examples=examples(100), suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_controller_step(data: st.DataObject):
    """OPBCController.step: a clear error naming the field, or decisions where every group holding a
    non-finite response token is rejected, no masked or non-finite token reaches the loss mask, weights are
    finite, reports finite, and the budget metrics finite; the same for non-contiguous inputs."""
    fields = (*LOGPROBS, "group_ids")
    plan = data.draw(S.plans(fields + CONTROLLER_OPTIONAL), label="plan")
    case = S.build_case(plan, fields, CONTROLLER_OPTIONAL, builders=CONTROLLER_BUILDERS)
    CASES["OPBCController.step"]["cases"] += 1
    run_outcome("OPBCController.step", _controller_run(case), case)


@pytest.mark.parametrize("target,seed,fields,optional,run,match", [
    ("OPBCCollection(all sections)", 3, LOGPROBS, ("response_mask", *MOE_FIELDS, "rewards"),
     _collection_run(tuple(SECTIONS)), r"`trainer_logprobs`.* are on meta"),
    ("OPBCController.step", 5, (*LOGPROBS, "group_ids"), ("response_mask",), lambda batch: OPBCController().step(batch),
     "are on meta"),
], ids=["collection", "controller"])
def test_whole_batch_on_another_device_is_a_clear_error(target, seed, fields, optional, run, match):
    plan = S.Plan(seed=seed, b=3, t=4, dtype=torch.float32, specials=(), rate=0.0, mask_kind="random")
    case = whole_batch_on_meta(S.build_case(plan, fields, optional, builders=CONTROLLER_BUILDERS))
    CASES[target + "/meta"]["cases"] += 1
    with pytest.raises(ValueError, match=match + " but the states of .* are on cpu"):
        run(case.batch)


def _decisions(plan: S.Plan) -> Any:
    case = S.build_case(plan, (*LOGPROBS, "group_ids"), ("response_mask",), builders=CONTROLLER_BUILDERS)
    return OPBCController(track_budget=False).evaluate(case.plain)


@pytest.mark.parametrize("cls", sorted(BUDGET_CLASSES, key=lambda c: c.__name__), ids=lambda c: c.__name__)
@settings(max_examples=examples(10), suppress_health_check=[HealthCheck.too_slow])
@given(plan=S.plans((*LOGPROBS, "response_mask"), mutate=False),
       form=st.sampled_from(("decisions", "mapping", "none", "string", "tensor", "list")))
def test_fuzz_budget_metric_update(cls: type[OPBCMetric], plan: S.Plan, form: str):
    """The budget metrics take the BatchDecisions of a step (or a mapping holding it) and nothing else."""
    CASES[cls.__name__]["cases"] += 1
    decisions = _decisions(plan)
    value = {"decisions": decisions, "mapping": decisions, "none": None, "string": "decisions",
             "tensor": torch.zeros(3), "list": [decisions]}[form]
    metric = cls()
    try:
        with assert_no_host_sync():
            metric.update({"opbc_decisions": value} if form != "decisions" else value)
    except (ValueError, TypeError) as err:
        CASES[cls.__name__]["error"] += 1
        assert form not in ("decisions", "mapping"), err
        assert field_named(str(err), ["opbc_decisions"]), err
        return
    CASES[cls.__name__]["ok"] += 1
    assert form in ("decisions", "mapping")
    assert_finite(metric.compute_dict(), cls.__name__)


# -- framework adapters feeding a collection --------------------------------------------------------------
ADAPTER_SECTIONS = ("mismatch", "moe", "per_round", "rollout")
VERL_ALIASES = {
    "old_log_probs": ("trainer_logprobs",),
    "rollout_log_probs": ("rollout_logprobs",),
    "response_mask": ("trainer_logprobs", "rollout_logprobs"),
    "attention_mask": ("response_mask", "prompt_lengths", "response_lengths", "responses"),
    "responses": ("response_mask", "attention_mask"),
    "uid": ("group_ids",),
    "token_level_rewards": ("rewards",),
}
TRL_ALIASES = {
    "old_per_token_logps": ("trainer_logprobs",),
    "sampling_per_token_logps": ("rollout_logprobs",),
    "completion_mask": ("response_mask", "response_lengths", "tool_mask", "trainer_logprobs", "rollout_logprobs"),
    "tool_mask": ("response_mask", "completion_mask"),
    "prompt_mask": ("prompt_lengths",),
}


@settings(max_examples=examples(60), suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), wrap=st.booleans())
def test_fuzz_verl_adapter_into_collection(data: st.DataObject, wrap: bool):
    fields = ("old_log_probs", "rollout_log_probs")
    optional = ("response_mask", "responses", "attention_mask", "uid", "token_level_rewards", "advantages")
    plan = data.draw(S.plans(fields + optional), label="plan")
    case = S.build_case(plan, fields, optional)
    CASES["verl_to_batch -> OPBCCollection"]["cases"] += 1

    def adapter(batch: dict[str, Any]) -> dict[str, Any]:
        if wrap:
            uid = batch.get("uid")
            batch = FakeDataProto({k: v for k, v in batch.items() if k != "uid"}, {} if uid is None else {"uid": uid})
        return verl_to_batch(batch)

    run = _collection_run(ADAPTER_SECTIONS, adapter)
    run_outcome("verl_to_batch -> OPBCCollection", run, case, aliases=VERL_ALIASES)


@settings(max_examples=examples(60), suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), num_generations=st.sampled_from((None, 1, 2, 3, 0, -1, 2.0)),
       process_index=st.sampled_from((0, 0, 1, -1)))
def test_fuzz_trl_adapter_into_collection(data: st.DataObject, num_generations: Any, process_index: int):
    fields = ("old_per_token_logps", "sampling_per_token_logps", "completion_mask")
    optional = ("tool_mask", "prompt_mask", "advantages")
    plan = data.draw(S.plans(fields + optional), label="plan")
    case = S.build_case(plan, fields, optional)
    if num_generations is not None:  # an invalid argument is as hostile as an invalid field
        if not (isinstance(num_generations, int) and num_generations >= 1):
            case.hostile.add("num_generations")
        elif process_index < 0:
            case.hostile.add("process_index")
    CASES["trl_to_batch -> OPBCCollection"]["cases"] += 1
    run = _collection_run(ADAPTER_SECTIONS, lambda batch: trl_to_batch(
        batch, num_generations=num_generations, process_index=process_index))
    run_outcome("trl_to_batch -> OPBCCollection", run, case, aliases=TRL_ALIASES)


# -- host-data metrics: agent trajectories and endpoint responses -----------------------------------------

def _host_outcome(target: str, classes: tuple[type[OPBCMetric], ...], batch: dict[str, Any], fields: list[str]):
    """Every class of a host-data section, and the section inside a collection, on one batch: all raise
    the same clear error naming one of ``fields``, or all return finite values (fractions in [0, 1])."""
    CASES[target]["cases"] += 1
    outcomes = []
    makers: list[Callable[[], Any]] = list(classes)
    if batch[fields[0]] is not None:  # (a collection skips a batch without the field)
        makers.append(lambda: OPBCCollection(sections=("agent", "endpoint")))
    for make in makers:
        metric = make()
        try:
            metric.update(batch)
            out = metric.compute_dict() if isinstance(metric, OPBCMetric) else metric.compute()
        except (ValueError, TypeError) as err:
            assert field_named(str(err), fields), f"{target}: the error does not name any of {fields}: {err}"
            outcomes.append(str(err))
            continue
        assert_finite(out, target)
        for key, value in out.items():
            if not key.endswith(("num_pairs", "num_responses", "_step_mean", "_step_min", "rollout_mean",
                                 "reference_mean")):
                assert 0.0 <= value.item() <= 1.0, (key, value)
        outcomes.append("ok")
    assert len(set(outcomes)) == 1, f"{target}: members disagree: {outcomes}"
    CASES[target]["ok" if outcomes[0] == "ok" else "error"] += 1


def _call(arguments: Any) -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": None,
             "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": arguments}}]}]


@settings(max_examples=examples(120), suppress_health_check=[HealthCheck.too_slow])
@given(pairs=S.TRAJECTORY_PAIRS)
@example(pairs=[(_call(S.Nested(5000)), _call("{}"))])  # parsed arguments nested past the recursion limit
@example(pairs=[(_call("[" * 5000 + "]" * 5000), _call(S.Opaque()))])  # nested JSON text; unserialisable value
@example(pairs=[(_call({1: "a", "b": 2}), _call(float("nan")))])  # keys that do not sort; NaN
def test_fuzz_agent_trajectory_pairs(pairs: Any):
    """Random chat transcripts (wrong roles and types, malformed / non-serialisable / deeply nested tool
    arguments, bad pairs): a ValueError naming ``trajectory_pairs`` or finite metrics."""
    _host_outcome("agent (trajectory_pairs)", AGENT_CLASSES, {"trajectory_pairs": pairs}, ["trajectory_pairs"])


_CHAT = {"object": "chat.completion", "system_fingerprint": "fp", "choices": [{"message": {"content": "hi"}}]}


@settings(max_examples=examples(120), suppress_health_check=[HealthCheck.too_slow])
@given(responses=S.ENDPOINT_RESPONSES, data=st.data())
def test_fuzz_endpoint_responses(responses: Any, data: st.DataObject):
    """Random OpenAI-compatible responses and request bodies: a ValueError naming ``endpoint_responses`` or
    ``endpoint_requests``, or coverage fractions in [0, 1]."""
    requests = data.draw(S.endpoint_requests(responses), label="requests")
    _endpoint_case(responses, requests)


@pytest.mark.parametrize("requests", [[5], [{"seed": "7"}], {"seed": True}, 5, [None, None]],
                         ids=["junk body", "string seed", "bool seed", "not a body", "too many"])
def test_a_bad_request_body_is_named_as_such(requests: Any):
    with pytest.raises(ValueError, match=r"`endpoint_requests"):
        M.SeedSupportCoverage().update(endpoint_responses=[_CHAT], endpoint_requests=requests)
    _endpoint_case([_CHAT], requests)


def _endpoint_case(responses: Any, requests: Any) -> None:
    batch = {"endpoint_responses": responses, "endpoint_requests": requests}
    _host_outcome("endpoint (endpoint_responses)", ENDPOINT_CLASSES, batch,
                  ["endpoint_responses", "endpoint_requests"])


# -- regression cases: one per bug the fuzzer found (each failed before its fix) --------------------------
NAN, INF, F32_MIN = S.NAN, S.INF, S.F32_MIN


def test_float32_minimum_sentinel_keeps_mismatch_values_finite():
    """finfo(float32).min as a logprob (a masked_fill value): r = 3.4e38 is finite, but float32 row sums of
    two such tokens overflowed to inf, and the min/max fill turned into NaN."""
    t = torch.full((2, 3), -1.0)
    r = torch.full((2, 3), F32_MIN)
    metrics = OPBCCollection(sections=("mismatch", "per_round"))
    metrics.update(trainer_logprobs=t, rollout_logprobs=r)
    out = metrics.compute()
    assert_finite(out, "finfo.min sentinel")
    assert out["opbc/is/veto_fraction"].item() == 1.0 and out["opbc/input/nonfinite_count"].item() == 0
    assert out["opbc/log_ratio/max"].item() == pytest.approx(-1.0 - F32_MIN, rel=1e-6)
    assert out["opbc/sequence/log_ratio_max_abs"].item() == pytest.approx(3 * (-1.0 - F32_MIN), rel=1e-6)
    decisions = OPBCController().step(trainer_logprobs=t, rollout_logprobs=r, group_ids=torch.tensor([0, 1]))
    assert all(math.isfinite(d.report.seq_log_ratio_max_abs) for d in decisions.decisions)


def test_a_log_ratio_that_overflows_is_counted_as_non_finite_everywhere():
    """Finite logprobs whose difference overflows float32 (+3e38 vs -3e38): the fused kernel dropped the
    token, while the per-round and controller statistics (BatchView) kept r = inf."""
    t = torch.tensor([[3e38, -1.0]])
    r = torch.tensor([[-3e38, -1.5]])
    metrics = OPBCCollection(sections=("mismatch", "per_round"))
    metrics.update(trainer_logprobs=t, rollout_logprobs=r)
    out = metrics.compute()
    assert_finite(out, "overflowing log ratio")
    assert out["opbc/input/nonfinite_count"].item() == 1
    assert out["per_round/round_0_abs_diff_mean"].item() == pytest.approx(0.5)
    (decision,) = OPBCController().step(trainer_logprobs=t, rollout_logprobs=r, group_ids=torch.tensor([3])).decisions
    assert decision.action is Action.REJECT and math.isfinite(decision.report.max_abs_log_ratio)


def test_perplexity_ratio_of_a_sentinel_is_finite_and_capped():
    """A -9999 sentinel made mean exp(d_i) overflow to inf; the ratio now caps d_i at 600 nats, where exp
    stays finite, and equals mean exp(d_i) below the cap (e.g. d_i = 30, beyond the clamp C = 20)."""
    t = torch.tensor([[-9999.0, -1.0], [-1.0, -2.0], [-61.0, -1.0]], dtype=torch.float64)
    r = torch.tensor([[-1.0, -1.0], [-1.5, -2.0], [-1.0, -1.0]], dtype=torch.float64)
    out = M.functional.perplexity_gap(t, r)
    d = [(-1.0 - 1.0) / 2 - (-9999.0 - 1.0) / 2, (-1.5 - 2.0) / 2 - (-1.0 - 2.0) / 2, 30.0]  # 4999, -0.25, 30
    expected = (math.exp(600.0) + math.exp(d[1]) + math.exp(d[2])) / 3
    assert out["opbc/ppl/ratio"].item() == pytest.approx(expected, rel=1e-12)
    assert out["opbc/ppl/log_ppl_diff"].item() == pytest.approx(sum(d) / 3, rel=1e-12)


@pytest.mark.parametrize("cls,field", [(M.KLCoef, "kl_coef"), (M.ActorLoss, "actor_loss"),
                                       (M.RMGradNorm, "rm_grad_norm")])
def test_non_finite_trainer_scalar_tensors_are_counted_not_averaged(cls, field):
    """A NaN 0-d or 1-D tensor scalar came out as a NaN mean; host values were already refused."""
    metric = cls()
    with assert_no_host_sync():
        metric.update({field: torch.tensor([1.0, float("nan"), 3.0])})
        metric.update({field: torch.tensor(2.0)})
    with pytest.raises(ValueError, match=rf"`{field}`.* held 1 invalid value\(s\) \(non-finite"):
        metric.compute()
    clean = cls()
    clean.update({field: torch.tensor([1.0, 3.0])})
    assert clean.compute().item() == 2.0


@pytest.mark.parametrize(
    "make,batch,bad",
    [
        (M.DPOMetrics, {f: torch.zeros(2) for f in DPO} | {DPO[3]: torch.tensor([0.0, NAN])}, DPO[3]),
        (M.RewardModelMetrics, {"chosen_scores": torch.zeros(2), "rejected_scores": torch.tensor([INF, 0.0])},
         "rejected_scores"),
        (M.PPOKL, {"policy_logprobs": torch.zeros(1, 2), "old_logprobs": torch.tensor([[0.0, NAN]])}, "old_logprobs"),
        (M.PolicyClipFraction, {"policy_logprobs": torch.zeros(1, 2), "old_logprobs": torch.zeros(1, 2),
                                "advantages": torch.tensor([NAN])}, "advantages"),
        (M.ExplainedVariance, {"returns": torch.zeros(1, 2), "values": torch.tensor([[0.0, NAN]])}, "values"),
        (M.AgentLoopTiming, {"agent_generate_s": [1.0], "agent_tool_calls_s": torch.tensor([-1.0])},
         "agent_tool_calls_s"),
        (lambda: M.GlobalSeqlen(world_size=1), {"prompt_lengths": torch.tensor([-3]),
                                                "response_lengths": torch.tensor([2])}, "prompt_lengths"),
        # negative tensor loss weights are counted
        (M.ActorLoss, {"actor_loss": torch.tensor([1.0, 2.0]), "loss_tokens": torch.tensor([3.0, -1.0])},
         "actor_loss`, `loss_tokens"),
    ],
)
def test_a_count_shared_by_several_fields_names_them_all(make, batch, bad):
    """The deferred error of a count shared by several fields named only the first of them."""
    metric = make()
    metric.update(batch)
    with pytest.raises(ValueError, match=rf"`{bad}`"):
        metric.compute()


META = torch.device("meta")
ONES2, ONES23, ZEROS12 = torch.ones(2), torch.ones(2, 3), torch.zeros(1, 2)


@pytest.mark.parametrize(
    "make,batch,match",
    # each batch with its one field `name` moved to meta
    [(make, {**batch, name: batch[name].to(META)}, rf"`{name}` is on meta") for make, batch, name in [
        (M.PolicyEntropy, {"entropies": ONES23, "response_mask": ONES23}, "response_mask"),
        (M.RewardStats, {"rewards": ONES23, "response_mask": ONES23}, "response_mask"),
        (M.PolicyClipFraction, {"policy_logprobs": ZEROS12, "old_logprobs": ZEROS12, "advantages": torch.zeros(1)},
         "advantages"),
        (M.DPOMetrics, {f: torch.zeros(2) for f in DPO}, DPO[2]),
        (M.ActorLoss, {"actor_loss": ONES2, "loss_tokens": ONES2}, "loss_tokens"),
        (lambda: M.ValidationAccuracy(["a"]), {"val_acc": ONES2, "data_sources": "a", "val_mask": ONES2}, "val_mask"),
        (M.ValidationTurns, {"val_num_turns": ONES2, "val_mask": ONES2}, "val_mask"),
        (lambda: M.GlobalSeqlen(world_size=2), {"prompt_lengths": ONES2, "response_lengths": ONES2,
                                                "rank_ids": torch.zeros(2, dtype=torch.long)}, "rank_ids"),
        (M.TotalTokenStats, {"prompt_lengths": ONES2, "response_lengths": ONES2}, "response_lengths"),
        (M.AgentLoopTiming, {"agent_generate_s": ONES2, "agent_tool_calls_s": ONES2}, "agent_tool_calls_s"),
    ]] + [
        # an IndexError (sum of an empty list) when only the optional tool-call times were given
        (M.AgentLoopTiming, {"agent_tool_calls_s": [1.0]}, r"`agent_generate_s` is required"),
        # a tensor inside a per-sample mapping raised torch's 'only one element tensors...' (and float() of a
        # device tensor is a host sync)
        (lambda: M.SampleMetricStats(["format"], group_gini=False),
         {"sample_metrics": [{"format": torch.tensor([1.0, 2.0])}]},
         r"`sample_metrics`\[0\]\['format'\] must be a number"),
        (lambda: M.ValidationAccuracy(["a"]), {"val_acc": ONES2, "data_sources": ["a"]},
         r"`data_sources` has 1 entries but `val_acc` has 2 prompts"),
        # per-sample tool-call times of another length than the generation times (misaligned samples) were taken
        (M.AgentLoopTiming, {"agent_generate_s": [1.0, 2.0], "agent_tool_calls_s": [0.5]},
         r"`agent_tool_calls_s` has shape \(1,\) but `agent_generate_s` has shape \(2,\)"),
    ] + [(make, batch, r"are on meta but the states of") for make, batch in [
        # host lists next to device tensors go to the tensors' device (no field-versus-field device error); the
        # only refusal left is the whole batch being elsewhere than the metric's states
        (M.PolicyEntropy, {"entropies": [[0.5, 1.0]], "response_mask": torch.ones(1, 2, device=META)}),
        (M.PPOKL, {"policy_logprobs": [[-1.0, -2.0]], "old_logprobs": torch.zeros(1, 2, device=META)}),
        (M.ExplainedVariance, {"values": [[1.0, 2.0]], "returns": torch.ones(1, 2, device=META)}),
        (M.DPOMetrics, {DPO[0]: torch.zeros(2, device=META), DPO[1]: [0.0, 1.0], DPO[2]: [0.0, 0.0],
                        DPO[3]: [1.0, 0.0]}),
        (M.ActorLoss, {"actor_loss": torch.ones(2, device=META), "loss_tokens": [3, 4]}),
        (lambda: M.ValidationAccuracy(["a"], n_samples=2),
         {"val_acc": [[1.0, 0.0]], "data_sources": "a", "val_mask": torch.ones(1, 2, device=META)}),
        (M.ValidationTurns, {"val_num_turns": torch.ones(1, 2, device=META), "val_mask": [[1, 0]]}),
        (lambda: M.GlobalSeqlen(world_size=1),
         {"prompt_lengths": [3, 4], "response_lengths": torch.ones(2, device=META)}),
        (M.AgentLoopTiming, {"agent_generate_s": torch.ones(2, device=META), "agent_tool_calls_s": [1, 2]}),
    ]],
)
def test_a_bad_field_is_a_clear_error_at_update(make, batch, match):
    """Fields on another device were moved silently (a hidden copy; on meta a crash inside torch) or mixed
    devices; the other cases crashed inside torch or Python."""
    with pytest.raises(ValueError, match=match):
        make().update(batch)


@pytest.mark.parametrize("field", ["policy_lag", "trainer_experts", "rollout_token_ids"])
def test_controller_fields_on_another_device_are_a_clear_error(field):
    """policy_lag was moved (a crash on meta), expert and token ids crashed inside torch."""
    t = torch.zeros(2, 3)
    batch = {"trainer_logprobs": t, "rollout_logprobs": t - 0.1, "group_ids": torch.tensor([0, 1]),
             "policy_lag": torch.zeros(2), "rollout_experts": torch.zeros(2, 3, 2, 1, dtype=torch.long),
             "trainer_experts": torch.zeros(2, 3, 2, 1, dtype=torch.long),
             "rollout_token_ids": torch.zeros(2, 3, dtype=torch.long),
             "trainer_token_ids": torch.zeros(2, 3, dtype=torch.long)}
    batch[field] = batch[field].to(META)
    with pytest.raises(ValueError, match=rf"`{field}` is on meta"):
        OPBCController().step(batch)


def test_adapter_group_id_errors_name_the_field():
    t = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"verl field `uid`"):
        verl_to_batch({"old_log_probs": t, "rollout_log_probs": t, "uid": torch.zeros(2, 2, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"`group_ids`"):
        trl_to_batch({"old_per_token_logps": t, "sampling_per_token_logps": t, "completion_mask": torch.ones(2, 3)},
                     group_ids=object())
    with pytest.raises(ValueError, match=r"TRL field `tool_mask` is on meta"):
        trl_to_batch({"old_per_token_logps": t, "sampling_per_token_logps": t, "completion_mask": torch.ones(2, 3),
                      "tool_mask": torch.ones(2, 3, device=META)})


def test_verl_token_rewards_are_summed_without_float32_overflow():
    t = torch.zeros(1, 3)
    out = verl_to_batch({"old_log_probs": t, "rollout_log_probs": t,
                         "token_level_rewards": torch.full((1, 3), F32_MIN)})
    assert out["rewards"].dtype == torch.float64 and math.isfinite(out["rewards"].item())
    assert out["rewards"].item() == pytest.approx(3 * F32_MIN)


@pytest.mark.parametrize("cls,field", [(M.ValidationAccuracy, "val_acc"), (M.ValidationReward, "val_rewards")])
def test_non_finite_validation_values_are_counted(cls, field):
    """NaN validation scores were dropped silently (neither used nor counted)."""
    metric = cls(["a"], n_samples=2)
    with assert_no_host_sync():
        metric.update({field: torch.tensor([[1.0, float("nan")], [0.0, 1.0]]), "data_sources": "a"})
    with pytest.raises(ValueError, match=rf"`{field}` held 1 invalid value\(s\) \(non-finite"):
        metric.compute()
    masked = cls(["a"], n_samples=2)  # under val_mask = 0 the value is not a sample: no error
    masked.update({field: torch.tensor([[1.0, float("nan")]]), "data_sources": "a",
                   "val_mask": torch.tensor([[1, 0]])})
    assert_finite(masked.compute(), cls.__name__)


def test_agent_section_leaves_out_the_tool_choice_rate_for_pairs_without_tool_calls():
    """Pairs without any tool call have no tool-choice disagreement rate (0 / 0): the key is left out, not 0 (a
    made-up value); every other agent key is there."""
    pair = ([{"role": "assistant", "content": "42"}], [{"role": "assistant", "content": "41"}])
    metrics = OPBCCollection(sections=("agent",))
    metrics.update(trajectory_pairs=[pair])
    out = metrics.compute()
    assert "agent/steps/tool_choice_disagreement_rate" not in out
    assert {k for k in out} == {k for cls in AGENT_CLASSES for k in cls.keys} - {
        "agent/steps/tool_choice_disagreement_rate"}
