"""One table of metric cases for the contracts every metric keeps (driven by ``tests/test_contracts.py``).

A :class:`Section` lists one factory per metric class of a section, a deterministic batch generator, a
hypothesis strategy of well-formed batches, the independent reference of ``tests/reference.py`` (or
``None`` where the section's references are per metric and live in its own test file), the unit a batch
splits into (a sequence, a sample, a trajectory pair, a response, or a whole prompt group), and the
functional API where one exists. Everything goes through public APIs: ``update``, ``forward``,
``compute``/``compute_dict``, ``state_dict``/``load_state_dict``, ``merge_state`` and the functional
functions, so the harness does not depend on how a metric stores its states.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

import opbc_metrics as M
from opbc_metrics import OPBCCollection, OPBCController
from opbc_metrics import functional as F
from opbc_metrics.agent import AGENT_METRICS
from opbc_metrics.endpoint import ENDPOINT_METRICS
from opbc_metrics.functional.mismatch import sketch_relative_error_bound
from opbc_metrics.functional.perf import TransformerFlops
from opbc_metrics.mismatch import MISMATCH_METRICS
from opbc_metrics.rollout import ROLLOUT_METRICS, chart_ranges
from tests import data as D
from tests import reference as R
from tests import training_reference as TR
from tests.data import concat_batches
from tests.ddp import count_collectives

Batch = dict[str, Any]


# --- batches: size, subsets, units ----------------------------------------------------------------------
def batch_size(batch: Batch) -> int:
    for v in batch.values():
        if isinstance(v, torch.Tensor) or isinstance(v, list):
            return len(v)
    raise ValueError("a batch without a tensor or list field")


def take(batch: Batch, idx: list[int]) -> Batch:
    """The rows ``idx`` of every per-row field (tensors along dim 0, lists, mappings of them)."""
    index = torch.tensor(idx, dtype=torch.long)

    def pick(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: pick(x) for k, x in v.items()}
        if isinstance(v, torch.Tensor):
            return v.index_select(0, index)
        return [v[i] for i in idx]

    return {k: pick(v) for k, v in batch.items()}


def units(batch: Batch, by: str) -> list[list[int]]:
    """The batch's rows grouped into the units a shard or a chunk must keep whole."""
    if by == "group":
        groups: dict[Any, list[int]] = {}
        for i, g in enumerate(batch["group_ids"].tolist()):
            groups.setdefault(g, []).append(i)
        return list(groups.values())
    return [[i] for i in range(batch_size(batch))]


def masked_out(batch: Batch) -> Batch:
    """The same batch with no valid token (every response mask entry 0)."""
    return dict(batch, response_mask=torch.zeros_like(batch["response_mask"]))


def floats(values: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: v.item() for k, v in values.items()}


