r"""Train-vs-rollout mismatch: pure functions over one batch.

Notation (per valid token t, i.e. ``response_mask = 1`` and both logprobs finite):
``r_t = trainer_logprobs - rollout_logprobs`` in nats, ``w_t = exp(clamp(r_t, -C, C))`` with clamp
``C`` (20 by default), ``N`` the number of valid tokens. Per sequence i: ``s_i = sum_t r_t``,
``n_i`` its valid tokens.

Near on-policy the interesting quantities are tiny differences of numbers near 1 (``E[w^2] - 1`` is
about ``Var(r)``, ``exp(r) - 1 - r`` about ``r^2 / 2``), so the kernels never form ``w``: per token they
take ``k3_t = expm1(r~_t) - r~_t`` (``r~`` the clamped ratio; an exact float subtraction for
``|r~_t| < 1``, so only ``expm1``'s own rounding remains) and ``delta_t = p_t - q_t = q_t expm1(log p_t -
log q_t)``, and sum them, their squares and their products with ``r~_t`` and ``q_t``. Every key comes from
these sums: the centred weight ``u = w - 1 = r~ + k3`` gives ``E[w^2] - 1 = E[u^2] + 2 E[u]``, ESS, the
weight mean and std. Float32 inputs then give every key to about 1e-6 relative of the float64 result at
drifts of 1e-4 to 1e-2, where ``E[w^2] - 1`` formed from float32 sums of ``w^2`` kept only a few digits.
These sums merge across updates and ranks like sums of ``w``.

One kernel, :func:`token_statistics`, computes every token-level sufficient statistic of the section
in one sweep (eager: cache-sized blocks of in-place ops; under ``torch.compile``: one fused loop over
the tokens, the histogram's scatter included); :func:`batch_statistics` caches it on the batch's
:class:`~opbc_metrics.batch.BatchView`, so a collection pays for it once.
Each metric then comes as a pair ``_x_update(stats) -> dict of its statistics`` and
``_x_compute(**stats) -> value``; the stateful classes in :mod:`opbc_metrics.mismatch` sum (or
max/min) the statistics over updates and ranks and call the same ``_x_compute``, so the functional
value of one batch equals the class value after one update.

The ``_x_compute`` steps return their on-policy value over an empty window (no valid token, or no valid
sequence): ESS, weight mean, second moment, perplexity ratio and Pearson 1; differences, fractions, KL
and chi-square terms 0. Nothing reports it: the stateful classes have no keys then (``data_counts``), and
the public functions below raise a ``ValueError`` on a batch without a valid token (the sequence-level
ones, ``sequence_ess``, ``sequence_log_ratio`` and ``perplexity_gap``, without a valid sequence;
``chi_square`` leaves ``chi2_seq`` out then). ``pearson`` needs two valid tokens: with one its key is
left out.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import operator
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from opbc_metrics.batch import (
    DEFAULT_CLAMP,
    DEFAULT_VETO,
    LOGPROB_HIGH,
    PROBABILITY_TOLERANCE,
    BatchView,
    check_clamp_dtype,
    from_host,
    raise_if_bad_inputs,
    valid_tokens,
)
from opbc_metrics.functional.statistics import Stats, require_data
from opbc_metrics.functional.statistics import safe_div as _safe_div

# The top-1% sketch bins log-weights over [-C, C]; 8192 bins keep its relative error under 0.25%.
DEFAULT_TOP_MASS_BINS = 8192
# Bin indices stay exact in float32 (and the compiled kernel's int32 lane offsets far from overflow).
MAX_TOP_MASS_BINS = 2**24
DEFAULT_TOP_FRACTION = 0.01
# opbc/ppl/ratio = mean exp(d_i) caps d_i at 600 nats: exp(600) ~ 3.8e260, so a sum over up to 1e47 sequences
# stays finite in float64 (exp would overflow at 709.8; only sentinel logprobs get near either).
PPL_LOG_CAP = 600.0
# Probabilities are exp(clamp(logp, -80, 0)): below e^-80 ~ 1.8e-35 the value is immaterial to every sum,
# and CPU exp takes a slow path (10-100x) on inputs whose result underflows (-inf padding, -9999 sentinels).
PROB_LOG_FLOOR = -80.0


def _view(trainer_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor | None) -> BatchView:
    return BatchView(
        trainer_logprobs=trainer_logprobs, rollout_logprobs=rollout_logprobs, response_mask=response_mask
    )


# ---------------------------------------------------------------------------------------------
# The kernels: every token-level sufficient statistic of the section in one sweep
# ---------------------------------------------------------------------------------------------
class _RowLayout:
    """Names of the rows of the per-sequence sums ``row_sums`` ([len(layout), B]), in order.

    The eager kernel reads runs of adjacent rows as one matrix (a Gram pair, the chunked rows, the
    scaled rows); :meth:`span` returns such a run as a slice and fails at import when the rows are
    not adjacent in that order, so a reordering cannot silently break a kernel.
    """

    def __init__(self, *names: str) -> None:
        self.names = names
        self.index = {name: i for i, name in enumerate(names)}
        if len(self.index) != len(names):
            raise AssertionError(f"duplicate row names in {names}")

    def __len__(self) -> int:
        return len(self.names)

    def span(self, *names: str) -> slice:
        """The slice of ``names``, which must be adjacent rows in this order."""
        first = self.index[names[0]]
        if self.names[first : first + len(names)] != names:
            raise AssertionError(f"rows {names} must be adjacent, in this order, in {self.names}")
        return slice(first, first + len(names))


# Per-sequence sums both kernels produce; every feature is 0 on invalid tokens, so plain sums over tokens
# are the statistics. "rounds" counts the starts of rounds (runs of 1s in the mask; only with the rounds
# group, else 0). The probability rows come last: without the group the eager kernel skips them. "sum_w" sums
# the raw weights w = exp(rc) (and the product sum "sum_w2" their squares): the sums of u = w - 1 (from rc and k3)
# keep the digits near on-policy, where w ~ 1, but not when every weight is small (u ~ -1 holds no digit of w).
_ROWS = _RowLayout(
    "n", "n_mask", "rounds", "sum_abs_r", "sum_r", "sum_rc", "sum_k3", "sum_w", "clipped", "vetoed", "sum_dp",
    "sum_q", "sum_abs_pq",
)
_ROW_SUMS = _ROWS.names
# Rows also summed per chunk of _ROUND_CHUNK tokens, for the per-round statistics (see _round_sums).
_CHUNKED = _ROWS.span("n", "n_mask", "rounds", "sum_abs_r")
if _CHUNKED.start != 0:
    raise AssertionError("the chunked rows must come first (the eager kernel sums the rest as one block)")
# Sums of r and |r| are taken on r * 2^-64 and scaled back in float64: a float32 sentinel such as finfo.min
# (a masked_fill value) is a finite r of 3.4e38, two of which overflow a float32 sum, while power-of-two
# scaling is exact (tokens with |r| < 2^-62 nats lose relative precision: at most 2^-62 nats each).
_R_SCALE = 2.0**-64
_SCALED_ROWS = _ROWS.span("sum_abs_r", "sum_r")
_FLAG_ROWS = _ROWS.span("clipped", "vetoed")  # |r| against the clamp and the veto, in one comparison
_PROB_ROWS = _ROWS.span("sum_dp", "sum_q", "sum_abs_pq")
if _PROB_ROWS.stop != len(_ROWS):
    raise AssertionError("the probability rows must come last (the eager kernel skips them without the group)")
# The two Gram pairs, as a batch of two [2, tokens] matrices for one bmm: (rc, k3) and (p - q, q).
_GRAM_PAIRS = (_ROWS.span("sum_rc", "sum_k3"), _ROWS.span("sum_dp", "sum_q"))
# Token-level sums of products: name -> the two rows multiplied, both from one Gram pair.
_PRODUCTS = {
    "sum_rc2": ("sum_rc", "sum_rc"),
    "sum_qq": ("sum_q", "sum_q"), "sum_dp2": ("sum_dp", "sum_dp"), "sum_qdp": ("sum_dp", "sum_q"),
}
# The Gram products, then the sums of w^2 and of u^2 = (w - 1)^2, each summed on its own: from the Gram products,
# sum u^2 = sum rc^2 + 2 sum rc k3 + sum k3^2 cancels when many tokens are far off-policy (rc = -5: 25 - 40 + 16).
_PRODUCT_SUMS = (*_PRODUCTS, "sum_w2", "sum_u2")
# The eager kernel reuses the p - q and q rows as int64 histogram indices once their sums are taken: for a
# float32 buffer of any block size, that view needs the p - q row at an even row index.
if _ROWS.index["sum_dp"] % 2:
    raise AssertionError("the sum_dp row must have an even index (it is viewed as int64 scratch)")


def _gram_position(a: str, b: str) -> int:
    """Where the product of rows ``a`` and ``b`` lies in the flattened ``[pair, 2, 2]`` Gram matrices."""
    for pair, rows in enumerate(_GRAM_PAIRS):
        i, j = _ROWS.index[a] - rows.start, _ROWS.index[b] - rows.start
        if 0 <= i < 2 and 0 <= j < 2:
            return 4 * pair + 2 * i + j
    raise AssertionError(f"rows {a} and {b} are not in one Gram pair")


_PRODUCT_POSITIONS = tuple(_gram_position(a, b) for a, b in _PRODUCTS.values())
# The per-round statistics: tokens per chunk of the chunked sums. A round's sums are differences of prefix sums
# at round starts: whole chunks from the chunk sums, the part of the chunk before the start recomputed from the
# inputs (a window of this many tokens per tracked round and sequence).
_ROUND_CHUNK = 32
# The compiled kernel's chunks: its chunk loop costs about the same at 32, 64 and 128 tokens, the window stage
# grows with the width (measured at 128 x 8192: the kernel with rounds 5.2 ms at 64, 5.8 ms at 128).
_COMPILED_ROUND_CHUNK = 64
_SCALAR_STATS = (
    *_ROW_SUMS, *_PRODUCT_SUMS, "sum_u", "min_r", "max_r", "max_abs_pq",
    "num_seqs", "sum_s", "sum_abs_s", "max_abs_s", "sum_geo", "sum_us", "sum_us2", "sum_ws", "sum_ws2", "sum_d",
    "sum_abs_d", "sum_exp_d",
)


def _l2_cache_bytes(cache_dir: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The first CPU's L2 cache size from Linux sysfs, 0 where unknown."""
    for index in range(8):
        base = f"{cache_dir}/index{index}/"
        try:
            with open(base + "level") as level, open(base + "size") as size:
                if level.read().strip() == "2":
                    text = size.read().strip().upper()
                    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
                    return int(text.rstrip("KM")) * scale
        except (OSError, ValueError):
            continue
    return 0


# Eager CPU work goes in blocks of about this many tokens, so that the dozen [rows, T] intermediates of a
# block stay in cache between the ops that use them, where whole-batch intermediates would stream through
# memory once per op (2-3x fewer CPU cycles per op at 64K tokens than at 2M). A 32K-token block with its
# inputs takes ~2 MiB: where that fits in L2 (Intel Xeon, 2 MiB) 32K-token blocks were 2-5% faster than 64K;
# where it does not (AMD EPYC, 1 MiB), 64K-token blocks were 7-8% faster than 32K (L3-resident; half the
# ~35 op dispatches per token) and 16K ones 17% slower. Not larger: the Gram products are float32 sums
# over a block (128K: 4x the float32 error of 32K at drift 1e-4).
_BLOCK_TOKENS = 1 << 15 if _l2_cache_bytes() >= 2 << 20 else 1 << 16
# float32 counts every integer up to 2^24 exactly: a batch of at most this many tokens is counted in float32.
_FLOAT32_EXACT_TOKENS = 2**24
# The compiled kernel spreads its histogram over this many copies (by token position): consecutive
# tokens, mostly in the same few central bins, then update different memory and do not wait on each other.
_HIST_LANES = 4
# The eager kernel's CPU scatter likewise: near on-policy the tokens of a block fall in one or two bins, and
# adds to one address wait on each other (a 32K-token block at drift 1e-3: 46 us in 1 copy, 25 in 2, 17 in 4,
# 14 in 8; 16 copies, 512 KiB of float32 counts at 8192 bins, leave L2: 80 us). Spread tokens (drift 0.05): 15 us
# in any number of copies; the offsets cost 2.6 us per block (an int32 add).
_EAGER_HIST_LANES = 4
# On CUDA the histogram's scatter is atomic adds, and tokens near on-policy fall in a few central bins, where adds to
# one address serialize: both kernels spread the tokens over up to this many copies of the histogram (by position,
# at most _CUDA_HIST_SLOTS slots in all) and sum the copies.
_CUDA_HIST_LANES = 256
_CUDA_HIST_SLOTS = 1 << 21


