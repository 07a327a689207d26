"""Load balance (``global_seqlen/*``), timing (``timing_s/*``, ``timing_per_token_ms/*``) and performance
(``perf/*``) metrics, and :class:`StageTimer`, the context manager that measures stages.

All of them keep one slot per rank (:class:`~opbc_metrics.training._base._PerRank`): each rank adds its
own workload and stage times to its slot, the sync sums the slots, and ``compute()`` takes the
extremes over ranks. A step's stage time is therefore the slowest rank's (the wall time the step
waited for), and each rank's workload stays separate.

Timings travel in the batch as ``timing_s``: a dict ``{stage: seconds}`` for one step on this rank,
what :meth:`StageTimer.pop` returns (and what verl's ``timing_raw`` already is). Each ``update`` that
carries ``timing_s`` is one step of this rank; token counts come from every update that carries both
``prompt_lengths`` and ``response_lengths`` (pass each sequence's lengths once per step, as for the length
metrics). Over a window of several steps, ``timing_s/<stage>`` is
the largest over ranks of a rank's mean seconds per step that timed the stage (a stage missing from a
step's ``timing_s`` was not run, not run in 0 s; a stage no rank timed has no key), and token counts are
per step (window total / steps); for a window of one step (compute and reset every step) these are verl's
per-step values.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from opbc_metrics.batch import BatchView, check_count, check_positive, check_same_shape
from opbc_metrics.functional import perf as P
from opbc_metrics.functional.statistics import safe_div
from opbc_metrics.functional.training import (
    PROMPT_LENGTHS,
    RESPONSE_LENGTHS,
    _count_stats,
    _turns_compute,
    field_tensor,
    nonnegative_field,
    tensor_device,
)
from opbc_metrics.metric import MAX, MIN, SUM, BySettings, table
from opbc_metrics.training._base import _PerRank, _TrainingMetric, diagnostic

F64 = torch.float64
RANK_IDS = "rank_ids"
TIMING_S = "timing_s"
DEFAULT_MAX_SEQLEN = 32768


def _check_stage_names(name: str, stages: Sequence[str]) -> tuple[str, ...]:
    stages = (stages,) if isinstance(stages, str) else tuple(stages)
    for s in stages:
        if not isinstance(s, str) or not s or any(not part for part in s.split("/")):
            raise ValueError(f"`{name}` entries must be non-empty strings without empty '/' parts, got {s!r}")
    if len(set(stages)) != len(stages):
        raise ValueError(f"`{name}` has duplicates: {stages}")
    return stages


def _workload(view: BatchView) -> tuple[Tensor, Tensor]:
    """Per-sequence workload ``prompt_lengths + response_lengths`` (float64) and the invalid-entry count."""
    p, bad_p = nonnegative_field(view, PROMPT_LENGTHS, device=tensor_device(view, RESPONSE_LENGTHS))
    r, bad_r = nonnegative_field(view, RESPONSE_LENGTHS, device=p.device)
    check_same_shape(PROMPT_LENGTHS, p, RESPONSE_LENGTHS, r)
    return p + r, bad_p + bad_r


# global_seqlen/*
class GlobalSeqlen(_PerRank):
    r"""Token workload per rank, ``global_seqlen/{min,max,minmax_diff,balanced_min,balanced_max,mean}``.

    A sequence's workload is ``prompt_lengths + response_lengths``. Each rank's ``update`` adds its
    sequences to its own workload (a driver holding the whole step passes ``rank_ids`` [B], the rank each
    sequence went to). ``min``/``max``/``mean`` are over the ranks' total workloads as assigned;
    ``balanced_min``/``balanced_max`` re-partition all the window's sequences over the same ranks with
    Karmarkar-Karp (or LPT), equal sequence counts per rank by default, as verl's
    ``get_seqlen_balanced_partitions`` does (see :mod:`opbc_metrics.functional.perf`).

    The sequences enter a fixed-size exact histogram of integer lengths ``0..max_seqlen`` (a sum state,
    so it syncs exactly); partitioning runs on the host in ``compute()``. Longer sequences are counted
    with their exact total but partitioned at their mean length (a warning says so). Non-integer lengths
    are rounded for the histogram. Report per step (compute and reset every step) for verl's per-step
    figures; a longer window pools its steps. No data in the window: no keys.

    Args:
        world_size: number of ranks (default: torch.distributed's, see ``_PerRank``).
        max_seqlen: the histogram's largest exact length (32768).
        algorithm: ``"karmarkar_karp"`` (default) or ``"lpt"``.
        equal_size: give every rank the same number of sequences (verl's default for DP ranks).
        workload: the cost the re-partitioning balances, as a function of the lengths tensor (default: the
            length itself). The balanced figures stay token totals of the partitions found. verl balances on
            ``24576 * s + s ** 2`` (:func:`opbc_metrics.integrations.verl.verl_workload`); pass that for verl's
            ``balanced_*`` values.

    Example:
        >>> import torch
        >>> metric = GlobalSeqlen(world_size=2)
        >>> metric.update(prompt_lengths=torch.tensor([100, 100, 100, 100, 100, 100]),
        ...               response_lengths=torch.tensor([800, 700, 0, 100, 200, 200]),
        ...               rank_ids=torch.tensor([0, 0, 0, 1, 1, 1]))
        >>> {k.split("/")[1]: v.item() for k, v in metric.compute().items()}  # doctest: +NORMALIZE_WHITESPACE
        {'min': 800.0, 'max': 1800.0, 'minmax_diff': 1000.0, 'balanced_min': 1300.0, 'balanced_max': 1300.0,
         'mean': 1300.0}
    """

    keys = P.SEQLEN_KEYS
    required_fields = (PROMPT_LENGTHS, RESPONSE_LENGTHS)
    higher_is_better = None
    states = table(workload=SUM.of("slots"), active=SUM.of("slots"), hist=SUM.of(lambda m: m.max_seqlen + 1),
                   overflow_count=SUM, overflow_sum=SUM, invalid=SUM, bad_rank=SUM)
    _deferred = (("invalid", required_fields, "negative or non-finite prompt/response lengths"),
                 ("bad_rank", RANK_IDS, "rank ids outside [0, world_size)"))
    data_counts = ("active", "invalid", "bad_rank")  # ranks that received sequences, and bad-value counts
    glossary = diagnostic("global_seqlen", aliases=("global_seqlen/minmax_diff",),
        what="Total token workload per GPU (data-parallel rank), not the length of any one sequence: the lightest and "
        "heaviest rank, their difference (the most important: large means fast GPUs wait for slow ones), the mean, "
        "and the lightest/heaviest after Karmarkar-Karp re-balancing (what balancing would achieve). A large max also "
        "explains OOMs.",
        unit="tokens (prompt + response) per rank over the window; ranks of the process group")

    def __init__(self, world_size: int | None = None, max_seqlen: int = DEFAULT_MAX_SEQLEN,
                 algorithm: str = "karmarkar_karp", equal_size: bool = True,
                 workload: Callable[[Tensor], Tensor] | None = None, **kwargs: Any) -> None:
        super().__init__(world_size, **kwargs)
        if workload is not None and not callable(workload):
            raise ValueError(f"`workload` must be a function of the lengths tensor, got {type(workload).__name__}")
        self.workload_fn = workload
        check_count("max_seqlen", max_seqlen, optional=False)
        if algorithm not in P.PARTITION_ALGORITHMS:
            raise ValueError(f"`algorithm` must be one of {P.PARTITION_ALGORITHMS}, got {algorithm!r}")
        self.max_seqlen, self.algorithm, self.equal_size = max_seqlen, algorithm, bool(equal_size)

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        lengths, invalid = _workload(view)
        device = lengths.device
        if view.has(RANK_IDS):
            ids, _ = field_tensor(view, RANK_IDS, ndims=(1,), dims=("B",), device=device)
            check_same_shape(RANK_IDS, ids, PROMPT_LENGTHS, lengths)
            if ids.is_floating_point() or ids.dtype == torch.bool:
                raise ValueError(f"batch field `{RANK_IDS}` must be an integer tensor, got {ids.dtype}")
            limit = self.world_size or self.slots
            onehot = ids[:, None] == torch.arange(limit, device=device)[None, :]
            per_rank = (onehot.to(F64) * lengths[:, None]).sum(dim=0)
            workload = torch.zeros(self.slots, dtype=F64, device=device)
            workload[:limit] = per_rank
            active = torch.zeros(self.slots, dtype=F64, device=device)
            active[:limit] = onehot.any(dim=0).to(F64)
            bad_rank = (~onehot.any(dim=1)).to(F64).sum()
        else:
            rank = self.current_rank()
            workload = self.one_hot_row(rank, lengths.sum().reshape(()))
            # A batch without sequences is no data (numel is shape metadata: no sync).
            active = self.one_hot_row(rank, torch.full((), float(lengths.numel() > 0), dtype=F64, device=device))
            bad_rank = torch.zeros((), dtype=F64, device=device)
        over = lengths > self.max_seqlen
        idx = lengths.round().clamp(0, self.max_seqlen).long()
        hist = torch.zeros(self.max_seqlen + 1, dtype=F64, device=device)
        hist.index_add_(0, idx, (~over).to(F64))
        return {"workload": workload, "active": active, "hist": hist, "overflow_count": over.to(F64).sum(),
                "overflow_sum": torch.where(over, lengths, torch.zeros((), dtype=F64, device=device)).sum(),
                "invalid": invalid, "bad_rank": bad_rank}

    def compute(self) -> dict[str, Tensor]:
        world = self.resolved_world_size((self.active > 0) | (self.workload > 0))
        loads = self.workload[:world].tolist()
        counts = self.hist.round().long().cpu()
        lengths = torch.repeat_interleave(torch.arange(len(counts), dtype=F64), counts).tolist()
        n_over = round(float(self.overflow_count))
        if n_over:
            warnings.warn(f"{n_over} sequences longer than max_seqlen={self.max_seqlen} were partitioned at their "
                          "mean length; raise max_seqlen for exact balanced figures", stacklevel=2)
            lengths.extend([float(self.overflow_sum) / n_over] * n_over)
        if not lengths:
            balanced = [0.0] * world
        elif self.workload_fn is None:
            balanced = P.partition_loads(lengths, world, self.algorithm, self.equal_size)
        else:
            costs = self.workload_fn(torch.tensor(lengths, dtype=F64)).tolist()
            parts = P.partition(costs, world, self.algorithm, self.equal_size)
            balanced = [float(sum(lengths[i] for i in p)) for p in parts]
        values = P.seqlen_balance_from_loads(loads, balanced)
        return {k: torch.tensor(v, dtype=F64, device=self.workload.device) for k, v in values.items()}


# StageTimer: the context manager
class StageTimer:
    """Measure named stages of a step with ``with timer("gen"): ...``; :meth:`pop` gives the ``timing_s``
    batch field ``{stage: seconds}`` (repeated stages add up) and starts the next step.

    Host wall-clock (``time.perf_counter``). CUDA work is asynchronous: pass ``cuda_sync=True`` to
    synchronise the device at the start and end of every stage, for device-accurate (and slower) timings.

    Args:
        stages: the allowed stage names (None: any).
        cuda_sync: call ``torch.cuda.synchronize()`` around each stage (when CUDA is available).

    Example:
        >>> timer = StageTimer(stages=("gen", "step"))
        >>> with timer("step"):
        ...     with timer("gen"):
        ...         pass
        >>> timer.record("gen", 0.5)
        >>> sorted(timer.timings), timer.timings["gen"] >= 0.5
        (['gen', 'step'], True)
        >>> batch = {"timing_s": timer.pop()}
        >>> timer.timings
        {}
    """

    def __init__(self, stages: Sequence[str] | None = None, cuda_sync: bool = False) -> None:
        self.stages = None if stages is None else _check_stage_names("stages", stages)
        self.cuda_sync = bool(cuda_sync)
        self.timings: dict[str, float] = {}

    def _check(self, stage: str) -> None:
        if self.stages is not None and stage not in self.stages:
            raise ValueError(f"unknown stage {stage!r}; declared stages: {list(self.stages)}")

    def _sync(self) -> None:
        if self.cuda_sync and torch.cuda.is_available():
            torch.cuda.synchronize()

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        self._check(stage)
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.record(stage, time.perf_counter() - start)

    time = __call__

    def record(self, stage: str, seconds: float) -> None:
        """Add an externally measured duration to ``stage``."""
        self._check(stage)
        seconds = float(seconds)
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"a stage time must be a finite non-negative number of seconds, got {seconds}")
        self.timings[stage] = self.timings.get(stage, 0.0) + seconds

    def pop(self) -> dict[str, float]:
        """This step's timings, and a fresh start for the next step."""
        out, self.timings = self.timings, {}
        return out


# timing_s/*, timing_per_token_ms/*, perf/*
def _timings(view: BatchView, stages: tuple[str, ...], strict: bool) -> tuple[list[float], list[float]]:
    """``(seconds, timed)`` per stage of ``stages``: a stage missing from ``timing_s`` was not timed (0, 0)."""
    value = view.field(TIMING_S)
    if not isinstance(value, Mapping):
        raise ValueError(f"batch field `{TIMING_S}` must be a dict {{stage: seconds}}, got {type(value).__name__}")
    unknown = [s for s in value if s not in stages]
    if strict and unknown:
        raise ValueError(f"batch field `{TIMING_S}` has undeclared stages {unknown}; declared: {list(stages)}")
    row, timed = [], []
    for s in stages:
        if s not in value:
            row.append(0.0)
            timed.append(0.0)
            continue
        v = value[s]
        if isinstance(v, Tensor):
            raise ValueError(f"batch field `{TIMING_S}` must hold Python floats (host times), got a tensor for {s!r}")
        try:
            v = float(v)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"batch field `{TIMING_S}` has a non-numeric time for {s!r}: {v!r}") from exc
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"batch field `{TIMING_S}` has an invalid time for {s!r}: {v}")
        row.append(v)
        timed.append(1.0)
    return row, timed