# --- the case table ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Section:
    name: str
    members: dict[str, Callable[[], Any]]  # one factory per metric class, by id
    batches: Callable[[], list[Batch]]  # four batches of different shapes (deterministic)
    strategy: st.SearchStrategy  # one well-formed batch
    reference: Callable[[Batch], dict[str, float | None]] | None  # independent, on one (concatenated) batch
    unit: str = "sequence"  # sequence | sample | pair | response | group
    functional: Callable[[Batch], dict[str, torch.Tensor]] | None = None
    blank: Callable[[Batch], Batch] = lambda b: take(b, [])  # a batch of this shape that carries no data
    time_split: bool = False  # per-token state: chunks along the time dim are chunks too
    permutable: bool = True
    rtol: float = 1e-9
    atol: float = 1e-12
    tol: Callable[[str], tuple[float, float]] | None = None  # (rtol, atol) per key between two runs
    ref_tol: Callable[[str], tuple[float, float]] | None = None  # (rtol, atol) against the reference, per key
    absent_ok: Callable[[float | None], bool] = lambda want: want is None  # reference keys a metric may leave out
    unstable: Callable[[Batch], set[str]] = lambda b: set()  # keys too ill-conditioned on this batch to compare
    prepare: Callable[[Batch], Batch] | None = None  # turns a batch into the metrics' input (a controller step)
    alone: tuple[str, ...] = ()  # members whose keys clash with another member's: kept out of the collection
    counters: tuple[str, ...] = ()  # members that count their input: zeros without data, not no keys
    stepwise: bool = False  # a batch is {"steps": [...]}, one update per training step
    # per-rank figures (per-step times, workloads): the values after a sync, from each rank's (concatenated)
    # data, where they are not one process's on the concatenation
    rank_reference: Callable[[list[Batch]], dict[str, float]] | None = None

    def collection(self) -> OPBCCollection:
        return OPBCCollection(metrics=[make() for name, make in self.members.items() if name not in self.alone])

    def updates(self, batch: Batch) -> list[Batch]:
        """The metrics' inputs for one batch: one per step, or the batch (a controller step of it)."""
        if self.stepwise:
            return batch["steps"]
        return [self.prepare(batch) if self.prepare else batch]

    def feed(self, metric: Any, batches: list[Batch]) -> Any:
        for b in batches:
            for x in self.updates(b):
                metric.update(x)
        return metric

    def runs(self) -> list[Any]:
        """Fresh metrics that together cover every member: the collection and the members kept out of it."""
        return [self.collection(), *(self.members[name]() for name in self.alone)]

    def shards(self, scenario: str) -> list[list[Batch]]:
        """Per-rank batches: ``uneven`` gives rank 0 two batches of different shapes and rank 1 one; on
        ``idle_rank`` rank 1 sees only a batch without data."""
        b = self.batches()
        return [[b[0], b[1]], [b[2]]] if scenario == "uneven" else [[b[3]], [self.blank(b[0])]]


SCENARIOS = ("uneven", "idle_rank")


def assert_close(got: dict[str, float], want: dict[str, float], section: Section, skip=(), where="") -> None:
    """The same keys, and values equal up to the section's rounding (``tol``, per key, where it has one)."""
    assert set(got) == set(want), (where, set(got) ^ set(want))
    for key in set(got) - set(skip):
        rtol, atol = section.tol(key) if section.tol else (section.rtol, section.atol)
        assert abs(got[key] - want[key]) <= atol + rtol * abs(want[key]), (where, key, got[key], want[key])


def assert_matches_reference(section: Section, got: dict[str, float], want: dict[str, float | None], where="") -> None:
    """Every key a metric reports is the reference's value; a reference key it leaves out is one the section
    allows to be absent (no data for it)."""
    assert got, f"{where}: no keys"
    assert set(got) <= set(want), (where, set(got) - set(want))
    for key, value in want.items():
        if key not in got:
            continue
        assert value is not None, (where, key, "reported without data")
        rtol, atol = section.ref_tol(key) if section.ref_tol else (section.rtol, section.atol)
        assert abs(got[key] - value) <= atol + rtol * abs(value), (where, key, got[key], value)


def missing_reference_keys(section: Section, got_keys: set[str], want: dict[str, float | None], keys: set[str]):
    """Reference keys among ``keys`` (a metric's own) that the metric left out without cause."""
    return {k for k in keys - got_keys if k in want and not section.absent_ok(want[k])}


# --- sections -------------------------------------------------------------------------------------------
def _mismatch_functional(b: Batch) -> dict[str, torch.Tensor]:
    args = (b["trainer_logprobs"], b["rollout_logprobs"], b["response_mask"])
    out = {
        "opbc/is/ess": F.importance_ess(*args),
        "opbc/is/seq_ess": F.sequence_ess(*args),
        "opbc/is/second_moment": F.importance_weight_second_moment(*args),
        "opbc/is/weight_mean": F.importance_weight_mean(*args),
        "opbc/is/weight_std": F.importance_weight_std(*args),
        "opbc/is/clipped_fraction": F.clipped_fraction(*args),
        "opbc/is/veto_fraction": F.veto_fraction(*args),
        "opbc/is/top_1pct_gradient_mass": F.top_gradient_mass(*args, bins=F.mismatch.DEFAULT_TOP_MASS_BINS),
    }
    for fn in (F.logprob_diff, F.log_ratio_range, F.sequence_log_ratio, F.kl_estimators, F.chi_square,
               F.perplexity_gap, F.probability_diff):
        out.update(fn(*args))
    return out


