"""Stateful rollout-group metrics (sections ``rollout`` and ``sample_metrics``), thin classes over
:mod:`opbc_metrics.functional.rollout`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any, ClassVar

import torch
from torch import Tensor

from opbc_metrics.batch import GROUP_IDS, BatchView
from opbc_metrics.functional.rollout import (
    ADVANTAGE_KEYS,
    ADVANTAGES,
    BAD_COUNTS,
    BAD_LAGS,
    COMPLETION_TOKEN_KEYS,
    DISCARD_KEYS,
    DISCARD_REASONS,
    DISCARD_SHARE_KEYS,
    DISCARDED_GROUP_KEYS,
    DISCARDED_STOP_KEY,
    DISCARDED_TOKEN_KEYS,
    LENGTH_CODE,
    LENGTH_CV_KEY,
    LENGTH_GINI_KEY,
    LENGTH_RATIO_KEY,
    NONFINITE,
    OFF_POLICY_KEYS,
    POLICY_LAG,
    PROMPT_LENGTHS,
    PROMPT_TOKEN_KEYS,
    RESPONSE_LENGTHS,
    REWARD_GINI_KEY,
    REWARD_KEYS,
    REWARDS,
    SAMPLE_METRICS,
    SAMPLE_METRICS_SECTION,
    SAMPLE_STATS,
    STATS,
    STOP_LENGTH_PCT_KEY,
    STOP_REASONS,
    TOTAL_TOKEN_KEYS,
    ZERO_ADVANTAGE_SPLIT_KEYS,
    _advantage_stats_update,
    _completion_token_stats_update,
    _discard_compute,
    _discard_update,
    _discarded_stats_compute,
    _discarded_stats_update,
    _length_cv_update,
    _length_gini_update,
    _length_ratio_update,
    _mean_over_groups,
    _moments_dict,
    _off_policy_update,
    _prompt_token_stats_update,
    _reward_gini_update,
    _reward_stats_update,
    _sample_compute,
    _sample_update,
    _stop_compute,
    _stop_update,
    _total_token_stats_update,
    check_sample_metric_names,
    sample_metric_keys,
    stop_codes_what,
)
from opbc_metrics.functional.statistics import Stats, raise_if_invalid
from opbc_metrics.metric import MAX, MIN, BySettings, GlossaryEntry, OPBCMetric, State, table

__all__ = ["ROLLOUT_METRICS", "CompletionLengthCV", "CompletionLengthGini", "CompletionLengthMaxMedianRatio",
           "CompletionTokenStats", "DiscardedRolloutStats", "DiscardedRollouts", "OffPolicySteps", "PromptTokenStats",
           "RolloutAdvantageStats", "RolloutRewardGini", "RolloutRewardStats", "SampleMetricStats",
           "StopReasonLengthPct", "TotalTokenStats", "chart_ranges", "rollout_metrics", "rollout_section"]

Range = tuple[float | None, float | None]

_SAMPLES = "rollout samples (one per completion), over the batches since the last reset and all ranks"
_GROUPS = (
    "prompt groups (group_ids) seen since the last reset on all ranks; each group must arrive whole in one "
    "update on one rank"
)
_DIAGNOSTIC = "none (diagnostic)"
_NO_ACTION = "no OPBC action; a dashboard signal"
#: ``_entry(name, what, ...)``: a glossary entry of this section, a diagnostic over samples unless it says otherwise.
_entry = partial(GlossaryEntry, unit=_SAMPLES, cap=_DIAGNOSTIC, action=_NO_ACTION)


def _check_range(name: str, value: Any) -> Range:
    """A declared ``(lo, hi)`` chart range; either bound may be None (then the observed one is used)."""
    try:
        lo, hi = value
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be a pair (lo, hi), got {value!r}") from None
    out = []
    for bound in (lo, hi):
        if bound is not None:
            bound = float(bound)
            if not math.isfinite(bound):
                raise ValueError(f"`{name}` bounds must be finite numbers or None, got {value!r}")
        out.append(bound)
    if out[0] is not None and out[1] is not None and out[0] > out[1]:
        raise ValueError(f"`{name}` must have lo <= hi, got {value!r}")
    return out[0], out[1]


def _resolve(declared: Range, seen_lo: float, seen_hi: float) -> tuple[float, float] | None:
    """Declared bounds where given, the observed ones otherwise; None while a bound is still unknown."""
    lo = declared[0] if declared[0] is not None else (seen_lo if math.isfinite(seen_lo) else None)
    hi = declared[1] if declared[1] is not None else (seen_hi if math.isfinite(seen_hi) else None)
    if lo is None or hi is None:
        return None
    return lo, max(lo, hi)


def _stat_ranges(prefix: str, rng: tuple[float, float], gini: bool = False) -> dict[str, tuple[float, float]]:
    lo, hi = rng
    out = {f"{prefix}/{s}": (lo, hi) for s in ("mean", "min", "max")}
    out[f"{prefix}/std"] = (0.0, (hi - lo) / math.sqrt(2.0))  # the largest sample std of values in [lo, hi]
    if gini and lo >= 0.0:
        out[f"{prefix}/group_gini_mean"] = (0.0, 1.0)
    return out


def _check_length_code(length_code: Any) -> int:
    if not isinstance(length_code, int) or isinstance(length_code, bool):
        raise ValueError(f"`length_code` must be an int, got {length_code!r}")
    return length_code


class _RolloutMetric(OPBCMetric):
    """Base of the rollout metrics: optional inputs (a collection skips them on batches without their fields).

    ``kernel`` is the batch statistics (the functional ``_x_update``) of a metric without settings. The
    ``invalid`` state counts bad values (``invalid_what``); ``compute()`` raises on them, naming
    ``invalid_field`` (default: the first required field).
    """

    optional_inputs = True
    data_counts = ("count", "groups", "seen", "invalid")  # invalid: compute() raises on them
    kernel: ClassVar[Callable[[BatchView], Stats]]
    invalid_field: ClassVar[str | tuple[str, ...]] = ""
    invalid_what: ClassVar[str] = NONFINITE

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        return self.kernel(view)

    def _raise_if_invalid(self) -> None:
        raise_if_invalid(self.invalid_field or self.required_fields[0], self.invalid, self.invalid_what)


class _ObservedRange(OPBCMetric):
    """Keeps the run's observed min/max of the ``min``/``max`` states, across resets, for chart ranges.

    The observed range is updated in ``compute()`` (after the DDP sync, so it is global on every rank);
    it lives in non-persistent buffers, so it moves with ``.to(device)`` but is not in the state dict.
    """

    def _init_observed(self, shape: tuple[int, ...] = ()) -> None:
        self.register_buffer("observed_min", torch.full(shape, math.inf, dtype=torch.float64), persistent=False)
        self.register_buffer("observed_max", torch.full(shape, -math.inf, dtype=torch.float64), persistent=False)

    def _observe(self, lo: Tensor, hi: Tensor) -> None:
        torch.minimum(self.observed_min, lo, out=self.observed_min)
        torch.maximum(self.observed_max, hi, out=self.observed_max)


_MOMENTS = table("count", "total", "total_sq", "total_hi", "total_sq_hi", "invalid", min=MIN, max=MAX)


class _MomentStats(_RolloutMetric, _ObservedRange):
    """Mean, sample std (n - 1), min and max of one per-sample quantity (keys ``<prefix>/{mean,std,min,max}``).

    The std key is left out while the window holds fewer than two samples (the sample std is undefined).
    """

    states = _MOMENTS

    def __init__(self, value_range: Range = (None, None), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.declared_range = _check_range("value_range", value_range)
        self._init_observed()

    def compute(self) -> dict[str, Tensor]:
        self._raise_if_invalid()
        self._observe(self.min, self.max)
        return _moments_dict(self.keys, **self.state_values(exclude=("invalid",)))

    def chart_ranges(self) -> dict[str, tuple[float, float]]:
        """``{key: (lo, hi)}`` for the charts: the declared range, else the run's observed min/max.

        ``std`` gets ``(0, (hi - lo) / sqrt(2))``. Empty until a bound is known (declared or observed by a
        ``compute()``). Reads two scalars to the host: call it when logging, not in the training step.
        """
        rng = _resolve(self.declared_range, float(self.observed_min), float(self.observed_max))
        return {} if rng is None else _stat_ranges(self.keys[0].rsplit("/", 1)[0], rng)


class RolloutRewardStats(_MomentStats):
    r"""Per-step reward statistics ``rollout/reward/{mean,std,min,max}`` (the UI's Reward tab).

    Over the samples of the window: mean, sample std (divide by n - 1, as Telescope; no std key for a
    single sample), min and max of the total
    reward per sample. ``rewards`` is ``[B]``, or ``[B, T]`` token-level rewards summed per sample over
    the response tokens (a sample without response tokens has no reward and is left out). ``reward_min`` /
    ``reward_max`` are the environment's declared reward range: metadata for the charts (:meth:`chart_ranges`),
    never used in the values; an undeclared bound is the run's observed one. Non-finite rewards raise a
    ``ValueError`` naming ``rewards`` at ``compute()``.
    No data in the window: no keys.

    Args:
        reward_min: the declared lower bound of the reward (None: observed).
        reward_max: the declared upper bound (None: observed).
        kwargs: torchmetrics ``Metric`` arguments.

    Example:
        >>> import torch
        >>> metric = RolloutRewardStats(reward_min=0.0, reward_max=1.0)
        >>> metric.update(rewards=torch.tensor([1.0, 0.0]))
        >>> metric.update(rewards=torch.tensor([0.0, 1.0]))
        >>> {k.split('/')[-1]: v.item() for k, v in metric.compute().items()}
        {'mean': 0.5, 'std': 0.5773502691896257, 'min': 0.0, 'max': 1.0}
        >>> metric.chart_ranges()["rollout/reward/mean"], metric.chart_ranges()["rollout/reward/std"]
        ((0.0, 1.0), (0.0, 0.7071067811865475))
    """

    keys, required_fields, higher_is_better = REWARD_KEYS, (REWARDS,), True
    kernel = staticmethod(_reward_stats_update)
    glossary = _entry(
        "Reward (rollout)",
        "Per-step statistics (mean, sample std (n - 1), min, max) of the total reward each sample received "
        "from the environment (RewardResult.total_reward). Declared reward_min/reward_max only normalise "
        "the charts.",
        aliases=("reward", "reward_mean", "reward_std"),
    )

    def __init__(self, reward_min: float | None = None, reward_max: float | None = None, **kwargs: Any) -> None:
        super().__init__(value_range=(reward_min, reward_max), **kwargs)
        self.reward_min, self.reward_max = self.declared_range


class RolloutAdvantageStats(_MomentStats):
    r"""Per-step advantage statistics ``rollout/advantage/{mean,std,min,max}`` (the UI's Advantage tab).

    ``advantages`` is ``[B]``, or ``[B, T]`` averaged per sample over the response tokens (a sample
    without response tokens is left out). How advantages are normalised depends on the algorithm; with
    GRPO's group normalisation the mean is ~0. No data in the window: no keys.

    Example:
        >>> import torch
        >>> metric = RolloutAdvantageStats()
        >>> metric.update(advantages=torch.tensor([[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5]]),
        ...               response_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]))
        >>> [round(v.item(), 4) for v in metric.compute().values()]
        [0.0, 0.7071, -0.5, 0.5]
    """

    keys, required_fields = ADVANTAGE_KEYS, (ADVANTAGES,)
    kernel = staticmethod(_advantage_stats_update)
    glossary = _entry("Advantage (rollout)", "Per-step statistics (mean, sample std (n - 1), min, max) of the "
                      "per-sample advantage. A std near 0 means most groups carry no learning signal.",
                      unit=_SAMPLES + " (a [B, T] field is averaged over each sample's response tokens)",
                      aliases=("advantage",))


class PromptTokenStats(_MomentStats):
    r"""Prompt token counts per step, ``rollout/tokens_prompt/{mean,std,min,max}`` (Tokens (Prompt)).

    ``prompt_lengths`` is a ``[B]`` tensor of token counts; negative or non-finite counts raise a
    ``ValueError`` naming the field at ``compute()``. With ``group_ids``, each prompt group's prompt is
    counted once (the samples of a group share one prompt; the group's first sample gives its length),
    as Telescope counts prompts; without them, every sample counts.

    Example:
        >>> import torch
        >>> metric = PromptTokenStats()
        >>> metric.update(prompt_lengths=torch.tensor([55, 55, 329]), group_ids=torch.tensor([0, 0, 1]))
        >>> [round(v.item(), 4) for v in metric.compute().values()]  # two prompts: 55 and 329
        [192.0, 193.7473, 55.0, 329.0]
    """

    keys, required_fields, invalid_what = PROMPT_TOKEN_KEYS, (PROMPT_LENGTHS,), BAD_COUNTS
    kernel = staticmethod(_prompt_token_stats_update)
    glossary = _entry("Tokens (Prompt)", "Distribution of prompt token counts in the step: mean, sample std (n - 1), "
                      "min, max; each prompt group's prompt counted once when group_ids are given (Telescope).")


class CompletionTokenStats(_MomentStats):
    r"""Completion token counts per step, ``rollout/tokens_completion/{mean,std,min,max}`` (Tokens (Completion)).

    ``response_lengths`` is ``[B]``: the completion tokens of each sample, summed across turns for
    multi-turn rollouts.

    Example:
        >>> import torch
        >>> metric = CompletionTokenStats()
        >>> metric.update(response_lengths=torch.tensor([10, 20, 30, 40]))
        >>> [round(v.item(), 4) for v in metric.compute().values()]
        [25.0, 12.9099, 10.0, 40.0]
    """

    keys, required_fields, invalid_what = COMPLETION_TOKEN_KEYS, (RESPONSE_LENGTHS,), BAD_COUNTS
    kernel = staticmethod(_completion_token_stats_update)
    glossary = _entry("Tokens (Completion)", "Distribution of completion token counts in the step (summed across "
                      "turns for multi-turn): mean, sample std (n - 1), min, max.")


class TotalTokenStats(_MomentStats):
    r"""Total tokens per sample (prompt + completion), ``rollout/tokens_total/{mean,std,min,max}``.

    Example:
        >>> import torch
        >>> metric = TotalTokenStats()
        >>> metric.update(prompt_lengths=torch.tensor([100, 300]), response_lengths=torch.tensor([10, 30]))
        >>> [round(v.item(), 4) for v in metric.compute().values()]
        [220.0, 155.5635, 110.0, 330.0]
    """

    keys, invalid_what = TOTAL_TOKEN_KEYS, BAD_COUNTS
    required_fields = invalid_field = (PROMPT_LENGTHS, RESPONSE_LENGTHS)
    kernel = staticmethod(_total_token_stats_update)
    glossary = _entry("Tokens (Total)", "Distribution of total tokens per sample (prompt + completion) in the "
                      "step: mean, sample std (n - 1), min, max.")


class _GroupMean(_RolloutMetric):
    """A per-group value averaged over the groups of the window: states ``(value_sum, groups)``."""

    empty_value: ClassVar[float] = 0.0
    states = table("value_sum", "groups", "invalid")

    def compute(self) -> Tensor:
        self._raise_if_invalid()
        return _mean_over_groups(self.value_sum, self.groups, self.empty_value)


class RolloutRewardGini(_GroupMean):
    r"""Reward Gini per prompt group, averaged over groups: ``rollout/reward/group_gini_mean``.

    Per group of n samples, :math:`G = \sum_i\sum_j |x_i - x_j| / (2 n^2 \bar x)` (population Gini;
    0 for a group of one or a non-positive reward sum), then the mean over the window's groups. It
    measures reward sparsity: 0 = every sample of a group got the same reward, toward 1 = the reward
    is concentrated in few samples. Needs ``rewards`` and ``group_ids``; a group must arrive whole in
    one update on one rank (GRPO generates and scores a group together). No data in the window: no keys.

    Example:
        >>> import torch
        >>> metric = RolloutRewardGini()
        >>> metric.update(rewards=torch.tensor([1.0, 0.0, 0.0, 0.0]), group_ids=torch.tensor([7, 7, 7, 7]))
        >>> metric.update(rewards=torch.tensor([1.0, 1.0]), group_ids=torch.tensor([3, 3]))
        >>> metric.compute()  # (0.75 + 0) / 2
        tensor(0.3750, dtype=torch.float64)
    """

    keys, required_fields = (REWARD_GINI_KEY,), (REWARDS, GROUP_IDS)
    kernel = staticmethod(_reward_gini_update)
    glossary = _entry(
        "Reward Gini (group mean)",
        "Population Gini coefficient of the rewards within each prompt group, averaged across groups: "
        "reward sparsity. 0 = all samples of a group got the same reward; toward 1 = extreme concentration.",
        unit=_GROUPS,
        action="no OPBC action; groups with Gini 0 carry no GRPO advantage (see rollout/discarded/zero_advantage)",
        aliases=("reward_gini", "group_reward_gini_mean"),
    )


class CompletionLengthGini(_GroupMean):
    r"""``group_length_gini_mean``: Gini of completion lengths within prompt groups, averaged across groups.

    Key ``rollout/tokens_completion/group_gini_mean``. Measures within-group length inequality
    (population Gini, 0 for a group of one or all-empty completions). No data in the window: no keys.

    Example:
        >>> import torch
        >>> metric = CompletionLengthGini()
        >>> metric.update(response_lengths=torch.tensor([10, 30, 20, 20]), group_ids=torch.tensor([0, 0, 1, 1]))
        >>> metric.compute()  # group 0: 20 / (2 * 4 * 20) = 0.25; group 1: 0
        tensor(0.1250, dtype=torch.float64)
    """

    keys, required_fields, invalid_what = (LENGTH_GINI_KEY,), (RESPONSE_LENGTHS, GROUP_IDS), BAD_COUNTS
    kernel = staticmethod(_length_gini_update)
    glossary = _entry("group_length_gini_mean", "Gini coefficient of completion lengths within prompt groups, "
                      "averaged across groups: within-group length inequality.", unit=_GROUPS)


class CompletionLengthMaxMedianRatio(_GroupMean):
    r"""``group_length_max_median_ratio_mean``: max/median completion length per group, averaged.

    Key ``rollout/tokens_completion/group_max_median_ratio_mean``. As Telescope: lengths are not floored
    (``[0, 2]`` gives 2), an even-sized group's median is the mean of its two middle lengths, and a group
    whose median is 0 has no ratio and is left out of the mean. A straggler indicator: values close to 1
    mean the completions of a group are roughly equal in length. No data in the window: no keys.

    Example:
        >>> import torch
        >>> metric = CompletionLengthMaxMedianRatio()
        >>> metric.update(response_lengths=torch.tensor([10, 20, 30, 5, 5]), group_ids=torch.tensor([0, 0, 0, 1, 1]))
        >>> metric.compute()  # (30 / 20 + 5 / 5) / 2
        tensor(1.2500, dtype=torch.float64)
    """

    keys, required_fields, invalid_what = (LENGTH_RATIO_KEY,), (RESPONSE_LENGTHS, GROUP_IDS), BAD_COUNTS
    empty_value, higher_is_better = 1.0, False
    kernel = staticmethod(_length_ratio_update)
    glossary = _entry(
        "group_length_max_median_ratio_mean",
        "Max/median ratio of completion lengths within prompt groups, averaged across groups (Telescope: "
        "no length floor; a group with median 0 has no ratio and is left out): a straggler indicator; close "
        "to 1 = completions of a group are roughly equal length.",
        unit=_GROUPS,
        action="no OPBC action; high values mean a few long generations hold up each group's step",
    )


class CompletionLengthCV(_GroupMean):
    r"""``group_length_cv_mean``: coefficient of variation of completion lengths within prompt groups, averaged.

    Key ``rollout/tokens_completion/group_cv_mean``. Per group, the sample std (n - 1) of its completion
    lengths over their mean (Telescope's definition); a group of one sample or with mean 0 has no CV and is
    left out of the mean. Scale-free, unlike the std: 0.5 means a group's lengths typically differ from
    their mean by half of it. No group with a CV in the window: no key.

    Example:
        >>> import torch
        >>> metric = CompletionLengthCV()
        >>> metric.update(response_lengths=torch.tensor([10, 30, 20, 20, 7]), group_ids=torch.tensor([0, 0, 1, 1, 2]))
        >>> metric.compute()  # group 0: 14.14 / 20; group 1: 0; group 2 (one sample): left out
        tensor(0.3536, dtype=torch.float64)
    """

    keys, required_fields, invalid_what = (LENGTH_CV_KEY,), (RESPONSE_LENGTHS, GROUP_IDS), BAD_COUNTS
    higher_is_better = False
    kernel = staticmethod(_length_cv_update)
    glossary = _entry("group_length_cv_mean", "Coefficient of variation (sample std / mean) of completion lengths "
                      "within prompt groups, averaged across groups (Telescope); groups of one sample or with mean "
                      "length 0 are left out. Within-group length spread, independent of the typical length.",
                      unit=_GROUPS)


class OffPolicySteps(_MomentStats):
    r"""How far behind the rollouts' weights were, ``rollout/off_policy_steps/{mean,std,min,max}``.

    ``policy_lag`` is ``[B]``: the number of trainer steps between the weights that generated each
    rollout and the weights being trained (0 on-policy). Statistics over the rollouts of the window, with
    the sample std (n - 1). A negative or non-finite lag raises a ``ValueError`` naming ``policy_lag`` at
    ``compute()``.

    Example:
        >>> import torch
        >>> metric = OffPolicySteps()
        >>> metric.update(policy_lag=torch.tensor([0, 1, 2, 1]))
        >>> [round(v.item(), 4) for v in metric.compute().values()]
        [1.0, 0.8165, 0.0, 2.0]
    """

    keys, required_fields, invalid_what = OFF_POLICY_KEYS, (POLICY_LAG,), BAD_LAGS
    higher_is_better = False
    kernel = staticmethod(_off_policy_update)
    glossary = _entry(
        "off_policy_steps",
        "Off-policy steps per rollout: trainer steps between the weights that generated the rollout and "
        "the weights being trained (policy_lag); mean, sample std (n - 1), min, max over the step's rollouts.",
        cap="rollouts with lag > max_off_policy_steps are discarded (rollout/discarded/max_async)",
        aliases=("policy_lag", "off_policy_steps_mean", "async_level"),
    )


class StopReasonLengthPct(_RolloutMetric):
    r"""``stop_reason_length_pct``: percentage (0-100) of samples that hit the token length limit.

    Key ``rollout/stop_reason/length_pct``. ``stop_reasons`` is a ``[B]`` int tensor of codes (see
    :data:`~opbc_metrics.functional.rollout.STOP_REASON_CODES`: 0 stop, 1 length, 2 abort; the code of
    truncation is ``length_code``), a ``[B]`` bool tensor (True = truncated), or a list of finish-reason
    strings where ``"length"`` marks truncation (vLLM / SGLang / OpenAI ``finish_reason``, verl's
    ``stop_reason``: :data:`~opbc_metrics.functional.rollout.STOP_REASON_STRINGS`). An unknown string raises a
    ``ValueError`` in ``update``; an int code other than 0, 1, 2 and ``length_code`` is counted there (no
    host sync) and makes ``compute()`` raise one naming ``stop_reasons``. No data: no key.

    Args:
        length_code: the int code that marks truncation (1).

    Example:
        >>> import torch
        >>> metric = StopReasonLengthPct()
        >>> metric.update(stop_reasons=["stop", "length", "stop", "stop"])
        >>> metric.update(stop_reasons=torch.tensor([1, 1, 0, 2]))
        >>> metric.compute()  # 3 of 8
        tensor(37.5000, dtype=torch.float64)
    """

    keys, required_fields, higher_is_better = (STOP_LENGTH_PCT_KEY,), (STOP_REASONS,), False
    states = table("length", "count", "invalid")
    plot_lower_bound, plot_upper_bound = 0.0, 100.0
    glossary = _entry("stop_reason_length_pct", "Percentage of samples that hit the token length limit (finish "
                      "reason 'length').", action="no OPBC action; a high value may indicate that max_token_len "
                      "is too low", aliases=("truncation_pct",))

    def __init__(self, length_code: int = LENGTH_CODE, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.length_code = _check_length_code(length_code)

    @property
    def invalid_what(self) -> str:  # type: ignore[override]
        return stop_codes_what(self.length_code)

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        stats = _stop_update(view, self.length_code, self.device)
        return {"length": stats["length"], "count": stats["count"], "invalid": stats["invalid"]}  # not the hits

    def compute(self) -> Tensor:
        self._raise_if_invalid()  # int codes outside the known ones, counted by update (no sync there)
        return _stop_compute(self.length, self.count)


class DiscardedRollouts(_RolloutMetric):
    r"""Discarded rollouts by reason: ``rollout/discarded/{max_async, zero_advantage, total, pct}``.

    Rollouts discarded and not trained on: ``max_async``, generated with weights too many steps
    behind (``max_off_policy_steps``); ``zero_advantage``, all samples of the group got the same reward,
    so the advantage is 0 (``discard_group_zero_advantage``). ``discard_reasons`` holds one code per
    generated rollout, kept ones included: a ``[B]`` int tensor (0 kept, 1 max_async, 2 zero_advantage;
    :func:`~opbc_metrics.functional.rollout.discard_reasons` computes it from rewards, group ids and the
    policy lag) or a list of ``"max_async"`` / ``"zero_advantage"`` / ``None``. Counts are rollouts
    summed over the window; ``pct`` is the discarded share of all rollouts seen, in percent. When
    something was discarded, ``max_async_pct`` and ``zero_advantage_pct`` give each reason's share of the
    discarded rollouts (percent; they sum to 100). With ``rewards`` in the batch, the zero-advantage
    discards are split by their reward (every sample of such a group got the same one):
    ``zero_advantage_all_zero`` (reward 0: the whole group failed), ``zero_advantage_all_positive`` (a
    positive reward: the whole group succeeded), and ``zero_advantage_reward_mean`` over them. Other int
    codes raise a ``ValueError`` naming ``discard_reasons`` at ``compute()``. No data in the window: no keys.

    Example:
        >>> import torch
        >>> metric = DiscardedRollouts()
        >>> metric.update(discard_reasons=["max_async", None, "zero_advantage", "zero_advantage"],
        ...               rewards=torch.tensor([0.5, 1.0, 1.0, 1.0]))
        >>> {k.split('/')[-1]: round(v.item(), 2) for k, v in metric.compute().items()}
        ... # doctest: +NORMALIZE_WHITESPACE
        {'max_async': 1.0, 'zero_advantage': 2.0, 'total': 3.0, 'pct': 75.0, 'max_async_pct': 33.33,
         'zero_advantage_pct': 66.67, 'zero_advantage_all_zero': 0.0, 'zero_advantage_all_positive': 2.0,
         'zero_advantage_reward_mean': 1.0}
    """

    keys = (*DISCARD_KEYS, *DISCARD_SHARE_KEYS, *ZERO_ADVANTAGE_SPLIT_KEYS)
    required_fields = (DISCARD_REASONS,)
    invalid_what, higher_is_better = "codes outside {0, 1, 2}", False
    glossary = _entry(
        "Discarded rollouts",
        "Rollouts discarded and not used for training, counted by reason: max_async (generated with "
        "weights too many steps behind) and zero_advantage (every sample of the group got the same reward, or "
        "the same advantage within 1e-9; never a group of one), their total and share of all rollouts (pct), "
        "each reason's share of the discarded (max_async_pct, zero_advantage_pct), and the zero-advantage "
        "discards split into all-zero and all-positive reward with their mean reward (Telescope).",
        unit="generated rollouts (samples, not groups), summed over the window and all ranks",
        cap="policy lag > max_off_policy_steps (max_async); a group with all-equal rewards when "
        "discard_group_zero_advantage is set (zero_advantage)",
        action="the rollout (max_async) or its whole group (zero_advantage) is dropped before the training step",
        aliases=("max_async", "zero_advantage", "discarded"),
    )

    states = table("max_async", "zero_advantage", "seen", "invalid", "rewarded", "za_rewarded", "za_all_zero",
                   "za_all_positive", "za_reward_sum")

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        return _discard_update(view, self.device)

    def compute(self) -> dict[str, Tensor]:
        self._raise_if_invalid()
        return _discard_compute(**self.state_values(exclude=("invalid",)))


class DiscardedRolloutStats(_RolloutMetric):
    r"""What the discarded rollouts looked like: ``rollout/discarded/tokens_completion/{mean,std,min,max,
    group_gini_mean,group_max_median_ratio_mean}`` and ``rollout/discarded/stop_reason/length_pct``.

    The completion-length statistics, the per-group length Gini and max/median ratio, and the truncated
    share of the rollouts discarded in the window (``discard_reasons`` 1 max_async or 2 zero_advantage),
    with the definitions of the same keys over all rollouts: sample std, Gini and max/median over each
    group's discarded rollouts (needs ``group_ids``), length share over the discarded rollouts' stop
    reasons (needs ``stop_reasons``). A key without data in the window (nothing discarded, no groups, no
    stop reasons) is left out.

    Args:
        length_code: the int stop-reason code that marks truncation (1).
        kwargs: torchmetrics ``Metric`` arguments.

    Example:
        >>> import torch
        >>> metric = DiscardedRolloutStats()
        >>> metric.update(discard_reasons=torch.tensor([2, 2, 0, 1]), response_lengths=torch.tensor([10, 30, 500, 20]),
        ...               group_ids=torch.tensor([0, 0, 1, 1]), stop_reasons=["stop", "length", "length", "stop"])
        >>> out = metric.compute()
        >>> [round(out[f"rollout/discarded/{k}"].item(), 4) for k in ("tokens_completion/mean",
        ...  "tokens_completion/group_max_median_ratio_mean", "stop_reason/length_pct")]
        [20.0, 1.25, 33.3333]
    """

    keys = (*DISCARDED_TOKEN_KEYS, *DISCARDED_GROUP_KEYS, DISCARDED_STOP_KEY)
    required_fields, invalid_field = (DISCARD_REASONS, RESPONSE_LENGTHS), RESPONSE_LENGTHS
    invalid_what, higher_is_better = BAD_COUNTS + " or discard codes outside {0, 1, 2}", None
    glossary = _entry(
        "Discarded rollout statistics",
        "Token (completion length mean, sample std, min, max), per-group length Gini and max/median "
        "ratio, and stop-reason (length_pct) statistics of the rollouts discarded in the step (max_async or "
        "zero_advantage), with the definitions of the same statistics over all rollouts (Telescope).",
        unit="discarded rollouts (and their prompt groups), over the window and all ranks",
    )
    states = table("count", "total", "total_sq", "total_hi", "total_sq_hi", "invalid", "gini_sum", "gini_groups",
                   "ratio_sum", "ratio_groups", "stop_length", "stop_count", "stop_invalid", min=MIN, max=MAX)
    data_counts = (*_RolloutMetric.data_counts, "stop_invalid")  # compute() raises on them

    def __init__(self, length_code: int = LENGTH_CODE, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.length_code = _check_length_code(length_code)

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        return _discarded_stats_update(view, self.length_code, self.device)

    def compute(self) -> dict[str, Tensor]:
        self._raise_if_invalid()
        raise_if_invalid(STOP_REASONS, self.stop_invalid, stop_codes_what(self.length_code))
        return _discarded_stats_compute(**self.state_values(exclude=("invalid", "stop_invalid")))


_SAMPLE_FIELDS = (SAMPLE_METRICS, GROUP_IDS)


class SampleMetricStats(_RolloutMetric, _ObservedRange):
    r"""Per-sample environment metrics: ``sample_metrics/<name>/{mean,std,min,max,group_gini_mean}``.

    The environment returns any per-sample numbers (reward components, tool-call counts, reasoning
    steps, ...) in ``sample_metrics``; per step they are aggregated into mean, sample std (n - 1), min and
    max, plus the population Gini within each prompt group averaged over groups (how concentrated the
    metric is within groups). **The names are fixed at construction** so that the state has a fixed
    size (five sums and two extremes per name); a batch holding an undeclared name raises a
    ``ValueError``. A declared name may be absent from a batch, and NaN means "not reported by this
    sample" (multi-environment batches): such samples are left out of that metric. Infinite values
    raise a ``ValueError`` naming ``sample_metrics`` and the metric at ``compute()``.

    ``sample_metrics`` is a mapping ``name -> [B]`` (tensors or lists of numbers) or a list of B
    per-sample mappings ``name -> number`` (what ``RewardResult.sample_metrics`` gives).
    ``metrics_ranges`` declares ``{name: (lo, hi)}`` chart ranges (metadata only); undeclared ones are
    the run's observed ranges (:meth:`chart_ranges`). No data in the window: no keys.

    Args:
        names: the per-sample metric names (non-empty, unique, no ``/``).
        metrics_ranges: declared chart ranges per name; either bound may be None.
        group_gini: also compute the per-group Gini (needs ``group_ids``); default True.
        kwargs: torchmetrics ``Metric`` arguments.

    Example:
        >>> import torch
        >>> metric = SampleMetricStats(["tool_calls", "format"], metrics_ranges={"format": (0, 1)})
        >>> metric.update(sample_metrics={"tool_calls": torch.tensor([0.0, 2.0, 1.0, 1.0]),
        ...                               "format": torch.tensor([1.0, 1.0, 0.0, 1.0])},
        ...               group_ids=torch.tensor([0, 0, 1, 1]))
        >>> out = metric.compute()
        >>> [round(out[f"sample_metrics/tool_calls/{s}"].item(), 4) for s in ("mean", "std", "group_gini_mean")]
        [1.0, 0.8165, 0.25]
        >>> [round(out[f"sample_metrics/format/{s}"].item(), 4) for s in ("mean", "std", "group_gini_mean")]
        [0.75, 0.5, 0.25]
        >>> metric.chart_ranges()["sample_metrics/format/mean"], metric.chart_ranges()["sample_metrics/tool_calls/max"]
        ((0.0, 1.0), (0.0, 2.0))
    """

    keys = BySettings(sample_metric_keys("<name>"), lambda m: tuple(
        f"{SAMPLE_METRICS_SECTION}/{n}/{s}" for n in m.names for s in (SAMPLE_STATS if m.group_gini else STATS)))
    required_fields = BySettings(_SAMPLE_FIELDS, lambda m: _SAMPLE_FIELDS[: 1 + m.group_gini])  # ids for the Gini
    glossary = GlossaryEntry(
        name="Sample metrics",
        what="Any per-sample metric the environment returns (reward components, response length, reasoning "
        "steps, tool-call counts, ...), aggregated per step into mean, sample std (n - 1), min and max, plus a "
        "Gini coefficient per prompt group averaged over groups (how concentrated the metric is within groups).",
        unit=_SAMPLES + " that reported the metric; the Gini over " + _GROUPS,
        cap=_DIAGNOSTIC,
        action=_NO_ACTION,
        aliases=("sample_metrics",),
    )

    def __init__(self, names: Sequence[str], metrics_ranges: Mapping[str, Range] | None = None, group_gini: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.names = check_sample_metric_names(names)
        self.group_gini = bool(group_gini)
        ranges = dict(metrics_ranges or {})
        unknown = sorted(set(ranges) - set(self.names))
        if unknown:
            raise ValueError(f"`metrics_ranges` names {unknown} are not among the metric names {list(self.names)}")
        self.metrics_ranges = {n: _check_range(f"metrics_ranges[{n!r}]", r) for n, r in ranges.items()}
        self._init_observed((len(self.names),))

    def state_table(self) -> dict[str, State]:
        gini = table("gini_sum", "groups") if self.group_gini else {}
        return {name: state.of("names") for name, state in {**_MOMENTS, **gini}.items()}

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        return _sample_update(view, self.names, self.group_gini, self.device)

    def compute(self) -> dict[str, Tensor]:
        invalid = self.invalid
        if bool((invalid > 0).any()):
            bad = [n for n, c in zip(self.names, invalid.tolist(), strict=True) if c > 0]
            raise ValueError(f"batch field `{SAMPLE_METRICS}` held infinite values for {bad}")
        self._observe(self.min, self.max)
        out = _sample_compute(self.names, **self.state_values(exclude=("invalid",)))
        # A name no sample reported in the window has no value (no made-up mean 0): its keys are left out.
        unseen = [n for n, c in zip(self.names, self.count.tolist(), strict=True) if c == 0]
        return {k: v for k, v in out.items() if k.split("/")[1] not in unseen}

    def chart_ranges(self) -> dict[str, tuple[float, float]]:
        """``{key: (lo, hi)}`` per metric: ``metrics_ranges`` where declared, else the run's observed range.

        ``std`` gets ``(0, (hi - lo) / sqrt(2))`` and ``group_gini_mean`` ``(0, 1)`` when the range is non-negative.
        Reads the observed extremes to the host: call it when logging.
        """
        out: dict[str, tuple[float, float]] = {}
        seen_lo, seen_hi = self.observed_min.tolist(), self.observed_max.tolist()
        for k, n in enumerate(self.names):
            rng = _resolve(self.metrics_ranges.get(n, (None, None)), seen_lo[k], seen_hi[k])
            if rng is not None:
                out.update(_stat_ranges(f"{SAMPLE_METRICS_SECTION}/{n}", rng, gini=self.group_gini))
        return out


ROLLOUT_METRICS: tuple[type[OPBCMetric], ...] = (
    RolloutRewardStats, RolloutRewardGini, RolloutAdvantageStats, PromptTokenStats, CompletionTokenStats,
    TotalTokenStats, CompletionLengthGini, CompletionLengthMaxMedianRatio, CompletionLengthCV, StopReasonLengthPct,
    DiscardedRollouts, DiscardedRolloutStats, OffPolicySteps,
)


def rollout_metrics(sample_metric_names: Sequence[str] = (), *, reward_min: float | None = None,
                    reward_max: float | None = None, metrics_ranges: Mapping[str, Range] | None = None,
                    length_code: int = LENGTH_CODE, **kwargs: Any) -> list[OPBCMetric]:
    """Every rollout metric, ready for an :class:`~opbc_metrics.collection.OPBCCollection`.

    :class:`SampleMetricStats` is included when ``sample_metric_names`` is given (its state size depends
    on the names). ``kwargs`` are torchmetrics ``Metric`` arguments passed to every member.

    Example:
        >>> from opbc_metrics import OPBCCollection
        >>> metrics = OPBCCollection(rollout_metrics(["tool_calls"], reward_min=0.0, reward_max=1.0))
        >>> len(metrics.keys_produced)
        50
    """
    settings: dict[type, dict[str, Any]] = {RolloutRewardStats: {"reward_min": reward_min, "reward_max": reward_max},
                                            StopReasonLengthPct: {"length_code": length_code},
                                            DiscardedRolloutStats: {"length_code": length_code}}
    out = [cls(**settings.get(cls, {}), **kwargs) for cls in ROLLOUT_METRICS]
    if sample_metric_names:
        out.append(SampleMetricStats(sample_metric_names, metrics_ranges=metrics_ranges, **kwargs))
    elif metrics_ranges:
        raise ValueError("`metrics_ranges` needs `sample_metric_names`")
    return out


def rollout_section(**kwargs: Any) -> list[OPBCMetric]:
    """The ``"rollout"`` factory of :data:`opbc_metrics.collection.SECTIONS`."""
    return rollout_metrics(**kwargs)


def chart_ranges(metrics: Any) -> dict[str, tuple[float, float]]:
    """The chart ranges of every member that declares some (a collection, a metric, or an iterable).

    Example:
        >>> import torch
        >>> reward = RolloutRewardStats(reward_max=2.0)
        >>> reward.update(rewards=torch.tensor([0.5, 1.5]))
        >>> _ = reward.compute()
        >>> chart_ranges([reward, StopReasonLengthPct()])["rollout/reward/min"]  # observed lo, declared hi
        (0.5, 2.0)
    """
    if hasattr(metrics, "members"):
        members: Iterable[Any] = metrics.members()
    elif isinstance(metrics, OPBCMetric):
        members = [metrics]
    else:
        members = metrics
    out: dict[str, tuple[float, float]] = {}
    for m in members:
        own = getattr(m, "chart_ranges", None)
        if callable(own):
            out.update(own())
    return out
