r"""The Off-Policy Budget Controller as pure tensor functions: per-group statistics, contract checks, rules,
correction weights.

Everything here works on all groups of a batch at once, with segment (scatter) operations over a dense group
index, and never synchronises host and device: no Python loop over groups or tokens, no data-dependent
shape. The group index has a fixed capacity of ``B`` (a batch of ``B`` sequences has at most ``B`` groups);
positions ``>= num_groups`` are padding, flagged by ``present``.

Notation as in :mod:`opbc_metrics.functional.mismatch` and :class:`~opbc_metrics.batch.BatchView`, whose
cached tensors are reused: valid token t (``response_mask = 1``, both logprobs finite),
``r_t = trainer - rollout``, ``w_t = exp(clamp(r_t, -C, C))``, per sequence ``s_i = sum_t r_t`` over ``n_i``
valid tokens. Per group g, over its valid tokens (``N_g`` of them) and its sequences:

* ``ess`` = :math:`(\sum w)^2 / (N_g \sum w^2)`, ``second_moment`` = :math:`\sum w^2 / N_g`,
  ``weight_mean`` = :math:`\sum w / N_g`, ``seq_ess`` = the same over sequence weights
  :math:`e^{\mathrm{clamp}(s_i, -C, C)}`;
* ``clipped_fraction`` / ``veto_fraction``: share of valid tokens with :math:`|r| > C` / :math:`|r| > V`;
* ``max_abs_log_ratio`` = :math:`\max |r|`;
* ``seq_log_ratio_mean``, ``seq_log_ratio_abs_mean``, ``seq_log_ratio_max_abs``, ``geo_log_ratio_mean``: of
  :math:`s_i` (and :math:`s_i / n_i`) over the group's sequences with a valid token and no non-finite token;
* ``top_1pct_gradient_mass``: share of :math:`\sum w` carried by the :math:`k_g = \max(1, \lfloor 0.01
  N_g \rfloor)` largest weights of the group: exact for a batch of at most :data:`CHUNK_TOKENS` tokens (all
  tokens sorted by the composite key (group, -w), then the first :math:`k_g` of each group's segment);
  for a larger batch, which is processed in chunks of rows to bound its memory, from a per-group histogram
  of clamped log-weights (:data:`GROUP_TOP_MASS_BINS` bins over ``[-C, C]``, fewer for batches of more than
  128 rows: 8 MiB at most), within a relative error of ``e^{C/bins} - 1`` (0.25% at 8192 bins), as the
  core sketch (the controller takes such a batch in one fused sweep, :func:`fused_pass`: on the CPU the
  same values, bit for bit);
* ``router_flip_rate`` = top-1 expert flips / (response tokens x layers), when expert ids (or router logits,
  top-1 = argmax) are given (as ``moe/router/flip_rate``: routing does not depend on the logprobs being finite);
* ``policy_lag`` = the largest lag of the group's sequences, in trainer steps, when given.

The weight statistics come from centred sums, of ``u = w - 1 = expm1(clamp(r, -C, C))`` and ``u^2`` (per
sequence of ``expm1(clamp(s_i, -C, C))``), as the mismatch kernel's: near on-policy ``1 - ESS``,
``second_moment - 1`` and ``weight_mean - 1`` keep their relative precision from float32 inputs.

Each is computed by the same ``_x_compute`` function the stateful metrics use, applied elementwise to the
per-group sufficient statistics, so a group's value equals the core metric on that group's rows alone. A
statistic without data in its group is NaN here and ``None`` in a host report: the token statistics of a
group with no valid token (it is rejected, ``no_response_tokens`` or ``non_finite``), the sequence
statistics (``seq_ess``, ``seq_log_ratio_*``, ``geo_log_ratio_mean``) of a group with no valid sequence, the
flip rate of a group with no response token, and the statistics whose inputs were not given (router flips,
lag). NaN compares false, so no rule fires on a missing statistic.
"""

from __future__ import annotations

import math
import threading
from typing import Any, NamedTuple

import torch
from torch import Tensor

from opbc_metrics.batch import PROBABILITY_TOLERANCE, BatchView, check_clamp_dtype, from_host, raise_if_bad_inputs
from opbc_metrics.functional import mismatch as M
from opbc_metrics.functional.statistics import Stats
from opbc_metrics.policy import (
    ACTIONS,  # noqa: F401  (re-exported: the action codes of these kernels index it)
    CONTRACT_REASONS,  # noqa: F401  (re-exported with the contract flags' names)
    REASON_NAMES,
    REASONS,
    TRAIN,
    TRAIN_WITH_CORRECTION,
    CorrectionLevel,
    CorrectionMode,
    OPBCPolicy,
)

# (action code, how many consecutive reasons map to it), in REASONS order.
_REASON_RUNS: tuple[tuple[int, int], ...] = tuple(
    (a, sum(1 for _, b in REASONS if b == a)) for a in dict.fromkeys(a for _, a in REASONS)
)

# The per-group statistics, in the column order of the packed host transfer.
STAT_NAMES: tuple[str, ...] = (
    "num_sequences",
    "num_response_tokens",
    "num_tokens",
    "nonfinite_count",
    "ess",
    "seq_ess",
    "second_moment",
    "weight_mean",
    "clipped_fraction",
    "veto_fraction",
    "max_abs_log_ratio",
    "seq_log_ratio_mean",
    "seq_log_ratio_abs_mean",
    "seq_log_ratio_max_abs",
    "geo_log_ratio_mean",
    "num_valid_sequences",
    "top_1pct_gradient_mass",
    "router_flip_rate",
    "policy_lag",
)

CORRECTION_LEVELS: tuple[str, ...] = tuple(level.value for level in CorrectionLevel)
CORRECTION_MODES: tuple[str, ...] = tuple(mode.value for mode in CorrectionMode)



# -- group index --------------------------------------------------------------------------------------
class GroupIndex(NamedTuple):
    """A dense index of the groups of a batch, built on the device.

    Attributes:
        row_group: ``[B]`` long, the dense group of each row; groups are numbered by ascending id.
        group_ids: ``[B]`` int64, the id of dense group ``g`` at position ``g`` (0 in padding positions).
        present: ``[B]`` bool, positions ``< num_groups``.
        num_groups: 0-dim long, the number of distinct ids.
    """

    row_group: Tensor
    group_ids: Tensor
    present: Tensor
    num_groups: Tensor

    @property
    def capacity(self) -> int:
        return self.row_group.shape[0]


def group_index(group_ids: Tensor) -> GroupIndex:
    """Dense group index of arbitrary integer ids, without ``unique`` (no host sync).

    A stable sort of the ids, segment starts where the sorted id changes, and a cumulative sum give each
    row its group; capacity is ``B``.

    Example:
        >>> import torch
        >>> idx = group_index(torch.tensor([7, -2, 7, 40]))
        >>> idx.row_group, idx.group_ids, idx.num_groups
        (tensor([1, 0, 1, 2]), tensor([-2,  7, 40,  0]), tensor(3))
    """
    ids = group_ids.to(torch.int64)
    b = ids.shape[0]
    sorted_ids, order = torch.sort(ids, stable=True)
    new = torch.ones(b, dtype=torch.bool, device=ids.device)
    if b > 1:
        new[1:] = sorted_ids[1:] != sorted_ids[:-1]
    seg_sorted = torch.cumsum(new.to(torch.int64), 0) - 1
    row_group = torch.empty_like(seg_sorted).scatter_(0, order, seg_sorted)
    dense_ids = torch.zeros(b, dtype=torch.int64, device=ids.device).scatter_(0, seg_sorted, sorted_ids)
    num_groups = new.to(torch.int64).sum()
    present = torch.arange(b, device=ids.device) < num_groups
    return GroupIndex(row_group, dense_ids, present, num_groups)