def _mismatch_unstable(batch: Batch) -> set[str]:
    """Pearson from raw moments rounds like 1e-16 * mean^2 / variance (documented): compare it only when
    both probability vectors vary."""
    t, r, m = D.logprobs_numpy(batch)
    valid = m != 0
    stable = valid.sum() > 1 and np.exp(t[valid]).var() > 1e-4 and np.exp(r[valid]).var() > 1e-4
    return set() if stable else {"opbc/prob/pearson"}


def _mismatch_tol(key: str) -> tuple[float, float]:
    # Weights far below 1 (r near -12) round near 1e-8 relative in the kernel's block sums, even in float64.
    if key == "opbc/is/top_1pct_gradient_mass":  # the sketch's documented bound
        return sketch_relative_error_bound() * 1.01 + 1e-7, 1e-12
    return 1e-7, 1e-12


MISMATCH = Section(
    "mismatch",
    members={cls.__name__: cls for cls in MISMATCH_METRICS},
    batches=lambda: [D.make_batch(batch=5, seq=12, seed=1, dtype=torch.float64),
                     D.make_batch(batch=3, seq=30, seed=2, dtype=torch.float64, heavy_tail=True, drift=2.0),
                     D.make_batch(batch=2, seq=7, seed=3, dtype=torch.float64, empty_rows=1),
                     D.make_batch(batch=4, seq=16, seed=4, dtype=torch.float64, heavy_tail=True, drift=2.0)],
    strategy=D.logprob_batches(),
    reference=lambda b: R.mismatch_reference(*D.logprobs_numpy(b)),
    functional=_mismatch_functional,
    blank=masked_out,
    counters=("InputHealth",),
    # raw-moment std and Pearson round at 1e-9 / 1e-7 absolute when chunks add in another order
    tol=lambda key: (1e-7, 1e-7 if key == "opbc/prob/pearson" else 1e-9),
    ref_tol=_mismatch_tol,
    unstable=_mismatch_unstable,
)

MOE = Section(
    "moe",
    members={"RouterFlipRate": lambda: M.RouterFlipRate(num_layers=8),
             "RouterSetDisagreement": M.RouterSetDisagreement},
    batches=lambda: [D.make_router_batch(batch=5, seq=12, layers=6, seed=11),
                     D.make_router_batch(batch=3, seq=30, layers=6, seed=12, swap=0.5),
                     D.make_router_batch(batch=2, seq=7, layers=6, seed=13, empty_rows=1, replace=0.6),
                     D.make_router_batch(batch=4, seq=16, layers=6, seed=14)],
    strategy=D.router_batches(),
    reference=lambda b: R.router_reference(*(b[k].numpy() for k in ("rollout_experts", "trainer_experts",
                                                                    "response_mask")), num_layers=8),
    functional=lambda b: {
        **F.router_flip_rate(b["rollout_experts"], b["trainer_experts"], b["response_mask"], num_layers=8),
        R.SET: F.router_topk_disagreement_rate(b["rollout_experts"], b["trainer_experts"], b["response_mask"]),
    },
    blank=masked_out,
    time_split=True,
    rtol=1e-12,
    atol=1e-12,
)

PER_ROUND = Section(
    "per_round",
    members={"PerRoundMismatch": lambda: M.PerRoundMismatch(capacity=3)},
    batches=lambda: [D.multi_turn_batch(batch=5, seq=24, seed=21),
                     D.multi_turn_batch(batch=3, seq=50, seed=22, p_switch=0.4),
                     D.multi_turn_batch(batch=2, seq=9, seed=23, empty_rows=1),
                     D.multi_turn_batch(batch=4, seq=30, seed=24, drift=1.0)],
    strategy=D.round_batches(),
    reference=lambda b: R.per_round_reference(*D.logprobs_numpy(b), capacity=3),
    functional=lambda b: F.per_round_mismatch(b["trainer_logprobs"], b["rollout_logprobs"], b["response_mask"],
                                              capacity=3),
    blank=masked_out,
    rtol=1e-10,
    absent_ok=lambda want: want is None or want == 0,  # rounds no sequence reached have no keys
)

