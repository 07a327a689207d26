r"""Rollout-group metrics: pure functions over one batch of rollouts (source: the rollout-metrics UI).

The keys, and how they map to the source's flat names, are tabled in :mod:`opbc_metrics.rollout`.
As in :mod:`opbc_metrics.functional.mismatch`, each metric is a pair ``_x_update(view, ...) -> dict of
sufficient statistics`` and ``_x_compute(**stats) -> value``; the stateful classes sum (or max/min)
the statistics over updates and ranks and call the same ``_x_compute``, so a public function's value
on one batch equals the class value after one update.

**Per-sample values.** ``rewards`` and ``advantages`` are ``[B]`` or ``[B, T]``. A ``[B, T]`` field is
reduced per sample over its response tokens (``response_mask`` = 1; every token when the mask is
absent): rewards are **summed** (verl's sequence score: token-level rewards are 0 except on the last
token), advantages are **averaged** (GRPO broadcasts one advantage over the sequence, so the mean is
that value; for GAE it is the sequence's mean advantage). A sample without response tokens has no
reward and no advantage (it is left out of their statistics and of the reward Gini; a window where no
sample had one gives no keys). ``prompt_lengths`` and
``response_lengths`` are ``[B]`` token counts; total tokens are their sum.

**Statistics per step.** "Per step" is the window since the last ``reset()``: all updates, all ranks.
Mean, **sample** standard deviation (divide by n - 1, as Telescope; undefined for one sample, so the
std key is left out while the window holds fewer than two), min and max come from the mergeable
float64 sums ``(n, sum x, sum x^2)`` and the extremes, so the synced value equals the value on the
concatenated data (never a mean of per-rank stds). A second set of sums of ``x * 2^-600`` is used
where the plain sums overflow (values beyond ~1e154), so finite inputs up to the float64 limit give
finite statistics. The variance ``E[x^2] - E[x]^2`` is exact for integer counts (sums below 2^53) and
otherwise carries a rounding error of a few ulps of ``E[x^2]``; a variance below ``1e-13 E[x^2]`` (a
std below ~3.2e-7 of the root mean square, under that rounding resolution) is reported as 0, so a
constant quantity has std exactly 0: values that differ only in their last 7 significant digits (say
1e200 and 1e200 * (1 + 1e-8)) get std 0, a documented limit of the mergeable raw moments.

**Prompt tokens** count each prompt group's prompt once (its first sample's length) when
``group_ids`` are given: all samples of a group share the prompt, and Telescope counts it once.

**Gini per prompt group.** For the n values of one group (``group_ids``, arbitrary integers or, as a
list, any hashable ids such as verl's ``uid`` strings), the population Gini coefficient

.. math:: G = \frac{\sum_i \sum_j |x_i - x_j|}{2 n^2 \bar x}
          = \frac{\sum_{i=1}^{n} (2i - n - 1)\, x_{(i)}}{n \sum_i x_i}

(``x_(i)`` sorted ascending), 0 for a group of one or a non-positive sum. The step value is the mean
over groups. Groups are found without data-dependent shapes: a stable sort by group id (then by
value, for the rank formula), segment starts from neighbouring ids, segment sums by ``scatter_add``
into fixed ``[B]`` buffers. Time O(B log B), memory O(B) per quantity.
The mean over groups is merged as ``(sum of per-group Gini, number of groups)``, which is exact only
if **a prompt group lives in one update on one rank** (true in GRPO, where a group is generated and
scored together): a group split across updates or ranks counts as two groups, each with its own
Gini. Per-group max/median length ratios (a group whose median length is 0 is left out, lengths are
not floored) and coefficients of variation (sample std / mean; groups of one or with mean 0 left out)
are merged the same way.

**Bad values.** Shapes, dtypes and devices are checked in ``update()`` (host metadata only). Values
cannot be inspected there without a host sync, so negative or non-finite token counts and lags, non-finite
rewards/advantages, infinite sample metrics and unknown int codes are counted by the update and
raise a ``ValueError`` naming the field at ``compute()`` (after sync, so on every rank alike); the
public functions below raise at once.

**No made-up values.** The ``_x_compute`` steps return 0 over an empty window for mean/min/max, the Gini and CV
means, the stop-reason percentage and the discard counts, and 1 for the max/median ratio mean (equal lengths).
Nothing reports it: the stateful classes have no keys then, and the public functions below raise a
``ValueError`` on a batch without the data their value needs
(:func:`~opbc_metrics.functional.statistics.require_data`): no sample (no reward, advantage, length or lag),
no rollout, no stop reason, no prompt group with a value. A std key needs two samples: with one it is left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from opbc_metrics.batch import (
    GROUP_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOGPROBS,
    TRAINER_LOGPROBS,
    BatchView,
    as_bool_mask,
    check_same_device,
    check_same_shape,
    from_host,
)
from opbc_metrics.functional.statistics import Stats, mean_std, moments, raise_if_invalid, require_data

F64 = torch.float64

REWARDS = "rewards"
ADVANTAGES = "advantages"
PROMPT_LENGTHS = "prompt_lengths"
RESPONSE_LENGTHS = "response_lengths"
STOP_REASONS = "stop_reasons"
DISCARD_REASONS = "discard_reasons"
SAMPLE_METRICS = "sample_metrics"

#: Int codes of ``stop_reasons`` (vLLM / SGLang / OpenAI finish reasons). Only ``length`` matters here;
#: the metric takes another code for it as ``length_code``. Any other int code raises (at ``compute()``).
STOP_REASON_CODES: dict[str, int] = {"stop": 0, "length": 1, "abort": 2}
LENGTH_CODE = STOP_REASON_CODES["length"]
#: Finish-reason strings accepted in a list of ``stop_reasons`` (``"length"`` marks truncation; None is "not
#: truncated"): vLLM and SGLang (stop, length, abort), OpenAI (also tool_calls, content_filter, function_call),
#: verl's ``AgentLoopOutput.stop_reason`` (completed, aborted, length). Any other string raises.
STOP_REASON_STRINGS: tuple[str, ...] = (
    "stop", "length", "abort", "tool_calls", "content_filter", "function_call", "completed", "aborted",
)
#: Int codes of ``discard_reasons``: 0 kept (trained on), 1 max_async, 2 zero_advantage.
DISCARD_REASON_CODES: dict[str, int] = {"kept": 0, "max_async": 1, "zero_advantage": 2}

STATS = ("mean", "std", "min", "max")
SAMPLE_STATS = (*STATS, "group_gini_mean")


def stat_keys(prefix: str) -> tuple[str, ...]:
    """``prefix/{mean,std,min,max}``.

    Example:
        >>> stat_keys("rollout/reward")
        ('rollout/reward/mean', 'rollout/reward/std', 'rollout/reward/min', 'rollout/reward/max')
    """
    return tuple(f"{prefix}/{s}" for s in STATS)


REWARD_PREFIX = "rollout/reward"
ADVANTAGE_PREFIX = "rollout/advantage"
PROMPT_TOKENS_PREFIX = "rollout/tokens_prompt"
COMPLETION_TOKENS_PREFIX = "rollout/tokens_completion"
TOTAL_TOKENS_PREFIX = "rollout/tokens_total"
REWARD_KEYS = stat_keys(REWARD_PREFIX)
ADVANTAGE_KEYS = stat_keys(ADVANTAGE_PREFIX)
PROMPT_TOKEN_KEYS = stat_keys(PROMPT_TOKENS_PREFIX)
COMPLETION_TOKEN_KEYS = stat_keys(COMPLETION_TOKENS_PREFIX)
TOTAL_TOKEN_KEYS = stat_keys(TOTAL_TOKENS_PREFIX)
REWARD_GINI_KEY = "rollout/reward/group_gini_mean"
LENGTH_GINI_KEY = "rollout/tokens_completion/group_gini_mean"
LENGTH_RATIO_KEY = "rollout/tokens_completion/group_max_median_ratio_mean"
STOP_LENGTH_PCT_KEY = "rollout/stop_reason/length_pct"
DISCARD_KEYS = ("rollout/discarded/max_async", "rollout/discarded/zero_advantage", "rollout/discarded/total",
                "rollout/discarded/pct")
#: Shares of the discarded rollouts by reason (percent of ``total``); only when something was discarded.
DISCARD_SHARE_KEYS = ("rollout/discarded/max_async_pct", "rollout/discarded/zero_advantage_pct")
#: The zero-advantage discards split by their (common) reward; only when ``rewards`` came with the codes.
ZERO_ADVANTAGE_SPLIT_KEYS = tuple(f"rollout/discarded/zero_advantage_{s}" for s in ("all_zero", "all_positive",
                                                                                   "reward_mean"))
DISCARDED_PREFIX = "rollout/discarded"
DISCARDED_TOKEN_KEYS = stat_keys(f"{DISCARDED_PREFIX}/tokens_completion")
DISCARDED_GROUP_KEYS = (f"{DISCARDED_PREFIX}/tokens_completion/group_gini_mean",
                        f"{DISCARDED_PREFIX}/tokens_completion/group_max_median_ratio_mean")
DISCARDED_STOP_KEY = f"{DISCARDED_PREFIX}/stop_reason/length_pct"
LENGTH_CV_KEY = "rollout/tokens_completion/group_cv_mean"
POLICY_LAG = "policy_lag"
OFF_POLICY_PREFIX = "rollout/off_policy_steps"
OFF_POLICY_KEYS = stat_keys(OFF_POLICY_PREFIX)
SAMPLE_METRICS_SECTION = "sample_metrics"


def sample_metric_keys(name: str) -> tuple[str, ...]:
    """The keys of one per-sample metric: ``sample_metrics/<name>/{mean,std,min,max,group_gini_mean}``.

    Example:
        >>> sample_metric_keys("format")[0], sample_metric_keys("format")[-1]
        ('sample_metrics/format/mean', 'sample_metrics/format/group_gini_mean')
    """
    return tuple(f"{SAMPLE_METRICS_SECTION}/{name}/{s}" for s in SAMPLE_STATS)


# ---------------------------------------------------------------------------------------------
# input access and validation (host metadata only)
# ---------------------------------------------------------------------------------------------
def _real_tensor(view: BatchView, name: str) -> Tensor:
    t = view.tensor(name)
    if t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"batch field `{name}` must be an integer or floating-point tensor, got {t.dtype}")
    return t


def _check_same_batch(name: str, t: Tensor, ref_name: str, ref: Tensor) -> None:
    if t.shape[0] != ref.shape[0]:
        raise ValueError(f"batch field `{name}` has {t.shape[0]} samples but `{ref_name}` has {ref.shape[0]}")
    if t.device != ref.device:
        raise ValueError(f"batch field `{name}` is on {t.device} but `{ref_name}` is on {ref.device}")


def _check_batch_size(view: BatchView, name: str, t: Tensor) -> None:
    """A per-sample field must have one entry per sequence of the batch's token-level fields (host metadata)."""
    for ref in (TRAINER_LOGPROBS, ROLLOUT_LOGPROBS, RESPONSE_MASK):
        other = view.data.get(ref)
        if isinstance(other, Tensor) and other.ndim >= 1 and other.shape[0] != t.shape[0]:
            raise ValueError(
                f"batch field `{name}` has {t.shape[0]} entries but `{ref}` has {other.shape[0]} sequences; give "
                f"one `{name}` value per sequence"
            )