class _StageClock(_PerRank):
    """Per-rank stage seconds and timed steps ``[slots, S]`` and steps ``[slots]``, plus the token and
    sequence counts of the window.

    Every ``update`` may carry ``timing_s`` (one step of this rank: adds its stage times, and counts the
    stages it holds as timed) and/or both ``prompt_lengths`` and ``response_lengths`` (adds the sequences'
    tokens), so in a collection the step's lengths can arrive with the micro-batches and the timings once
    at the end of the step. A stage's seconds per step are over the steps that timed it; a stage no rank
    timed in the window has no keys (verl's ``compute_timing_metrics`` reports only the stages of
    ``timing_raw``), and figures per token need tokens. Subclasses set ``clock_stages`` (the stages timed)
    in their constructor.
    """

    strict_stages = False
    required_fields = ()  # timing_s and the lengths are each optional; see statistics
    _deferred = (("invalid", (PROMPT_LENGTHS, RESPONSE_LENGTHS), "negative or non-finite prompt/response lengths"),)
    states = table(time=SUM.of("slots", "clock_stages"), timed=SUM.of("slots", "clock_stages"), steps=SUM.of("slots"),
                   tokens_response=SUM, tokens_all=SUM, sum_sq=SUM, sequences=SUM, invalid=SUM)
    data_counts = ("timed", "invalid")  # a window in which no stage was timed has no keys

    def accepts(self, view: BatchView) -> bool:
        """A collection updates this metric with batches carrying ``timing_s`` or both length fields."""
        return view.has(TIMING_S) or view.has(PROMPT_LENGTHS, RESPONSE_LENGTHS)

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        stats: dict[str, Tensor] = {}
        if view.has(TIMING_S):
            rank = self.current_rank()
            row, timed = _timings(view, self.clock_stages, self.strict_stages)
            stats["time"] = self.one_hot_row(rank, torch.tensor(row, dtype=F64))
            stats["timed"] = self.one_hot_row(rank, torch.tensor(timed, dtype=F64))
            stats["steps"] = self.one_hot_row(rank, torch.ones((), dtype=F64))
        if view.has(PROMPT_LENGTHS, RESPONSE_LENGTHS):
            lengths, invalid = _workload(view)
            r, _ = nonnegative_field(view, RESPONSE_LENGTHS)
            stats.update(tokens_response=r.sum(), tokens_all=lengths.sum(), sum_sq=(lengths * lengths).sum(),
                         sequences=torch.full((), float(lengths.numel()), dtype=F64, device=lengths.device),
                         invalid=invalid)
        return stats

    def per_step(self) -> tuple[Tensor, Tensor, list[bool]]:
        """``(seconds per timed step of the slowest rank [S], steps of the window, whether each stage was
        timed)``; the last is read to the host (compute time, synced states: every rank agrees)."""
        seconds = P.slowest_rank_per_step(self.time, self.timed)
        return seconds, self.steps.max(), (self.timed.sum(dim=0) > 0).tolist()

    def num_ranks(self) -> int:
        return self.resolved_world_size(self.steps > 0)