AGENT = Section(
    "agent",
    members={cls.__name__: cls for cls in AGENT_METRICS},
    batches=lambda: [{"trajectory_pairs": D.random_pairs(seed, n)} for seed, n in ((10, 7), (11, 2), (12, 5), (13, 6))],
    strategy=D.pair_lists().map(lambda pairs: {"trajectory_pairs": pairs}),
    reference=lambda b: R.agent_reference(b["trajectory_pairs"]),
    unit="pair",
    functional=lambda b: F.agent_metrics(b["trajectory_pairs"]),
    rtol=1e-12,
    atol=1e-15,
)


def _exchange_batch(exchanges: list) -> Batch:
    return dict(zip(("endpoint_responses", "endpoint_requests"), D.split_exchanges(exchanges), strict=True))


ENDPOINT = Section(
    "endpoint",
    members={cls.__name__: cls for cls in ENDPOINT_METRICS},
    batches=lambda: [_exchange_batch(D.random_exchanges(seed, n)) for seed, n in ((20, 9), (21, 3), (22, 5), (23, 7))],
    strategy=D.exchange_lists().map(_exchange_batch),
    reference=lambda b: R.endpoint_reference(list(zip(b["endpoint_responses"], b["endpoint_requests"], strict=True))),
    unit="response",
    functional=lambda b: F.endpoint_capabilities(b["endpoint_responses"], b["endpoint_requests"]),
    rtol=1e-12,
    atol=1e-15,
)

def _rollout_functional(b: Batch) -> dict[str, torch.Tensor]:
    gid, lengths = b["group_ids"], b["response_lengths"]
    return {
        **F.rollout.reward_stats(b["rewards"]), **F.rollout.advantage_stats(b["advantages"]),
        **F.rollout.token_stats(b["prompt_lengths"], lengths, gid),
        **F.rollout.discarded_counts(b["discard_reasons"], b["rewards"]),
        **F.rollout.discarded_rollout_stats(b["discard_reasons"], lengths, gid, b["stop_reasons"]),
        **F.rollout.off_policy_steps(b["policy_lag"]), **F.rollout.sample_metric_stats(b["sample_metrics"], gid),
        "rollout/tokens_completion/group_cv_mean": F.rollout.group_length_cv(lengths, gid),
        "rollout/reward/group_gini_mean": F.rollout.group_gini(b["rewards"], gid),
        "rollout/tokens_completion/group_gini_mean": F.rollout.group_gini(lengths.double(), gid),
        "rollout/tokens_completion/group_max_median_ratio_mean": F.rollout.group_max_median_ratio(lengths, gid),
        "rollout/stop_reason/length_pct": F.rollout.stop_reason_length_pct(b["stop_reasons"]),
    }


ROLLOUT = Section(
    "rollout",
    members={**{cls.__name__: cls for cls in ROLLOUT_METRICS},
             "SampleMetricStats": lambda: M.SampleMetricStats(D.NAMES)},
    # whole prompt groups, ids disjoint across batches (a group lives on one rank)
    batches=lambda: [D.make_rollouts(groups=g, seed=s, first_id=s) for g, s in ((5, 1), (2, 2), (3, 3), (4, 4))],
    strategy=D.rollout_groups().map(D.groups_batch),
    reference=lambda b: R.rollout_reference(b, D.NAMES),
    unit="group",
    functional=_rollout_functional,
    ref_tol=lambda key: (1e-9, 1e-9),
)


def _training_batch(batch: int, seq: int, seed: int, empty_rows: int = 0) -> Batch:
    """Training fields whose ``entropies`` are those of the ``logits`` (both entropy metrics, one reference)."""
    b = D.make_training_batch(batch=batch, seq=seq, seed=seed, empty_rows=empty_rows)
    return dict(b, entropies=torch.from_numpy(TR.ref_token_entropies(b["logits"])))