def _token_mask(view: BatchView, name: str, t: Tensor) -> Tensor:
    """``response_mask`` as bool for the ``[B, T]`` field ``name`` (all ones when absent).

    On a shape mismatch the field at fault is ``name`` (the error names it and the two shapes it may have), unless
    the logprobs have its shape: then the mask is (verl's ``attention_mask`` over prompt + response, say).
    """
    if not view.has(RESPONSE_MASK):
        return torch.ones(t.shape, dtype=torch.bool, device=t.device)
    mask = view.tensor(RESPONSE_MASK)
    if t.shape != mask.shape:
        for ref in (TRAINER_LOGPROBS, ROLLOUT_LOGPROBS):
            # Peek without marking the field read: a logprob field no metric reads is still reported as unread.
            logprobs = dict.get(view.data, ref)
            if isinstance(logprobs, Tensor) and logprobs.shape == t.shape:
                check_same_shape(RESPONSE_MASK, mask, ref, logprobs)
        raise ValueError(
            f"batch field `{name}` has shape {tuple(t.shape)} but `{RESPONSE_MASK}` has shape {tuple(mask.shape)}: "
            f"give `{name}` the response_mask's shape [B, T] = {tuple(mask.shape)} (one value per response token) "
            "or [B] (one value per sequence)"
        )
    check_same_device(name, t, RESPONSE_MASK, mask)
    return as_bool_mask(mask)


def _per_sample(view: BatchView, name: str, reduce: str) -> tuple[Tensor, Tensor]:
    """``(x, w)``: float64 ``[B]`` per-sample values and 0/1 weights (0: the sample has no value).

    ``[B, T]`` fields are reduced over the response tokens: ``reduce="sum"`` or ``"mean"``.
    """

    def make() -> tuple[Tensor, Tensor]:
        t = _real_tensor(view, name)
        if t.ndim not in (1, 2):  # before the batch-size check, which reads shape[0] (a 0-dim tensor has none)
            raise ValueError(f"batch field `{name}` must have shape [B] or [B, T], got {tuple(t.shape)}")
        _check_batch_size(view, name, t)
        if t.ndim == 1:
            x = t.to(F64)
            return x, torch.ones_like(x)
        mask = _token_mask(view, name, t)
        x = torch.where(mask, t.to(F64), 0.0).sum(dim=1)
        n = mask.sum(dim=1).to(F64)
        # A sample without response tokens has no value (not a made-up reward 0): weight 0.
        return (x if reduce == "sum" else x / n.clamp_min(1.0)), (n > 0).to(F64)

    return view.shared(("rollout/per_sample", name, reduce), make)