class StageTiming(_StageClock):
    """``timing_s/<stage>`` (seconds per step, slowest rank) and ``timing_per_token_ms/<stage>``.

    Batch fields: ``timing_s`` (``{stage: seconds}`` of this rank's step, e.g. :meth:`StageTimer.pop`;
    a stage missing from it was not timed in that step) and, for the per-token figures, ``prompt_lengths``
    and ``response_lengths`` [B] of the step's sequences on this rank (in the same or any other update of
    the window). ``timing_s/<stage>`` is the mean over the steps that timed the stage; a stage no rank
    timed in the window has no keys (as verl's ``compute_timing_metrics`` reports only the stages of
    ``timing_raw``). ``timing_per_token_ms/<stage>`` =
    1000 x stage seconds / tokens of the step over all ranks: response tokens for ``gen``, prompt + response
    tokens for the other stages (verl's ``compute_timing_metrics``); no key without tokens (verl reports 0.0
    there).

    Args:
        stages: the stage names (fixed: one state slot each); default verl's ``gen, reward, old_log_prob,
            ref, values, adv, update_critic, update_actor, update_weights, step``.
        per_token_stages: stages that get ``timing_per_token_ms`` (default: verl's ``gen, ref, values, adv,
            update_critic, update_actor`` that are in ``stages``).
        response_token_stages: stages normalised by response tokens only (``gen``).
        strict: raise on a ``timing_s`` stage not in ``stages`` (default True); False ignores it.
        world_size: see :class:`GlobalSeqlen`.

    Example:
        >>> import torch
        >>> metric = StageTiming(stages=("gen", "update_actor", "step"))
        >>> metric.update(timing_s={"gen": 2.0, "update_actor": 1.0, "step": 3.5},
        ...               prompt_lengths=torch.tensor([100, 100]), response_lengths=torch.tensor([400, 600]))
        >>> {k: v.item() for k, v in metric.compute().items()}  # doctest: +NORMALIZE_WHITESPACE
        {'timing_s/gen': 2.0, 'timing_s/update_actor': 1.0, 'timing_s/step': 3.5,
         'timing_per_token_ms/gen': 2.0, 'timing_per_token_ms/update_actor': 0.8333333333333334}
    """

    keys = BySettings(("timing_s/<stage>", "timing_per_token_ms/<stage>"), lambda m: (
        *(f"timing_s/{s}" for s in m.stages), *(f"timing_per_token_ms/{s}" for s in m.per_token_stages)))
    higher_is_better = False
    glossary = diagnostic("timing_s", aliases=("timing_per_token_ms", "timing_s/step", "timing_s/gen"),
        what="Wall time per step of each stage (gen, reward, old_log_prob, ref, adv, update_actor, update_critic, "
        "update_weights, step), as the slowest rank saw it, and the same per token (timing_per_token_ms, better for "
        "comparing runs that generate different token counts). Check step first, then its largest component (usually "
        "gen).",
        unit="steps over the window; the slowest rank (max over ranks); per-token figures divide by the step's "
        "tokens summed over ranks")

    def __init__(self, stages: Sequence[str] = P.DEFAULT_STAGES, per_token_stages: Sequence[str] | None = None,
                 response_token_stages: Sequence[str] = P.DEFAULT_RESPONSE_TOKEN_STAGES, strict: bool = True,
                 world_size: int | None = None, **kwargs: Any) -> None:
        super().__init__(world_size, **kwargs)
        self.stages = _check_stage_names("stages", stages)
        if per_token_stages is None:
            per_token_stages = tuple(s for s in P.DEFAULT_PER_TOKEN_STAGES if s in self.stages)
        self.per_token_stages = _check_stage_names("per_token_stages", per_token_stages)
        missing = [s for s in self.per_token_stages if s not in self.stages]
        if missing:
            raise ValueError(f"`per_token_stages` {missing} are not in `stages`")
        self.response_token_stages = _check_stage_names("response_token_stages", response_token_stages)
        self.strict_stages = bool(strict)
        self.clock_stages = self.stages

    def compute(self) -> dict[str, Tensor]:
        seconds, n, timed = self.per_step()
        out = {f"timing_s/{s}": seconds[i] for i, s in enumerate(self.stages) if timed[i]}
        has_tokens = (torch.stack([self.tokens_response, self.tokens_all]) > 0).tolist()
        for s in self.per_token_stages:
            i, response = self.stages.index(s), s in self.response_token_stages
            if timed[i] and has_tokens[0 if response else 1]:
                tokens = (self.tokens_response if response else self.tokens_all) / n
                out[f"timing_per_token_ms/{s}"] = 1000.0 * seconds[i] / tokens
        return out