TRAINING = Section(
    "training",
    members={
        "PPOKL": M.PPOKL, "ApproxKL": lambda: M.ApproxKL(estimator="k2"),
        "PolicyClipFraction": lambda: M.PolicyClipFraction(clip_ratio_low=0.1, clip_ratio_high=0.3),
        "PolicyEntropy": M.PolicyEntropy, "PolicyEntropy(logits)": lambda: M.PolicyEntropy(from_logits=True),
        "ValueStats": M.ValueStats, "ReturnStats": M.ReturnStats,
        "AdvantageStats": M.AdvantageStats, "RewardStats": M.RewardStats, "ScoreStats": M.ScoreStats,
        "ExplainedVariance": M.ExplainedVariance, "ResponseLength": lambda: M.ResponseLength(max_response_length=5),
        "PromptLength": lambda: M.PromptLength(max_prompt_length=20), "AbortedRatio": M.AbortedRatio,
        "NumTurns": M.NumTurns, "DPOMetrics": M.DPOMetrics, "RewardModelMetrics": M.RewardModelMetrics,
        "AgentLoopTiming": M.AgentLoopTiming, "AgentLoopSlowest": M.AgentLoopSlowest,
    },
    alone=("PolicyEntropy(logits)",),
    batches=lambda: [_training_batch(5, 10, 1), _training_batch(3, 17, 2), _training_batch(4, 6, 3, empty_rows=2),
                     _training_batch(6, 9, 4, empty_rows=1)],
    strategy=st.builds(lambda b, t, seed, empty: _training_batch(b, t, seed, empty_rows=min(empty, b)),
                       st.integers(1, 7), st.integers(1, 9), st.integers(0, 10_000), st.integers(0, 2)),
    reference=TR.training_reference,
)

SCALARS = Section(
    "trainer-scalars",
    members={**{cls.__name__: cls for cls in (M.ActorLoss, M.PolicyGradientLoss, M.EntropyLoss, M.KLLoss, M.KLCoef,
                                              M.ActorGradNorm, M.ActorLR, M.CriticLoss, M.CriticLR, M.RMGradNorm)},
             "LRSchedulerState": M.LRSchedulerState},
    batches=lambda: [D.make_scalars(n, seed) for n, seed in ((2, 0), (1, 1), (3, 2), (4, 3))],
    strategy=st.builds(D.make_scalars, st.integers(1, 6), st.integers(0, 10_000)),
    reference=TR.scalars_reference,
    unit="sample",
)

VAL_SOURCES, VAL_KS = ("gsm8k", "math", "aime"), (1, 2, 4)
VALIDATION = Section(
    "validation",
    members={"ValidationAccuracy": lambda: M.ValidationAccuracy(VAL_SOURCES, n_samples=4, ks=VAL_KS),
             "ValidationReward": lambda: M.ValidationReward(VAL_SOURCES, n_samples=4, ks=VAL_KS),
             "ValidationTurns": M.ValidationTurns},
    batches=lambda: [D.make_validation_batch(p, seed=seed) for p, seed in ((5, 1), (2, 2), (4, 3), (6, 4))],
    strategy=st.builds(D.make_validation_batch, st.integers(1, 6), st.just(4), st.integers(0, 10_000)),
    reference=lambda b: TR.validation_reference(b, VAL_SOURCES, 4, VAL_KS),
    unit="sample",
    absent_ok=lambda want: want is None or want == 0,  # a source without data has no keys
)

STAGES, FLOPS = ("gen", "update_actor", "old_log_prob", "step"), (1e9, 4, 256)


def _steps_reference(ranks: list[Batch]) -> dict[str, float]:
    return TR.steps_reference([r["steps"] for r in ranks], STAGES, FLOPS, peak=1e15)


STEPS = Section(
    "training-steps",
    members={"StageTiming": lambda: M.StageTiming(stages=STAGES), "Throughput": M.Throughput,
             "ModelFlopsUtilization": lambda: M.ModelFlopsUtilization(TransformerFlops(*FLOPS), peak_flops=1e15),
             "GlobalSeqlen": M.GlobalSeqlen},
    batches=lambda: [D.make_steps(n, seed, rows) for n, seed, rows in ((1, 1, 5), (1, 2, 3), (1, 3, 4), (3, 4, 6))],
    strategy=st.builds(D.make_steps, st.integers(1, 4), st.integers(0, 10_000), st.integers(1, 6)),
    reference=lambda b: _steps_reference([b]),
    stepwise=True,
    rank_reference=_steps_reference,
)