def _hist_lanes(device: torch.device, bins: int, cpu_lanes: int) -> int:
    """Copies of the histogram a kernel scatters into: ``cpu_lanes`` on the CPU, up to 256 elsewhere."""
    return cpu_lanes if device.type == "cpu" else max(1, min(_CUDA_HIST_LANES, _CUDA_HIST_SLOTS // (bins + 2)))


class _Workspaces(threading.local):
    """Per-thread CPU buffers of the eager kernel and the views a block of a given shape uses.

    Views are made once per block shape: at ~2 us per Python-level view, the ~30 a block needs made the
    kernel 9-13% slower when made per block (see :func:`release_workspaces`).
    """

    def __init__(self) -> None:
        self.plans: dict[tuple[Any, ...], _BlockPlan] = {}
        self.calls: dict[tuple[Any, ...], _CallPlan] = {}
        self.rounds: dict[tuple[Any, ...], dict[str, Tensor]] = {}


_WORKSPACES = _Workspaces()


class _BlockPlan:
    """Buffers and row views for eager blocks of ``rows`` sequences of length ``t``.

    Rows are reused once the block's sums are taken (min/max scratch in the |p - q| row, the histogram's
    int64 bin indices over the p - q and q rows, its int32 indices in the |r| row): 14 rows, so a 32K-token
    block and its inputs take ~2 MiB, a 2 MiB L2 cache on the Intel VM (measured: 4-6% faster than separate scratch
    and index buffers).
    """

    def __init__(
        self, rows: int, t: int, dtype: torch.dtype, bins: int, device: torch.device, summed: int, rounds: bool
    ) -> None:
        n = rows * t
        self.rows = rows
        self.features = x = torch.empty(len(_ROWS), rows, t, dtype=dtype, device=device)
        if not rounds:
            x[_ROWS.index["rounds"]].zero_()  # never written without the group
        self.d, self.a = torch.empty(2, rows, t, dtype=dtype, device=device).unbind(0)
        rows_of = dict(zip(_ROWS.names, x.unbind(0)))
        self.valid, self.m, self.starts = rows_of["n"], rows_of["n_mask"], rows_of["rounds"]
        self.dp, self.q, self.apq = rows_of["sum_dp"], rows_of["sum_q"], rows_of["sum_abs_pq"]
        self.pq = x[_GRAM_PAIRS[1]].flatten(1)  # p - q and q: one [2, tokens] matrix
        self.rs, self.ars = rows_of["sum_r"], rows_of["sum_abs_r"]
        self.rc, self.k3 = rows_of["sum_rc"], rows_of["sum_k3"]
        self.w = rows_of["sum_w"]
        self.w_flat, self.k3_flat = self.w.view(-1), self.k3.view(-1)
        self.rck3 = x[_GRAM_PAIRS[0]].flatten(1)
        self.rck3_t = self.rck3.t()
        # Both Gram pairs as one batch of two [2, tokens] matrices, for one bmm of both Gram matrices.
        gap = _GRAM_PAIRS[1].start - _GRAM_PAIRS[0].start
        self.pairs = x.view(-1).as_strided((2, 2, n), (gap * n, n, 1), _GRAM_PAIRS[0].start * n)
        self.pairs_t = self.pairs.transpose(1, 2)
        # |r| * 2^-64 as one row against both thresholds, into the adjacent clipped and vetoed rows.
        self.flags = x[_FLAG_ROWS].flatten(1)
        self.ars_row = self.ars.view(1, -1)
        self.summed = x[:summed]
        self.summed_rest = x[_CHUNKED.stop : summed]  # with the rounds group, the chunked rows' sums come from chunks
        # Round starts, flat: a token starts a round when its mask is 1 and the previous token's 0 (fixed up
        # at each row's first token).
        m_flat, starts_flat = self.m.view(-1), self.starts.view(-1)
        self.m_next, self.m_previous, self.starts_next = m_flat[1:], m_flat[:-1], starts_flat[1:]
        self.starts_first = self.starts[:, 0]
        # The chunked rows as [rows in _CHUNKED, rows, chunks, _ROUND_CHUNK], and the tail of a row whose length
        # is not a multiple of the chunk.
        whole = t - t % _ROUND_CHUNK
        self.chunked = x[_CHUNKED][..., :whole].unflatten(-1, (whole // _ROUND_CHUNK, _ROUND_CHUNK))
        self.tail = x[_CHUNKED][..., whole:] if whole < t else None
        # Free once the sums are taken: the |p - q| row as scratch, the p - q and q rows as int64 bin indices
        # (converted via int32 in the |r| row).
        self.e = self.apq
        self.idx_flat = (self.pq if dtype == torch.float32 else self.dp).reshape(-1).view(torch.int64)
        self.valid_flat, self.rs_flat = self.valid.view(-1), self.rs.view(-1)
        self.valid_row = self.valid.view(1, -1)
        self.idx32_flat = self.ars.reshape(-1).view(torch.int32)[:n]  # int32 indices in the |r| row
        self.lanes = _hist_lanes(device, bins, _EAGER_HIST_LANES)
        self.block_counts = torch.empty(self.lanes * (bins + 1), dtype=dtype, device=device)
        # Each token's copy of the histogram, as an int32 offset of its bin index.
        self.lane_offsets = (torch.arange(n, dtype=torch.int32, device=device) % self.lanes).mul_(bins + 1)
        # Bin offsets for invalid tokens (weight 0, any bin will do), 16 distinct ones in a row: a run of
        # padding in one bin is a chain of dependent read-modify-writes (measured: the block's scatter
        # 47 us against 30 us spread). Offsets lie within +-0.495 bins of the middle bin, where r = 0 puts them.
        self.spread = ((torch.arange(t, device=device) % 16).to(dtype) / 16 - 0.5) * (0.99 * bins)


class _CallPlan:
    """Per-call partial results of the eager kernel for a batch shape, and their per-block views.

    Made once per batch shape (views cost ~2 us each, ~6 per block); the statistics assembled from them
    are new tensors, so reusing them across calls aliases nothing a caller holds.
    """

    def __init__(
        self, b: int, t: int, rows: int, dtype: torch.dtype, device: torch.device, summed: int, rounds: bool
    ) -> None:
        blocks = -(-b // rows)
        # Skipped groups leave zeros: their rows come last and are never written.
        self.row_sums = torch.zeros(len(_ROWS), b, dtype=dtype, device=device)
        # Gram matrices of the feature pairs (rc, k3) and (p - q, q).
        self.grams = torch.zeros(blocks, 2, 2, 2, dtype=dtype, device=device)
        self.w2 = torch.zeros(blocks, dtype=dtype, device=device)  # sums of w^2 (a dot product per block)
        self.u2 = torch.zeros(blocks, dtype=dtype, device=device)  # sums of u^2
        self.extremes = torch.zeros(3, blocks, dtype=dtype, device=device)  # min r, max r, max |p - q|
        # the largest valid trainer / rollout logprob ([block, side]; 0 stands in for invalid tokens)
        self.logprob_high = torch.zeros(blocks, 2, dtype=dtype, device=device)
        self.product_index = from_host(_PRODUCT_POSITIONS, torch.int64, device)
        # Chunk sums of the _CHUNKED rows, [rows, B, chunks] (the last chunk of a row may be partial).
        chunks = -(-t // _ROUND_CHUNK) if rounds else 0
        self.chunks = torch.zeros(len(range(len(_ROWS))[_CHUNKED]), b, chunks, dtype=dtype, device=device)
        whole = t // _ROUND_CHUNK
        self.outputs = list(zip(
            self.row_sums[:summed].split(rows, dim=1), self.grams.unbind(0), self.w2.unbind(0), self.u2.unbind(0),
            *self.extremes.unbind(0), self.logprob_high.unbind(0),
            self.chunks[..., :whole].split(rows, dim=1), self.chunks[..., whole:].split(rows, dim=1),
            self.row_sums[_CHUNKED.stop : summed].split(rows, dim=1),
        ))


def _cached_plan(cache: dict[tuple[Any, ...], Any], make: Any, *key: Any) -> Any:
    """``make(*key)``, cached per thread on CPU for the last few keys (made fresh on other devices)."""
    if next(k for k in key if isinstance(k, torch.device)).type != "cpu":
        return make(*key)
    plan = cache.get(key)
    if plan is None:
        # Keep the plans of the last few shapes only: a block plan holds ~14 x max(_BLOCK_TOKENS, T) elements.
        if len(cache) >= 4:
            cache.pop(next(iter(cache)))
        plan = cache[key] = make(*key)
    return plan


def release_workspaces() -> None:
    """Free this thread's workspace buffers (about 14 x ``max(_BLOCK_TOKENS, T)`` elements per cached block shape)."""
    _WORKSPACES.plans.clear()
    _WORKSPACES.calls.clear()
    _WORKSPACES.rounds.clear()


def token_statistics(
    trainer: Tensor, rollout: Tensor, mask: Tensor, clamp: float, veto: float, bins: int,
    prob: bool = True, hist: bool = True, rounds: int = 0,
) -> Stats:
    """All sufficient statistics of the mismatch section for one batch, in one sweep over the tokens.

    A token is valid when ``mask`` is set and ``r = trainer - rollout`` is finite (so both logprobs
    are; :func:`~opbc_metrics.batch.valid_tokens`). Eager, the batch goes through in blocks of about 32K
    tokens with in-place ops on cached buffers (:func:`_blocked_token_statistics`); under ``torch.compile``
    the same statistics come from pure expressions that inductor fuses into one loop over the tokens, the
    histogram's scatter included (:func:`_fused_token_statistics`, ``fullgraph=True``). Both feed
    :func:`_assemble_statistics`.

    Args:
        trainer: ``[B, T]`` trainer logprobs (float32 or float64).
        rollout: ``[B, T]`` rollout logprobs, same dtype.
        mask: ``[B, T]`` bool response mask (compiled, also its ``uint8`` view: see
            :func:`compiled_token_statistics`).
        clamp: C, the log-ratio clamp.
        veto: the veto threshold.
        bins: bins of the top-1% sketch's log-weight histogram over ``[-C, C]``.
        prob: compute the probability statistics (``sum_dp`` ... ``max_abs_pq``; else 0).
        hist: compute the log-weight histogram (else zeros).
        rounds: compute the per-round statistics for rounds ``0 .. rounds - 1`` and an overflow bucket
            (``round_*`` and ``max_rounds``, see :func:`_round_sums`); 0: none.

    Returns:
        float64 0-dim tensors named in ``_SCALAR_STATS``, ``hist`` (``[bins]`` token counts), eager also
        ``logprob_high`` (``[2]``: the trainer's and the rollout's largest logprob over every token, 0 standing in
        for invalid ones; :attr:`~opbc_metrics.batch.BatchView.logprob_high`), compiled with ``hist`` also
        :data:`LOGPROB_POSITIVE` and, with
        ``rounds``, the ``[rounds + 1]`` sums in :data:`ROUND_STATS` and ``max_rounds``.

    Example:
        >>> import torch
        >>> s = token_statistics(torch.tensor([[0.0, -1.0]]), torch.tensor([[-1.0, -1.0]]),
        ...                      torch.tensor([[True, True]]), 20.0, 30.0, 16)
        >>> s["n"].item(), s["sum_r"].item(), s["max_r"].item(), int(s["hist"].sum())
        (2.0, 1.0, 1.0, 2)
    """
    if torch.compiler.is_compiling():
        return _fused_token_statistics(trainer, rollout, mask, clamp, veto, bins, prob, hist, rounds)
    return _blocked_token_statistics(trainer, rollout, mask, clamp, veto, bins, prob, hist, rounds)


def _blocked_token_statistics(
    trainer: Tensor, rollout: Tensor, mask: Tensor, clamp: float, veto: float, bins: int, prob: bool, hist: bool,
    rounds: int,
) -> Stats:
    """Eager kernel: blocks of whole sequences, ~32 in-place ops per block on cache-resident buffers.

    Float arithmetic only: on CPU, ``where``, bool outputs and bool-to-float casts cost 5-20x a multiply.
    Ops that read the inputs come first, while the block's inputs are still in cache.
    """
    f64, dtype, device = torch.float64, trainer.dtype, trainer.device
    b, t = trainer.shape
    rows = max(1, min(b, _BLOCK_TOKENS // max(t, 1))) if device.type == "cpu" else b
    # Skipped groups leave zeros: their rows come last in the feature buffer and are not summed.
    summed = len(_ROWS) if prob else _PROB_ROWS.start
    with_rounds = rounds > 0
    call = _cached_plan(_WORKSPACES.calls, _CallPlan, b, t, rows, dtype, device, summed, with_rounds)
    # Histogram counts accumulate in the features' dtype while that is exact, else per block into float64.
    exact_counts = dtype == f64 or b * t <= _FLOAT32_EXACT_TOKENS
    lanes = _hist_lanes(device, bins, _EAGER_HIST_LANES)
    counts = torch.zeros(lanes * (bins + 1), dtype=dtype if exact_counts else f64, device=device)
    scale, big = bins / (2.0 * clamp), torch.finfo(dtype).max
    # Operands as 0-dim tensors of the features' dtype: a Python scalar costs a conversion per call.
    zero, r_scale, shift, scale_t = (
        torch.full((), v, dtype=dtype, device=device) for v in (0.0, _R_SCALE, clamp, scale)
    )
    thresholds = from_host([[clamp * _R_SCALE], [veto * _R_SCALE]], dtype, device)
    # One C++ call per input instead of a Python-level view per block. The mask goes as uint8: a uint8 -> float
    # copy is ~6x faster than bool -> float.
    block_views = zip(trainer.split(rows), rollout.split(rows), mask.view(torch.uint8).split(rows), call.outputs)
    x = None
    for tr, ro, mb, (sums, grams, w2, u2, lo_r, hi_r, hi_pq, logprob_high, chunk_sums, tail_sums, rest_sums) in (
        block_views
    ):
        if x is None or x.rows != tr.shape[0]:  # all blocks but the last have `rows` rows
            x = _cached_plan(_WORKSPACES.plans, _BlockPlan, tr.shape[0], t, dtype, bins, device, summed, with_rounds)
        d, a, valid = x.d, x.a, x.valid
        torch.sub(tr, ro, out=d)
        # The rule of valid_tokens, in float arithmetic: d / mask is d where the mask is set and inf or NaN
        # where it is not, so a token is valid where that quotient is finite, i.e. where nan_to_num leaves it
        # unchanged; r is that quotient's nan_to_num.
        d.div_(x.m.copy_(mb))
        r = torch.nan_to_num(d, 0.0, 0.0, 0.0, out=a)
        torch.eq(d, r, out=valid)
        if with_rounds:  # starts = m * (1 - previous m) = m - m * previous m: here m * previous m (0 at each row's
            # first token), its chunk sums subtracted from the mask's after the loop (one op per call, not per block)
            torch.mul(x.m_next, x.m_previous, out=x.starts_next)
            x.starts_first.zero_()
        # Both sides' logprobs on valid tokens (0 elsewhere), their max over every token: a side above 0 holds
        # probabilities or logits (the input check at compute; a sample of the columns missed short responses).
        torch.nan_to_num(tr, 0.0, 0.0, 0.0, out=x.dp)
        torch.nan_to_num(ro, 0.0, 0.0, 0.0, out=x.q)
        torch.amax(x.pq.mul_(x.valid_row), 1, out=logprob_high)
        if prob:
            # p = exp(a), q = exp(b) with a, b the logprobs clamped to [PROB_LOG_FLOOR, 0], on valid tokens (0
            # elsewhere). p - q as q * expm1(a - b): exact to a few ulps, where exp(a) - exp(b) keeps only the
            # rounding error of p and q near on-policy. The same two transcendental ops per token as two exps.
            x.pq.clamp_(PROB_LOG_FLOOR, 0.0)
            torch.sub(x.dp, x.q, out=x.dp).expm1_()  # a - b is in [-80, 80]: finite
            x.q.exp_().mul_(valid)
            dp = x.dp.mul_(x.q)
            torch.amax(torch.abs(dp, out=x.apq), (0, 1), out=hi_pq)
        torch.abs(torch.mul(r, r_scale, out=x.rs), out=x.ars)
        torch.gt(x.ars_row, thresholds, out=x.flags)
        rc = torch.clamp(r, -clamp, clamp, out=x.rc)
        # k3 = expm1(rc) - rc, in place (the sum of u^2 = expm1(rc)^2 on the way). Invalid tokens have rc = 0, hence
        # u = k3 = 0: no masking needed.
        torch.dot(x.k3_flat, torch.expm1(rc, out=x.k3).view(-1), out=u2)
        x.k3.sub_(rc)
        torch.exp(rc, out=x.w).mul_(valid)  # raw weights: 0 on invalid tokens
        torch.dot(x.w_flat, x.w_flat, out=w2)
        if prob:
            torch.bmm(x.pairs, x.pairs_t, out=grams)  # both Gram matrices in one call
        else:
            torch.mm(x.rck3, x.rck3_t, out=grams[0])
        if with_rounds:  # the chunked rows' sums per chunk (before the |r| row becomes scratch; per row after the
            # loop, from the chunk sums), the other rows' per row
            torch.sum(x.chunked, -1, out=chunk_sums)
            if x.tail is not None:
                torch.sum(x.tail, -1, keepdim=True, out=tail_sums)
            torch.sum(x.summed_rest, -1, out=rest_sums)
        else:
            torch.sum(x.summed, -1, out=sums)  # every per-sequence sum of the block at once
        # Extremes over valid tokens: the others move to the far end of the finite range.
        invalid = torch.eq(valid, zero, out=d)
        torch.amin(torch.add(r, invalid, alpha=big, out=x.e), (0, 1), out=lo_r)
        torch.amax(torch.add(r, invalid, alpha=-big, out=x.e), (0, 1), out=hi_r)
        if hist:
            # Bin of rc, counted with weight `valid` (0 drops invalid tokens without index masking); invalid
            # tokens (rc = 0, `invalid` = 1) move off the middle bin by their spread offset, valid ones by exactly 0.
            torch.add(rc, shift, out=x.rs).mul_(scale_t).addcmul_(invalid, x.spread)
            # float -> int32 (truncation: the bin), plus the lane's offset, -> int64 (the index scatter takes): 6.5 us
            # a block; float -> int64 directly 16 us, an int32 + int32 add into int64 14 us (a temporary and a copy)
            x.idx_flat.copy_(x.idx32_flat.copy_(x.rs_flat).add_(x.lane_offsets))
            if exact_counts:
                counts.scatter_add_(0, x.idx_flat, x.valid_flat)
            else:
                counts.add_(x.block_counts.zero_().scatter_add_(0, x.idx_flat, x.valid_flat))
    if with_rounds:  # the starts: the mask's chunk sums less those of m * previous m; then the sums per row
        starts = call.chunks[_ROWS.index["rounds"]]
        torch.sub(call.chunks[_ROWS.index["n_mask"]], starts, out=starts)
        torch.sum(call.chunks, -1, out=call.row_sums[_CHUNKED])
    if lanes > 1:
        counts = counts.view(lanes, bins + 1).sum(0).to(f64)  # exact: counts stay exact in their dtype (above)
    products = torch.cat((call.grams.sum(0, dtype=f64).view(-1).take(call.product_index),
                          call.w2.sum(0, dtype=f64, keepdim=True), call.u2.sum(0, dtype=f64, keepdim=True)))
    extremes = torch.cat((call.extremes[:1].amin(1), call.extremes[1:].amax(1)))
    out = _assemble_statistics(call.row_sums, products, extremes, counts, clamp, bins, call.logprob_high.amax(0))
    if with_rounds:
        out.update(_round_sums(call.chunks, trainer, rollout, mask, rounds))
    return out


# The compiled kernel's count of valid tokens with a positive logprob ([2]: trainer above the tolerance; rollout above
# it, the trainer not), from two extra copies of its histogram (:func:`_fused_token_statistics`).
LOGPROB_POSITIVE = "logprob_positive"


# The order in which the compiled kernel sums its rows and returns them: in this order inductor fuses the
# reductions and the histogram's scatter into one loop over the tokens (measured: the layout's order, with the
# rounds row among them, made the kernel 1.7x slower at 128 x 8192).
_FUSED_ORDER = ("n", "n_mask", "sum_r", "sum_abs_r", "sum_rc", "sum_k3", "clipped", "vetoed", "sum_dp", "sum_q",
                "sum_abs_pq", "sum_w")


def _fused_token_statistics(
    trainer: Tensor, rollout: Tensor, mask: Tensor, clamp: float, veto: float, bins: int, prob: bool, hist: bool,
    rounds: int,
) -> Stats:
    """Compiled kernel: pure expressions with every reduction along T, which inductor fuses into one loop.

    With ``rounds``, :func:`_chunk_sums` (or :func:`_ragged_chunk_sums`, rows of T not a multiple) sums the chunked
    rows per chunk of ``_COMPILED_ROUND_CHUNK`` tokens, inside the main loop's loop over rows where its rows are whole
    chunks; rows shorter than a chunk are padded with masked-out tokens for the chunk sums and :func:`_round_sums`.
    """
    f64, dtype = torch.float64, trainer.dtype
    if rounds:
        mask_in = _round_mask(trainer, mask)
        unpadded = (trainer, rollout, mask_in)
    seqs, t = trainer.shape
    pieces = _reduction_pieces(t)
    if pieces > 1:  # rows of contiguous inputs as `pieces` rows each: views, no copy
        trainer, rollout, mask = (x.reshape(seqs * pieces, t // pieces) for x in (trainer, rollout, mask))
    if mask.dtype == torch.uint8:
        # (converted to the logprobs' dtype and compared there: a uint8 comparison's mask, cast to the float lanes,
        # made the kernel with rounds 1.4x slower at 256 x 8192)
        mask = (mask_in.reshape(trainer.shape) if rounds else mask).to(dtype) > 0
    d = trainer - rollout
    ok = valid_tokens(d, mask)
    r = torch.where(ok, d, 0.0)
    rc = r.clamp(-clamp, clamp)
    ar = r.abs()

    # Each expression holding an exp is rebuilt at every use: on CPU, inductor stores a reused exp result
    # to memory (an extra pass over the tokens), while the copies inside one fused loop are computed once.
    # The forms of the exp arguments are the fast ones measured on inductor's CPU code (2-3x apart per exp,
    # same values): the raw difference clamped, not the masked one; a one-sided clamp of a logprob and a select.
    def k3() -> Tensor:  # expm1(rc) - rc
        x = d.clamp(-clamp, clamp)
        return torch.where(ok, torch.where(x.abs() < _SERIES_RANGE, _expm1_tail(x), torch.exp(x) - 1.0 - x), 0.0)

    def u() -> Tensor:  # expm1(rc) = rc + k3 (float32 rounding of |rc| at most, against |u| <= 1 far off-policy)
        return rc + k3()

    def w() -> Tensor:  # the raw weight exp(rc) (the same exp as k3's beyond the series range)
        return torch.where(ok, torch.exp(d.clamp(-clamp, clamp)), 0.0)

    def probability(logp: Tensor) -> Tensor:
        return torch.where(ok, torch.where(logp > 0, 1.0, torch.exp(logp.clamp(min=PROB_LOG_FLOOR))), 0.0)

    def p() -> Tensor:
        return probability(trainer)

    def q() -> Tensor:
        return probability(rollout)

    def dp() -> Tensor:  # p - q: near on-policy q * expm1(a - b), a and b the clamped logprobs
        g = trainer.clamp(PROB_LOG_FLOOR, 0.0) - rollout.clamp(PROB_LOG_FLOOR, 0.0)
        return torch.where(g.abs() < _SERIES_RANGE, q() * (g + _expm1_tail(g)), p() - q())

    def apq() -> Tensor:
        return dp().abs()

    rs = r * _R_SCALE
    zeros = torch.zeros(trainer.shape[0], dtype=dtype, device=trainer.device)
    if prob:
        prob_rows = [dp().sum(-1), q().sum(-1), apq().sum(-1)]
        prob_products = [(q() * q()).sum(-1), (dp() * dp()).sum(-1), (q() * dp()).sum(-1)]
        max_abs_pq = apq().amax(-1).amax()
    else:
        prob_rows = prob_products = [zeros] * 3
        max_abs_pq = torch.zeros((), dtype=dtype, device=trainer.device)
    # Summed in this order (the one inductor fuses with the histogram into one loop), then placed in the layout.
    summed = torch.stack([
        ok.to(dtype).sum(-1), mask.to(dtype).sum(-1), rs.sum(-1), rs.abs().sum(-1), rc.sum(-1), k3().sum(-1),
        (ar > clamp).to(dtype).sum(-1), (ar > veto).to(dtype).sum(-1), *prob_rows, w().sum(-1),
    ])
    features = dict(zip(_FUSED_ORDER, summed.unbind(0)), rounds=zeros)
    row_sums = torch.stack([features[name] for name in _ROWS.names])
    named_products = dict(zip(("sum_rc2", "sum_qq", "sum_dp2", "sum_qdp", "sum_w2", "sum_u2"),
                              [(rc * rc).sum(-1), *prob_products, (w() * w()).sum(-1), (u() * u()).sum(-1)]))
    products = torch.stack([named_products[name] for name in _PRODUCT_SUMS]).sum(-1, dtype=f64)
    if pieces > 1:
        row_sums = row_sums.view(len(_ROWS), seqs, pieces).sum(-1, dtype=f64)
    counts = torch.zeros(bins + 1, dtype=f64, device=trainer.device)
    positive = None
    if hist:
        # Every token adds 1 (a constant, nothing to load): invalid ones to slot bins + 1 of their copy,
        # which is dropped. int32 counts are exact to 2^31 tokens per slot.
        lanes, width, i32 = _hist_lanes(trainer.device, bins, _HIST_LANES), bins + 2, torch.int32
        idx = torch.where(ok, ((d.clamp(-clamp, clamp) + clamp) * (bins / (2.0 * clamp))).to(i32), bins + 1)
        # The input check: a token whose trainer (else rollout) logprob is above the tolerance goes to an extra copy
        # of the histogram (lane `lanes`, else `lanes + 1`), whose valid slots count them; the histogram sums every
        # copy, so its counts stay exact. No reduction node of its own: as two more maxima the same check slowed the
        # dynamic-shape graph 1.3-1.8x, the extra copies 0.93-1.11x (benchmarks/README.md, "The compiled kernel's input
        # check").
        lane = torch.arange(trainer.shape[-1], dtype=i32, device=trainer.device) % lanes
        lane = torch.where(trainer > PROBABILITY_TOLERANCE, lanes,
                           torch.where(rollout > PROBABILITY_TOLERANCE, lanes + 1, lane))
        idx = idx + lane * width
        one = torch.ones((), dtype=i32, device=trainer.device)
        slots = (lanes + 2) * width
        counts = torch.zeros(slots, dtype=i32, device=trainer.device).index_put_((idx,), one, accumulate=True)
        counts = counts.view(lanes + 2, width)[:, : bins + 1]
        positive = counts[lanes:].sum(-1, dtype=f64)
        counts = counts.sum(0, dtype=f64)
    if rounds:  # (the same expression as below: one node of the graph, the per-row min of r)
        chunks, windowed = _round_chunk_sums(*unpadded, torch.where(ok, r, math.inf).amin(-1))
    extremes = torch.stack([
        torch.where(ok, r, math.inf).amin(-1).amin(), torch.where(ok, r, -math.inf).amax(-1).amax(), max_abs_pq,
    ])
    out = _assemble_statistics(row_sums, products, extremes, counts, clamp, bins)
    if positive is not None:
        out[LOGPROB_POSITIVE] = positive
    if rounds:
        out.update(_round_statistics_from_chunks(chunks, windowed, rounds))
    return out


def _round_mask(trainer: Tensor, mask: Tensor) -> Tensor:
    """The mask as the per-round sums read it: 0/1 numbers, a uint8 mask converted where read (after the views of it:
    a view of a converted mask, under dynamic shapes, was indexed modulo its sizes, a scalar loop), a bool one
    converted here. expand_as: the logprobs' size symbols under dynamic shapes (a view, no copy)."""
    return mask.expand_as(trainer) if mask.dtype == torch.uint8 else mask.to(trainer.dtype)


def _round_chunk_sums(
    trainer: Tensor, rollout: Tensor, mask: Tensor, anchor: Tensor | None
) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """The compiled per-round chunk sums and the inputs the windows read, ``mask`` from :func:`_round_mask`. With
    ``anchor`` (the main loop's per-row result, its rows as the main loop cuts them) the chunk sums run inside the
    main loop (:func:`_chunk_sums`); without, in a loop of their own."""
    t = trainer.shape[-1]
    # The chunk sums and windows read rows padded to whole chunks; the main loop reads the inputs themselves
    # (padded, under dynamic shapes inductor indexed them modulo their sizes: a scalar loop, ~700x slower).
    pad = -t % _COMPILED_ROUND_CHUNK
    def padded_row(x: Tensor) -> Tensor:
        return torch.nn.functional.pad(x, (0, pad)) if pad else x

    padded = (padded_row(trainer), padded_row(rollout), padded_row(mask))
    if pad and t > _COMPILED_ROUND_CHUNK:
        whole_rows = anchor is not None and anchor.shape[0] == trainer.shape[0]  # the main loop's rows: the sequences
        chunks = _ragged_chunk_sums(trainer, rollout, mask, anchor if whole_rows else None)
    else:  # (rows shorter than a chunk: the padded rows, in a loop of their own)
        chunks = _chunk_sums(*padded, None if pad else anchor)
    # (the windows of rows longer than a chunk read the unpadded inputs: _round_sums shifts a row's partial last
    # window back inside the row)
    windowed = (trainer, rollout, mask) if t > _COMPILED_ROUND_CHUNK else padded
    return chunks, windowed


def _round_statistics_from_chunks(chunks: Tensor, windowed: tuple[Tensor, Tensor, Tensor], rounds: int) -> Stats:
    """The ``rounds`` row and :data:`ROUND_STATS` from :func:`_round_chunk_sums`. The rounds row comes from the chunk
    sums, not the main loop's (kept 0 there: a row changed after the loop kept inductor from fusing the histogram's
    scatter into it)."""
    out = {"rounds": chunks[_ROWS.index["rounds"] - _CHUNKED.start].sum(dtype=torch.float64)}
    out.update(_round_sums(chunks, *windowed, rounds, _COMPILED_ROUND_CHUNK))
    return out


def _separate_round_statistics(trainer: Tensor, rollout: Tensor, mask: Tensor, rounds: int) -> Stats:
    """The compiled per-round statistics as a graph of their own (see :data:`SEPARATE_ROUNDS_ROW`)."""
    chunks, windowed = _round_chunk_sums(trainer, rollout, _round_mask(trainer, mask), None)
    return _round_statistics_from_chunks(chunks, windowed, rounds)


def _chunk_features(d: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
    """Valid (0/1) and scaled |r| of tokens with difference ``d`` and 0/1 float mask ``m``, for the chunk sums."""
    ok = torch.where((d - d) == 0, m, 0.0)  # valid_tokens' rule, as 0/1 floats (m is)
    return ok, torch.where(ok > 0, d, 0.0).abs() * _R_SCALE


# A chunk's counts (at most its width) packed in one float as digits of base _PACK: n + _PACK n_mask + _PACK^2
# pairs. Every partial sum is an integer below _PACK^3 = 2^21 for 64-token chunks: exact in float32.
_PACK = float(2 * _COMPILED_ROUND_CHUNK)
_PACK2 = _PACK * _PACK


def _unpack_counts(packed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The counts a packed chunk sum holds: ``n, n_mask, pairs``."""
    pairs = torch.floor(packed * (1.0 / _PACK2))  # (powers of two: exact)
    rest = packed - pairs * _PACK2
    n_mask = torch.floor(rest * (1.0 / _PACK))
    return rest - n_mask * _PACK, n_mask, pairs


def _whole_chunk_sums(tr: Tensor, ro: Tensor, mv: Tensor, zero: Tensor) -> Tensor:
    """The n, n_mask, pairs and |r| sums of chunks laid out as ``[..., chunks, width]`` views: ``[4, ..., chunks]``.

    All tokens of a chunk but its last, and the pairs (m[j], m[j + 1]) inside it (slices one token apart: no
    padded previous-token load, whose per-vector bounds check cost ~0.6 ms at 128 x 8192); the last token added
    on its own. Written unlike the main loop's trainer - rollout: the graph would share one such node between
    the two loops, storing it to memory instead of computing it in both. ``zero`` (an exact 0 from the main
    loop's per-row result, or zeros) is added to every sum, for outer-loop fusion.
    """
    head = slice(0, _COMPILED_ROUND_CHUNK - 1)
    m = mv[..., head]
    n, sum_abs_r = _chunk_features(-ro[..., head] + tr[..., head], m)
    last_n, last_abs_r = _chunk_features(-ro[..., -1] + tr[..., -1], mv[..., -1])
    # The three counts packed in one float per token: one sum (a horizontal reduction per chunk) where there were
    # three (measured: the kernel with rounds 0.93-0.95x at 64 x 4096; the same from 128 x 8192, memory-bound).
    packed = (n + m * _PACK + m * mv[..., 1:] * _PACK2 + zero).sum(-1) + (last_n + mv[..., -1] * _PACK)
    return torch.stack([*_unpack_counts(packed), (sum_abs_r + zero).sum(-1) + last_abs_r])


def _chunk_sums(trainer: Tensor, rollout: Tensor, mask: Tensor, anchor: Tensor | None) -> Tensor:
    """The compiled kernel's chunk sums of the _CHUNKED rows, ``[rows, B, T / _COMPILED_ROUND_CHUNK]`` (T a multiple).

    ``mask`` as 0/1 numbers, uint8 (converted after the views) or floats: a bool mask's conversion in inductor's CPU
    code was most of this loop's cost (~0.9 ns per token; the loop with float masks ~0.3 ns). ``anchor``: a per-row
    result of the main loop (``[B * pieces]``, its rows as the main loop cuts them): the chunk sums read it (as an
    exact 0), so inductor runs them inside the main loop's loop over rows (outer-loop fusion), on the row it has
    just read, still in cache (measured on one host: 0.90x the kernel at 256 x 8192, 0.97x at 128 x 8192, the same
    at 64 x 4096; on another the whole kernel ran 1.9-2.5x slower this way for every T > 4096, hence
    :data:`SEPARATE_ROUNDS_ROW`). Reductions over chunks rather than along the rows: cutting the main reductions
    into chunk-sized pieces made the whole kernel ~1.5x slower.
    """
    b, t = trainer.shape
    dtype, width = trainer.dtype, _COMPILED_ROUND_CHUNK
    rows = b if anchor is None else anchor.shape[0]
    if anchor is None or (t * b // rows) % width:  # the main loop's rows are no whole chunks: a loop of its own
        rows, zero = b, torch.zeros(b, dtype=dtype, device=trainer.device)
    else:
        zero = (anchor > anchor).to(dtype)  # 0 (anchor is a min over a row: never NaN, at most inf)
    # (sizes from the inputs' shape: the mask's own size symbols, under dynamic shapes, split the loop in two)
    tr, ro, mv = (x.reshape(rows, b * t // (rows * width), width) for x in (trainer, rollout, mask))
    mv = mv.to(dtype)
    sums = _whole_chunk_sums(tr, ro, mv, zero.view(rows, 1, 1)).view(len(_CHUNK_ROW), -1)
    # The starts: the mask's count less the pairs (j - 1, j) with j in the chunk, the pair across the boundary
    # before the chunk included unless the chunk starts a row.
    chunks = b * t // width
    edges = mask.reshape(chunks, width).to(dtype)
    across = edges[1:, 0] * edges[:-1, -1]
    row_first = torch.arange(1, chunks, device=mask.device) % (t // width) == 0
    starts = sums[1] - sums[2] - torch.nn.functional.pad(torch.where(row_first, 0.0, across), (1, 0))
    # (stacked, not written into `sums`: 0.88x the kernel with rounds at 256 x 8192, as in _ragged_chunk_sums)
    return torch.stack([sums[0], sums[1], starts, sums[3]]).view(len(_CHUNK_ROW), b, t // width)


def _ragged_chunk_sums(trainer: Tensor, rollout: Tensor, mask: Tensor, anchor: Tensor | None) -> Tensor:
    """:func:`_chunk_sums` for rows of T not a multiple of the chunk (``[rows, B, ceil(T / chunk)]``): the whole chunks
    from ``unfold`` views of the inputs (contiguous loads; the padded inputs were loaded through the pad's bounds
    checks, in a loop of its own), the partial last chunk of each row summed on its own. ``anchor`` (the main loop's
    per-row result, when its rows are the sequences): read as an exact 0, for outer-loop fusion."""
    b, t = trainer.shape
    dtype, width = trainer.dtype, _COMPILED_ROUND_CHUNK
    zero = torch.zeros(b, dtype=dtype, device=trainer.device) if anchor is None else (anchor > anchor).to(dtype)
    tr, ro, mv = (x.unfold(-1, width, width) for x in (trainer, rollout, mask))  # [B, T // width, width]
    mv = mv.to(dtype)
    whole = _whole_chunk_sums(tr, ro, mv, zero.view(b, 1, 1))  # [4, B, T // width]
    start = t // width * width
    tt, rt, mt = trainer[:, start:], rollout[:, start:], mask[:, start:].to(dtype)
    tail_n, tail_abs_r = _chunk_features(-rt + tt, mt)
    tail = torch.stack([tail_n.sum(-1), mt.sum(-1), (mt[:, :-1] * mt[:, 1:]).sum(-1), tail_abs_r.sum(-1)])
    sums = torch.cat([whole, tail.unsqueeze(-1)], dim=-1)  # [4, B, T // width + 1]
    # The starts: the mask's count less the pairs inside the chunk and the pair across its first token (none for
    # a row's first chunk), from the chunk views' edge columns. Stacked, not written into `sums`: that in-place
    # row went with the main loop split in two passes under dynamic shapes (the kernel with rounds 1.73 -> 1.28x
    # the mismatch-only one at 128 x 8100; benchmarks/README.md).
    across = torch.cat([mv[:, 1:, 0] * mv[:, :-1, -1], (mt[:, 0] * mv[:, -1, -1]).unsqueeze(-1)], dim=-1)
    starts = sums[1] - sums[2] - torch.nn.functional.pad(across, (1, 0))  # [B, T // width + 1]
    return torch.stack([sums[0], sums[1], starts, sums[3]])


# The per-round statistics: name -> the chunked row whose per-round sums it holds ([rounds + 1] float64,
# rounds 0 .. rounds - 1 and the overflow bucket, summed over sequences).
ROUND_STATS = {"round_valid": "n", "round_tokens": "n_mask", "round_sum_abs": "sum_abs_r"}


def _round_sums(
    chunks: Tensor, trainer: Tensor, rollout: Tensor, mask: Tensor, capacity: int, width: int = _ROUND_CHUNK
) -> Stats:
    """Per-round sums from the kernels' chunk sums, and the most rounds of any sequence.

    A round is a run of 1s in the mask; round ``i`` of a sequence, with the gap after it (whose terms are
    0), is the stretch from its start to the next round's start. So its sums are differences of prefix
    sums at round starts: ``P(start of round i + 1) - P(start of round i)``, ``P(start of round 0) = 0`` (no
    response token before it), the row total past the last round, rounds ``>= capacity`` pooled. A prefix
    sum at a start is the sum of the whole chunks before it (cumulative chunk sums) plus the part of its
    chunk before it, recomputed from the inputs on a window of ``width`` tokens (and the token before,
    for the start rule). Which chunk holds a row's k-th start comes from the cumulative start counts.
    Float64 throughout, no data-dependent shape: starts that do not exist read the row total.

    Args:
        chunks: ``[len(_CHUNKED), B, chunks]`` sums per chunk of ``width`` tokens (the last may be partial)
            of the _CHUNKED rows, in the inputs' dtype (|r| scaled by ``_R_SCALE``).
        trainer, rollout, mask: the kernel's ``[B, T]`` inputs.
        capacity: rounds with their own bucket.
        width: tokens per chunk.
    """
    f64, dtype = torch.float64, trainer.dtype
    b, t = trainer.shape
    device, n_chunks = trainer.device, chunks.shape[-1]
    consts = _round_constants(b, t, capacity, width, dtype, device)
    # (converted before the cumsum: compiled, the conversion joins the graph; as cumsum's dtype it was two more aten
    # calls around inductor's cumsum fallback)
    inclusive = chunks.to(f64).cumsum(-1)  # [rows, B, chunks]
    totals = inclusive[..., -1]
    starts_row = _CHUNK_ROW["rounds"]
    # The k-th start of each row for k = 2 .. capacity + 1 (the starts of rounds 1 .. capacity): its chunk is
    # the first whose cumulative start count reaches k.
    k = consts["k"]
    start_counts = inclusive[starts_row]
    if torch.compiler.is_compiling() and device.type != "cpu":
        # The start counts' prefix sums in a buffer of their own: inductor's Triton searchsorted ignored a view's
        # storage offset before torch 2.13 (pytorch/pytorch#182343) and searched the first row of `inclusive`
        # (seen on an H200 with torch 2.11: every round sum wrong). Its CPU code calls aten's searchsorted.
        start_counts = chunks[starts_row].cumsum(-1, dtype=f64)
    chunk = torch.searchsorted(start_counts, k).clamp_(max=n_chunks - 1)  # [B, capacity]
    exists = k <= totals[starts_row].unsqueeze(-1)
    # Sums of the chunks before it (exclusive prefix): the inclusive prefix of the chunk before, 0 for chunk 0.
    later = chunk > 0
    before = inclusive.gather(-1, (chunk - 1).clamp_(min=0).expand(len(_CHUNK_ROW), b, capacity)) * later
    rank = (k - before[starts_row]).to(dtype)  # the start is the rank-th start of its chunk
    # The chunk's tokens and the token before it, [B, capacity, 1 + width]. Positions before the row (chunk 0's
    # token before) or past its end (a partial last chunk) read a token of the row instead: the first only for the
    # start rule, zeroed below; the others come after the start, so they are never "before" it (and a missing start
    # reads the row total).
    if torch.compiler.is_compiling():
        # (compiled) each window a row of an `unfold` view of an input: inductor loads it as contiguous vectors, where
        # a gather by token positions was a scalar load per token (~5 ns each); the token before the window (0 at a
        # row's first chunk) gathered on its own.
        # A row's partial last chunk (T not a multiple of width, T > width) is read through the window ending at the
        # row's end, shifted back by `offset` tokens, whose first `offset` tokens (of the chunk before) are left out:
        # every load inside the row, where windows of padded inputs were loaded through the pad's masks.
        chunk_first = torch.mul(chunk, width)
        first = chunk_first.clamp(max=t - width)  # the window's first token
        offset = chunk_first - first

        def window(x: Tensor) -> Tensor:  # (unfold: a literal window width; view or reshape gave T // (T // 64) under
            # dynamic shapes, whose divisions inductor left in the inner loop, ~3x the window kernel)
            return x.unfold(-1, width, 1)[consts["row_chunks"], first]

        m = window(mask).to(dtype)
        m_previous = mask[consts["row_chunks"], (first - 1).clamp_(min=0)].unsqueeze(-1).to(dtype)
        m_before = torch.cat([m_previous * later.unsqueeze(-1), m[..., :-1]], dim=-1)
        d = window(trainer) - window(rollout)
        m = m * (consts["offsets"][1:] >= offset.unsqueeze(-1)).to(dtype)  # the chunk's tokens
    else:
        pos = torch.add(consts["offsets"], chunk.unsqueeze(-1), alpha=width)
        pos[..., 0].clamp_(min=0)
        if t % width:
            pos.clamp_(max=t - 1)
        pos = pos.view(b, -1)
        # (gathered as uint8, whose copy to float is ~6x faster than bool's)
        m = mask.view(torch.uint8).gather(1, pos).view(b, capacity, -1).to(dtype)
        m[..., 0] *= later
        d = (trainer.gather(1, pos) - rollout.gather(1, pos)).view(b, capacity, -1)[..., 1:]
        m, m_before = m[..., 1:], m[..., :-1]
    starts = m - m * m_before
    # Tokens of the chunk before the start: fewer than `rank` starts up to them (integers: clamp(rank - seen, 0, 1)).
    if torch.compiler.is_compiling() and device.type == "cpu":
        # (inductor's CPU code leaves cumsum to aten, out of the graph: fed and summed as bytes, 0.5x the time of
        # float32 ones, which aten accumulates in float64; exact: at most `width` starts)
        seen = starts.to(torch.uint8).cumsum(-1, dtype=torch.uint8).to(dtype)
    else:
        seen = starts.cumsum(-1)
    ahead = (rank.unsqueeze(-1) - seen).clamp_(0.0, 1.0)
    # valid, mask and |r| of those tokens, summed in the inputs' dtype (at most `width`): [3, B, capacity].
    if torch.compiler.is_compiling():  # valid_tokens' rule (inductor's nan_to_num is a scalar loop)
        ok = valid_tokens(d, m > 0)
        features = (ok.to(dtype), m, torch.where(ok, d, 0.0).abs())
        # (three sums, not one of the stacked features: the stack is a buffer, which the graph wrote before the cumsum
        # and read back after it; measured at 256 x 8192, the window loops 0.34 -> 0.18 ms)
        partial = torch.stack([(x * ahead).sum(-1) for x in features]).to(f64)
    else:  # into a cached buffer: a float `out` of eq is ~3x faster than eq to bool and a copy to float
        # The rule of valid_tokens in float arithmetic (as in the eager kernel): d / m is d where the mask is set,
        # inf or NaN where not; a token is valid where nan_to_num leaves that unchanged, and the result is r (0
        # elsewhere).
        q = d / m
        r = torch.nan_to_num(q, 0.0, 0.0, 0.0)
        feats = consts["features"]
        torch.eq(q, r, out=feats[0])
        feats[1].copy_(m)
        torch.abs(r, out=feats[2])
        partial = feats.mul_(ahead).sum(-1).to(f64)
    # Prefix sums at the starts (the row total where a start does not exist), between 0 and the row total;
    # summed over rows first, the bucket sums are their differences.
    scale = consts["scale"]
    total = totals.index_select(0, consts["rows"]).unsqueeze(-1) * scale  # [3, B, 1]
    prefix = torch.where(exists, torch.addcmul(partial, before.index_select(0, consts["rows"]), scale), total)
    bounds = torch.cat([prefix, total], dim=-1).sum(1)  # [3, capacity + 1]
    sums = bounds - torch.nn.functional.pad(bounds[:, :-1], (1, 0))
    out: Stats = dict(zip(ROUND_STATS, sums.unbind(0)))
    most = totals[starts_row].amax() if b else torch.full((), -math.inf, dtype=f64, device=device)
    out["max_rounds"] = most
    return out


_CHUNK_ROW = {name: i for i, name in enumerate(_ROWS.names[_CHUNKED])}


def _make_round_constants(
    b: int, t: int, capacity: int, width: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Tensor]:
    # (index tensors: a Python list index is copied to the device with a stream sync)
    names = ROUND_STATS.values()
    return {
        "k": torch.arange(2, capacity + 2, dtype=torch.float64, device=device).expand(b, capacity).contiguous(),
        "offsets": torch.arange(-1, width, device=device),
        "row_chunks": torch.arange(b, device=device).unsqueeze(-1),  # compiled only
        "features": torch.empty(3, b, capacity, width, dtype=dtype, device=device),  # eager only
        "rows": from_host([_CHUNK_ROW[name] for name in names], torch.int64, device),
        "scale": from_host([1.0 / _R_SCALE if name == "sum_abs_r" else 1.0 for name in names], torch.float64,
                           device).view(-1, 1, 1),
    }


def _round_constants(
    b: int, t: int, capacity: int, width: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Tensor]:
    """The constant tensors and the buffer of :func:`_round_sums`, cached per shape on the CPU in eager mode."""
    if torch.compiler.is_compiling():
        return _make_round_constants(b, t, capacity, width, dtype, device)
    return _cached_plan(_WORKSPACES.rounds, _make_round_constants, b, t, capacity, width, dtype, device)


# Inductor's CPU code computes expm1 as exp(x) - 1, which keeps no relative precision near 0: the compiled
# kernel takes expm1(x) - x from its Taylor series for |x| below this (to x^6: truncation under 2e-8 of
# x^2 / 2), and exp(x) - 1 - x beyond (within ~1e-5 of x^2 / 2 per token, errors of either sign).
_SERIES_RANGE = 0.125


def _expm1_tail(x: Tensor) -> Tensor:
    """``expm1(x) - x`` for ``|x| < _SERIES_RANGE``: ``x^2 (1/2 + x/6 + ... + x^4/6!)``, Horner's scheme."""
    poly = x * (1.0 / 720) + 1.0 / 120
    for c in (1.0 / 24, 1.0 / 6, 0.5):
        poly = poly * x + c
    return x * x * poly


# Inductor's CPU code sums float32 over more than this many elements with a cascade helper: per-element
# bookkeeping that made the whole compiled kernel 16% slower at 256 x 8192 (measured, same statistics).
_PLAIN_SUM_ELEMENTS = 4096


def _reduction_pieces(t: int) -> int:
    """Pieces to cut rows of length ``t`` into (a power of two dividing ``t``) for plain float32 sums.

    Each piece's partial sums are at most 4096 float32 terms (16 SIMD lanes of 256), then added in float64:
    no less exact than the cascade. Rows of another length stay whole.
    """
    pieces = 1
    while t > pieces * _PLAIN_SUM_ELEMENTS and t % (2 * pieces) == 0:
        pieces *= 2
    return pieces if t <= pieces * _PLAIN_SUM_ELEMENTS else 1


def _assemble_statistics(
    row_sums: Tensor, products: Tensor, extremes: Tensor, hist: Tensor, clamp: float, bins: int,
    logprob_high: Tensor | None = None,
) -> Stats:
    """The statistics dict from the per-sequence and per-batch partial results of either kernel.

    ``extremes`` is ``[min r, max r, max |p - q|]``, ``logprob_high`` (eager only) the largest trainer and rollout
    logprob over all tokens, 0 standing in for invalid ones. Sequences are ``[B]``-sized, so float64 throughout.
    A sequence counts if it has a valid token and no masked token with a non-finite log ratio. Per-sequence
    terms are stacked and summed at once, results unbound from one tensor: ~25 small ops per call.
    """
    f64 = torch.float64
    rows = row_sums.to(f64, copy=True)
    rows[_SCALED_ROWS].mul_(1.0 / _R_SCALE)
    totals = dict(zip(_ROWS.names, rows.sum(-1).unbind(0)))
    seq_n, seq_mask_n, seq_r = (rows[_ROWS.index[name]] for name in ("n", "n_mask", "sum_r"))
    has_tokens = totals["n"] > 0
    seq_counts = (seq_n > 0) & (seq_n == seq_mask_n)
    seq_ok = seq_counts.to(f64)
    s = seq_r * seq_ok
    abs_s = s.abs()
    geo = s / seq_n.clamp_min(1.0)
    s_clamped = s.clamp(-clamp, clamp)
    us = torch.expm1(s_clamped) * seq_ok  # sequence weight - 1
    ws = torch.exp(s_clamped) * seq_ok  # the sequence weight (its digits when it is small, which us loses)
    # d_i = mean rollout logp - mean trainer logp = -geo_i. A sentinel (-9999, finfo.min) can make d_i
    # thousands of nats: capped where exp stays finite.
    exp_d = torch.exp(geo.neg().clamp(max=PPL_LOG_CAP)) * seq_ok
    per_seq = torch.stack((seq_ok, s, abs_s, geo, us, us * us, ws, ws * ws, geo.abs(), exp_d)).sum(-1)
    num_seqs, sum_s, sum_abs_s, sum_geo, sum_us, sum_us2, sum_ws, sum_ws2, sum_abs_d, sum_exp_d = per_seq.unbind(0)
    min_r, max_r, max_abs_pq = extremes.to(f64).unbind(0)
    high = {} if logprob_high is None else {"logprob_high": logprob_high.to(f64)}
    # Tokens at rc = C land one past the last bin: the last bin includes its upper edge.
    counts = hist[:bins].to(f64, copy=True)
    counts[-1:] += hist[bins:]
    return {
        # The histogram comes first: in this output order inductor schedules the compiled kernel's histogram
        # scatter ahead of the reductions and fuses the two into one loop over the tokens (measured: in the
        # other order the scatter is a second loop that reads the inputs from memory again).
        "hist": counts,
        **{name: totals[name] for name in _FUSED_ORDER},
        "rounds": totals["rounds"],
        **dict(zip(_PRODUCT_SUMS, products.unbind(0))),
        # u = w - 1 = rc + k3: its sum from those of rc and k3 (sum_u2 is one of the products).
        "sum_u": totals["sum_rc"] + totals["sum_k3"],
        "min_r": torch.where(has_tokens, min_r, math.inf),
        "max_r": torch.where(has_tokens, max_r, -math.inf),
        "max_abs_pq": max_abs_pq,
        "num_seqs": num_seqs,
        "sum_s": sum_s,
        "sum_abs_s": sum_abs_s,
        "max_abs_s": torch.where(seq_counts, abs_s, -math.inf).amax(),
        "sum_geo": sum_geo,
        "sum_us": sum_us,
        "sum_us2": sum_us2,
        "sum_ws": sum_ws,
        "sum_ws2": sum_ws2,
        "sum_d": -sum_geo,
        "sum_abs_d": sum_abs_d,
        "sum_exp_d": sum_exp_d,
        **high,
    }


def _empty_statistics(bins: int, device: torch.device, rounds: int) -> Stats:
    out = {k: torch.zeros((), dtype=torch.float64, device=device) for k in _SCALAR_STATS}
    for k in ("max_r", "max_abs_pq", "max_abs_s"):
        out[k] = torch.full((), float("-inf"), dtype=torch.float64, device=device)
    out["min_r"] = torch.full((), float("inf"), dtype=torch.float64, device=device)
    out["hist"] = torch.zeros(bins, dtype=torch.float64, device=device)
    if rounds:
        out.update({k: torch.zeros(rounds + 1, dtype=torch.float64, device=device) for k in ROUND_STATS})
        out["max_rounds"] = torch.full((), float("-inf"), dtype=torch.float64, device=device)
    return out


_COMPILED: dict[str, Any] = {}
_RECOMPILE_LIMIT = 64

# For rows longer than this the compiled per-round statistics run on CPU as a graph of their own, after the mismatch
# kernel (which is then the mismatch section's own graph), instead of inside its main loop. They read the inputs a
# second time, but the main loop's code stays the mismatch-only one: with the chunk sums inside it, the whole kernel
# ran 1.9-2.5x the mismatch-only one for every T > 4096 measured on one host (8 x 16384 to 256 x 8192, 128 x 8100;
# dynamic shapes; 1.27x at 256 x 8192 on another), where the separate graph costs 1.2-1.4x. For T <= 4096 the loop
# inside stays (64 x 4096 to 256 x 4096: 0.96-0.97x inside, 1.22-1.23x separate; 512 x 1024: 1.13x against 1.38x).
# benchmarks/README.md, "Compiled per-round statistics: a graph of their own". With _GCC_SCHEDULING_FLAGS (which
# removed that 2x) the two paths measured alike for T > 4096 (1.31-1.40x against 1.32-1.53x from 16 x 8192 to
# 256 x 8192, 8 x 16384) but for 128 x 8100 (1.69x inside, 1.36x separate): the threshold stays.
SEPARATE_ROUNDS_ROW = 4096


# GCC flags for the compiled kernels' C++: scheduling before register allocation, aware of register pressure (off by
# default on x86). The main loop keeps ~21 vector accumulators and their temporaries live (~100 spills); without
# these, small changes to the graph flipped its speed up to 2x (the kernel with per-round sums 2.1-2.5x the
# mismatch-only one for T > 4096, see SEPARATE_ROUNDS_ROW) with the same loop structure. Measured (round_paths.py,
# CPU, one thread, dynamic graphs): the mismatch-only kernel 1.2-1.8x faster from 64 x 4096 to 256 x 8192, the one
# with per-round sums 1.3-2.1x (benchmarks/README.md, "GCC register-pressure scheduling").
_GCC_SCHEDULING_FLAGS = ("fschedule-insns", "fsched-pressure")


@contextlib.contextmanager
def _pressure_aware_scheduling() -> Iterator[None]:
    """While inductor builds this module's kernels: :data:`_GCC_SCHEDULING_FLAGS` added to its C++ optimization
    flags when the compiler is GCC. The flags enter the compile command and so inductor's cache key; a torch
    without the hook this patches (a private function of inductor's C++ builder) compiles with its own flags."""
    try:
        builder: Any = importlib.import_module("torch._inductor.cpp_builder")  # (imported once: inductor's own)
    except ImportError:
        builder = None
    flags_of = getattr(builder, "_get_optimization_cflags", None)
    is_gcc = getattr(builder, "_is_gcc", None)
    if flags_of is None or is_gcc is None:
        yield
        return

    def with_scheduling(cpp_compiler: str, *args: Any, **kwargs: Any) -> Any:
        cflags, ldflags = flags_of(cpp_compiler, *args, **kwargs)
        return ([*cflags, *_GCC_SCHEDULING_FLAGS] if is_gcc(cpp_compiler) else cflags), ldflags

    builder._get_optimization_cflags = with_scheduling
    try:
        yield
    finally:
        builder._get_optimization_cflags = flags_of


def compiled_token_statistics() -> Any:
    """:func:`token_statistics` under ``torch.compile(fullgraph=True)``, built on first use."""
    if "fn" not in _COMPILED:
        # Inductor's CPU backend fuses at most 16 reductions into one loop by default; the kernel has 21.
        # Its histogram indices are in range by construction (clamped bins, int32 lane offsets < 2^27 for
        # bins <= MAX_TOP_MASS_BINS), so the per-vector bounds assertion goes (measured: 7-10% of the kernel).
        options = {"cpp.max_horizontal_fusion_size": 32, "assert_indirect_indexing": False}
        compiled = torch.compile(token_statistics, fullgraph=True, dynamic=None, options=options)

        def run(
            trainer: Tensor, rollout: Tensor, mask: Tensor, clamp: float, veto: float, bins: int, prob: bool = True,
            hist: bool = True, rounds: int = 0,
        ) -> Stats:
            # Strided inputs (a slice of a longer padded batch, as frameworks cut out the response) copied first:
            # the graph for non-contiguous strides ran ~10x slower (measured at 128 x 8192, a [:, 37:] slice: 26 ms
            # mismatch-only and 48 ms with rounds, against 2.2 and 2.7 ms contiguous; a copy costs ~0.1 ns a token).
            trainer, rollout, mask = (x.contiguous() for x in (trainer, rollout, mask))
            if trainer.device.type == "cpu" and mask.dtype == torch.bool:
                # The graph reads the mask's uint8 view (no copy): inductor's CPU code loads a bool mask through a
                # scalar loop per 16 tokens, a uint8 one as vectors (measured: the mismatch-only kernel 0.90-0.92x,
                # the one with rounds 0.91-0.99x against a float copy of the mask made here, from 64 x 4096 up).
                mask = mask.view(torch.uint8)
            # One graph per combination of statistic groups and capacity (constants of the graph), and per
            # shape until dynamo makes the shapes dynamic: more than dynamo's default 8 per function. The capacity
            # stays a constant (specialize_int): once dynamo has seen two values it made it a size symbol, and
            # the window stage's shapes with it (a patch of two settings costs ~7 us more per call than of one).
            patch = {"recompile_limit": _RECOMPILE_LIMIT, **({"specialize_int": True} if rounds else {})}
            if rounds and trainer.device.type == "cpu" and trainer.shape[-1] > SEPARATE_ROUNDS_ROW:
                with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT), _pressure_aware_scheduling():
                    out = compiled(trainer, rollout, mask, clamp, veto, bins, prob, hist, 0)
                with torch._dynamo.config.patch(**patch), _pressure_aware_scheduling():
                    out.update(separate_rounds(trainer, rollout, mask, rounds))
                return out
            with torch._dynamo.config.patch(**patch), _pressure_aware_scheduling():
                return compiled(trainer, rollout, mask, clamp, veto, bins, prob, hist, rounds)

        separate_rounds = torch.compile(_separate_round_statistics, fullgraph=True, dynamic=None)
        _COMPILED["fn"] = run
    return _COMPILED["fn"]


# The shared pre-computation of this module, as named in BatchView requests. Its needs beyond the core that
# every mismatch metric reads: "prob" (the probability statistics: two of the three exps per token), "hist"
# (the top-1% histogram), ("rounds", capacity) (the per-round sums) and ("settings", clamp, veto, bins) (the
# settings the members of a collection use, so that the per-round metric, which has none, shares their call).
# Members ask for theirs before any member updates (OPBCMetric.request_shared); the kernel computes the union.
TOKEN_STATISTICS = "token_statistics"
STATISTIC_GROUPS = frozenset({"prob", "hist"})


def rounds_need(capacity: int) -> tuple[str, int]:
    """The request for the per-round sums with ``capacity`` tracked rounds."""
    return ("rounds", capacity)


def settings_need(clamp: float, veto: float, bins: int) -> tuple[str, float, float, int]:
    """The request naming the settings a mismatch metric computes the statistics with."""
    return ("settings", float(clamp), float(veto), int(bins))


def check_bins(bins: Any) -> int:
    """``bins`` of the top-1% sketch, checked: an integer in ``[2, MAX_TOP_MASS_BINS]``."""
    value = None if isinstance(bins, bool) or not hasattr(bins, "__index__") else operator.index(bins)
    if value is None or not 2 <= value <= MAX_TOP_MASS_BINS:
        raise ValueError(f"`top_mass_bins` must be an integer in [2, {MAX_TOP_MASS_BINS}], got {bins!r}")
    return value


def batch_statistics(
    view: BatchView,
    clamp: float = DEFAULT_CLAMP,
    veto: float = DEFAULT_VETO,
    bins: int = DEFAULT_TOP_MASS_BINS,
    compiled: bool = False,
    groups: frozenset[Any] = STATISTIC_GROUPS,
) -> Stats:
    """:func:`token_statistics` of a view, computed once per settings and shared by all metrics.

    ``groups`` is what the caller reads (``"prob"``, ``"hist"``, :func:`rounds_need`); the needs the view's
    users requested (:meth:`~opbc_metrics.batch.BatchView.request` of :data:`TOKEN_STATISTICS`) are added, so
    the metrics of one collection share one call. Per-round sums come for the largest capacity asked for.
    Compiled when ``compiled`` or the view asks for it (:attr:`~opbc_metrics.batch.BatchView.compiled`).
    """
    needs = frozenset(groups) | view.requested(TOKEN_STATISTICS)
    check_bins(bins)
    check_clamp_dtype(clamp, view.dtype)
    prob, hist = "prob" in needs, "hist" in needs
    rounds = max((n[1] for n in needs if isinstance(n, tuple) and n[0] == "rounds"), default=0)
    compiled = compiled or view.compiled

    def make() -> Stats:
        trainer, rollout, mask = view.token_inputs
        if trainer.numel() == 0:  # shape metadata, not data: no sync
            return _empty_statistics(bins, trainer.device, rounds)
        settings = (float(clamp), float(veto), int(bins))
        kernel = compiled_token_statistics() if compiled else token_statistics
        stats = kernel(trainer, rollout, mask, *settings, prob, hist, rounds)
        view.shared(LOGPROB_HIGH, lambda: _logprob_high(view, stats))
        return stats

    return view.shared((TOKEN_STATISTICS, float(clamp), float(veto), int(bins), prob, hist, rounds), make)


def _logprob_high(view: BatchView, stats: Stats) -> Tensor:
    """The input check's largest logprobs (:attr:`~opbc_metrics.batch.BatchView.logprob_high`) from the kernel's
    statistics: the eager kernel's maxima over every token; the compiled kernel's column-sample maxima, raised to
    +inf on a side whose positive-logprob count (:data:`LOGPROB_POSITIVE`, every token) the sample missed: "a value
    above the tolerance, its size unknown" (valid tokens are finite, so +inf stands for nothing else). Without the
    histogram the compiled kernel has no count: the sample alone."""
    if "logprob_high" in stats:
        return stats["logprob_high"]
    sample = view.logprob_sample[1]
    if LOGPROB_POSITIVE not in stats:
        return sample
    missed = (stats[LOGPROB_POSITIVE] > 0) & (sample <= PROBABILITY_TOLERANCE)
    return torch.where(missed, math.inf, sample)


def shared_settings(view: BatchView) -> tuple[float, float, int]:
    """The (clamp, veto, bins) of the statistics the view's users requested, else the defaults: a reader
    of setting-free statistics (the per-round sums) then shares their kernel call."""
    requested = sorted(n[1:] for n in view.requested(TOKEN_STATISTICS) if isinstance(n, tuple) and n[0] == "settings")
    return requested[0] if requested else (DEFAULT_CLAMP, DEFAULT_VETO, DEFAULT_TOP_MASS_BINS)


def _pick(stats: Stats, *names: str) -> Stats:
    return {name: stats[name] for name in names}


# ---------------------------------------------------------------------------------------------
# opbc/is/*: importance weights
# ---------------------------------------------------------------------------------------------
def _ess_update(stats: Stats) -> Stats:
    return {"sum_u": stats["sum_u"], "sum_u2": stats["sum_u2"], "sum_w": stats["sum_w"], "sum_w2": stats["sum_w2"],
            "count": stats["n"]}


# The weight moments come from the sums of u = w - 1 while the mean weight is at least this, else from the raw
# sums of w. Near on-policy (w ~ 1) float sums of w keep no digits of E[w^2] - E[w]^2, those of u keep u's; when
# every weight is small (u ~ -1, a sequence log-ratio of -20 nats: w = 2e-9) sum w^2 = N + 2 sum u + sum u^2
# cancels to rounding noise, while the raw sums keep w's digits. At a mean of 1/2 both keep all but ~2 bits.
_CENTRED_FROM_MEAN = 0.5


def _weight_moments(
    sum_u: Tensor, sum_u2: Tensor, sum_w: Tensor, sum_w2: Tensor, count: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(sum w, sum w^2, N sum w^2 - (sum w)^2 = N^2 Var(w) >= 0)``, each from the sums that keep its digits."""
    centred = sum_u >= (_CENTRED_FROM_MEAN - 1.0) * count
    total = torch.where(centred, count + sum_u, sum_w)
    squares = torch.where(centred, count + 2.0 * sum_u + sum_u2, sum_w2)
    # (the clamp absorbs rounding only)
    spread = torch.where(centred, count * sum_u2 - sum_u * sum_u, count * sum_w2 - sum_w * sum_w).clamp_min(0.0)
    return total, squares, spread


def _ess_compute(sum_u: Tensor, sum_u2: Tensor, sum_w: Tensor, sum_w2: Tensor, count: Tensor) -> Tensor:
    """ESS ``(sum w)^2 / (N sum w^2)`` as ``1 - N^2 Var(w) / (N sum w^2)``: near on-policy ``1 - ESS`` (the part that
    moves) from the sums of ``u = w - 1``, free of cancellation; far from it from the raw sums
    (:func:`_weight_moments`)."""
    _, squares, spread = _weight_moments(sum_u, sum_u2, sum_w, sum_w2, count)
    return (1.0 - _safe_div(spread, count * squares, 0.0)).clamp(0.0, 1.0)


#: What a public function needs, by the count it reads: (what the batch lacks, what to pass).
_NEEDS = {
    "n": ("valid token (response_mask = 1 and both logprobs finite)",
          "a batch with a response token (`response_mask` 1) whose `trainer_logprobs` and `rollout_logprobs` are "
          "both finite: here the batch has none, or every one is masked out or non-finite"),
    "num_seqs": ("valid sequence (one with a valid token and no non-finite response token)",
                 "a batch with a sequence that has a valid token and finite `trainer_logprobs` and "
                 "`rollout_logprobs` on all its response tokens (`response_mask` 1)"),
}


def _raise_if_empty(function: str, count: Tensor, need: str = "n") -> None:
    """The public functions' guard (:func:`~opbc_metrics.functional.statistics.require_data`): one batch without a
    valid token (or sequence) has no value (the on-policy value would be made up)."""
    require_data(count, function, *_NEEDS[need])


def _stats(
    function: str,
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None,
    clamp: float = DEFAULT_CLAMP,
    veto: float = DEFAULT_VETO,
    bins: int = DEFAULT_TOP_MASS_BINS,
    need: str = "n",
) -> Stats:
    """The batch statistics of the public function ``function``; ``ValueError`` when the batch has no valid token
    (``need="n"``) or no valid sequence (``need="num_seqs"``, the sequence-level functions)."""
    view = _view(trainer_logprobs, rollout_logprobs, response_mask)
    stats = batch_statistics(view, clamp, veto, bins)
    raise_if_bad_inputs(*view.logprob_range, view.mask_other_values)  # probabilities, logits, a -100 label mask
    _raise_if_empty(function, stats[need], need)
    return stats


def importance_ess(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None = None,
    clamp: float = DEFAULT_CLAMP,
) -> Tensor:
    r"""Token-level effective sample size of the importance weights (``opbc/is/ess``).

    .. math:: \mathrm{ESS} = \frac{(\sum_t w_t)^2}{N \sum_t w_t^2}, \quad w_t = e^{\mathrm{clamp}(r_t, -C, C)}

    1 means on-policy; toward 0, off-policy.

    Example:
        >>> import torch
        >>> t = torch.tensor([[-1.0, -1.0, -2.0]])
        >>> importance_ess(t, t)
        tensor(1., dtype=torch.float64)
        >>> importance_ess(t, t - torch.tensor([[0.0, 1.0, 0.0]])).round(decimals=4)
        tensor(0.7904, dtype=torch.float64)
    """
    stats = _stats("importance_ess", trainer_logprobs, rollout_logprobs, response_mask, clamp)
    return _ess_compute(**_ess_update(stats))


def _seq_ess_update(stats: Stats) -> Stats:
    return {"sum_u": stats["sum_us"], "sum_u2": stats["sum_us2"], "sum_w": stats["sum_ws"], "sum_w2": stats["sum_ws2"],
            "count": stats["num_seqs"]}


def sequence_ess(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None = None,
    clamp: float = DEFAULT_CLAMP,
) -> Tensor:
    r"""Sequence-level ESS (``opbc/is/seq_ess``) with ``w_i = exp(clamp(s_i, -C, C))``.

    .. math:: \mathrm{ESS}_{seq} = \frac{(\sum_i w_i)^2}{M \sum_i w_i^2}

    over the M sequences with at least one valid token.

    Example:
        >>> import torch
        >>> t = torch.zeros(2, 2)
        >>> sequence_ess(t, t - torch.tensor([[1.0, 0.0], [0.0, 0.0]])).round(decimals=4)
        tensor(0.8240, dtype=torch.float64)
    """
    stats = _stats("sequence_ess", trainer_logprobs, rollout_logprobs, response_mask, clamp, need="num_seqs")
    return _ess_compute(**_seq_ess_update(stats))


def _weight_moments_update(stats: Stats) -> Stats:
    return _ess_update(stats)


def _second_moment_compute(sum_u: Tensor, sum_u2: Tensor, sum_w: Tensor, sum_w2: Tensor, count: Tensor) -> Tensor:
    return _safe_div(_weight_moments(sum_u, sum_u2, sum_w, sum_w2, count)[1], count, 0.0)


def _weight_mean_compute(sum_u: Tensor, sum_u2: Tensor, sum_w: Tensor, sum_w2: Tensor, count: Tensor) -> Tensor:
    return _safe_div(_weight_moments(sum_u, sum_u2, sum_w, sum_w2, count)[0], count, 0.0)


def _weight_std_compute(sum_u: Tensor, sum_u2: Tensor, sum_w: Tensor, sum_w2: Tensor, count: Tensor) -> Tensor:
    return torch.sqrt(_weight_moments(sum_u, sum_u2, sum_w, sum_w2, count)[2]) / count.clamp_min(1.0)


def importance_weight_second_moment(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None = None,
    clamp: float = DEFAULT_CLAMP,
) -> Tensor:
    r"""``opbc/is/second_moment``: :math:`E[w^2] = \frac{1}{N}\sum_t w_t^2`.

    Example:
        >>> import torch
        >>> t = torch.zeros(1, 2)
        >>> importance_weight_second_moment(t, torch.tensor([[0.0, -1.0]])).round(decimals=4)
        tensor(4.1945, dtype=torch.float64)
    """
    stats = _stats("importance_weight_second_moment", trainer_logprobs, rollout_logprobs, response_mask, clamp)
    return _second_moment_compute(**_weight_moments_update(stats))


def importance_weight_mean(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None = None,
    clamp: float = DEFAULT_CLAMP,
) -> Tensor:
    r"""``opbc/is/weight_mean``: :math:`\frac{1}{N}\sum_t w_t`.

    Example:
        >>> import torch
        >>> t = torch.zeros(1, 2)
        >>> importance_weight_mean(t, torch.tensor([[0.0, -1.0]])).round(decimals=4)
        tensor(1.8591, dtype=torch.float64)
    """
    stats = _stats("importance_weight_mean", trainer_logprobs, rollout_logprobs, response_mask, clamp)
    return _weight_mean_compute(**_weight_moments_update(stats))


def importance_weight_std(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None = None,
    clamp: float = DEFAULT_CLAMP,
) -> Tensor:
    r"""``opbc/is/weight_std``: population standard deviation of the token importance weights.

    .. math:: \sigma_w = \sqrt{\tfrac{1}{N}\sum_t (w_t - 1)^2 - \big(\tfrac{1}{N}\sum_t (w_t - 1)\big)^2}

    (divisor N; a batch without a valid token raises), from the mergeable sums of ``w - 1`` and ``(w - 1)^2`` (of
    ``w`` and ``w^2`` when the mean weight is below 1/2).

    Example:
        >>> import torch
        >>> t = torch.zeros(1, 2)
        >>> importance_weight_std(t, torch.tensor([[0.0, -1.0]])).round(decimals=4)  # weights 1 and e
        tensor(0.8591, dtype=torch.float64)
    """
    stats = _stats("importance_weight_std", trainer_logprobs, rollout_logprobs, response_mask, clamp)
    return _weight_std_compute(**_weight_moments_update(stats))


def _clipped_update(stats: Stats) -> Stats:
    return {"hits": stats["clipped"], "count": stats["n"]}


def _vetoed_update(stats: Stats) -> Stats:
    return {"hits": stats["vetoed"], "count": stats["n"]}


def _fraction_compute(hits: Tensor, count: Tensor) -> Tensor:
    return _safe_div(hits, count, 0.0)


def clipped_fraction(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None = None,
    clamp: float = DEFAULT_CLAMP,
) -> Tensor:
    r"""``opbc/is/clipped_fraction``: share of valid tokens with :math:`|r_t| > C` (exceeded the clamp).

    Example:
        >>> import torch
        >>> t = torch.full((1, 4), -30.0)
        >>> clipped_fraction(t, t - torch.tensor([[0.0, 25.0, 3.0, 21.0]]))  # |r| = 0, 25, 3, 21
        tensor(0.5000, dtype=torch.float64)
    """
    stats = _stats("clipped_fraction", trainer_logprobs, rollout_logprobs, response_mask, clamp)
    return _fraction_compute(**_clipped_update(stats))


def veto_fraction(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None = None,
    veto: float = DEFAULT_VETO,
) -> Tensor:
    r"""``opbc/is/veto_fraction``: share of valid tokens with :math:`|r_t| > V` (30 nats by default).

    Example:
        >>> import torch
        >>> t = torch.full((1, 4), -30.0)
        >>> veto_fraction(t, t - torch.tensor([[0.0, 25.0, 3.0, 9999.0]]))  # |r| = 0, 25, 3, 9999
        tensor(0.2500, dtype=torch.float64)
    """
    stats = _stats("veto_fraction", trainer_logprobs, rollout_logprobs, response_mask, veto=veto)
    return _fraction_compute(**_vetoed_update(stats))


# ---------------------------------------------------------------------------------------------
# opbc/is/top_1pct_gradient_mass
# ---------------------------------------------------------------------------------------------
def top_k_count(count: Tensor, fraction: float = DEFAULT_TOP_FRACTION) -> Tensor:
    """``k = max(1, floor(fraction * N))``."""
    return torch.floor(count * fraction + 1e-9).clamp_min(1.0)


def _top_mass_sketch_update(stats: Stats) -> Stats:
    return {"bin_count": stats["hist"], "sum_w": stats["sum_w"]}


def _top_mass_sketch_compute(
    bin_count: Tensor, sum_w: Tensor, clamp: float = DEFAULT_CLAMP, fraction: float = DEFAULT_TOP_FRACTION
) -> Tensor:
    """Walk the histogram from the top bin: whole bins while they fit in k, then part of one bin.

    Every token in a bin of log-weight width ``h = 2C / bins`` has a weight within a factor
    ``e^{h/2}`` of the weight at the bin's centre. The walk takes exactly the bins (and the share of
    the last bin) that the true k largest weights occupy and values each token at its bin centre, so
    the top-k weight sum is within a factor ``e^{±h/2}`` of the truth; it is divided by the exact
    total ``sum w``. Relative error bound: ``e^{h/2} - 1``.
    """
    bins = bin_count.shape[-1]
    width = 2.0 * clamp / bins
    centres = -clamp + width * (torch.arange(bins, dtype=torch.float64, device=bin_count.device) + 0.5)
    counts, value = bin_count.flip(0), torch.exp(centres).flip(0)
    k = top_k_count(counts.sum(), fraction)
    before = torch.cumsum(counts, 0) - counts
    take = torch.minimum((k - before).clamp_min(0.0), counts)
    return _safe_div((take * value).sum(), sum_w, 0.0).clamp(0.0, 1.0)


def sketch_relative_error_bound(clamp: float = DEFAULT_CLAMP, bins: int = DEFAULT_TOP_MASS_BINS) -> float:
    """The sketch's relative error bound ``e^{h/2} - 1`` with bin width ``h = 2C / bins``.

    Example:
        >>> round(sketch_relative_error_bound(20.0, 8192), 5)
        0.00244
    """
    return math.expm1(clamp / bins)


def _top_mass_exact_compute(weights: Tensor, count: Tensor, fraction: float = DEFAULT_TOP_FRACTION) -> Tensor:
    """Exact top-k mass from all weights (invalid tokens carry weight 0 and sort last)."""
    if weights.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=weights.device)
    k = int(top_k_count(count, fraction).item())
    top = torch.topk(weights.reshape(-1), min(k, weights.numel())).values.sum()
    return _safe_div(top.to(torch.float64), weights.sum().to(torch.float64), 0.0).clamp(0.0, 1.0)


def top_gradient_mass(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None = None,
    clamp: float = DEFAULT_CLAMP,
    fraction: float = DEFAULT_TOP_FRACTION,
    bins: int | None = None,
) -> Tensor:
    r"""``opbc/is/top_1pct_gradient_mass``: share of :math:`\sum_t w_t` carried by the ``k`` largest weights.

    ``k = max(1, floor(fraction * N))``. With ``bins=None`` the value is exact (a sort); with ``bins``
    it is the histogram sketch the stateful metric uses, within a relative error of
    ``e^{C/bins} - 1``.

    Example:
        >>> import torch
        >>> t = torch.zeros(1, 4)
        >>> top_gradient_mass(t, torch.tensor([[0.0, 0.0, 0.0, -1.0]])).round(decimals=4)
        tensor(0.4754, dtype=torch.float64)
    """
    view = _view(trainer_logprobs, rollout_logprobs, response_mask)
    raise_if_bad_inputs(*view.logprob_range, view.mask_other_values)
    _raise_if_empty("top_gradient_mass", view.num_valid)
    if bins is None:
        return _top_mass_exact_compute(view.weights(clamp), view.num_valid, fraction)
    stats = batch_statistics(view, clamp, DEFAULT_VETO, bins)
    return _top_mass_sketch_compute(**_top_mass_sketch_update(stats), clamp=clamp, fraction=fraction)


# ---------------------------------------------------------------------------------------------
# opbc/logprob/*, opbc/log_ratio/*
# ---------------------------------------------------------------------------------------------
LOGPROB_KEYS = ("opbc/logprob/abs_diff_mean", "opbc/logprob/abs_diff_max", "opbc/logprob/diff_mean")
LOG_RATIO_KEYS = ("opbc/log_ratio/min", "opbc/log_ratio/max", "opbc/log_ratio/max_abs")


def _logprob_diff_update(stats: Stats) -> Stats:
    return {
        "sum_abs": stats["sum_abs_r"],
        "sum_diff": stats["sum_r"],
        "max_abs": torch.maximum(stats["max_r"], -stats["min_r"]),
        "count": stats["n"],
    }


def _logprob_diff_compute(sum_abs: Tensor, sum_diff: Tensor, max_abs: Tensor, count: Tensor) -> dict[str, Tensor]:
    return {
        LOGPROB_KEYS[0]: _safe_div(sum_abs, count, 0.0),
        LOGPROB_KEYS[1]: torch.where(count > 0, max_abs, torch.zeros_like(max_abs)),
        LOGPROB_KEYS[2]: _safe_div(sum_diff, count, 0.0),
    }


def logprob_diff(
    trainer_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor | None = None
) -> dict[str, Tensor]:
    r"""``opbc/logprob/*``: mean :math:`|r|`, max :math:`|r|` and mean :math:`r` over valid tokens.

    Example:
        >>> import torch
        >>> out = logprob_diff(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]]))
        >>> {k.split('/')[-1]: round(v.item(), 3) for k, v in out.items()}
        {'abs_diff_mean': 0.75, 'abs_diff_max': 1.0, 'diff_mean': -0.25}
    """
    stats = _stats("logprob_diff", trainer_logprobs, rollout_logprobs, response_mask)
    return _logprob_diff_compute(**_logprob_diff_update(stats))


def _log_ratio_range_update(stats: Stats) -> Stats:
    return {"min": stats["min_r"], "max": stats["max_r"], "count": stats["n"]}


def _log_ratio_range_compute(min: Tensor, max: Tensor, count: Tensor) -> dict[str, Tensor]:
    zero = torch.zeros_like(min)
    lo, hi = torch.where(count > 0, min, zero), torch.where(count > 0, max, zero)
    return {LOG_RATIO_KEYS[0]: lo, LOG_RATIO_KEYS[1]: hi, LOG_RATIO_KEYS[2]: torch.maximum(lo.abs(), hi.abs())}


def log_ratio_range(
    trainer_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor | None = None
) -> dict[str, Tensor]:
    r"""``opbc/log_ratio/*``: min, max and max-abs of the raw (unclamped) log ratio :math:`r`.

    Example:
        >>> import torch
        >>> out = log_ratio_range(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]]))
        >>> [round(v.item(), 2) for v in out.values()]
        [-1.0, 0.5, 1.0]
    """
    stats = _stats("log_ratio_range", trainer_logprobs, rollout_logprobs, response_mask)
    return _log_ratio_range_compute(**_log_ratio_range_update(stats))


# ---------------------------------------------------------------------------------------------
# opbc/sequence/*
# ---------------------------------------------------------------------------------------------
SEQUENCE_KEYS = (
    "opbc/sequence/log_ratio_mean",
    "opbc/sequence/log_ratio_abs_mean",
    "opbc/sequence/log_ratio_max_abs",
    "opbc/sequence/geo_log_ratio_mean",
)


def _sequence_update(stats: Stats) -> Stats:
    return {
        "sum_s": stats["sum_s"],
        "sum_abs_s": stats["sum_abs_s"],
        "max_abs_s": stats["max_abs_s"],
        "sum_geo": stats["sum_geo"],
        "count": stats["num_seqs"],
    }


def _sequence_compute(
    sum_s: Tensor, sum_abs_s: Tensor, max_abs_s: Tensor, sum_geo: Tensor, count: Tensor
) -> dict[str, Tensor]:
    return {
        SEQUENCE_KEYS[0]: _safe_div(sum_s, count, 0.0),
        SEQUENCE_KEYS[1]: _safe_div(sum_abs_s, count, 0.0),
        SEQUENCE_KEYS[2]: torch.where(count > 0, max_abs_s, torch.zeros_like(max_abs_s)),
        SEQUENCE_KEYS[3]: _safe_div(sum_geo, count, 0.0),
    }


def sequence_log_ratio(
    trainer_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor | None = None
) -> dict[str, Tensor]:
    r"""``opbc/sequence/*`` over sequences :math:`s_i = \sum_t r_t`.

    Mean :math:`s_i`, mean :math:`|s_i|`, max :math:`|s_i|`, and the length-normalised (geometric)
    mean of :math:`s_i / n_i`, over sequences with at least one valid token and no non-finite one.

    Example:
        >>> import torch
        >>> out = sequence_log_ratio(torch.full((2, 2), -1.0),  # r: [1, 1] and [-0.5, 0]
        ...                          torch.tensor([[-2.0, -2.0], [-0.5, -1.0]]))
        >>> [round(v.item(), 3) for v in out.values()]
        [0.75, 1.25, 2.0, 0.375]
    """
    stats = _stats("sequence_log_ratio", trainer_logprobs, rollout_logprobs, response_mask, need="num_seqs")
    return _sequence_compute(**_sequence_update(stats))


# ---------------------------------------------------------------------------------------------
# opbc/kl/*
# ---------------------------------------------------------------------------------------------
KL_KEYS = ("opbc/kl/k1", "opbc/kl/k2", "opbc/kl/k3")
CHI2_KEYS = ("opbc/kl/chi2_token", "opbc/kl/chi2_seq")


def _kl_update(stats: Stats) -> Stats:
    return {
        "sum_k1": -stats["sum_rc"],
        "sum_k2": 0.5 * stats["sum_rc2"],
        "sum_k3": stats["sum_k3"],  # per token expm1(rc) - rc, summed
        "count": stats["n"],
    }


def _kl_compute(sum_k1: Tensor, sum_k2: Tensor, sum_k3: Tensor, count: Tensor) -> dict[str, Tensor]:
    return {
        KL_KEYS[0]: _safe_div(sum_k1, count, 0.0),
        KL_KEYS[1]: _safe_div(sum_k2, count, 0.0),
        KL_KEYS[2]: _safe_div(sum_k3, count, 0.0).clamp_min(0.0),
    }


def kl_estimators(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None = None,
    clamp: float = DEFAULT_CLAMP,
) -> dict[str, Tensor]:
    r"""``opbc/kl/k1, k2, k3``: Schulman's estimators of KL(rollout || trainer), tokens sampled from the rollout.

    With :math:`\tilde r = \mathrm{clamp}(r, -C, C)`: ``k1 = mean(-r~)``, ``k2 = mean(r~^2 / 2)``,
    ``k3 = mean(exp(r~) - 1 - r~)`` (non-negative; clamped at 0 against rounding).

    Example:
        >>> import torch
        >>> out = kl_estimators(torch.tensor([[0.0, -1.0]]), torch.tensor([[-1.0, 0.0]]))
        >>> [round(v.item(), 4) + 0.0 for v in out.values()]
        [0.0, 0.5, 0.5431]
    """
    return _kl_compute(**_kl_update(_stats("kl_estimators", trainer_logprobs, rollout_logprobs, response_mask, clamp)))


def _chi2_update(stats: Stats) -> Stats:
    return {
        "sum_u": stats["sum_u"],
        "sum_u2": stats["sum_u2"],
        "count": stats["n"],
        "sum_seq_u": stats["sum_us"],
        "sum_seq_u2": stats["sum_us2"],
        "seq_count": stats["num_seqs"],
    }


def _chi2_compute(
    sum_u: Tensor, sum_u2: Tensor, count: Tensor, sum_seq_u: Tensor, sum_seq_u2: Tensor, seq_count: Tensor
) -> dict[str, Tensor]:
    # E[w^2] - 1 = E[(w - 1)^2] + 2 E[w - 1]: no difference of numbers near 1.
    return {
        CHI2_KEYS[0]: _safe_div(sum_u2 + 2.0 * sum_u, count, 0.0),
        CHI2_KEYS[1]: _safe_div(sum_seq_u2 + 2.0 * sum_seq_u, seq_count, 0.0),
    }


def chi_square(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None = None,
    clamp: float = DEFAULT_CLAMP,
) -> dict[str, Tensor]:
    r"""``opbc/kl/chi2_token`` = :math:`E_t[w_t^2] - 1` and ``opbc/kl/chi2_seq`` = :math:`E_i[w_i^2] - 1`.

    Example:
        >>> import torch
        >>> out = chi_square(torch.zeros(1, 2), torch.tensor([[0.0, -1.0]]))
        >>> [round(v.item(), 4) for v in out.values()]
        [3.1945, 6.3891]
    """
    stats = _stats("chi_square", trainer_logprobs, rollout_logprobs, response_mask, clamp)
    out = _chi2_compute(**_chi2_update(stats))
    if not bool(stats["num_seqs"] > 0):  # valid tokens, but every sequence has a non-finite one: as the metric
        del out[CHI2_KEYS[1]]
    return out


# ---------------------------------------------------------------------------------------------
# opbc/ppl/*
# ---------------------------------------------------------------------------------------------
PPL_KEYS = ("opbc/ppl/log_ppl_diff", "opbc/ppl/log_ppl_abs_diff", "opbc/ppl/ratio")


def _ppl_update(stats: Stats) -> Stats:
    return {"sum_d": stats["sum_d"], "sum_abs_d": stats["sum_abs_d"], "sum_exp_d": stats["sum_exp_d"],
            "count": stats["num_seqs"]}


def _ppl_compute(sum_d: Tensor, sum_abs_d: Tensor, sum_exp_d: Tensor, count: Tensor) -> dict[str, Tensor]:
    return {
        PPL_KEYS[0]: _safe_div(sum_d, count, 0.0),
        PPL_KEYS[1]: _safe_div(sum_abs_d, count, 0.0),
        PPL_KEYS[2]: _safe_div(sum_exp_d, count, 1.0),
    }


def perplexity_gap(
    trainer_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor | None = None
) -> dict[str, Tensor]:
    r"""``opbc/ppl/*``: per sequence :math:`d_i = \overline{\log p_{roll}} - \overline{\log p_{train}}`.

    ``log_ppl_diff`` = mean :math:`d_i` (log of trainer-over-rollout perplexity), ``log_ppl_abs_diff`` =
    mean :math:`|d_i|`, ``ratio`` = mean :math:`e^{\min(d_i, 600)}` (perplexity ratio; in float64; the cap
    only acts on a per-token log-perplexity gap above 600 nats, i.e. a sentinel logprob such as -9999, which
    would otherwise overflow the ratio to inf).

    Example:
        >>> import torch
        >>> out = perplexity_gap(torch.tensor([[-1.0, -1.0]]), torch.tensor([[-0.5, -0.5]]))
        >>> [round(v.item(), 4) for v in out.values()]
        [0.5, 0.5, 1.6487]
    """
    stats = _stats("perplexity_gap", trainer_logprobs, rollout_logprobs, response_mask, need="num_seqs")
    return _ppl_compute(**_ppl_update(stats))


# ---------------------------------------------------------------------------------------------
# opbc/prob/*
# ---------------------------------------------------------------------------------------------
PROB_KEYS = ("opbc/prob/abs_diff_mean", "opbc/prob/abs_diff_max", "opbc/prob/pearson", "opbc/prob/diff_std")
_PROB_STATS = ("sum_q", "sum_dp", "sum_qq", "sum_qdp", "sum_dp2", "sum_abs_pq", "max_abs_pq", "n")


def _prob_update(stats: Stats) -> Stats:
    return _pick(stats, *_PROB_STATS)


def _prob_compute(
    sum_q: Tensor,
    sum_dp: Tensor,
    sum_qq: Tensor,
    sum_qdp: Tensor,
    sum_dp2: Tensor,
    sum_abs_pq: Tensor,
    max_abs_pq: Tensor,
    n: Tensor,
) -> dict[str, Tensor]:
    # Moments of q and delta = p - q; those of p follow: p = q + delta.
    m = n.clamp_min(1.0)
    mean_q, mean_dp = sum_q / m, sum_dp / m
    var_q = (sum_qq / m - mean_q**2).clamp_min(0.0)
    cov_q_dp = sum_qdp / m - mean_q * mean_dp
    var_dp = (sum_dp2 / m - mean_dp**2).clamp_min(0.0)
    cov = var_q + cov_q_dp
    var_p = (var_q + 2.0 * cov_q_dp + var_dp).clamp_min(0.0)
    den = torch.sqrt(var_p * var_q)
    # Zero variance leaves Pearson undefined: report 1 when the probabilities are identical, else 0.
    degenerate = torch.where(sum_abs_pq > 0, torch.zeros_like(den), torch.ones_like(den))
    pearson = torch.where(den > 0, (cov / den.clamp_min(1e-300)).clamp(-1.0, 1.0), degenerate)
    # verl's probs_diff_std: torch.std (divisor N - 1) of |p - q|, whose squares are those of p - q. One token:
    # exactly 0 (sum_dp2 and sum_abs_pq^2 round differently, and their difference is noise, not a spread).
    diff_m2 = (sum_dp2 - sum_abs_pq * sum_abs_pq / m).clamp_min(0.0)
    return {
        PROB_KEYS[0]: _safe_div(sum_abs_pq, n, 0.0),
        PROB_KEYS[1]: torch.where(n > 0, max_abs_pq.clamp_min(0.0), torch.zeros_like(max_abs_pq)),
        PROB_KEYS[2]: torch.where(n > 0, pearson, torch.ones_like(pearson)),
        PROB_KEYS[3]: torch.where(n > 1, torch.sqrt(diff_m2 / (n - 1.0).clamp_min(1.0)), torch.zeros_like(diff_m2)),
    }


def probability_diff(
    trainer_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor | None = None
) -> dict[str, Tensor]:
    r"""``opbc/prob/*`` on probabilities :math:`p = e^{\log p}`: disagreement of :math:`p_{train}` and :math:`p_{roll}`.

    Mean, max and standard deviation of :math:`|p_{train} - p_{roll}|` and Pearson's correlation of the two
    probability vectors over valid tokens. ``diff_std`` is verl's ``probs_diff_std`` (its rollout-vs-trainer
    debug metrics): ``torch.std`` of the absolute differences, divisor N - 1. Both it and Pearson need two
    tokens: with fewer, their keys are left out. Pearson with zero variance is 1 if the probabilities
    are identical, else 0. Logprobs above 0 (invalid)
    are read as 0 and below -80 as -80 (``e^-80 ~ 1.8e-35``: immaterial to every sum, and it keeps CPU exp off
    its slow path). Everything comes from mergeable moments of q and of ``p - q`` (partial sums in the input
    dtype over a sequence or a block of at most 32K tokens, accumulated in float64): the spread of the
    differences keeps its precision near on-policy (``p - q`` is taken as ``q * expm1(log p - log q)``), and
    Pearson's rounding error is about ``eps * E[q^2] / Var(q)`` (eps of the input dtype): negligible for real
    token probabilities, visible only when one side's probabilities are all nearly equal.

    Example:
        >>> import torch
        >>> out = probability_diff(torch.tensor([[0.0, -1.0, -2.0]]), torch.tensor([[0.0, -1.1, -2.0]]))
        >>> [round(v.item(), 4) for v in out.values()]
        [0.0117, 0.035, 0.9991, 0.0202]
    """
    stats = _prob_update(_stats("probability_diff", trainer_logprobs, rollout_logprobs, response_mask))
    out = _prob_compute(**stats)
    if not bool(stats["n"] > 1):  # a correlation and a sample std need two tokens: no made-up value for one
        del out[PROB_KEYS[2]], out[PROB_KEYS[3]]
    return out


# ---------------------------------------------------------------------------------------------
# opbc/input/*
# ---------------------------------------------------------------------------------------------
INPUT_KEYS = ("opbc/input/nonfinite_count", "opbc/input/num_tokens", "opbc/input/num_sequences")


def _input_update(stats: Stats) -> Stats:
    return {"nonfinite": stats["n_mask"] - stats["n"], "tokens": stats["n"], "sequences": stats["num_seqs"]}


def _input_compute(nonfinite: Tensor, tokens: Tensor, sequences: Tensor) -> dict[str, Tensor]:
    return {INPUT_KEYS[0]: nonfinite, INPUT_KEYS[1]: tokens, INPUT_KEYS[2]: sequences}