class Throughput(_StageClock):
    """``perf/{total_num_tokens,time_per_step,throughput}``: tokens per step, seconds per step, and tokens
    per second per GPU.

    Batch fields: ``timing_s`` with the ``step`` stage (other stages are ignored) and ``prompt_lengths``,
    ``response_lengths`` [B] of this rank's sequences (same or other updates). ``total_num_tokens`` =
    prompt + response tokens of the step over all ranks; ``time_per_step`` = the slowest rank's step time;
    ``throughput`` = ``total_num_tokens / (time_per_step * num_gpus)`` (verl's ``compute_throughout_metrics``).
    Each key needs its inputs in the window: ``total_num_tokens`` sequence lengths, ``time_per_step`` a
    timed ``step`` stage, ``throughput`` both and a non-zero step time; no made-up 0s.

    Args:
        step_stage: the stage that times a whole step ("step").
        num_gpus: GPUs the tokens are spread over (default: the number of ranks).
        world_size: see :class:`GlobalSeqlen`.

    Example:
        >>> import torch
        >>> metric = Throughput(num_gpus=2)
        >>> metric.update(timing_s={"step": 4.0, "gen": 3.0},
        ...               prompt_lengths=torch.tensor([100, 100]), response_lengths=torch.tensor([300, 500]))
        >>> {k: v.item() for k, v in metric.compute().items()}
        {'perf/total_num_tokens': 1000.0, 'perf/time_per_step': 4.0, 'perf/throughput': 125.0}
    """

    keys = ("perf/total_num_tokens", "perf/time_per_step", "perf/throughput")
    higher_is_better = True
    glossary = diagnostic("perf/throughput", aliases=("perf/total_num_tokens", "perf/time_per_step", "throughput"),
        what="Tokens processed per step, wall time per step, and tokens per second per GPU: the core efficiency "
        "metric.",
        unit="steps over the window; tokens summed over ranks, time of the slowest rank")

    def __init__(self, step_stage: str = "step", num_gpus: int | None = None, world_size: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(world_size, **kwargs)
        (self.step_stage,) = _check_stage_names("step_stage", step_stage)
        self.num_gpus = check_count("num_gpus", num_gpus)
        self.clock_stages = (self.step_stage,)

    data_counts = ("steps", "invalid")  # tokens per step need steps; each key checks its own inputs below

    def compute(self) -> dict[str, Tensor]:
        seconds, n, (timed,) = self.per_step()
        has_sequences, has_time = (torch.stack([self.sequences, seconds[0]]) > 0).tolist()
        tokens = safe_div(self.tokens_all, n, 0.0)
        gpus = self.num_gpus or self.num_ranks()
        out = {}
        if has_sequences:
            out[self.keys[0]] = tokens
        if timed:
            out[self.keys[1]] = seconds[0]
        if has_sequences and has_time:
            out[self.keys[2]] = tokens / (seconds[0] * gpus)
        return out


# MFU name -> (timing stage, FLOPs mode). verl's perf/mfu/actor is measured in the actor update,
# perf/mfu/actor_infer in the old-logprob forward pass.
DEFAULT_MFU_STAGES: dict[str, tuple[str, str | float]] = {
    "actor": ("update_actor", "train"),
    "actor_infer": ("old_log_prob", "forward"),
}


class ModelFlopsUtilization(_StageClock):
    r"""``perf/mfu/<name>``: model FLOPs utilisation of a stage.

    MFU = FLOPs of the step's sequences / (stage seconds x GPUs x peak FLOP/s). FLOPs come from a
    :class:`~opbc_metrics.functional.perf.TransformerFlops` estimate over all ranks' sequences
    (``2 N_active`` per token plus the attention term :math:`4 d L \sum s_i^2`), times 3 for a training
    stage (forward + backward) or 1 for a forward-only stage; the peak is the accelerator's dense bf16
    figure from :data:`~opbc_metrics.functional.perf.PEAK_FLOPS`, or ``peak_flops``. Stage seconds are the
    slowest rank's. Batch fields as :class:`Throughput`. A name whose stage was not timed (or took 0 s) in
    the window, or a window without sequence lengths, has no key.

    Args:
        flops: the model's FLOPs estimate.
        stages: ``{name: (timing stage, mode)}`` with mode ``"train"``, ``"forward"`` or a multiple of a
            forward pass (e.g. ``3 * ppo_epochs``); default ``actor`` (update_actor, train) and
            ``actor_infer`` (old_log_prob, forward).
        accelerator: device name looked up in the peak table (default: the current CUDA device).
        peak_flops: peak FLOP/s per device, overriding the table.
        num_gpus: default: the number of ranks.

    Example:
        >>> import torch
        >>> from opbc_metrics.functional.perf import TransformerFlops
        >>> flops = TransformerFlops(active_params=1e9, num_layers=1, attention_dim=1000)
        >>> metric = ModelFlopsUtilization(flops, stages={"actor": ("update_actor", "train")}, peak_flops=1e12)
        >>> metric.update(timing_s={"update_actor": 12.0}, prompt_lengths=torch.tensor([0]),
        ...               response_lengths=torch.tensor([1000]))
        >>> metric.compute()["perf/mfu/actor"]  # 3 * (2e9 * 1000 + 4 * 1000 * 1000**2) / (12 * 1e12)
        tensor(0.5010, dtype=torch.float64)
    """

    keys = BySettings(("perf/mfu/<name>",), lambda m: tuple(f"perf/mfu/{n}" for n in m.mfu_stages))
    higher_is_better = True
    glossary = diagnostic("perf/mfu", aliases=("perf/mfu/actor", "perf/mfu/actor_infer", "MFU"),
        what="Model FLOPs utilisation: the share of the GPUs' peak compute a stage actually used (actor: training "
        "update; actor_infer: forward-only inference). 50-60% is typical for training; below 30% GPUs wait on "
        "communication, data loading or load imbalance.",
        unit="steps over the window; FLOPs of all ranks' sequences over (slowest rank's stage time x GPUs x " "peak)")

    def __init__(self, flops: P.TransformerFlops, stages: Mapping[str, tuple[str, str | float]] | None = None,
                 accelerator: str | None = None, peak_flops: float | None = None, num_gpus: int | None = None,
                 world_size: int | None = None, **kwargs: Any) -> None:
        super().__init__(world_size, **kwargs)
        if not isinstance(flops, P.TransformerFlops):
            raise ValueError(f"`flops` must be a TransformerFlops, got {type(flops).__name__}")
        self.flops = flops
        stages = dict(DEFAULT_MFU_STAGES if stages is None else stages)
        names = _check_stage_names("stages", list(stages))
        self.mfu_stages = {n: (stages[n][0], P.flops_multiplier(stages[n][1])) for n in names}
        timing = tuple(dict.fromkeys(t for t, _ in self.mfu_stages.values()))
        _check_stage_names("timing stages", timing)
        self.peak = (check_positive("peak_flops", peak_flops) if peak_flops is not None
                     else P.peak_flops(accelerator if accelerator is not None else P.detect_accelerator()))
        self.num_gpus = check_count("num_gpus", num_gpus)
        self.clock_stages = timing

    def compute(self) -> dict[str, Tensor]:
        seconds, n, _ = self.per_step()
        if not float(self.sequences):
            return {}  # no FLOPs known: no made-up 0% utilisation
        steps = max(float(n), 1.0)
        tokens, sum_sq = float(self.tokens_all) / steps, float(self.sum_sq) / steps
        gpus = self.num_gpus or self.num_ranks()
        out = {}
        for name, (stage, mult) in self.mfu_stages.items():
            sec = float(seconds[self.clock_stages.index(stage)])
            if sec <= 0:
                continue  # not timed in the window (or 0 s): no utilisation to report
            value = P.mfu(mult * self.flops.forward_flops(tokens, sum_sq), sec, gpus, self.peak)
            out[f"perf/mfu/{name}"] = torch.tensor(value, dtype=F64, device=self.time.device)
        return out


# timing_s/agent_loop/*: per-sample times of agent loops
AGENT_GENERATE_S = "agent_generate_s"
AGENT_TOOL_CALLS_S = "agent_tool_calls_s"
AGENT_LOOP_KEYS = tuple(f"timing_s/agent_loop/{part}/{stat}" for part in ("generate_sequences", "tool_calls")
                        for stat in ("min", "max", "mean"))


class AgentLoopTiming(_TrainingMetric):
    """Per-sample agent-loop times, ``timing_s/agent_loop/{generate_sequences,tool_calls}/{min,max,mean}``.

    Batch fields (seconds per sample, [B]): ``agent_generate_s`` (time in generation), optional
    ``agent_tool_calls_s`` (time in tool calls, one per sample too: another length raises). Statistics over
    samples of the window and all ranks (a sample's time is its own, so no slowest-rank reduction applies); no
    data in the window: no keys.

    Example:
        >>> metric = AgentLoopTiming()
        >>> metric.update(agent_generate_s=[1.5, 4.0, 2.5], agent_tool_calls_s=[0.0, 3.0, 0.5])
        >>> [v.item() for v in metric.compute().values()]
        [1.5, 4.0, 2.6666666666666665, 0.0, 3.0, 1.1666666666666667]
    """

    keys = AGENT_LOOP_KEYS
    required_fields = (AGENT_GENERATE_S,)
    higher_is_better = False
    _deferred = (("invalid", (AGENT_GENERATE_S, AGENT_TOOL_CALLS_S), "negative or non-finite sample times"),)
    states = table(**{f"{part}_{stat}": state for part in ("gen", "tool")
                      for stat, state in (("sum", SUM), ("max", MAX), ("min", MIN), ("count", SUM))}, invalid=SUM)
    # Each part's keys need its own samples: a window without tool-call times has no tool_calls keys (not 0 s).
    data_counts = ("gen_count", "tool_count", "invalid")
    key_counts = tuple((key, "gen_count" if "/generate_sequences/" in key else "tool_count") for key in AGENT_LOOP_KEYS)
    glossary = diagnostic("timing_s/agent_loop", unit="samples over the window and all ranks",
        what="Distribution of per-sample generation and tool-call time in agentic rollouts: min, max, mean. A max far "
        "above the mean means one slow sample (long generation, slow or looping tools) bounds the batch.")

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        view.field(AGENT_GENERATE_S)  # required (a clear error when missing); the tool-call times are optional
        stats: dict[str, Tensor] = {}
        gen: Tensor | None = None
        for part, name in (("gen", AGENT_GENERATE_S), ("tool", AGENT_TOOL_CALLS_S)):
            if view.has(name):
                ref = stats.get("gen_sum")  # host values of the tool times go where the generation times are
                x, s = _count_stats(view, name, None if ref is None else ref.device)
                if gen is None:
                    gen = x
                else:  # one entry per sample on both sides: lists of other lengths are misaligned samples
                    check_same_shape(name, x, AGENT_GENERATE_S, gen)
                invalid = s.pop("invalid")
                stats["invalid"] = invalid if ref is None else stats["invalid"] + invalid
                stats.update({f"{part}_{stat}": value for stat, value in s.items()})
        return stats

    def compute(self) -> dict[str, Tensor]:  # min, max, mean of each part, as the turn counts
        parts = (("gen", self.keys[:3]), ("tool", self.keys[3:]))
        return {key: value for part, keys in parts for key, value in _turns_compute(
            *(getattr(self, f"{part}_{stat}") for stat in ("sum", "max", "min", "count")), keys=keys).items()}


AGENT_SLOWEST_KEYS = tuple(f"timing_s/agent_loop/slowest/{part}"
                           for part in ("generate_sequences", "tool_calls", "prompt_length", "response_length"))


class AgentLoopSlowest(_PerRank):
    """The slowest agent-loop sample of the window, ``timing_s/agent_loop/slowest/*`` (as verl reports it).

    The slowest sample is the one with the largest generation + tool-call time over the window and all
    ranks; its ``generate_sequences`` and ``tool_calls`` seconds and its ``prompt_length`` and
    ``response_length`` are reported. Batch fields [B]: ``agent_generate_s`` (required),
    ``agent_tool_calls_s`` (0 s in the total when absent), ``prompt_lengths``, ``response_lengths``; a field the
    slowest sample's batch did not carry has no key (its value is unknown, not 0).

    An argmax does not merge by sum, max or min, so each rank keeps its own slowest sample in its own
    slot (the sync sums the slots: exact), ``update`` keeps the slower of the slot and the batch's
    slowest with ``torch.where`` (no host sync), and merging two states of one rank (``forward``,
    ``merge_state``) keeps the slower row. ``compute`` picks the slowest slot. Ties keep the earlier
    sample. No data in the window: no keys.

    Example:
        >>> metric = AgentLoopSlowest()
        >>> metric.update(agent_generate_s=[1.0, 4.0], agent_tool_calls_s=[3.5, 0.0], response_lengths=[90, 300])
        >>> metric.update(agent_generate_s=[2.0], agent_tool_calls_s=[1.0], response_lengths=[120])
        >>> {k.split("/")[-1]: v.item() for k, v in metric.compute().items()}  # no prompt_lengths: no key
        {'generate_sequences': 1.0, 'tool_calls': 3.5, 'response_length': 90.0}
    """

    keys = AGENT_SLOWEST_KEYS
    required_fields = (AGENT_GENERATE_S,)
    higher_is_better = False
    _FIELDS = (AGENT_GENERATE_S, AGENT_TOOL_CALLS_S, "prompt_lengths", "response_lengths")
    _deferred = (("invalid", _FIELDS, "negative or non-finite values"),)
    # Per slot: total seconds, generation, tool calls, prompt length, response length; an optional field the batch
    # did not carry as _ABSENT (every value is >= 0), left out at compute.
    states = table(slowest=SUM.of("slots", 5), seen=SUM.of("slots"), invalid=SUM)
    _ABSENT = -1.0
    glossary = diagnostic("timing_s/agent_loop/slowest", unit="the single slowest sample over the window and all ranks",
        what="Details of the slowest agentic rollout sample of the step (largest generation + tool-call time): its "
        "generation and tool-call seconds and its prompt and response lengths, to tell a long generation from a slow "
        "or looping tool.")

    def _update_view(self, view: BatchView) -> None:
        gen, invalid = nonnegative_field(view, AGENT_GENERATE_S)
        cols = [gen]
        for name in self._FIELDS[1:]:
            if view.has(name):
                x, bad = nonnegative_field(view, name, device=gen.device)
                check_same_shape(name, x, AGENT_GENERATE_S, gen)
                invalid = invalid + bad
            else:
                x = torch.full_like(gen, self._ABSENT)
            cols.append(x)
        if gen.numel() == 0:  # shape metadata, not data
            self.accumulate(invalid=invalid)
            return
        rows = torch.stack([cols[0] + cols[1].clamp(min=0.0), *cols], dim=1)  # [B, 5]
        if rows.device != self.slowest.device:  # as OPBCMetric.accumulate: host data moves, other devices raise
            if rows.device.type != "cpu":
                raise ValueError(f"batch field `{AGENT_GENERATE_S}` is on {rows.device} but the metric's states "
                                 f"are on {self.slowest.device}")
            rows = rows.to(self.slowest.device)
        best = rows.index_select(0, torch.argmax(rows[:, 0]).reshape(1))[0]  # tensor index: no sync
        rank = self.current_rank()
        slot, seen = self.slowest[rank], self.seen[rank]
        better = (best[0] > slot[0]) | (seen == 0)
        self.slowest[rank] = torch.where(better, best.to(self.slowest.dtype), slot)
        self.seen[rank] += 1.0
        self.accumulate(invalid=invalid)

    def _reduce_states(self, incoming_state: dict[str, Any]) -> None:
        local_rows, local_seen = self.slowest.clone(), self.seen.clone()
        super()._reduce_states(incoming_state)  # sums every state, the rows included: fixed below
        in_rows = incoming_state["slowest"].to(local_rows.device)
        in_seen = incoming_state["seen"].to(local_seen.device)
        take = (in_seen > 0) & ((local_seen == 0) | (in_rows[:, 0] > local_rows[:, 0]))
        self.slowest = torch.where(take[:, None], in_rows, local_rows)

    def compute(self) -> dict[str, Tensor]:
        totals = torch.where(self.seen > 0, self.slowest[:, 0], torch.full_like(self.seen, float("-inf")))
        row = self.slowest[torch.argmax(totals)] * (self.seen.sum() > 0)
        carried = (row[1:] != self._ABSENT).tolist()  # (compute: a host read is allowed)
        return {k: v for k, v, c in zip(self.keys, row[1:], carried, strict=True) if c}