def _controller(preset: str) -> Section:
    def step(batch: Batch) -> Batch:
        return {"opbc_decisions": OPBCController(preset, track_budget=False).step(batch)}

    return Section(
        f"controller-{preset}",
        members={cls.__name__: cls for cls in (M.DecisionGroupShare, M.DecisionTokenShare, M.DecisionReasonCount,
                                               M.CorrectionTokenShare)},
        batches=lambda: [D.grouped_batch(9, 14, seed=1, drift=1.5, heavy_tail=True), D.grouped_batch(5, 30, seed=2),
                         D.grouped_batch(6, 7, seed=3, empty_rows=1, drift=3.0, heavy_tail=True),
                         D.grouped_batch(8, 16, seed=5, drift=2.0, heavy_tail=True)],
        strategy=st.builds(lambda b, t, seed: D.grouped_batch(b, t, seed=seed, drift=2.0, heavy_tail=True),
                           st.integers(1, 10), st.integers(1, 8), st.integers(0, 10_000)),
        reference=None,  # the budget's values by hand: test_controller.py
        unit="group",  # a decision is per prompt group: shards and chunks keep groups whole
        prepare=step,
        rtol=1e-12,
    )


SECTIONS = {s.name: s for s in (MISMATCH, MOE, PER_ROUND, AGENT, ENDPOINT, ROLLOUT, TRAINING, SCALARS, VALIDATION,
                                STEPS, _controller("masked_is"), _controller("truncated_is"))}
MEMBERS = [(s.name, m) for s in SECTIONS.values() for m in s.members]
ONE_COLLECTION = [name for name in SECTIONS if name != "controller-truncated_is"]  # every class once


# --- DDP ------------------------------------------------------------------------------------------------
def ddp_worker(rank: int, world_size: int) -> dict:
    """Every section on this rank's shards: its collection (with the collectives it issued), each member
    alone, and one collection holding every section's members."""
    out: dict = {}
    for section in SECTIONS.values():
        for scenario in SCENARIOS:
            collection = section.collection()
            alone = {name: make() for name, make in section.members.items()}
            for m in (collection, *alone.values()):
                section.feed(m, section.shards(scenario)[rank])
            local = {k: v.clone() for k, v in collection.state_dict().items()}
            with count_collectives() as calls:
                values = floats(collection.compute())
            # compute() gives the local states back, so accumulation goes on
            restored = all(torch.equal(v, local[k]) for k, v in collection.state_dict().items())
            out[section.name, scenario] = (values, calls["n"], {n: floats(m.compute_dict()) for n, m in alone.items()},
                                           restored)
    everything = OPBCCollection(metrics=[m for s in ONE_COLLECTION for m in SECTIONS[s].collection().members()])
    for section in map(SECTIONS.get, ONE_COLLECTION):
        own = {type(m) for m in section.collection().members()}
        for m in everything.members():
            if type(m) in own:
                section.feed(m, section.shards("uneven")[rank])
    with count_collectives() as calls:
        out["everything"] = (floats(everything.compute()), calls["n"])
    return {**out, **_ddp_specifics(rank)}


def _ddp_specifics(rank: int) -> dict:
    """What two ranks show beyond equality: the mean of per-rank ESS values (the peers' way) is not the global
    ESS; rollout chart ranges after compute() (the declared bound, the global observed one); a deferred
    bad-value error raised on every rank alike though one rank saw the bad value."""
    local = concat_batches(MISMATCH.shards("uneven")[rank])
    ess = F.importance_ess(local["trainer_logprobs"], local["rollout_logprobs"], local["response_mask"])
    torch.distributed.all_reduce(ess)
    rollout = OPBCCollection(M.rollout_metrics(D.NAMES, reward_min=0.0))
    ROLLOUT.feed(rollout, ROLLOUT.shards("uneven")[rank]).compute()
    bad = D.make_rollouts(groups=2, seed=9, first_id=9)
    if rank == 0:
        bad["response_lengths"][0] = -3
    try:
        ROLLOUT.feed(ROLLOUT.collection(), [bad]).compute()
        error = None
    except ValueError as err:
        error = str(err)
    return {"mean_of_rank_ess": ess.item() / 2, "chart_ranges": chart_ranges(rollout), "deferred_error": error}