def _finite(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Drop non-finite values: ``(x, w)`` zeroed there, and how many weighted values were non-finite."""
    ok = torch.isfinite(x)
    bad = ((w > 0) & ~ok).to(F64).sum(dim=0)
    return torch.where(ok, x, 0.0), torch.where(ok, w, 0.0), bad


def _lengths(view: BatchView, name: str) -> tuple[Tensor, Tensor]:
    """``(x, invalid)``: a ``[B]`` count field (token counts, or ``policy_lag``'s trainer steps) in float64 and
    its count of negative/non-finite values."""

    def make() -> tuple[Tensor, Tensor]:
        t = _real_tensor(view, name)
        if t.ndim != 1:
            counts = "trainer steps" if name == POLICY_LAG else "token counts"
            raise ValueError(f"batch field `{name}` must have shape [B] ({counts}), got {tuple(t.shape)}")
        _check_batch_size(view, name, t)
        x = t.to(F64)
        bad = ~torch.isfinite(x) | (x < 0)
        return torch.where(bad, 0.0, x), bad.to(F64).sum()

    return view.shared(("rollout/lengths", name), make)


def _ids_from_host(values: Any) -> Tensor:
    """Number hashable ids (e.g. verl's ``uid`` strings) in order of first appearance, on the host."""
    index: dict[Any, int] = {}
    try:
        ids = [index.setdefault(v, len(index)) for v in values]
    except TypeError as err:
        raise ValueError(f"batch field `{GROUP_IDS}` must hold hashable ids: {err}") from None
    return torch.tensor(ids, dtype=torch.long)


def _group_ids(view: BatchView, ref_name: str, ref: Tensor) -> Tensor:
    """``[B]`` integer group ids on ``ref``'s device, checked against the ``[B]`` field ``ref_name``.

    A tensor must be an integer ``[B]`` tensor (arbitrary values, not necessarily 0..G-1); a list, tuple
    or NumPy array of hashable ids is numbered on the host (no device sync: it is host data).
    """

    def make() -> tuple[Tensor, bool]:
        g = view.field(GROUP_IDS)
        if isinstance(g, Tensor):
            if g.is_floating_point() or g.is_complex() or g.dtype == torch.bool:
                raise ValueError(f"batch field `{GROUP_IDS}` must be an integer tensor, got {g.dtype}")
            if g.ndim != 1:
                raise ValueError(f"batch field `{GROUP_IDS}` must have shape [B], got {tuple(g.shape)}")
            return g, False
        if isinstance(g, np.ndarray):
            if g.ndim != 1:
                raise ValueError(f"batch field `{GROUP_IDS}` must have shape [B], got {g.shape}")
            if g.dtype.kind in "iu":
                return torch.from_numpy(g.astype(np.int64)), True
            return _ids_from_host(g.tolist()), True
        if isinstance(g, (list, tuple)):
            return _ids_from_host(g), True
        raise ValueError(
            f"batch field `{GROUP_IDS}` must be an integer tensor [B] or a list of hashable ids, got {type(g).__name__}"
        )

    ids, from_host = view.shared("rollout/group_ids", make)
    if from_host:
        ids = ids.to(ref.device)
    if ids.shape[0] != ref.shape[0]:
        raise ValueError(f"batch field `{GROUP_IDS}` has {ids.shape[0]} samples but `{ref_name}` has {ref.shape[0]}")
    if ids.device != ref.device:
        raise ValueError(f"batch field `{GROUP_IDS}` is on {ids.device} but `{ref_name}` is on {ref.device}")
    return ids


# ---------------------------------------------------------------------------------------------
# groups as segments of a sort (fixed shapes: no unique, nonzero or bincount)
# ---------------------------------------------------------------------------------------------
class GroupSegments(NamedTuple):
    """The prompt groups of a batch as contiguous segments of the samples sorted by group id.

    Attributes:
        order: ``[B]`` sorted position -> sample index (a stable sort by group id).
        seg: ``[B]`` group index 0..G-1 of each sorted position.
        start: ``[B]`` first sorted position of that group.
        is_start: ``[B]`` bool, the first position of each group (``is_start.sum()`` = G).
        group_index: ``[B]`` group index of each sample, in the original order.
    """

    order: Tensor
    seg: Tensor
    start: Tensor
    is_start: Tensor
    group_index: Tensor


def group_segments(group_ids: Tensor) -> GroupSegments:
    """Segments of the samples sorted by group id, with fixed ``[B]`` shapes and no host sync.

    Example:
        >>> import torch
        >>> s = group_segments(torch.tensor([7, 3, 7, 3, 9]))
        >>> s.order, s.seg, s.start
        (tensor([1, 3, 0, 2, 4]), tensor([0, 0, 1, 1, 2]), tensor([0, 0, 2, 2, 4]))
        >>> s.group_index
        tensor([1, 0, 1, 0, 2])
    """
    ids, order = torch.sort(group_ids, stable=True)
    is_start = torch.ones_like(ids, dtype=torch.bool)
    is_start[1:] = ids[1:] != ids[:-1]
    seg = torch.cumsum(is_start.to(torch.long), 0) - 1
    pos = torch.arange(ids.shape[0], device=ids.device)
    start = torch.cummax(torch.where(is_start, pos, 0), 0).values
    group_index = torch.empty_like(seg).scatter_(0, order, seg)
    return GroupSegments(order, seg, start, is_start, group_index)


def _segments(view: BatchView, ref_name: str, ref: Tensor) -> GroupSegments:
    ids = _group_ids(view, ref_name, ref)
    return view.shared(("rollout/segments", ids.device), lambda: group_segments(ids))


def _sort_within_groups(segs: GroupSegments, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Sort ``[B, F]`` columns by (group, value), valid values first in each group.

    Returns ``(x sorted, valid sorted, perm)`` with ``perm[p, f]`` the sample at sorted position ``p``.
    Group segments keep the positions of :func:`group_segments` (both sorts are stable).
    """
    key = torch.where(valid, x, float("inf"))
    by_value = torch.argsort(key, dim=0, stable=True)
    perm = torch.gather(by_value, 0, torch.argsort(segs.group_index[by_value], dim=0, stable=True))
    return torch.gather(x, 0, perm), torch.gather(valid, 0, perm), perm


def _segment_sum(segs: GroupSegments, values: Tensor) -> Tensor:
    """Per sorted position, the sum of ``values`` (``[B, F]``, sorted positions) over its group."""
    seg = segs.seg[:, None].expand_as(values)
    return torch.gather(torch.zeros_like(values).scatter_add_(0, seg, values), 0, seg)


def _gini_update(segs: GroupSegments, x: Tensor, valid: Tensor) -> Stats:
    """Per column of ``[B, F]``: the sum over groups of the group's Gini and the number of groups.

    A group counts if it has at least one valid value; its Gini is over its valid values.
    """
    xs, vs, _ = _sort_within_groups(segs, x, valid)
    xv = torch.where(vs, xs, 0.0)
    # Gini is scale-free: dividing each group by its largest |x| keeps subnormal groups exact and huge ones finite.
    seg = segs.seg[:, None].expand_as(xv)
    scale = torch.gather(torch.zeros_like(xv).scatter_reduce_(0, seg, xv.abs(), "amax"), 0, seg)
    xv = xv / torch.where(scale > 0, scale, 1.0)
    n = _segment_sum(segs, vs.to(F64))
    total = _segment_sum(segs, xv)
    pos = torch.arange(x.shape[0], device=x.device)
    rank = (pos - segs.start + 1).to(F64)[:, None]  # 1-based rank among the group's valid values
    term = (2.0 * rank - n - 1.0) * xv
    contrib = torch.where(total > 0, term / (n * torch.where(total > 0, total, 1.0)), 0.0)
    groups = (segs.is_start[:, None] & (n > 0)).to(F64).sum(dim=0)
    return {"gini_sum": contrib.sum(dim=0), "groups": groups}


def _mean_over_groups(total: Tensor, groups: Tensor, empty: float) -> Tensor:
    return torch.where(groups > 0, total / groups.clamp_min(1.0), torch.full_like(total, empty))


def _public_group_mean(stats: Stats, function: str, missing: str, what_to_pass: str) -> Tensor:
    """A public function's mean over groups; ``ValueError`` when no group counted
    (:func:`~opbc_metrics.functional.statistics.require_data`), where the metric has no key."""
    require_data(stats["groups"], function, missing, what_to_pass)
    return stats["value_sum"] / stats["groups"]


def _max_median_update(segs: GroupSegments, lengths: Tensor, valid: Tensor | None = None) -> Stats:
    """Sum over groups of max/median completion length (over the ``valid`` samples), and the number of
    groups counted: a group whose median is 0 has no ratio and is left out."""
    x = lengths[:, None]
    ok = torch.ones_like(x, dtype=torch.bool) if valid is None else valid[:, None]
    xs, vs, _ = _sort_within_groups(segs, x, ok)
    xs = xs[:, 0]
    n = _segment_sum(segs, vs.to(F64))[:, 0].to(torch.long)  # valid values per group, sorted first
    start = segs.start
    last = xs.shape[0] - 1
    lo = torch.gather(xs, 0, (start + torch.div(n - 1, 2, rounding_mode="floor")).clamp(0, last))
    hi = torch.gather(xs, 0, (start + torch.div(n, 2, rounding_mode="floor")).clamp(0, last))
    top = torch.gather(xs, 0, (start + n - 1).clamp(0, last))
    median = (lo + hi) / 2.0
    counted = segs.is_start & (n > 0) & (median > 0)
    ratio = top / torch.where(counted, median, 1.0)
    return {"value_sum": torch.where(counted, ratio, 0.0).sum(), "groups": counted.to(F64).sum()}


def _cv_update(segs: GroupSegments, lengths: Tensor) -> Stats:
    """Sum over groups of the coefficient of variation (sample std / mean) of the lengths, and the number of
    groups counted: groups of two samples or more with a positive mean."""
    x = lengths[segs.order]
    ones = torch.ones_like(x)
    n = _segment_sum(segs, ones[:, None])[:, 0]
    mean = _segment_sum(segs, x[:, None])[:, 0] / n
    sq = _segment_sum(segs, ((x - mean) ** 2)[:, None])[:, 0]
    counted = segs.is_start & (n > 1) & (mean > 0)
    cv = (sq / (n - 1.0).clamp_min(1.0)).sqrt() / torch.where(counted, mean, 1.0)
    return {"value_sum": torch.where(counted, cv, 0.0).sum(), "groups": counted.to(F64).sum()}


def _first_of_group(segs: GroupSegments) -> Tensor:
    """``[B]`` float64, 1 on the first sample (in batch order) of each group: a stable sort keeps it first."""
    return torch.zeros(segs.order.shape, dtype=F64, device=segs.order.device).scatter_(
        0, segs.order, segs.is_start.to(F64)
    )


# ---------------------------------------------------------------------------------------------
# moments: mean / sample std / min / max
# ---------------------------------------------------------------------------------------------
# The rollout states' names for the statistics of functional.statistics.moments.
_STATE_NAMES = {"count": "count", "sum": "total", "sum_sq": "total_sq", "sum_hi": "total_hi",
                "sum_sq_hi": "total_sq_hi", "min": "min", "max": "max"}


def _moments_update(x: Tensor, w: Tensor, invalid: Tensor) -> Stats:
    """Sufficient statistics (:func:`~opbc_metrics.functional.statistics.moments`) of ``x`` (``[B]`` or
    ``[B, F]``) over the samples with weight ``w = 1``, and the count of invalid values."""
    return {**{_STATE_NAMES[k]: v for k, v in moments(x, w > 0).items()}, "invalid": invalid}


def _moments_compute(count: Tensor, total: Tensor, total_sq: Tensor, min: Tensor, max: Tensor, total_hi: Tensor,
                     total_sq_hi: Tensor) -> tuple[Tensor, ...]:
    """``(mean, sample std, min, max)``; 0 each over an empty window, std NaN for fewer than two samples."""
    mean, std = mean_std(count, total, total_sq, total_hi, total_sq_hi, min, max, ddof=1)
    nonempty = count > 0
    return mean, std, torch.where(nonempty, min, 0.0), torch.where(nonempty, max, 0.0)


def _moments_dict(keys: Sequence[str], **stats: Tensor) -> dict[str, Tensor]:
    """``keys`` = (mean, std, min, max) keys; the std key only over two samples or more, no key without a sample
    (one host read)."""
    count = float(stats["count"])
    if count == 0:
        return {}  # no sample: no mean, min or max (not 0)
    out = dict(zip(keys, _moments_compute(**stats), strict=True))
    if count < 2:
        del out[keys[1]]
    return out


NONFINITE = "non-finite values"
#: What to pass to a public function of a per-sample field that is left out where a sample has no response token.
_WITH_RESPONSE = "`{}` with at least one sample (one with a response token when a `response_mask` is given)"
BAD_COUNTS = "negative or non-finite token counts"
# policy_lag is a count of trainer steps, not of tokens: its own rule in its message.
BAD_LAGS = ("negative or non-finite lags: `policy_lag` counts the trainer steps between the weights that generated "
            "each rollout and the weights being trained, a finite number >= 0 (0 on-policy)")


def _value_stats_update(view: BatchView, name: str, reduce: str) -> Stats:
    x, w, invalid = _finite(*_per_sample(view, name, reduce))
    return _moments_update(x, w, invalid)


def _reward_stats_update(view: BatchView) -> Stats:
    return _value_stats_update(view, REWARDS, "sum")


def _advantage_stats_update(view: BatchView) -> Stats:
    return _value_stats_update(view, ADVANTAGES, "mean")


def _completion_token_stats_update(view: BatchView) -> Stats:
    x, invalid = _lengths(view, RESPONSE_LENGTHS)
    return _moments_update(x, torch.ones_like(x), invalid)


def _prompt_token_stats_update(view: BatchView) -> Stats:
    """Prompt lengths, each prompt group's prompt counted once (its first sample) when ``group_ids`` are given."""
    x, invalid = _lengths(view, PROMPT_LENGTHS)
    w = _first_of_group(_segments(view, PROMPT_LENGTHS, x)) if view.has(GROUP_IDS) else torch.ones_like(x)
    return _moments_update(x, w, invalid)


def _total_tokens(view: BatchView) -> tuple[Tensor, Tensor]:
    prompt, bad_p = _lengths(view, PROMPT_LENGTHS)
    response, bad_r = _lengths(view, RESPONSE_LENGTHS)
    _check_same_batch(RESPONSE_LENGTHS, response, PROMPT_LENGTHS, prompt)
    return prompt + response, bad_p + bad_r


def _total_token_stats_update(view: BatchView) -> Stats:
    x, invalid = _total_tokens(view)
    return _moments_update(x, torch.ones_like(x), invalid)


def _checked(stats: Stats, field: str, what: str) -> Stats:
    raise_if_invalid(field, stats.pop("invalid"), what)
    return stats


def _public_moments(keys: Sequence[str], stats: Stats, function: str, missing: str, what_to_pass: str
                    ) -> dict[str, Tensor]:
    """A public function's ``keys`` (mean, std, min, max) of one batch: ``ValueError`` without a sample
    (:func:`~opbc_metrics.functional.statistics.require_data`), the std key left out with one."""
    require_data(stats["count"], function, missing, what_to_pass)
    return _moments_dict(keys, **stats)


def reward_stats(rewards: Tensor, response_mask: Tensor | None = None) -> dict[str, Tensor]:
    r"""``rollout/reward/{mean,std,min,max}`` of one batch; ``[B, T]`` rewards are summed per sample.

    Std is the sample std (divide by n - 1, as Telescope); a single sample has no std key. A batch without a
    sample (or whose every sample has no response token) raises a ``ValueError``.

    Example:
        >>> import torch
        >>> out = reward_stats(torch.tensor([1.0, 0.0, 0.0, 1.0]))
        >>> {k.split('/')[-1]: v.item() for k, v in out.items()}
        {'mean': 0.5, 'std': 0.5773502691896257, 'min': 0.0, 'max': 1.0}
        >>> reward_stats(torch.tensor([]))  # no sample: no value
        Traceback (most recent call last):
        ...
        ValueError: reward_stats(): no sample with a reward in the batch, so there is no value to return (a number ...
        >>> list(reward_stats(torch.tensor([3.0])))  # one sample: no std key
        ['rollout/reward/mean', 'rollout/reward/min', 'rollout/reward/max']
        >>> reward_stats(torch.tensor([[0.0, 2.0], [0.0, 5.0]]), torch.tensor([[1, 1], [1, 0]]))['rollout/reward/max']
        tensor(2., dtype=torch.float64)
    """
    view = BatchView(rewards=rewards, response_mask=response_mask)
    return _public_moments(REWARD_KEYS, _checked(_reward_stats_update(view), REWARDS, NONFINITE), "reward_stats",
                           "sample with a reward", _WITH_RESPONSE.format(REWARDS))


def advantage_stats(advantages: Tensor, response_mask: Tensor | None = None) -> dict[str, Tensor]:
    r"""``rollout/advantage/{mean,std,min,max}``; ``[B, T]`` advantages are averaged per sample.

    As :func:`reward_stats`: no std key for one sample, a ``ValueError`` for none.

    Example:
        >>> import torch
        >>> adv = torch.tensor([[1.0, 1.0, 9.0], [-1.0, -1.0, -1.0]])
        >>> out = advantage_stats(adv, torch.tensor([[1, 1, 0], [1, 1, 1]]))
        >>> [round(v.item(), 4) for v in out.values()]
        [0.0, 1.4142, -1.0, 1.0]
    """
    view = BatchView(advantages=advantages, response_mask=response_mask)
    return _public_moments(ADVANTAGE_KEYS, _checked(_advantage_stats_update(view), ADVANTAGES, NONFINITE),
                           "advantage_stats", "sample with an advantage", _WITH_RESPONSE.format(ADVANTAGES))


def token_stats(prompt_lengths: Tensor, response_lengths: Tensor, group_ids: Any = None) -> dict[str, Tensor]:
    r"""``rollout/tokens_{prompt,completion,total}/{mean,std,min,max}`` of one batch.

    With ``group_ids``, each prompt group's prompt counts once in the prompt statistics (all samples of a
    group share the prompt; its first sample's length is taken). Completion and total tokens are per sample.
    No std keys for one sample; a ``ValueError`` for none.

    Example:
        >>> import torch
        >>> out = token_stats(torch.tensor([10, 20]), torch.tensor([5, 15]))
        >>> [round(out[f"rollout/tokens_{k}/{s}"].item(), 4) for k in ("prompt", "total") for s in ("mean", "std")]
        [15.0, 7.0711, 25.0, 14.1421]
        >>> token_stats(torch.tensor([55, 55, 329]), torch.tensor([1, 2, 3]), torch.tensor([0, 0, 1]))[
        ...     "rollout/tokens_prompt/mean"].item()
        192.0
    """
    view = BatchView(prompt_lengths=prompt_lengths, response_lengths=response_lengths, group_ids=group_ids)
    need = ("token_stats", "sample", "`prompt_lengths` and `response_lengths` with at least one sample")
    out = _public_moments(PROMPT_TOKEN_KEYS, _checked(_prompt_token_stats_update(view), PROMPT_LENGTHS, BAD_COUNTS),
                          *need)
    out.update(_public_moments(COMPLETION_TOKEN_KEYS, _checked(_completion_token_stats_update(view),
                                                               RESPONSE_LENGTHS, BAD_COUNTS), *need))
    out.update(_public_moments(TOTAL_TOKEN_KEYS, _checked(_total_token_stats_update(view), PROMPT_LENGTHS,
                                                          BAD_COUNTS), *need))
    return out


# ---------------------------------------------------------------------------------------------
# Gini and max/median per prompt group
# ---------------------------------------------------------------------------------------------
def _group_gini_update(view: BatchView, name: str, x: Tensor, valid: Tensor) -> Stats:
    """``value_sum`` (of the group Ginis) and ``groups`` of the ``[B]`` values ``x`` of the field ``name``."""
    stats = _gini_update(_segments(view, name, x), x[:, None], valid[:, None])
    return {"value_sum": stats["gini_sum"][0], "groups": stats["groups"][0]}


def _reward_gini_update(view: BatchView) -> Stats:
    x, w, invalid = _finite(*_per_sample(view, REWARDS, "sum"))
    return {**_group_gini_update(view, REWARDS, x, w > 0), "invalid": invalid}


def _length_gini_update(view: BatchView) -> Stats:
    x, invalid = _lengths(view, RESPONSE_LENGTHS)
    return {**_group_gini_update(view, RESPONSE_LENGTHS, x, torch.ones_like(x, dtype=torch.bool)), "invalid": invalid}


def _length_ratio_update(view: BatchView) -> Stats:
    x, invalid = _lengths(view, RESPONSE_LENGTHS)
    return {**_max_median_update(_segments(view, RESPONSE_LENGTHS, x), x), "invalid": invalid}


def _length_cv_update(view: BatchView) -> Stats:
    x, invalid = _lengths(view, RESPONSE_LENGTHS)
    return {**_cv_update(_segments(view, RESPONSE_LENGTHS, x), x), "invalid": invalid}


def group_length_cv(response_lengths: Tensor, group_ids: Any) -> Tensor:
    r"""Mean over prompt groups of the coefficient of variation of completion lengths (``group_length_cv_mean``).

    Per group, sample std (n - 1) / mean of its completion lengths; groups of one sample or with mean 0
    have no CV and are left out (0 when no group has one).

    Example:
        >>> import torch
        >>> group_length_cv(torch.tensor([10, 30, 20, 20, 7]), torch.tensor([0, 0, 1, 1, 2]))  # (0.7071 + 0) / 2
        tensor(0.3536, dtype=torch.float64)
    """
    view = BatchView(response_lengths=response_lengths, group_ids=group_ids)
    stats = _checked(_length_cv_update(view), RESPONSE_LENGTHS, BAD_COUNTS)
    return _public_group_mean(stats, "group_length_cv", "group with a length CV",
                              "`response_lengths` and `group_ids` with a prompt group of two samples or more and a "
                              "positive mean length")


def gini(values: Tensor) -> Tensor:
    r"""Population Gini coefficient of a 1-D tensor: :math:`\sum_i\sum_j |x_i - x_j| / (2 n^2 \bar x)`.

    0 for one value or a non-positive sum; no value (an empty tensor) raises a ``ValueError``. For non-negative
    values it lies in ``[0, (n - 1) / n]``.

    Example:
        >>> import torch
        >>> gini(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        tensor(0.2500, dtype=torch.float64)
        >>> gini(torch.tensor([0.0, 0.0, 0.0, 1.0]))  # all in one sample: (n - 1) / n
        tensor(0.7500, dtype=torch.float64)
        >>> gini(torch.tensor([]))
        Traceback (most recent call last):
        ...
        ValueError: gini(): no value in the batch, so there is no value to return (a number would be made up); ...
    """
    if values.ndim != 1:
        raise ValueError(f"`values` must have shape [n], got {tuple(values.shape)}")
    require_data(values.numel(), "gini", "value", "at least one value in `values`")
    return group_gini(values, torch.zeros(values.shape, dtype=torch.long, device=values.device))


def group_gini(values: Tensor, group_ids: Any) -> Tensor:
    r"""Mean over prompt groups of each group's population Gini (0 for a group of one or a non-positive sum).

    Args:
        values: ``[B]`` per-sample values (rewards, completion lengths, a per-sample metric).
        group_ids: ``[B]`` integer tensor (arbitrary ids) or a list of hashable ids.

    Example:
        >>> import torch
        >>> group_gini(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0]), torch.tensor([7, 7, 7, 7, 3, 3]))
        tensor(0.3750, dtype=torch.float64)
    """
    if not isinstance(values, Tensor) or values.ndim != 1:
        raise ValueError(f"`values` must be a tensor of shape [B], got {getattr(values, 'shape', type(values))}")
    view = BatchView(values=values, group_ids=group_ids)
    x, w = _per_sample(view, "values", "sum")
    x, w, invalid = _finite(x, w)
    raise_if_invalid("values", invalid, NONFINITE)
    stats = _group_gini_update(view, "values", x, w > 0)
    return _public_group_mean(stats, "group_gini", "group with a value",
                              "at least one value in `values`, with its id in `group_ids`")


def group_max_median_ratio(response_lengths: Tensor, group_ids: Any) -> Tensor:
    r"""Mean over prompt groups of max / median completion length (``group_length_max_median_ratio_mean``).

    The median of an even-sized group is the mean of its two middle values; a group whose median is 0
    has no ratio and is left out of the mean (as Telescope, which does not floor lengths). 1 means
    equal lengths; large values flag stragglers.

    Example:
        >>> import torch
        >>> group_max_median_ratio(torch.tensor([10, 20, 30, 5, 5]), torch.tensor([0, 0, 0, 1, 1]))
        tensor(1.2500, dtype=torch.float64)
        >>> group_max_median_ratio(torch.tensor([0, 2, 0, 0, 5]), torch.tensor([0, 0, 1, 1, 1]))  # [0, 0, 5] left out
        tensor(2., dtype=torch.float64)
    """
    view = BatchView(response_lengths=response_lengths, group_ids=group_ids)
    stats = _checked(_length_ratio_update(view), RESPONSE_LENGTHS, BAD_COUNTS)
    return _public_group_mean(stats, "group_max_median_ratio", "group with a positive median length",
                              "`response_lengths` and `group_ids` with a prompt group whose median length is positive "
                              "(a group whose median is 0 has no ratio)")


def zero_advantage_mask(rewards: Tensor, group_ids: Any, response_mask: Tensor | None = None, atol: float = 0.0,
                        advantages: Tensor | None = None, advantage_atol: float = 1e-9) -> Tensor:
    r"""``[B]`` bool: samples of a prompt group of two or more whose advantage is zero for the whole group.

    GRPO's group-normalised advantage is then 0 for every sample of the group, so it carries no
    gradient (``discard_group_zero_advantage``). As Telescope judges it: when ``advantages`` are given,
    every sample's advantage is within ``advantage_atol`` (1e-9, strictly) of the group's first sample's;
    otherwise every sample got the same reward (max - min <= ``atol``). A group of one is never
    zero-advantage (there is nothing to compare). ``[B, T]`` rewards are summed per sample first, ``[B, T]``
    advantages averaged over the response. Vectorised (a sort by group; no host sync). A NaN makes its
    group non-zero-advantage.

    Example:
        >>> import torch
        >>> zero_advantage_mask(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5]), torch.tensor([4, 4, 2, 2, 9]))
        tensor([ True,  True, False, False, False])
        >>> zero_advantage_mask(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([4, 4, 2, 2]),
        ...                     advantages=torch.tensor([0.0, 0.0, 0.5, -0.5]))  # advantages decide
        tensor([ True,  True, False, False])
    """
    view = BatchView(rewards=rewards, group_ids=group_ids, response_mask=response_mask, advantages=advantages)
    x, _ = _per_sample(view, REWARDS, "sum")
    segs = _segments(view, REWARDS, x)
    ones = torch.ones_like(x)
    n = _segment_sum(segs, ones[:, None])[:, 0]  # group size, per sorted position
    if advantages is not None:
        a, _ = _per_sample(view, ADVANTAGES, "mean")
        _check_same_batch(ADVANTAGES, a, REWARDS, x)
        a_sorted = a[segs.order]
        first = torch.gather(a_sorted, 0, segs.start)  # a stable sort keeps each group's first sample first
        off = ~((a_sorted - first).abs() < advantage_atol)  # NaN counts as off
        flat = _segment_sum(segs, off.to(F64)[:, None])[:, 0] == 0
    else:
        xs, _, _ = _sort_within_groups(segs, x[:, None], torch.ones_like(x, dtype=torch.bool)[:, None])
        xs = xs[:, 0]
        last = (segs.start + n.to(torch.long) - 1)
        spread = torch.gather(xs, 0, last) - torch.gather(xs, 0, segs.start)
        flat = spread <= atol
    flat = flat & (n > 1)
    return torch.empty_like(flat).scatter_(0, segs.order, flat)


def discard_reasons(rewards: Tensor, group_ids: Any, *, policy_lag: Tensor | None = None,
                    max_off_policy_steps: int | None = None, discard_group_zero_advantage: bool = True,
                    response_mask: Tensor | None = None, atol: float = 0.0, advantages: Tensor | None = None) -> Tensor:
    r"""``[B]`` int codes of :data:`DISCARD_REASON_CODES`: 0 kept, 1 ``max_async``, 2 ``zero_advantage``.

    ``max_async``: ``policy_lag > max_off_policy_steps`` (the rollout's weights are too many steps
    behind); it takes precedence. ``zero_advantage``: the sample's group got one reward for all its
    samples, or all the same advantage when ``advantages`` are given; never a group of one
    (:func:`zero_advantage_mask`), when ``discard_group_zero_advantage``. Feed the codes to
    :class:`~opbc_metrics.rollout.DiscardedRollouts` as ``discard_reasons``.

    Example:
        >>> import torch
        >>> discard_reasons(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]),
        ...                 policy_lag=torch.tensor([0, 9, 0, 0]), max_off_policy_steps=4)
        tensor([2, 1, 0, 0])
    """
    codes = torch.zeros(len(rewards), dtype=torch.long, device=rewards.device)
    if discard_group_zero_advantage:
        flat = zero_advantage_mask(rewards, group_ids, response_mask, atol, advantages=advantages)
        codes = torch.where(flat, DISCARD_REASON_CODES["zero_advantage"], codes)
    if policy_lag is not None:
        if max_off_policy_steps is None:
            raise ValueError("`max_off_policy_steps` is required with `policy_lag`")
        if not isinstance(policy_lag, Tensor) or policy_lag.shape != codes.shape:
            raise ValueError(f"`policy_lag` must be a tensor of shape {tuple(codes.shape)}")
        codes = torch.where(policy_lag.to(codes.device) > max_off_policy_steps, DISCARD_REASON_CODES["max_async"],
                            codes)
    return codes


# ---------------------------------------------------------------------------------------------
# stop reasons and discarded rollouts
# ---------------------------------------------------------------------------------------------
def _host_codes(name: str, values: Sequence[Any], table: dict[str, int], none_code: int, unknown_code: int | None,
                device: torch.device | str) -> Tensor:
    """Codes of a host list of strings / ints / None; unknown strings map to ``unknown_code`` or raise
    (:func:`~opbc_metrics.functional.statistics.raise_if_invalid`, counting and naming every unknown string)."""
    codes = []
    for v in values:
        if v is None:
            codes.append(none_code)
        elif isinstance(v, str):
            if v in table:
                codes.append(table[v])
            elif unknown_code is not None:
                codes.append(unknown_code)
            else:
                unknown = [u for u in values if isinstance(u, str) and u not in table]  # (only on this error)
                distinct = list(dict.fromkeys(unknown))
                raise_if_invalid(name, torch.tensor(float(len(unknown))),
                                 f"unknown reason{'s' if len(distinct) > 1 else ''} {', '.join(map(repr, distinct))}; "
                                 f"known: {sorted(table)} and None")
        elif isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
            codes.append(int(v))
        else:
            raise ValueError(f"batch field `{name}` must hold strings, int codes or None, got {type(v).__name__}")
    return from_host(codes, torch.long, device)


def _code_tensor(view: BatchView, name: str, table: dict[str, int], none_code: int, unknown_code: int | None,
                 device: torch.device | str, allow_bool: bool) -> Tensor:
    """A ``[B]`` int (or bool) tensor of codes from a tensor, a NumPy array, or a list of strings / ints / None."""

    def make() -> Tensor:
        v = view.field(name)
        if isinstance(v, np.ndarray):
            v = v.tolist()
        if isinstance(v, Tensor):
            if v.ndim != 1:
                raise ValueError(f"batch field `{name}` must have shape [B], got {tuple(v.shape)}")
            if v.is_floating_point() or v.is_complex() or (v.dtype == torch.bool and not allow_bool):
                raise ValueError(f"batch field `{name}` must hold int codes, got {v.dtype}")
            return v
        if isinstance(v, (list, tuple)):
            return _host_codes(name, v, table, none_code, unknown_code, device)
        raise ValueError(f"batch field `{name}` must be an int tensor [B] or a list of strings, got {type(v).__name__}")

    # (the string table is part of the key: two stop metrics with different length codes map "length" differently)
    return view.shared(("rollout/codes", name, tuple(sorted(table.items())), none_code, unknown_code), make)


def _stop_codes(view: BatchView, length_code: int, device: torch.device | str = "cpu") -> Tensor:
    """The ``[B]`` stop codes (or bools) of a batch; strings map onto ``length_code`` ("length") or a known code
    that is not it."""
    not_length = next(c for c in STOP_REASON_CODES.values() if c != length_code)
    table = {**dict.fromkeys(STOP_REASON_STRINGS, not_length), "length": length_code}
    return _code_tensor(view, STOP_REASONS, table, not_length, None, device, allow_bool=True)


def _stop_update(view: BatchView, length_code: int, device: torch.device | str = "cpu") -> Stats:
    """Truncated and total counts, the per-sample hits, and ``invalid``: int codes other than those of
    :data:`STOP_REASON_CODES` and ``length_code``, counted (a tensor's values cannot be read without a sync)."""
    # Strings: "length" is truncation; None and the other known finish reasons are not; unknown strings raise
    # here (a host list: no sync). They map onto a known code that is not length_code.
    codes = _stop_codes(view, length_code, device)
    if codes.dtype == torch.bool:
        hit, invalid = codes, torch.zeros((), dtype=F64, device=codes.device)
    else:
        hit = codes == length_code
        known = hit.clone()
        for code in STOP_REASON_CODES.values():
            known |= codes == code
        invalid = (~known).to(F64).sum()
    return {"length": hit.to(F64).sum(), "count": torch.full((), float(hit.shape[0]), dtype=F64, device=hit.device),
            "hits": hit, "invalid": invalid}


def stop_codes_what(length_code: int) -> str:
    """What a deferred ``stop_reasons`` error says the accepted int codes are."""
    known = sorted({*STOP_REASON_CODES.values(), length_code})
    return (f"int codes other than {known} (STOP_REASON_CODES {STOP_REASON_CODES}, length_code {length_code}); "
            f"strings may be any of {list(STOP_REASON_STRINGS)}")


def _stop_compute(length: Tensor, count: Tensor) -> Tensor:
    return torch.where(count > 0, 100.0 * length / count.clamp_min(1.0), torch.zeros_like(length))


def stop_reason_length_pct(stop_reasons: Any, length_code: int = LENGTH_CODE) -> Tensor:
    r"""``stop_reason_length_pct``: percentage (0-100) of samples that stopped on the token-length limit.

    ``stop_reasons`` is a ``[B]`` int tensor of :data:`STOP_REASON_CODES` (``length_code``, 1 by
    default, marks truncation), a ``[B]`` bool tensor (True = truncated), or a list of finish-reason
    strings of :data:`STOP_REASON_STRINGS` in which ``"length"`` marks truncation (None: not truncated).
    Other int codes or strings raise a ``ValueError`` naming them and the accepted values.

    Example:
        >>> import torch
        >>> stop_reason_length_pct(["stop", "length", "stop", "length"])
        tensor(50., dtype=torch.float64)
        >>> stop_reason_length_pct(torch.tensor([0, 1, 2, 0]))
        tensor(25., dtype=torch.float64)
        >>> stop_reason_length_pct(torch.tensor([0, 7]))
        Traceback (most recent call last):
        ...
        ValueError: batch field `stop_reasons` held 1 invalid value(s) (int code(s) [7]; accepted: [0, 1, 2] ...
    """
    view = BatchView(stop_reasons=stop_reasons)
    stats = _stop_update(view, length_code)
    if bool(stats["invalid"] > 0):  # a functional call may read to the host; the metric defers this to compute()
        codes = _stop_codes(view, length_code)
        known = sorted({*STOP_REASON_CODES.values(), length_code})
        bad = torch.unique(codes[~torch.isin(codes, torch.tensor(known, device=codes.device))]).tolist()
        raise_if_invalid(STOP_REASONS, stats["invalid"], f"int code(s) {bad}; accepted: {known} (STOP_REASON_CODES "
                         f"{STOP_REASON_CODES}, length_code {length_code}) or the strings {list(STOP_REASON_STRINGS)}")
    require_data(stats["count"], "stop_reason_length_pct", "stop reason",
                 "at least one stop reason (`stop_reasons` is empty)")
    return _stop_compute(stats["length"], stats["count"])


def _discard_codes(view: BatchView, device: torch.device | str) -> Tensor:
    return _code_tensor(view, DISCARD_REASONS, {**DISCARD_REASON_CODES, "": 0}, 0, None, device, allow_bool=False)


def _discard_update(view: BatchView, device: torch.device | str = "cpu") -> Stats:
    codes = _discard_codes(view, device)
    zero = codes == DISCARD_REASON_CODES["zero_advantage"]
    stats = {
        "max_async": (codes == DISCARD_REASON_CODES["max_async"]).to(F64).sum(),
        "zero_advantage": zero.to(F64).sum(),
        "seen": torch.full((), float(codes.shape[0]), dtype=F64, device=codes.device),
        "invalid": ((codes < 0) | (codes > 2)).to(F64).sum(),
    }
    if view.has(REWARDS):  # the split of the zero-advantage discards by their reward
        x, w = _per_sample(view, REWARDS, "sum")
        _check_same_batch(REWARDS, x, DISCARD_REASONS, codes)
        ok = zero & (w > 0) & torch.isfinite(x)
        stats.update(
            rewarded=torch.full((), float(codes.shape[0]), dtype=F64, device=codes.device),
            za_rewarded=ok.to(F64).sum(),
            za_all_zero=(ok & (x == 0)).to(F64).sum(),
            za_all_positive=(ok & (x > 0)).to(F64).sum(),
            za_reward_sum=torch.where(ok, x, 0.0).sum(),
        )
    return stats


def _discard_compute(max_async: Tensor, zero_advantage: Tensor, seen: Tensor, rewarded: Tensor | None = None,
                     za_rewarded: Tensor | None = None, za_all_zero: Tensor | None = None,
                     za_all_positive: Tensor | None = None, za_reward_sum: Tensor | None = None) -> dict[str, Tensor]:
    """The discard keys; the shares only when something was discarded, the split only when rewards came
    with the codes, its reward mean only over zero-advantage discards with a reward (host reads)."""
    total = max_async + zero_advantage
    pct = torch.where(seen > 0, 100.0 * total / seen.clamp_min(1.0), torch.zeros_like(total))
    out = dict(zip(DISCARD_KEYS, (max_async, zero_advantage, total, pct), strict=True))
    if bool(total > 0):
        out.update(zip(DISCARD_SHARE_KEYS, (100.0 * max_async / total, 100.0 * zero_advantage / total), strict=True))
    if rewarded is not None and bool(rewarded > 0):
        out[ZERO_ADVANTAGE_SPLIT_KEYS[0]] = za_all_zero
        out[ZERO_ADVANTAGE_SPLIT_KEYS[1]] = za_all_positive
        if bool(za_rewarded > 0):
            out[ZERO_ADVANTAGE_SPLIT_KEYS[2]] = za_reward_sum / za_rewarded
    return out


def discarded_counts(discard_reasons: Any, rewards: Tensor | None = None) -> dict[str, Tensor]:
    r"""``rollout/discarded/*`` counts from per-rollout reason codes.

    ``discard_reasons``: a ``[B]`` int tensor of :data:`DISCARD_REASON_CODES` (0 kept, 1 max_async,
    2 zero_advantage) or a list of ``"max_async"`` / ``"zero_advantage"`` / ``None`` (kept), one entry per
    generated rollout, kept ones included, so that ``pct`` (discarded share of all rollouts, 0-100) is
    meaningful. Counts are rollouts (samples), not groups. When something was discarded,
    ``max_async_pct`` / ``zero_advantage_pct`` are each reason's share of the discarded (0-100). With
    ``rewards`` (``[B]`` or ``[B, T]``, summed per sample), the zero-advantage discards are split by their
    reward: ``zero_advantage_all_zero`` (reward 0: the whole group failed), ``zero_advantage_all_positive``
    (a positive reward: the whole group succeeded), ``zero_advantage_reward_mean``. No rollout (an empty
    ``discard_reasons``): a ``ValueError``.

    Example:
        >>> import torch
        >>> out = discarded_counts(["max_async", None, "zero_advantage", "zero_advantage"])
        >>> [round(v.item(), 2) for v in out.values()]
        [1.0, 2.0, 3.0, 75.0, 33.33, 66.67]
        >>> out = discarded_counts(["zero_advantage"] * 3 + [None], rewards=torch.tensor([0.0, 0.0, 1.0, 0.5]))
        >>> [out[f"rollout/discarded/zero_advantage_{k}"].item() for k in ("all_zero", "all_positive", "reward_mean")]
        [2.0, 1.0, 0.3333333333333333]
    """
    stats = _discard_update(BatchView(discard_reasons=discard_reasons, rewards=rewards))
    raise_if_invalid(DISCARD_REASONS, stats.pop("invalid"), "codes outside {0, 1, 2}")
    require_data(stats["seen"], "discarded_counts", "rollout",
                 "one code in `discard_reasons` per generated rollout, kept ones included (it is empty)")
    return _discard_compute(**stats)


def _discarded_stats_update(view: BatchView, length_code: int, device: torch.device | str = "cpu") -> Stats:
    """Completion-length moments, per-group Gini and max/median, and the truncated count of the discarded
    rollouts (codes 1 and 2) of one batch; the group and stop-reason parts when their fields are given."""
    codes = _discard_codes(view, device)
    x, invalid = _lengths(view, RESPONSE_LENGTHS)
    _check_same_batch(RESPONSE_LENGTHS, x, DISCARD_REASONS, codes)
    gone = (codes == DISCARD_REASON_CODES["max_async"]) | (codes == DISCARD_REASON_CODES["zero_advantage"])
    stats = _moments_update(x, gone.to(F64), invalid + ((codes < 0) | (codes > 2)).to(F64).sum())
    if view.has(GROUP_IDS):
        segs = _segments(view, RESPONSE_LENGTHS, x)
        gini = _gini_update(segs, x[:, None], gone[:, None])
        ratio = _max_median_update(segs, x, gone)
        stats.update(gini_sum=gini["gini_sum"][0], gini_groups=gini["groups"][0], ratio_sum=ratio["value_sum"],
                     ratio_groups=ratio["groups"])
    if view.has(STOP_REASONS):
        stop = _stop_update(view, length_code, device)
        hit = stop["hits"]
        _check_same_batch(STOP_REASONS, hit, DISCARD_REASONS, codes)
        stats.update(stop_length=(hit & gone).to(F64).sum(), stop_count=gone.to(F64).sum(),
                     stop_invalid=stop["invalid"])
    return stats


def _discarded_stats_compute(gini_sum: Tensor, gini_groups: Tensor, ratio_sum: Tensor, ratio_groups: Tensor,
                             stop_length: Tensor, stop_count: Tensor, **moments: Tensor) -> dict[str, Tensor]:
    """The keys that have data: token moments over the discarded, group keys over groups with a discarded
    rollout, the truncated share over discarded rollouts with a stop reason (host reads)."""
    out = _moments_dict(DISCARDED_TOKEN_KEYS, **moments)  # (no keys without a sample)
    if bool(gini_groups > 0):
        out[DISCARDED_GROUP_KEYS[0]] = gini_sum / gini_groups
    if bool(ratio_groups > 0):
        out[DISCARDED_GROUP_KEYS[1]] = ratio_sum / ratio_groups
    if bool(stop_count > 0):
        out[DISCARDED_STOP_KEY] = _stop_compute(stop_length, stop_count)
    return out


def discarded_rollout_stats(
    discard_reasons: Any, response_lengths: Tensor, group_ids: Any = None, stop_reasons: Any = None,
    length_code: int = LENGTH_CODE,
) -> dict[str, Tensor]:
    r"""What the discarded rollouts (codes 1 and 2) looked like: ``rollout/discarded/tokens_completion/
    {mean,std,min,max}``, ``.../group_gini_mean`` and ``.../group_max_median_ratio_mean`` (over the
    discarded rollouts of each group, with ``group_ids``), ``rollout/discarded/stop_reason/length_pct``
    (with ``stop_reasons``). The same definitions as the keys of all rollouts; keys without data are left out.

    Example:
        >>> import torch
        >>> out = discarded_rollout_stats(torch.tensor([2, 2, 0, 1]), torch.tensor([10, 30, 500, 20]),
        ...                               torch.tensor([0, 0, 1, 1]), ["stop", "length", "length", "stop"])
        >>> {k.removeprefix("rollout/discarded/"): round(v.item(), 4) for k, v in out.items()}
        ... # doctest: +NORMALIZE_WHITESPACE
        {'tokens_completion/mean': 20.0, 'tokens_completion/std': 10.0, 'tokens_completion/min': 10.0,
         'tokens_completion/max': 30.0, 'tokens_completion/group_gini_mean': 0.125,
         'tokens_completion/group_max_median_ratio_mean': 1.25, 'stop_reason/length_pct': 33.3333}
    """
    view = BatchView(discard_reasons=discard_reasons, response_lengths=response_lengths, group_ids=group_ids,
                     stop_reasons=stop_reasons)
    stats = _discarded_stats_update(view, length_code)
    raise_if_invalid(RESPONSE_LENGTHS, stats.pop("invalid"), BAD_COUNTS + " or discard codes outside {0, 1, 2}")
    raise_if_invalid(STOP_REASONS, stats.pop("stop_invalid", torch.zeros(())), stop_codes_what(length_code))
    zero = torch.zeros((), dtype=F64)
    for name in ("gini_sum", "gini_groups", "ratio_sum", "ratio_groups", "stop_length", "stop_count"):
        stats.setdefault(name, zero)
    return _discarded_stats_compute(**stats)


def _off_policy_update(view: BatchView) -> Stats:
    x, invalid = _lengths(view, POLICY_LAG)
    return _moments_update(x, torch.ones_like(x), invalid)


def off_policy_steps(policy_lag: Tensor) -> dict[str, Tensor]:
    r"""``rollout/off_policy_steps/{mean,std,min,max}``: how many trainer steps behind each rollout's weights were.

    No std key for one rollout; a ``ValueError`` for none.

    Example:
        >>> import torch
        >>> [v.item() for v in off_policy_steps(torch.tensor([0, 1, 2])).values()]
        [1.0, 1.0, 0.0, 2.0]
    """
    view = BatchView(policy_lag=policy_lag)
    return _public_moments(OFF_POLICY_KEYS, _checked(_off_policy_update(view), POLICY_LAG, BAD_LAGS),
                           "off_policy_steps", "rollout", "at least one lag in `policy_lag`")


# ---------------------------------------------------------------------------------------------
# per-sample metrics
# ---------------------------------------------------------------------------------------------
def check_sample_metric_names(names: Sequence[str]) -> tuple[str, ...]:
    """Validate the per-sample metric names fixed at construction (non-empty, unique, no ``/``)."""
    if isinstance(names, str):
        raise ValueError(f"`names` must be a sequence of metric names, got the string {names!r}")
    out = tuple(names)
    for n in out:
        if not isinstance(n, str) or not n or "/" in n or n != n.strip():
            raise ValueError(f"sample metric names must be non-empty strings without '/', got {n!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"sample metric names must be unique, got {list(out)}")
    return out


def _refuse_unknown(unknown: set[str], names: tuple[str, ...]) -> None:
    if unknown:
        raise ValueError(
            f"batch field `{SAMPLE_METRICS}` has unknown metrics {sorted(unknown)}; the metric was built with "
            f"{list(names)} (names are fixed at construction so that the state has a fixed size)"
        )


def _host_number(sample: Mapping[Any, Any], i: int, name: str) -> float:
    """One per-sample value of a list of mappings: a host number (NaN when the sample did not report it)."""
    v = sample.get(name)
    if v is None:
        return float("nan")
    if isinstance(v, (bool, int, float, np.integer, np.floating)):
        return float(v)
    raise ValueError(
        f"batch field `{SAMPLE_METRICS}`[{i}][{name!r}] must be a number (per-sample mappings hold host values), "
        f"got {type(v).__name__}"
    )


def _sample_matrix(view: BatchView, names: tuple[str, ...], device: torch.device | str) -> Tensor:
    """``[B, K]`` float64 values of the K declared per-sample metrics, NaN where a sample did not report one.

    ``sample_metrics`` is a mapping ``name -> [B]`` (tensor or list of numbers) or a list of per-sample
    mappings ``name -> number`` (what ``RewardResult.sample_metrics`` gives per sample).
    """

    def make() -> Tensor:
        raw = view.field(SAMPLE_METRICS)
        known = set(names)
        if isinstance(raw, Mapping):
            _refuse_unknown({str(k) for k in raw if k not in known}, names)
            cols: dict[str, Tensor] = {}
            for n in names:
                if raw.get(n) is None:
                    continue
                v = raw[n]
                t = v if isinstance(v, Tensor) else from_host(np.asarray(v, dtype=np.float64), F64, device)
                if t.ndim != 1 or t.dtype == torch.bool or t.is_complex():
                    raise ValueError(
                        f"batch field `{SAMPLE_METRICS}`[{n!r}] must be a real [B] tensor, got {t.dtype} "
                        f"of shape {tuple(t.shape)}"
                    )
                cols[n] = t
            if not cols:  # no declared metric in this batch: B all-missing rows (B from group_ids if given)
                size = len(view.data[GROUP_IDS]) if view.has(GROUP_IDS) else 0
                return torch.full((size, len(names)), float("nan"), dtype=F64, device=device)
            first_name, first = next(iter(cols.items()))
            for n, t in cols.items():
                if t.shape[0] != first.shape[0]:
                    raise ValueError(
                        f"batch field `{SAMPLE_METRICS}`[{n!r}] has {t.shape[0]} samples but [{first_name!r}] has "
                        f"{first.shape[0]}"
                    )
                if t.device != first.device:
                    raise ValueError(
                        f"batch field `{SAMPLE_METRICS}`[{n!r}] is on {t.device} but [{first_name!r}] is on "
                        f"{first.device}"
                    )
            nan = torch.full(first.shape, float("nan"), dtype=F64, device=first.device)
            return torch.stack([cols[n].to(F64) if n in cols else nan for n in names], dim=1)
        if isinstance(raw, (list, tuple)) and all(isinstance(d, Mapping) for d in raw):
            _refuse_unknown({str(k) for d in raw for k in d if k not in known}, names)
            rows = [[_host_number(d, i, n) for n in names] for i, d in enumerate(raw)]
            return from_host(rows, F64, device).reshape(len(raw), len(names))
        raise ValueError(
            f"batch field `{SAMPLE_METRICS}` must be a mapping name -> [B] values or a list of per-sample "
            f"mappings, got {type(raw).__name__}"
        )

    return view.shared(("rollout/sample_metrics", names), make)


def _sample_update(view: BatchView, names: tuple[str, ...], group_gini: bool, device: torch.device | str = "cpu"
                   ) -> Stats:
    x = _sample_matrix(view, names, device)
    present = ~torch.isnan(x)
    valid = torch.isfinite(x)
    invalid = (present & ~valid).to(F64).sum(dim=0)  # +-inf: a bug, not a missing value
    x = torch.where(valid, x, 0.0)
    stats = _moments_update(x, valid.to(F64), invalid)
    if group_gini:
        stats.update(_gini_update(_segments(view, SAMPLE_METRICS, x), x, valid))
    return stats


def _sample_compute(names: tuple[str, ...], gini_sum: Tensor | None = None, groups: Tensor | None = None,
                    **moments: Tensor) -> dict[str, Tensor]:
    mean, std, lo, hi = _moments_compute(**moments)
    count = moments["count"]
    gini_mean = None if gini_sum is None or groups is None else _mean_over_groups(gini_sum, groups, 0.0)
    has_std = (count > 1).tolist()
    out: dict[str, Tensor] = {}
    for k, n in enumerate(names):
        keys = sample_metric_keys(n)
        values = [mean[k], std[k], lo[k], hi[k]] + ([gini_mean[k]] if gini_mean is not None else [])
        out.update((key, v) for key, v in zip(keys, values, strict=False) if has_std[k] or key != keys[1])
    return out


def sample_metric_stats(sample_metrics: Any, group_ids: Any = None) -> dict[str, Tensor]:
    r"""``sample_metrics/<name>/{mean,std,min,max,group_gini_mean}`` of one batch.

    Args:
        sample_metrics: a mapping ``name -> [B]`` values, or a list of per-sample mappings. NaN (or a
            name missing from a sample's mapping) means "not reported by that sample"; such samples are
            left out of that metric's statistics and Gini.
        group_ids: ``[B]`` prompt groups; without them the Gini keys are left out.

    A metric no sample reported has no keys, and one reported once no std key; a batch in which no metric was
    reported at all raises a ``ValueError``.

    Example:
        >>> import torch
        >>> out = sample_metric_stats({"tool_calls": torch.tensor([0.0, 2.0, 1.0, 1.0])},
        ...                           group_ids=torch.tensor([0, 0, 1, 1]))
        >>> {k.split('/')[-1]: round(v.item(), 4) for k, v in out.items()}
        {'mean': 1.0, 'std': 0.8165, 'min': 0.0, 'max': 2.0, 'group_gini_mean': 0.25}
    """
    raw = sample_metrics
    if isinstance(raw, Mapping):
        names = tuple(raw)
    elif isinstance(raw, (list, tuple)):
        names = tuple(dict.fromkeys(k for d in raw for k in d))
    else:
        names = ()
    names = check_sample_metric_names(names)
    view = BatchView(sample_metrics=sample_metrics, group_ids=group_ids)
    stats = _sample_update(view, names, group_gini=group_ids is not None)
    invalid = stats.pop("invalid")
    for k, n in enumerate(names):
        raise_if_invalid(SAMPLE_METRICS, invalid[k], f"infinite values of {n!r}")
    counts = stats["count"].tolist()
    require_data(sum(counts), "sample_metric_stats", "reported sample metric value",
                 "`sample_metrics` with at least one finite value (NaN or a missing name is 'not reported')")
    out = _sample_compute(names, **stats)
    unseen = {n for n, c in zip(names, counts, strict=True) if c == 0}  # no made-up mean 0: no keys
    return {k: v for k, v in out.items() if k.split("/")[1] not in unseen}