def _segment_sum(values: Tensor, index: GroupIndex) -> Tensor:
    """Sum of per-row ``values`` into their groups, in float64 (``[capacity]``)."""
    out = torch.zeros(index.capacity, dtype=torch.float64, device=values.device)
    return out.index_add_(0, index.row_group, values.to(torch.float64))


def _segment_max(values: Tensor, index: GroupIndex) -> Tensor:
    """Max of per-row ``values`` into their groups, in float64; -inf for a group with no row."""
    out = torch.full((index.capacity,), float("-inf"), dtype=torch.float64, device=values.device)
    return out.scatter_reduce_(0, index.row_group, values.to(torch.float64), "amax", include_self=True)


def _row_amax(x: Tensor, keep: Tensor) -> Tensor:
    """Per-row max of ``x`` over ``keep`` positions; -inf for a row without any."""
    neg_inf = torch.full((), float("-inf"), dtype=x.dtype, device=x.device)
    masked = torch.where(keep, x, neg_inf)
    if masked.shape[-1] == 0:
        return torch.full(masked.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    return masked.amax(dim=-1)


# -- per-group statistics -----------------------------------------------------------------------------
def _group_top_mass_sum(weights: Tensor, index: GroupIndex, count: Tensor, fraction: float) -> Tensor:
    """Per group, the exact sum of its ``k_g = max(1, floor(fraction * N_g))`` largest token weights.

    Tokens are sorted by the composite key (group ascending, weight descending): one sort of an exact
    int64 key for float32 weights, two stable sorts otherwise. A token's rank inside its group is its
    position minus the group's start (an exclusive cumulative sum of the groups' token counts, invalid
    tokens included: they carry weight 0 and sort last in their group).
    """
    b, t = weights.shape
    flat_w = weights.reshape(-1)
    flat_g = index.row_group[:, None].expand(b, t).reshape(-1)
    if weights.dtype == torch.float32:
        # One sort of an exact int64 composite key: the bits of a non-negative float32 are monotone in its
        # value, so (group << 31) | (2^31 - 1 - bits) orders by group, then by weight descending.
        bits = (flat_w.view(torch.int32) & 0x7FFFFFFF).to(torch.int64)  # weights are >= 0 (+0.0 for -0.0)
        _, perm = torch.sort(flat_g * (2**31) + (2**31 - 1 - bits))
    else:
        _, by_weight = torch.sort(flat_w, descending=True, stable=True)
        _, by_group = torch.sort(flat_g[by_weight], stable=True)
        perm = by_weight[by_group]
    w_sorted, g_sorted = flat_w[perm], flat_g[perm]
    tokens_per_group = torch.zeros(index.capacity, dtype=torch.int64, device=weights.device)
    tokens_per_group.index_add_(0, index.row_group, torch.full((b,), t, dtype=torch.int64, device=weights.device))
    start = torch.cumsum(tokens_per_group, 0) - tokens_per_group
    rank = torch.arange(b * t, device=weights.device) - start[g_sorted]
    k = M.top_k_count(count, fraction)  # float64 [capacity]
    take = rank.to(torch.float64) < k[g_sorted]
    top = torch.zeros(index.capacity, dtype=torch.float64, device=weights.device)
    return top.index_add_(0, g_sorted, w_sorted.to(torch.float64) * take)


# The stats reduced by max over a group's rows; every other row statistic is summed.
_MAX_ROW_STATS = ("max_abs", "max_abs_s")


def _row_update(view: BatchView, clamp: float, veto: float, flips: Tensor | None = None) -> Stats:
    """Per-row (``[b]``) statistics of the rows of ``view``: all the per-token work of the group statistics."""
    _, _, mask = view.token_inputs
    valid = view.valid
    # Centred weights u = w - 1 = expm1(rc) (0 on invalid tokens, where rc = 0): near on-policy E[w^2] - E[w]^2
    # from float32 sums of w keeps no digits, from sums of u it keeps those of u (as the mismatch kernel's).
    # Per row in the compute dtype (rounding relative to sum |u|: 4e-7 of 1 - ESS at 32K tokens a row and
    # drifts 1e-4..1e-2; float64 row sums cost 20% of a step at 64 x 32768), per group in float64.
    rc = view.clamped_log_ratio(clamp)
    u = torch.expm1(rc)
    # Raw weights too: when every weight of a group is small, u ~ -1 holds none of their digits
    # (mismatch._weight_moments).
    w = torch.exp(rc).mul_(view.valid_f)
    abs_r = view.abs_log_ratio  # 0 on invalid tokens, so comparisons with positive thresholds need no mask
    s = view.seq_log_ratio
    us = torch.expm1(s.clamp(-clamp, clamp)) * view.seq_valid_f  # sequence weight - 1
    ws = torch.exp(s.clamp(-clamp, clamp)) * view.seq_valid_f  # the sequence weight
    rows: Stats = {
        "num_response_tokens": mask.sum(dim=1),
        "count": view.seq_lengths,
        "nonfinite": (mask & ~view.finite).sum(dim=1),
        "sum_u": u.sum(dim=1),
        "sum_u2": (u * u).sum(dim=1),
        "sum_w": w.sum(dim=1),
        "sum_w2": (w * w).sum(dim=1),
        "clipped": (abs_r > clamp).sum(dim=1),
        "vetoed": (abs_r > veto).sum(dim=1),
        "max_abs": _row_amax(abs_r, valid),
        **_sequence_rows(s, us, ws, view.seq_valid, view.seq_valid_f, view.seq_lengths),
    }
    if flips is not None:
        # As moe/router/flip_rate: over response tokens x layers (routing exists whatever the logprobs).
        rows["flips"] = (flips & mask[..., None]).sum(dim=(1, 2))
    return rows


def _sequence_rows(s: Tensor, us: Tensor, ws: Tensor, seq_valid: Tensor, seq_valid_f: Tensor, count: Tensor) -> Stats:
    """The sequence-level row statistics from ``s`` (sum of r, 0 outside ``seq_valid``), ``us`` and ``ws`` (the
    sequence weight - 1 and the weight, 0 outside) and ``count`` (valid tokens): shared by the chunked and the fused
    pass."""
    return {
        "sum_s": s,
        "sum_abs_s": s.abs(),
        "max_abs_s": torch.where(seq_valid, s.abs(), torch.full_like(s, float("-inf"))),
        "sum_geo": s / count.clamp_min(1.0),  # as BatchView.seq_mean_log_ratio
        "seq_count": seq_valid_f,
        "sum_us": us,
        "sum_us2": us * us,
        "sum_ws": ws,
        "sum_ws2": ws * ws,
    }


def _group_from_rows(rows: Stats, index: GroupIndex, layers: int | None = None, lag_rows: Tensor | None = None
                     ) -> Stats:
    """Per-group sufficient statistics (``[capacity]`` float64 each) from per-row ones; ``layers``: the MoE
    layers of the flips (router statistics only when given)."""
    b = index.row_group.shape[0]
    stats: Stats = {"num_sequences": _segment_sum(torch.ones(b, device=index.row_group.device), index)}
    for name, value in rows.items():
        stats[name] = _segment_max(value, index) if name in _MAX_ROW_STATS else _segment_sum(value, index)
    nan = torch.full((index.capacity,), float("nan"), dtype=torch.float64, device=index.row_group.device)
    if layers is not None:
        stats["flip_den"] = stats["num_response_tokens"] * float(layers)
    else:
        stats["flips"], stats["flip_den"] = nan, nan
    stats["lag"] = _segment_max(lag_rows, index) if lag_rows is not None else nan
    return stats


# -- the same in bounded memory: rows in chunks, the top-1% mass from a per-group histogram ------------
#: Tokens per chunk of rows. A batch larger than one chunk is processed chunk by chunk, so its per-token
#: temporaries are those of one chunk, and its top-1% mass comes from the per-group histogram sketch.
CHUNK_TOKENS = 2**16
#: On an accelerator a chunk costs its kernel launches (some 35-100 per chunk, microseconds each) whatever its size,
#: so a batch goes in at most this many chunks there: temporaries of 1/16 of the batch's tokens, or CHUNK_TOKENS.
ACCELERATOR_CHUNKS = 16
#: Bins of the per-group log-weight histogram over [-C, C] (fewer for many groups, to bound its memory).
GROUP_TOP_MASS_BINS = 8192
_GROUP_HIST_ENTRIES = 2**20


def row_chunks(view: BatchView, chunk_tokens: int | None = None) -> list[tuple[int, int]]:
    """Row ranges ``(first, end)`` covering the batch, about ``chunk_tokens`` tokens each (one range when it
    fits in one chunk); by default :data:`CHUNK_TOKENS`, and on an accelerator at most :data:`ACCELERATOR_CHUNKS`
    ranges. Host metadata only."""
    _, _, mask = view.token_inputs
    b, t = mask.shape
    rows = max(1, (CHUNK_TOKENS if chunk_tokens is None else chunk_tokens) // max(t, 1))
    if chunk_tokens is None and mask.device.type != "cpu":
        rows = max(rows, -(-b // ACCELERATOR_CHUNKS))
    return [(i, min(i + rows, b)) for i in range(0, max(b, 1), rows)]


def chunk_view(view: BatchView, first: int, end: int) -> BatchView:
    """The rows ``first:end`` of ``view`` as a view of their own (``view`` itself when that is every row).

    A fresh view per chunk: its cached per-token quantities are freed with it, after the chunk's work.
    """
    trainer, rollout, mask = view.token_inputs
    if first == 0 and end >= mask.shape[0]:
        return view
    return BatchView(trainer_logprobs=trainer[first:end], rollout_logprobs=rollout[first:end],
                     response_mask=mask[first:end])


def group_top_mass_bins(capacity: int) -> int:
    """Bins of the per-group top-1% histogram: 8192, fewer for more than 128 rows (at most 2^20 entries)."""
    return max(256, min(GROUP_TOP_MASS_BINS, _GROUP_HIST_ENTRIES // max(capacity, 1)))


def _group_hist_update(view: BatchView, row_group: Tensor, capacity: int, clamp: float, bins: int,
                       hist: Tensor | None) -> Tensor:
    """Add the valid tokens of ``view`` to the ``[capacity * bins]`` per-group histogram of clamped log-weights."""
    lw = view.clamped_log_ratio(clamp)
    slot = ((lw + clamp) * (bins / (2.0 * clamp))).to(torch.int64).clamp_(0, bins - 1)
    slot += (row_group * bins)[:, None]
    if hist is None:
        hist = torch.zeros(capacity * bins, dtype=torch.float64, device=lw.device)
    return hist.index_add_(0, slot.reshape(-1), view.valid_f.reshape(-1).to(torch.float64))


def _group_top_mass_sketch(hist: Tensor, count: Tensor, clamp: float, fraction: float = M.DEFAULT_TOP_FRACTION
                           ) -> Tensor:
    """Per group, the sum of its ``k_g`` largest weights from its histogram (walked from the top bin, tokens
    valued at their bin centre): within a factor ``e^{+-C/bins}`` of the exact sum (the core sketch's bound)."""
    counts = hist.view(count.shape[0], -1).flip(-1)
    bins = counts.shape[1]
    width = 2.0 * clamp / bins
    centres = -clamp + width * (torch.arange(bins, dtype=torch.float64, device=hist.device) + 0.5)
    k = M.top_k_count(count, fraction)[:, None]
    before = torch.cumsum(counts, dim=1) - counts
    take = torch.minimum((k - before).clamp_min(0.0), counts)
    return (take * torch.exp(centres).flip(0)).sum(dim=1)


def group_update(
    view: BatchView,
    index: GroupIndex,
    clamp: float,
    veto: float,
    fraction: float = M.DEFAULT_TOP_FRACTION,
    flips: Tensor | None = None,
    lag_rows: Tensor | None = None,
    chunks: list[tuple[int, int]] | None = None,
    top_mass_bins: int | None = None,
) -> Stats:
    """Per-group sufficient statistics (``[capacity]`` float64 each) of one batch, over the row ``chunks``
    (default: one). The sums and extremes are exact however the rows are chunked; the top-1% mass is exact
    for one chunk and from a per-group histogram for more (within the sketch's bound ``e^{C/bins} - 1``)."""
    check_clamp_dtype(clamp, view.dtype)
    layers = None if flips is None else flips.shape[-1]
    if chunks is None or len(chunks) == 1:
        stats = _group_from_rows(_row_update(view, clamp, veto, flips), index, layers, lag_rows)
        stats["top_sum"] = _group_top_mass_sum(view.weights(clamp), index, stats["count"], fraction)
        return stats
    bins = top_mass_bins or group_top_mass_bins(index.capacity)
    parts: list[Stats] = []
    hist = None
    for i, j in chunks:
        sub = chunk_view(view, i, j)
        parts.append(_row_update(sub, clamp, veto, None if flips is None else flips[i:j]))
        hist = _group_hist_update(sub, index.row_group[i:j], index.capacity, clamp, bins, hist)
    stats = _group_from_rows(cat_rows(parts), index, layers, lag_rows)
    assert hist is not None
    stats["top_sum"] = _group_top_mass_sketch(hist, stats["count"], clamp, fraction)
    return stats


def cat_rows(parts: list[Stats]) -> Stats:
    """Per-row statistics of consecutive row chunks, joined into those of the whole batch."""
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}


# -- the controller's pass over a large batch on the CPU: every per-token statistic in one sweep ------------
# The chunked path above makes ~100 short-lived per-chunk tensors (bool temporaries, bool-to-float casts, fresh
# 4 MiB histogram temporaries whose page faults cost more CPU time than their arithmetic). This pass goes through
# the same row chunks once, with in-place float arithmetic on buffers cached per chunk shape (as the mismatch
# kernel's), and gives the same values bit for bit: the same ops on the same chunk shapes wherever rounding
# depends on them (expm1/exp, the float32 row sums, the float64 sum of r).
#: Rows of the fused pass's per-token counts, summed along T in one call (u and u^2 are summed one row at a
#: time, as the chunked path sums them: with several threads, a stacked sum may split its rows differently).
_FUSED_ROWS = ("n_mask", "n_valid", "clipped", "vetoed", "zero_r", "zero_t", "unfilled_r", "unfilled_t")
_FI = {name: i for i, name in enumerate(_FUSED_ROWS)}


class _FusedPlan:
    """Buffers of the fused pass for chunks of ``rows`` sequences of length ``t`` (~24 values per token)."""

    def __init__(self, rows: int, t: int, dtype: torch.dtype, bins: int, device: torch.device) -> None:
        n = rows * t
        self.rows = rows
        self.x = x = torch.empty(len(_FUSED_ROWS), rows, t, dtype=dtype, device=device)
        self.m, self.v = x[_FI["n_mask"]], x[_FI["n_valid"]]
        self.flags = x[_FI["clipped"] : _FI["vetoed"] + 1].view(2, n)  # |r| > C and |r| > V, in one comparison
        self.zeros = x[_FI["zero_r"] : _FI["zero_t"] + 1]
        self.unfilled = x[_FI["unfilled_r"] : _FI["unfilled_t"] + 1]
        self.d, self.r, self.a, self.rc, self.u, self.u2, self.w, self.w2 = torch.empty(
            8, rows, t, dtype=dtype, device=device).unbind(0)
        self.pair = torch.empty(2, rows, t, dtype=dtype, device=device)  # per side: logprob / mask, then outside
        self.below = torch.empty(2, rows, t, dtype=dtype, device=device)  # per side: logprob < -gap
        self.v64 = torch.empty(n, dtype=torch.float64, device=device) if dtype != torch.float64 else None
        self.idx32 = torch.empty(rows, t, dtype=torch.int32, device=device)
        self.idx = torch.empty(n, dtype=torch.int64, device=device)
        self.a_row, self.v_flat, self.idx32_flat = self.a.view(1, n), self.v.view(n), self.idx32.view(n)
        # Offsets of invalid tokens' histogram slots: 16 distinct ones in a row, within +-0.495 bins of the middle.
        self.spread = ((torch.arange(t, device=device) % 16).to(dtype) / 16 - 0.5) * (0.99 * bins)


class _SketchPlan:
    """The per-group histogram (``[capacity, bins]`` float64) and the sketch's scratch, kept across calls: made
    fresh, its 4-8 MiB cost a page fault per 4 KiB (measured: 7 ms of system time per step at 64 groups)."""

    def __init__(self, capacity: int, bins: int, clamp: float, device: torch.device) -> None:
        self.hist = torch.zeros(capacity, bins, dtype=torch.float64, device=device)
        self.scratch = torch.empty(capacity, bins, dtype=torch.float64, device=device)
        width = 2.0 * clamp / bins
        centres = -clamp + width * (torch.arange(bins, dtype=torch.float64, device=device) + 0.5)
        self.top_values = torch.exp(centres).flip(0)
        self.zero = torch.zeros((), dtype=torch.float64, device=device)


class _FusedWorkspaces(threading.local):
    def __init__(self) -> None:
        self.chunks: dict[tuple[Any, ...], _FusedPlan] = {}
        self.sketches: dict[tuple[Any, ...], _SketchPlan] = {}


_FUSED_WORKSPACES = _FusedWorkspaces()


def release_controller_workspaces() -> None:
    """Free this thread's buffers of the controller's fused pass (about 24 values per token of one chunk, and
    two ``[capacity, bins]`` float64 histograms)."""
    _FUSED_WORKSPACES.chunks.clear()
    _FUSED_WORKSPACES.sketches.clear()


def fused_pass_applies(view: BatchView, chunks: list[tuple[int, int]]) -> bool:
    """Whether :func:`fused_pass` takes the batch: several chunks, contiguous float32 or float64 inputs already in
    the compute dtype (the contract checks compare the raw values in their own dtype). Any device: on an
    accelerator it makes ~3x fewer kernel launches per chunk than the chunked path."""
    if len(chunks) < 2 or view.dtype not in (torch.float32, torch.float64):
        return False
    trainer, rollout, mask = view.token_inputs
    raw = (view.tensor("trainer_logprobs"), view.tensor("rollout_logprobs"))
    return all(x.dtype == view.dtype for x in raw) and all(x.is_contiguous() for x in (trainer, rollout, mask))


class FusedPass(NamedTuple):
    """What :func:`fused_pass` leaves for the rest of the step."""

    stats: Stats  # per-group sufficient statistics, as group_update's
    contract_rows: Stats  # per-row counts, as _contract_rows'
    valid_rows: Tensor  # [B] valid tokens per row (compute dtype)
    clipped_rows: Tensor  # [B] valid tokens with |r| > C per row
    loss_mask: Tensor | None  # [B, T] bool: the valid tokens (with_weights)
    weights: Tensor | None  # [B, T] exp(clamp(r, -C, C)) on valid tokens, 0 elsewhere (with_weights)


def fused_pass(
    view: BatchView,
    index: GroupIndex,
    clamp: float,
    veto: float,
    alignment_gap: float,
    chunks: list[tuple[int, int]],
    fraction: float = M.DEFAULT_TOP_FRACTION,
    flips: Tensor | None = None,
    lag_rows: Tensor | None = None,
    token_ids: tuple[Tensor, Tensor] | None = None,
    with_weights: bool = False,
) -> FusedPass:
    """The group statistics (:func:`group_update` over ``chunks``), the contract's per-row counts
    (:func:`_contract_rows`) and, ``with_weights``, the core weights and valid tokens, in one sweep over the
    tokens (see :func:`fused_pass_applies`). Same values as those functions (on the CPU bit for bit)."""
    check_clamp_dtype(clamp, view.dtype)
    trainer, rollout, mask = view.token_inputs
    b, t = mask.shape
    dtype, device, f64 = view.dtype, view.device, torch.float64
    bins = group_top_mass_bins(index.capacity)
    # (cached per thread and key as the mismatch kernel's buffers)
    sketch = M._cached_plan(_FUSED_WORKSPACES.sketches, _SketchPlan, index.capacity, bins, float(clamp), device)
    hist_flat = sketch.hist.zero_().view(-1)
    sums = torch.empty(len(_FUSED_ROWS), b, dtype=dtype, device=device)
    sum_r = torch.empty(b, dtype=f64, device=device)
    sum_u, sum_u2, sum_w, sum_w2 = torch.empty(4, b, dtype=dtype, device=device)
    max_abs = torch.empty(b, dtype=dtype, device=device)
    outside = torch.empty(2, b, dtype=dtype, device=device)  # per side, the largest finite |x| off the response
    inside = torch.empty(2, b, dtype=dtype, device=device)  # per side, the largest finite x on the response (or 0)
    loss_mask = torch.empty((b, t), dtype=torch.bool, device=device) if with_weights else None
    weights = torch.empty((b, t), dtype=dtype, device=device) if with_weights else None
    # The histogram is kept from the top bin down (the order the sketch walks it): slot = last - bin.
    last_slot = (index.row_group * bins + (bins - 1)).to(torch.int32)[:, None]
    # Operands as 0-dim tensors of the compute dtype (a Python scalar costs a conversion per call); the same
    # float32 values as the Python scalars of the chunked path.
    zero, c_pos, scale, top_bin = (
        torch.full((), v, dtype=dtype, device=device) for v in (0.0, clamp, bins / (2.0 * clamp), bins - 1)
    )
    thresholds = from_host([[clamp], [veto]], dtype, device)
    gap = torch.full((), -float(alignment_gap), dtype=dtype, device=device)
    mask_u8 = mask.view(torch.uint8)
    extra: dict[str, list[Tensor]] = {"flips": [], "token_ids_differ": []}
    # Every chunk's views, one C++ call per tensor (a Python-level slice per chunk and tensor cost ~3% of a step).
    sizes = [j - i for i, j in chunks]
    per_chunk = [trainer.split(sizes), rollout.split(sizes), mask_u8.split(sizes), outside.split(sizes, 1),
                 inside.split(sizes, 1), sum_r.split(sizes), max_abs.split(sizes), sum_u.split(sizes),
                 sum_u2.split(sizes), sum_w.split(sizes), sum_w2.split(sizes), sums.split(sizes, 1),
                 last_slot.split(sizes)]
    outputs: list[Any] = [[None] * len(sizes)] * 2
    if weights is not None and loss_mask is not None:
        outputs = [weights.split(sizes), loss_mask.view(torch.uint8).split(sizes)]
    x = None
    for (
        (i, j), tr, ro, mb, out_c, in_c, sum_r_c, max_abs_c, sum_u_c, sum_u2_c, sum_w_c, sum_w2_c, sums_c, last_c, w_c,
        lm_c,
    ) in zip(chunks, *per_chunk, *outputs):
        if x is None or x.rows != j - i:
            x = M._cached_plan(_FUSED_WORKSPACES.chunks, _FusedPlan, j - i, t, dtype, bins, device)
        # Contract checks first, on the raw inputs while they are in cache. Per side x / m is x on the response
        # and +-inf or NaN off it, so it is 0 exactly at response tokens where x is.
        m = x.m.copy_(mb)  # uint8 -> float: ~6x faster than bool -> float
        torch.div(ro, m, out=x.pair[0])
        torch.div(tr, m, out=x.pair[1])
        torch.eq(x.pair, zero, out=x.zeros)  # (rollout 0, trainer 0) on the response
        # The largest finite response logprob per side (0 when none): above the tolerance, probabilities or logits.
        torch.amax(torch.nan_to_num(x.pair, 0.0, 0.0, 0.0, out=x.pair), -1, out=in_c)
        torch.lt(tr, gap, out=x.below[0])
        torch.lt(ro, gap, out=x.below[1])
        torch.mul(x.zeros, x.below, out=x.unfilled)  # rollout 0 and trainer < -gap; trainer 0 and rollout < -gap
        # Off the response, x - x * m is x; on it 0 (or NaN for an infinite x); nan_to_num then leaves the
        # finite values off the response: one is non-zero iff the largest |value| is > 0 (aminmax: 40x slower).
        torch.addcmul(tr, tr, m, value=-1, out=x.pair[0])
        torch.addcmul(ro, ro, m, value=-1, out=x.pair[1])
        torch.nan_to_num(x.pair, 0.0, 0.0, 0.0, out=x.pair).abs_()
        torch.amax(x.pair, -1, out=out_c)
        # r on valid tokens as the mismatch kernel finds it: (trainer - rollout) / m is finite exactly there.
        d = torch.sub(tr, ro, out=x.d).div_(m)
        r = torch.nan_to_num(d, 0.0, 0.0, 0.0, out=x.r)
        v = torch.eq(d, r, out=x.v)
        torch.sum(r, 1, dtype=f64, out=sum_r_c)
        a = torch.abs(r, out=x.a)
        torch.amax(a, 1, out=max_abs_c)
        torch.gt(x.a_row, thresholds, out=x.flags)
        rc = torch.clamp(r, -clamp, clamp, out=x.rc)
        torch.sum(torch.expm1(rc, out=x.u), 1, out=sum_u_c)
        torch.sum(torch.mul(x.u, x.u, out=x.u2), 1, out=sum_u2_c)
        torch.sum(torch.exp(rc, out=x.w).mul_(v), 1, out=sum_w_c)
        torch.sum(torch.mul(x.w, x.w, out=x.w2), 1, out=sum_w2_c)
        if w_c is not None:
            w_c.copy_(x.w)
            lm_c.copy_(v)
        torch.sum(x.x, -1, out=sums_c)
        # The histogram of rc per group, counted with weight `valid` (invalid tokens, rc = 0, add 0).
        slot = torch.add(rc, c_pos, out=x.d).mul_(scale).clamp_max_(top_bin)
        # Invalid tokens move off the middle bin by their column's spread (valid ones by exactly 0): a run of
        # padding in one slot is a chain of dependent adds (measured: the whole step 5% slower).
        slot.addcmul_(torch.eq(v, zero, out=x.a), x.spread)
        torch.sub(last_c, x.idx32.copy_(slot), out=x.idx32)
        hist_flat.scatter_add_(0, x.idx.copy_(x.idx32_flat), x.v_flat if x.v64 is None else x.v64.copy_(x.v_flat))
        if flips is not None:
            extra["flips"].append((flips[i:j] & mask[i:j, :, None]).sum(dim=(1, 2)))
        if token_ids is not None:
            extra["token_ids_differ"].append(token_ids_differ(mask[i:j], token_ids[0][i:j], token_ids[1][i:j]))

    rows = dict(zip(_FUSED_ROWS, sums.unbind(0)))
    count, nonfinite = rows["n_valid"], rows["n_mask"] - rows["n_valid"]
    seq_valid = (count > 0) & (nonfinite == 0)
    seq_valid_f = seq_valid.to(dtype)
    s = sum_r * seq_valid_f
    # expm1 per chunk, as the chunked path: its vectorised and scalar code paths may differ in the last bit.
    s_clamped = s.clamp(-clamp, clamp)
    us, ws = torch.empty_like(s), torch.empty_like(s)
    for i, j in chunks:
        torch.expm1(s_clamped[i:j], out=us[i:j])
        torch.exp(s_clamped[i:j], out=ws[i:j])
    us, ws = us * seq_valid_f, ws * seq_valid_f
    row_stats: Stats = {
        "num_response_tokens": rows["n_mask"],
        "count": count,
        "nonfinite": nonfinite,
        "sum_u": sum_u,
        "sum_u2": sum_u2,
        "sum_w": sum_w,
        "sum_w2": sum_w2,
        "clipped": rows["clipped"],
        "vetoed": rows["vetoed"],
        "max_abs": torch.where(count > 0, max_abs, torch.full_like(max_abs, float("-inf"))),
        **_sequence_rows(s, us, ws, seq_valid, seq_valid_f, count),
    }
    if flips is not None:
        row_stats["flips"] = torch.cat(extra["flips"])
    stats = _group_from_rows(row_stats, index, None if flips is None else flips.shape[-1], lag_rows)
    stats["top_sum"] = _sketch_in_place(sketch, stats["count"], fraction)

    # (trainer, rollout): the zero counts on the response, a finite non-zero value off it
    contract_rows = _contract_flags(rows["n_mask"], (rows["zero_t"], rows["zero_r"]), (outside[0] > 0, outside[1] > 0),
                                    rows["unfilled_r"] + rows["unfilled_t"], nonfinite,
                                    (inside[0] > PROBABILITY_TOLERANCE, inside[1] > PROBABILITY_TOLERANCE))
    if token_ids is not None:
        contract_rows["token_ids_differ"] = torch.cat(extra["token_ids_differ"])
    return FusedPass(stats, contract_rows, count, rows["clipped"], loss_mask, weights)


def _sketch_in_place(plan: _SketchPlan, count: Tensor, fraction: float) -> Tensor:
    """:func:`_group_top_mass_sketch` on the plan's histogram (kept from the top bin down), in its buffers: the
    same ops, the same values."""
    counts, before = plan.hist, plan.scratch
    # The counts are integers: every way of forming these sums is exact. An exclusive cumsum in one pass, and
    # one clamp for clamp_min and minimum, make 5 passes over the histogram of the chunked path's 7.
    before[:, 0] = 0.0
    torch.cumsum(counts[:, :-1], dim=1, out=before[:, 1:])
    k = M.top_k_count(count, fraction)[:, None]
    take = torch.clamp(torch.sub(k, before, out=before), min=plan.zero, max=counts, out=before)
    return take.mul_(plan.top_values).sum(dim=1)


def fused_correction_applies(policy: OPBCPolicy) -> bool:
    """Whether :func:`fused_correction` gives the policy's correction: token level, ``truncate`` at ``e^{+-C}``."""
    return _uses_core_clamp(policy, policy.correction_level.value) and policy.correction_mode.value == "truncate"


def fused_correction(
    fused: FusedPass, row_action: Tensor, policy: OPBCPolicy, chunks: list[tuple[int, int]], dtype: torch.dtype
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """``(loss_mask, weights, counts)`` of the core correction (:func:`fused_correction_applies`) from the fused
    pass, as :func:`_correction` over ``chunks`` gives them; overwrites the pass's buffers."""
    assert fused.loss_mask is not None and fused.weights is not None
    trained_row = (row_action == TRAIN) | (row_action == TRAIN_WITH_CORRECTION)
    corrected_row = trained_row if policy.correct_train else row_action == TRAIN_WITH_CORRECTION
    loss_mask = fused.loss_mask.view(torch.uint8).mul_(trained_row.view(torch.uint8)[:, None]).view(torch.bool)
    if float(policy.clamp) <= 40.0:
        # Valid tokens have weights in [e^-C, e^C]: scaled by 2^60 (finite) and capped at 1 they are the 1s of a
        # trained row (a select per token is ~10x slower); corrected rows scale by 1, untrained rows by 0.
        inf = float("inf")
        scale = torch.where(corrected_row, 1.0, torch.where(trained_row, 2.0**60, 0.0)).to(dtype)[:, None]
        cap = torch.where(corrected_row, inf, torch.where(trained_row, 1.0, 0.0)).to(dtype)[:, None]
        weights = fused.weights.mul_(scale).clamp_max_(cap)
    else:
        weights = torch.where(corrected_row[:, None], fused.weights, loss_mask.to(dtype), out=fused.weights)
    # The counts as the chunked path sums them: exact per chunk, accumulated chunk by chunk in `dtype`.
    per_row = torch.stack([fused.valid_rows * trained_row, fused.valid_rows * corrected_row,
                           fused.clipped_rows * corrected_row, torch.zeros_like(fused.valid_rows)], dim=1)
    totals = torch.zeros(len(chunks), 4, dtype=torch.float64, device=per_row.device)
    chunk_of_row = torch.cat([torch.full((j - i,), c, dtype=torch.int64, device=per_row.device)
                              for c, (i, j) in enumerate(chunks)])
    totals = totals.index_add_(0, chunk_of_row, per_row.to(torch.float64)).to(dtype)
    acc = torch.zeros(4, dtype=dtype, device=per_row.device)
    for c in range(len(chunks)):
        acc += totals[c]
    counts = dict(zip(("trained_tokens", "corrected_tokens", "truncated_tokens", "masked_tokens"), acc.unbind(0)))
    return loss_mask, weights, counts


_WEIGHT_SUMS = ("sum_u", "sum_u2", "sum_w", "sum_w2")  # the weight sums mismatch._weight_moments reads
_SEQ_WEIGHT_SUMS = ("sum_us", "sum_us2", "sum_ws", "sum_ws2")


def _group_compute(stats: Stats) -> Stats:
    """Per-group values from :func:`group_update`'s statistics, by the core ``_x_compute`` functions."""
    count = stats["count"]
    seq = M._sequence_compute(
        stats["sum_s"], stats["sum_abs_s"], stats["max_abs_s"], stats["sum_geo"], stats["seq_count"]
    )
    # No made-up values: a statistic of a group that has none of its data (no valid token, no valid sequence,
    # no response token for the flips) is NaN, not the core's empty-window value (ESS 1, fractions 0). NaN
    # compares false, so no rule fires on it: such a group is rejected by its contract flags alone.
    nan = torch.full_like(count, float("nan"))
    tokens, sequences = count > 0, stats["seq_count"] > 0

    def of_tokens(value: Tensor) -> Tensor:
        return torch.where(tokens, value, nan)

    def of_sequences(value: Tensor) -> Tensor:
        return torch.where(sequences, value, nan)

    token_sums = [stats[k] for k in _WEIGHT_SUMS]
    flip_den = stats["flip_den"]  # NaN without expert ids, 0 for a group without response tokens
    flip_rate = torch.where(flip_den > 0, M._safe_div(stats["flips"], flip_den, 0.0), nan)
    return {
        "num_sequences": stats["num_sequences"],
        "num_response_tokens": stats["num_response_tokens"],
        "num_tokens": count,
        "nonfinite_count": stats["nonfinite"],
        "ess": of_tokens(M._ess_compute(*token_sums, count)),
        "seq_ess": of_sequences(M._ess_compute(*(stats[k] for k in _SEQ_WEIGHT_SUMS), stats["seq_count"])),
        "second_moment": of_tokens(M._second_moment_compute(*token_sums, count)),
        "weight_mean": of_tokens(M._weight_mean_compute(*token_sums, count)),
        "clipped_fraction": of_tokens(M._fraction_compute(stats["clipped"], count)),
        "veto_fraction": of_tokens(M._fraction_compute(stats["vetoed"], count)),
        "max_abs_log_ratio": of_tokens(stats["max_abs"]),
        "seq_log_ratio_mean": of_sequences(seq[M.SEQUENCE_KEYS[0]]),
        "seq_log_ratio_abs_mean": of_sequences(seq[M.SEQUENCE_KEYS[1]]),
        "seq_log_ratio_max_abs": of_sequences(seq[M.SEQUENCE_KEYS[2]]),
        "geo_log_ratio_mean": of_sequences(seq[M.SEQUENCE_KEYS[3]]),
        "num_valid_sequences": stats["seq_count"],
        "top_1pct_gradient_mass": of_tokens(
            M._safe_div(stats["top_sum"], stats["sum_w"], 0.0).clamp(0.0, 1.0)
        ),
        "router_flip_rate": flip_rate,
        "policy_lag": stats["lag"],
    }


def group_statistics(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    group_ids: Tensor,
    response_mask: Tensor | None = None,
    clamp: float = M.DEFAULT_CLAMP,
    veto: float = M.DEFAULT_VETO,
    policy_lag: Tensor | None = None,
) -> tuple[Tensor, Stats]:
    """Per-group statistics of one batch: ``(sorted distinct group ids, {name: [G] float64 tensor})``.

    The functional form of the controller's per-group report (see the module docstring for the
    definitions). This convenience reads the number of groups to the host to trim the padding; the
    controller itself keeps the fixed-capacity tensors.

    Example:
        >>> import torch
        >>> t = torch.zeros(3, 2)
        >>> ids, stats = group_statistics(t, t - torch.tensor([[0.0, 0.0], [0.0, 1.0], [0.0, 0.0]]),
        ...                               torch.tensor([5, 5, 9]))
        >>> ids
        tensor([5, 9])
        >>> stats["ess"].round(decimals=4), stats["max_abs_log_ratio"]
        (tensor([0.7869, 1.0000], dtype=torch.float64), tensor([1., 0.], dtype=torch.float64))
    """
    view = BatchView(trainer_logprobs=trainer_logprobs, rollout_logprobs=rollout_logprobs, response_mask=response_mask)
    raise_if_bad_inputs(*view.logprob_range, view.mask_other_values)  # probabilities, logits, a -100 label mask
    index = group_index(group_ids)
    lag = None if policy_lag is None else policy_lag.to(torch.float64)
    values = _group_compute(group_update(view, index, clamp, veto, lag_rows=lag))
    g = int(index.num_groups.item())
    return index.group_ids[:g], {k: v[:g] for k, v in values.items()}


# -- contract -----------------------------------------------------------------------------------------
def token_ids_differ(mask: Tensor, rollout_ids: Tensor, trainer_ids: Tensor) -> Tensor:
    """``[B]`` the response tokens (``mask`` set) of each row whose rollout and trainer token ids differ: the
    comparison behind the controller's ``token_ids_mismatch`` and
    :class:`~opbc_metrics.mismatch.InputHealth`'s refusal.

    Example:
        >>> mask = torch.tensor([[True, True, False]])
        >>> token_ids_differ(mask, torch.tensor([[5, 6, 7]]), torch.tensor([[5, 9, 8]]))
        tensor([1])
    """
    return (mask & (rollout_ids != trainer_ids)).sum(dim=1)


def _contract_rows(view: BatchView, alignment_gap: float, token_ids: tuple[Tensor, Tensor] | None = None) -> Stats:
    """Per-row (``[b]``) counts behind the contract flags: all the per-token work of the checks (the rows whose
    mask is not 0/1 come from the whole batch's view, :attr:`~opbc_metrics.batch.BatchView.mask_other_rows`)."""
    trainer_raw = view.tensor("trainer_logprobs")
    rollout_raw = view.tensor("rollout_logprobs")
    trainer, rollout, mask = view.token_inputs
    dt = view.dtype
    trainer_zero, rollout_zero = trainer_raw == 0, rollout_raw == 0
    threshold = -float(alignment_gap)
    unfilled = mask & ((trainer_zero & (rollout_raw < threshold)) | (rollout_zero & (trainer_raw < threshold)))
    outside = ~mask
    rows = _contract_flags(
        mask.sum(dim=1).to(dt),
        tuple((mask & zero).sum(dim=1).to(dt) for zero in (trainer_zero, rollout_zero)),
        tuple((outside & ~zero & torch.isfinite(raw)).any(dim=1)
              for raw, zero in ((trainer_raw, trainer_zero), (rollout_raw, rollout_zero))),
        unfilled.sum(dim=1).to(dt),
        (mask & ~view.finite).sum(dim=1),
        # per side (rollout, trainer, as the fused pass), a finite response logprob above the tolerance
        tuple((mask & (x > PROBABILITY_TOLERANCE) & (x < math.inf)).any(dim=1) for x in (rollout, trainer)),
    )
    if token_ids is not None:
        rollout_ids, trainer_ids = token_ids
        rows["token_ids_differ"] = token_ids_differ(mask, rollout_ids, trainer_ids)
    return rows


def _contract_flags(resp: Tensor, zero_rows: tuple[Tensor, Tensor], present_outside: tuple[Tensor, Tensor],
                    unfilled: Tensor, non_finite: Tensor, positive: tuple[Tensor, Tensor]) -> Stats:
    """The per-row contract counts from per-side (trainer, rollout) facts: ``zero_rows`` the response tokens whose
    logprob is exactly 0, ``present_outside`` a finite non-zero logprob off the response; ``unfilled`` the tokens
    with one side 0 and the other below -gap; ``positive`` (either side order) a finite response logprob above
    :data:`~opbc_metrics.batch.PROBABILITY_TOLERANCE`. Shared by the chunked and the fused pass."""
    has_resp = resp > 0
    all_zero = [zero == resp for zero in zero_rows]
    shifted = torch.zeros_like(has_resp)
    for side in range(2):
        shifted = shifted | (has_resp & all_zero[side] & present_outside[side] & ~all_zero[1 - side])
    return {
        "resp": resp,
        # Per sequence, as the origin checks it: one sequence without logprobs rejects its whole group.
        "missing": has_resp & (all_zero[0] != all_zero[1]),
        "misaligned": unfilled + shifted.to(resp.dtype),
        "non_finite": non_finite,
        "positive": positive[0] | positive[1],
    }


def _contract_from_rows(rows: Stats, index: GroupIndex, lag_rows: Tensor | None = None,
                        mask_other: Tensor | None = None) -> dict[str, Tensor]:
    """Per-group contract failures (``[capacity]`` bool each), on the group's response tokens (mask = 1), from
    :func:`_contract_rows`' per-row counts (and the controller's ``negative_expert_ids`` row) and the ``[B]`` rows
    whose mask holds values other than 0/1 (``None``: none can).

    * ``logprobs_missing`` (the origin's ``missing_logprobs``): some sequence of the group has one side's
      logprobs exactly 0.0 on every one of its response tokens while the other side's are not (an engine
      that returned no logprobs fills zeros). The check is per sequence: one such sequence rejects its
      group. A sequence with both sides all-zero agrees and is not flagged.
    * ``no_response_tokens``: the group has no response token at all.
    * ``logprobs_misaligned``: (a) a response token where one side is exactly 0.0 (probability 1, the usual
      fill value) while the other side gives the token a probability below ``exp(-alignment_gap)``
      (default gap ln 2: less than even odds), or (b) a sequence whose logprobs on one side are exactly 0.0
      on all its response tokens but finite and non-zero on some masked-out position, while the other side is
      not all zero there (the logprobs are laid out on other positions than the mask: an offset or a wrong
      mask). Both sides exactly 0 on the response agree (a response of near-certain tokens) and pass.
    * ``non_finite``: a NaN or infinite logprob on a response token (or a log ratio that overflows the
      compute dtype, see :attr:`~opbc_metrics.batch.BatchView.finite`).
    * ``logprobs_positive``: a response token whose trainer or rollout logprob is finite and above
      :data:`~opbc_metrics.batch.PROBABILITY_TOLERANCE` (0.01): probabilities or logits passed as logprobs (the
      collection refuses them at compute; log-probabilities are <= 0).
    * ``mask_not_binary``: a sequence of the group whose raw ``response_mask`` holds a value other than 0 and 1
      (a -100 label mask, 0.5 weights, NaN): every non-zero entry would count as a response token (the
      collection refuses such a mask at compute). A bool mask never fails it.
    * ``token_ids_mismatch``: rollout and trainer token ids differ on a response token (only when both
      are given).
    * ``expert_ids_negative``: a response token with a negative routed expert id on either side (only with expert
      ids; a -1 placeholder for a token the engine did not route is no expert, and compared as one it would read
      as a router flip).
    * ``invalid_policy_lag``: a sequence of the group has a policy lag that is NaN, infinite or negative
      (only when ``policy_lag`` is given): the lag rules cannot judge the group.
    """
    resp_g = _segment_sum(rows["resp"], index)
    # A batch-wide shape mismatch is found before any per-token work (the controller's batch validation).
    out: dict[str, Tensor] = {"shape_mismatch": torch.zeros_like(resp_g, dtype=torch.bool)}
    out["logprobs_missing"] = _segment_sum(rows["missing"], index) > 0
    out["no_response_tokens"] = resp_g == 0
    out["logprobs_misaligned"] = _segment_sum(rows["misaligned"], index) > 0
    out["non_finite"] = _segment_sum(rows["non_finite"], index) > 0
    out["logprobs_positive"] = _segment_sum(rows["positive"], index) > 0
    if mask_other is not None:
        out["mask_not_binary"] = _segment_sum(mask_other, index) > 0
    else:  # an absent or bool mask
        out["mask_not_binary"] = torch.zeros_like(out["non_finite"])
    for reason, row in (("token_ids_mismatch", "token_ids_differ"), ("expert_ids_negative", "negative_expert_ids")):
        if row in rows:
            out[reason] = _segment_sum(rows[row], index) > 0
        else:
            out[reason] = torch.zeros_like(out["non_finite"])
    out["invalid_policy_lag"] = invalid_lag_groups(lag_rows, index)
    return out


def invalid_lag_groups(lag_rows: Tensor | None, index: GroupIndex) -> Tensor:
    """``[capacity]`` bool: groups with a NaN, infinite or negative per-sequence lag (none without lags)."""
    if lag_rows is None:
        return torch.zeros(index.capacity, dtype=torch.bool, device=index.row_group.device)
    bad = ~(torch.isfinite(lag_rows) & (lag_rows >= 0))
    return _segment_sum(bad, index) > 0


# -- rules --------------------------------------------------------------------------------------------
def _rule_conditions(values: Stats, contract: dict[str, Tensor], policy: OPBCPolicy) -> Tensor:
    """``[capacity, R]`` bool: which rule conditions hold for each group, in the order of :data:`REASONS`.

    Missing statistics (NaN: a lag or flip rate not given, or a group without the tokens or sequences to
    measure ESS, fractions or the flip rate) compare false, so their rules never fire.
    """
    ess, lag, flip = values["ess"], values["policy_lag"], values["router_flip_rate"]
    conditions = {
        **contract,
        "veto": values["veto_fraction"] > policy.max_veto_fraction,
        "lag_above_max": lag > policy.max_lag,
        "ess_below_min": ess < policy.min_ess,
        "router_flip_above_max": flip > policy.max_flip,
        "clipped_above_max": values["clipped_fraction"] > policy.max_clipped,
        "lag_above_replay": lag > policy.replay_lag,
        "ess_below_replay": ess < policy.replay_ess,
    }
    return torch.stack([conditions[name] for name in REASON_NAMES], dim=-1)


def _first_match(reasons: Tensor, present: Tensor) -> Tensor:
    """The action of each group: the strictest action among its rules that hold (rules are ordered by
    action precedence, so this is the first match), ``train`` when none holds; -1 on padding positions."""
    # The reason -> action codes, built on the device from runs of equal codes (a host list would cost a
    # host-to-device copy, which synchronises on CUDA).
    codes = torch.cat([torch.full((n,), a, dtype=torch.int64, device=reasons.device) for a, n in _REASON_RUNS])
    action = torch.where(reasons, codes, torch.full_like(codes, TRAIN)).amin(dim=-1)
    return torch.where(present, action, torch.full_like(action, -1))


def decide(values: Stats, contract: dict[str, Tensor], present: Tensor, policy: OPBCPolicy) -> tuple[Tensor, Tensor]:
    """``(action [capacity] long, reasons [capacity, R] bool)`` of every group under ``policy``.

    ``action`` holds codes into :data:`ACTIONS` (-1 on padding); ``reasons`` every condition that held,
    whatever the action.

    Example:
        >>> import torch
        >>> idx = group_index(torch.tensor([0, 1]))
        >>> values = {"ess": torch.tensor([0.2, 0.9], dtype=torch.float64),
        ...           "veto_fraction": torch.zeros(2, dtype=torch.float64),
        ...           "clipped_fraction": torch.tensor([0.0, 0.5], dtype=torch.float64),
        ...           "policy_lag": torch.full((2,), float("nan"), dtype=torch.float64),
        ...           "router_flip_rate": torch.full((2,), float("nan"), dtype=torch.float64)}
        >>> contract = {name: torch.zeros(2, dtype=torch.bool) for name in CONTRACT_REASONS}
        >>> action, reasons = decide(values, contract, idx.present, OPBCPolicy())
        >>> [ACTIONS[a] for a in action.tolist()]
        ['quarantine', 'train_with_correction']
        >>> [REASON_NAMES[r] for r in reasons[0].nonzero().flatten().tolist()]
        ['ess_below_min', 'ess_below_replay']
    """
    reasons = _rule_conditions(values, contract, policy) & present[:, None]
    return _first_match(reasons, present), reasons


# -- correction weights -------------------------------------------------------------------------------
def _log_bounds(policy: OPBCPolicy) -> tuple[float, float]:
    """``(log floor, log cap)`` of the correction weights; ``None`` bounds mean ``e^{-C}`` and ``e^{C}``."""
    clamp = float(policy.clamp)
    if policy.weight_cap is None:
        log_cap = clamp
    else:
        log_cap = math.log(policy.weight_cap) if policy.weight_cap < math.inf else math.inf
    if policy.weight_floor is None:
        log_floor = -clamp
    else:
        log_floor = math.log(policy.weight_floor) if policy.weight_floor > 0 else -math.inf
    return log_floor, log_cap


def _uses_core_clamp(policy: OPBCPolicy, level: str) -> bool:
    """Token level with both bounds at their default ``e^{+-C}``: the weights are the core's ``w``."""
    return level == "token" and policy.weight_cap is None and policy.weight_floor is None


def _log_ratio_at_level(view: BatchView, level: str) -> Tensor:
    """``[B, T]`` log importance ratio at a level: token ``r_t``, sequence ``s_i``, geometric ``s_i / n_i``."""
    if level == "token":
        return view.log_ratio
    seq = view.seq_log_ratio if level == "sequence" else view.seq_mean_log_ratio
    return seq[:, None].expand_as(view.log_ratio)


def _correction(view: BatchView, row_action: Tensor, policy: OPBCPolicy) -> dict[str, Tensor]:
    """Token-level loss mask and importance weights for the trainer, and the budget counts.

    Rows of groups decided ``train_with_correction`` (and ``train`` when ``policy.correct_train``) get the
    correction: with ``rho`` the ratio at ``policy.correction_level`` and bounds ``[floor, cap]``,
    ``truncate`` uses ``clamp(rho, floor, cap)`` (computed in log space) on every token, ``mask`` keeps the
    tokens (token level) or whole sequences (sequence, geometric) with ``floor <= rho <= cap`` at their true
    ratio and drops the others from the loss mask. Other trained rows get weight 1. Rows of groups sent to
    ``replay``, ``quarantine`` or ``reject`` get mask 0. Weights are 0 wherever the mask is 0 (so
    ``weights * loss`` never multiplies an infinite ratio by 0) and are detached from the graph.
    """
    valid = view.valid
    trained_row = (row_action == TRAIN) | (row_action == TRAIN_WITH_CORRECTION)
    corrected_row = row_action == TRAIN_WITH_CORRECTION
    if policy.correct_train:
        corrected_row = trained_row
    log_floor, log_cap = _log_bounds(policy)
    level, mode = policy.correction_level.value, policy.correction_mode.value
    core = _uses_core_clamp(policy, level)
    log_rho = _log_ratio_at_level(view, level).detach()
    outside = (log_rho > log_cap) | (log_rho < log_floor)
    if mode == "truncate":
        if core:  # the core's own clamp: the weights are exactly BatchView.weights(C)
            rho = view.weights(policy.clamp).detach()
        else:
            rho = log_rho.clamp(min=log_floor, max=log_cap).exp()
        keep = torch.ones_like(valid)
        truncated = outside
        masked = torch.zeros_like(valid)
    else:
        keep = ~outside
        rho = torch.where(keep, log_rho, torch.zeros_like(log_rho)).exp()
        truncated = torch.zeros_like(valid)
        masked = outside
    corrected = valid & corrected_row[:, None]
    loss_mask = valid & trained_row[:, None] & (keep | ~corrected_row[:, None])
    one = torch.ones((), dtype=view.dtype, device=view.device)
    weights = torch.where(corrected, rho.to(view.dtype), one)
    weights = torch.where(loss_mask, weights, torch.zeros_like(weights))
    dt = view.dtype
    return {
        "loss_mask": loss_mask,
        "weights": weights,
        "trained_tokens": (valid & trained_row[:, None]).sum().to(dt),
        "corrected_tokens": corrected.sum().to(dt),
        "truncated_tokens": (corrected & truncated).sum().to(dt),
        "masked_tokens": (corrected & masked).sum().to(dt),
    }


def correction_weights(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None = None,
    level: str = "token",
    mode: str = "truncate",
    cap: float = 2.0,
    floor: float = 0.0,
    check_inputs: bool = True,
) -> tuple[Tensor, Tensor]:
    r"""Rollout-correction importance weights of one batch: ``(loss_mask [B, T] bool, weights [B, T])``.

    The correction the controller applies to trained groups, here for every sequence: with :math:`\rho` the
    importance ratio at ``level`` (token :math:`e^{r_t}`, sequence :math:`e^{s_i}`, geometric
    :math:`e^{s_i / n_i}`), ``truncate`` gives :math:`\mathrm{clamp}(\rho, floor, cap)` (TIS: ``cap=2``,
    ``floor=0``), ``mask`` keeps tokens (or sequences) with :math:`floor \le \rho \le cap` at their true
    ratio and drops the rest from the mask (MIS). Weights are 0 wherever the mask is 0.

    ``check_inputs`` refuses probabilities or logits passed as logprobs and response masks with values other
    than 0 and 1 (``ValueError``), reading three numbers to the host; ``False`` skips it (no host sync).

    Example:
        >>> import torch
        >>> t = torch.tensor([[-1.0, -1.0, -1.0]])
        >>> r = torch.tensor([[-2.0, -1.0, -0.5]])   # ratios e, 1, e^-0.5
        >>> mask, w = correction_weights(t, r)
        >>> w.round(decimals=4)
        tensor([[2.0000, 1.0000, 0.6065]])
        >>> mask, w = correction_weights(t, r, mode="mask", floor=0.5)
        >>> mask, w.round(decimals=4)
        (tensor([[False,  True,  True]]), tensor([[0.0000, 1.0000, 0.6065]]))
    """
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"`level` must be one of {CORRECTION_LEVELS}, got {level!r}")
    if mode not in CORRECTION_MODES:
        raise ValueError(f"`mode` must be one of {CORRECTION_MODES}, got {mode!r}")
    view = BatchView(trainer_logprobs=trainer_logprobs, rollout_logprobs=rollout_logprobs, response_mask=response_mask)
    if check_inputs:
        raise_if_bad_inputs(*view.logprob_range, view.mask_other_values)
    policy = OPBCPolicy(weight_cap=cap, weight_floor=floor, correction_level=CorrectionLevel(level),
                        correction_mode=CorrectionMode(mode), correct_train=True)
    rows = torch.full((view.token_inputs[0].shape[0],), TRAIN, dtype=torch.int64, device=view.device)
    out = _correction(view, rows, policy)
    return out["loss_mask"], out["weights"]
