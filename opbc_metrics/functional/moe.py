r"""MoE router drift between the rollout engine and the trainer: pure functions over one batch.

Inputs, per side (rollout and trainer), either

* routed expert ids ``rollout_experts`` / ``trainer_experts`` ``[B, T, L, K]`` (any integer dtype),
  ordered by routing weight, highest first; or
* router logits (the scores the router selects on) ``rollout_router_logits`` /
  ``trainer_router_logits`` ``[B, T, L, E]`` (floating point), from which the top-K experts are taken
  with ``torch.topk`` (``top_k`` must then be given; exact ties resolve as ``torch.topk`` does).

The two sides may use different forms (e.g. replayed expert ids from the rollout engine, router
logits from the trainer). When a side carries both, its expert ids are used. With ``top_k`` given,
expert ids with more than ``top_k`` columns are cut to their first (highest-weight) ``top_k``; with
``top_k=None`` both sides must be expert ids of the same K.

A *valid token* is a response token (``response_mask != 0``; every token when the mask is absent).
Logprobs play no part: a token whose logprob is non-finite still has routed experts. Index ``l`` is
the position along the ``L`` axis of the given tensors (the MoE layers, in model order; dense layers
are not in the tensor).

* ``moe/router/flip_rate``: top-1 expert differs, over valid (token, layer) pairs.
* ``moe/router/topk_disagreement_rate``: share of valid tokens whose top-K expert *set* differs in at
  least one layer. The sets are compared as sets: every id of one side occurs among the other side's
  ids and vice versa (K x K comparisons of each (token, layer), fixed shapes), so the order within the
  top-K does not matter and an id repeated in a row counts once. With the number of experts E known
  (``num_experts``, or both sides given as router logits), the comparisons run on ids copied to the
  narrowest dtype that holds ``[0, E)`` (uint8 for E <= 256: several times cheaper), the same result;
  an id outside ``[0, E)`` in a valid token then makes the stateful metric's ``compute()`` raise. Without
  ``num_experts``, ids of K > 2 are compared as int16: an id outside ``[0, 2**15)`` in a valid token makes
  ``compute()`` raise the same way (pass ``num_experts``); K <= 2 ids compare exactly, and a negative one raises.
  A negative id (a -1 placeholder for a token the engine did not route) is no expert: the flip rate's
  ``compute()`` raises on one too.
  Compiled (the metric's ``compiled=True`` or a compiled collection, on CPU for K > 2), one ``torch.compile``
  loop compares the int64 ids themselves (no narrowing) and flags the same out-of-range ids.
* ``moe/router/layer_{l}/flip_rate``: the flip rate of layer ``l``, for the layers that saw a valid token
  in the window (decided on the synced counts; a layer without data has no key). ``num_layers`` (the
  model's number of MoE layers) sizes the state; a batch with more layers (``L > num_layers``) raises a
  ``ValueError``. Unset, the capacity is 64 layers and deeper layers ``l >= 64`` are pooled into
  ``moe/router/layer_overflow/flip_rate`` (that key only when such layers were seen).
* ``moe/router/worst_layer`` / ``worst_layer_flip_rate``: the layer with the highest flip rate among
  the layers that saw a valid token (the first one on ties), and its rate. The pooled overflow bucket
  competes as index 64, read "a layer >= 64": pass ``num_layers`` to resolve it.

A window without a valid token has no keys (the metrics); the public functions raise a ``ValueError`` on a
batch without a response token (no made-up rate 0 / worst layer -1).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from opbc_metrics.batch import (
    RESPONSE_MASK,
    ROLLOUT_LOGPROBS,
    TRAINER_LOGPROBS,
    BatchView,
    as_bool_mask,
    check_count,
)
from opbc_metrics.functional.mismatch import _RECOMPILE_LIMIT
from opbc_metrics.functional.statistics import Stats, require_data
from opbc_metrics.functional.statistics import safe_div as _safe_div

ROLLOUT_EXPERTS = "rollout_experts"
TRAINER_EXPERTS = "trainer_experts"
ROLLOUT_ROUTER_LOGITS = "rollout_router_logits"
TRAINER_ROUTER_LOGITS = "trainer_router_logits"
EXPERT_FIELDS = (ROLLOUT_EXPERTS, TRAINER_EXPERTS)
LOGIT_FIELDS = (ROLLOUT_ROUTER_LOGITS, TRAINER_ROUTER_LOGITS)

# Per-layer capacity of the stateful flip-rate metric: covers the MoE depth of Mixtral (32),
# Qwen3-30B-A3B (48), DeepSeek-V3 / Kimi K2 (58 MoE layers); deeper models pool into the overflow.
DEFAULT_MOE_LAYERS = 64

FLIP_RATE_KEY = "moe/router/flip_rate"
TOPK_DISAGREEMENT_KEY = "moe/router/topk_disagreement_rate"
WORST_LAYER_KEY = "moe/router/worst_layer"
WORST_LAYER_RATE_KEY = "moe/router/worst_layer_flip_rate"
LAYER_OVERFLOW_KEY = "moe/router/layer_overflow/flip_rate"


def layer_key(layer: int) -> str:
    """The key of one layer's flip rate.

    Example:
        >>> layer_key(3)
        'moe/router/layer_3/flip_rate'
    """
    return f"moe/router/layer_{layer}/flip_rate"


def flip_rate_keys(num_layers: int) -> tuple[str, ...]:
    """Keys produced by the flip-rate metric with capacity ``num_layers``, in order.

    Example:
        >>> flip_rate_keys(2)
        ('moe/router/flip_rate', 'moe/router/worst_layer', 'moe/router/worst_layer_flip_rate', \
'moe/router/layer_0/flip_rate', 'moe/router/layer_1/flip_rate', 'moe/router/layer_overflow/flip_rate')
    """
    return (
        FLIP_RATE_KEY,
        WORST_LAYER_KEY,
        WORST_LAYER_RATE_KEY,
        *(layer_key(i) for i in range(num_layers)),
        LAYER_OVERFLOW_KEY,
    )


def check_top_k(top_k: int | None) -> int | None:
    """Validate a ``top_k`` constructor argument (``None`` or an integer >= 1)."""
    return check_count("top_k", top_k)


# ---------------------------------------------------------------------------------------------
# input validation
# ---------------------------------------------------------------------------------------------
def _check_ids(ids: Tensor, name: str) -> None:
    if not isinstance(ids, Tensor):
        raise ValueError(f"batch field `{name}` must be a torch.Tensor, got {type(ids).__name__}")
    if ids.ndim != 4:
        raise ValueError(f"batch field `{name}` must have shape [B, T, L, K], got {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"batch field `{name}` must hold integer expert ids, got {ids.dtype}")
    if ids.shape[2] == 0 or ids.shape[3] == 0:
        raise ValueError(f"batch field `{name}` needs at least one layer and one expert, got {tuple(ids.shape)}")


def _check_logits(logits: Tensor, name: str, top_k: int | None) -> int:
    if not isinstance(logits, Tensor):
        raise ValueError(f"batch field `{name}` must be a torch.Tensor, got {type(logits).__name__}")
    if logits.ndim != 4:
        raise ValueError(f"batch field `{name}` must have shape [B, T, L, E], got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"batch field `{name}` must be floating-point router logits, got {logits.dtype}")
    if top_k is None:
        raise ValueError(
            f"batch field `{name}` holds router logits, which need `top_k` (the number of routed experts): pass "
            '`top_k=K` to the metric or function, or `section_options={"moe": {"top_k": K}}` to an OPBCCollection'
        )
    if logits.shape[2] == 0 or logits.shape[3] < top_k:
        raise ValueError(
            f"batch field `{name}` must have at least one layer and E >= top_k = {top_k} experts, "
            f"got {tuple(logits.shape)}"
        )
    return top_k


def router_topk(router_logits: Tensor, k: int) -> Tensor:
    """The ``k`` experts with the highest router logits, ``[B, T, L, k]`` int64, highest first.

    Example:
        >>> import torch
        >>> router_topk(torch.tensor([[[[0.1, 2.0, -1.0, 0.7]]]]), 2)
        tensor([[[[1, 3]]]])
    """
    _check_logits(router_logits, "router_logits", check_top_k(k))
    return torch.topk(router_logits, k, dim=-1, largest=True, sorted=True).indices


def _side(view: BatchView, ids_name: str, logits_name: str, top_k: int | None) -> tuple[Tensor, str]:
    """One side's expert ids (from ids or from logits) and the field they came from."""
    if view.has(ids_name):
        ids = view.field(ids_name)
        _check_ids(ids, ids_name)
        if top_k is not None:
            if ids.shape[3] < top_k:
                raise ValueError(
                    f"batch field `{ids_name}` has K = {ids.shape[3]} experts per layer, fewer than top_k = {top_k}"
                )
            ids = ids[..., :top_k]
        return ids, ids_name
    if view.has(logits_name):
        logits = view.field(logits_name)
        k = _check_logits(logits, logits_name, top_k)
        return torch.topk(logits, k, dim=-1, largest=True, sorted=True).indices, logits_name
    present = ", ".join(sorted(k for k, v in view.data.items() if v is not None)) or "none"
    raise ValueError(f"batch field `{ids_name}` (or `{logits_name}`) is required but missing (present: {present})")


def _negative_key(top_k: int | None) -> tuple[str, int | None]:
    """The view cache key of the ``[B, T]`` flags "the token holds a negative expert id (or one >= 2**31) on either
    side" of :func:`router_inputs` ``(view, top_k)``: whichever router metric of a collection reads the ids first
    stores them, the other skips that pass over the ids (a per-token minimum of each side)."""
    return ("moe_negative_tokens", top_k)


# A collection whose set disagreement compares K = 2 expert ids without num_experts asks for this (the request names
# its top_k): the flip rate's update then takes its top-1 flips and negative flags from the sets' chunk loop, which
# computes both from the same compares (one pass over the ids for both metrics).
PAIR_SETS = "moe_pair_sets"


def _uses_pair_sets(view: BatchView, rollout: Tensor, num_experts: int | None) -> bool:
    """Whether the set disagreement of these ids runs the shared K = 2 loop (:func:`_pair_statistics`)."""
    has_ids = view.has(ROLLOUT_EXPERTS) or view.has(TRAINER_EXPERTS)  # (both logits: ids bounded, no range check)
    return rollout.shape[3] == 2 and rollout.device.type == "cpu" and num_experts is None and has_ids


def _pair_statistics(view: BatchView, top_k: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """``([B, T, L] top-1 flips, [B, T] negative, [B, T] set differs)`` of K = 2 ids without ``num_experts``, from
    one chunk loop (:func:`_set_differs_tokens`); cached on the view for the flip rate and the set disagreement."""

    def make() -> tuple[Tensor, Tensor, Tensor]:
        rollout, trainer, _ = router_inputs(view, top_k)
        flips = torch.empty(rollout.shape[:3], dtype=torch.bool, device=rollout.device)
        differs, negative = _set_differs_tokens(rollout, trainer, None, True, view.cached(_negative_key(top_k)),
                                                flips=flips)
        assert negative is not None
        return flips, negative, differs

    return view.shared((PAIR_SETS, top_k), make)


def router_inputs(view: BatchView, top_k: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(rollout_ids, trainer_ids, mask)``: validated ``[B, T, L, K]`` ids and the ``[B, T]`` bool mask.

    Cached on the view, so every router metric of a collection resolves (and top-Ks) the inputs once.
    """
    return view.shared(("moe_router_inputs", top_k), lambda: _resolve(view, top_k))


def _resolve(view: BatchView, top_k: int | None) -> tuple[Tensor, Tensor, Tensor]:
    rollout, r_name = _side(view, ROLLOUT_EXPERTS, ROLLOUT_ROUTER_LOGITS, top_k)
    trainer, t_name = _side(view, TRAINER_EXPERTS, TRAINER_ROUTER_LOGITS, top_k)
    if (r_name, t_name) == LOGIT_FIELDS:
        # Top-Ks over different numbers of experts are not the same experts (their K columns would hide it).
        r_logits, t_logits = (view.field(name) for name in LOGIT_FIELDS)
        if t_logits.shape[3] != r_logits.shape[3]:
            raise ValueError(
                f"batch field `{t_name}` has E = {t_logits.shape[3]} experts (shape {tuple(t_logits.shape)}) but "
                f"`{r_name}` has E = {r_logits.shape[3]} (shape {tuple(r_logits.shape)}): both sides' router logits "
                "must score the same experts; pass the logits of the same MoE layers of the same model"
            )
    if trainer.shape[:3] != rollout.shape[:3]:
        raise ValueError(
            f"batch field `{t_name}` has [B, T, L] = {tuple(trainer.shape[:3])} but `{r_name}` has "
            f"{tuple(rollout.shape[:3])}"
        )
    if trainer.shape[3] != rollout.shape[3]:
        raise ValueError(
            f"batch field `{t_name}` has K = {trainer.shape[3]} experts per layer but `{r_name}` has "
            f"K = {rollout.shape[3]}; set `top_k` to compare the first top_k of each"
        )
    if trainer.device != rollout.device:
        raise ValueError(f"batch field `{t_name}` is on {trainer.device} but `{r_name}` is on {rollout.device}")
    b, t = rollout.shape[:2]
    for name in (TRAINER_LOGPROBS, ROLLOUT_LOGPROBS):
        # Peek without marking the field read: a logprob field no metric reads is still reported as unread.
        logprobs = dict.get(view.data, name)
        if isinstance(logprobs, Tensor) and tuple(logprobs.shape) != (b, t):
            raise ValueError(
                f"batch field `{r_name}` has [B, T] = {(b, t)} but `{name}` has shape {tuple(logprobs.shape)}: "
                "expert ids (or router logits) must cover the same sequences and tokens as the logprobs"
            )
    if view.has(RESPONSE_MASK):
        mask = view.tensor(RESPONSE_MASK)
        if tuple(mask.shape) != (b, t):
            raise ValueError(
                f"batch field `{RESPONSE_MASK}` has shape {tuple(mask.shape)} but `{r_name}` has [B, T] = {(b, t)}"
            )
        if mask.device != rollout.device:
            raise ValueError(f"batch field `{RESPONSE_MASK}` is on {mask.device} but `{r_name}` is on {rollout.device}")
        if mask.is_complex():
            raise ValueError(f"batch field `{RESPONSE_MASK}` must be bool, integer or float, got {mask.dtype}")
        mask = as_bool_mask(mask)
    else:
        mask = torch.ones((b, t), dtype=torch.bool, device=rollout.device)
    return rollout, trainer, mask


def _check_pair(rollout_experts: Tensor, trainer_experts: Tensor) -> None:
    _check_ids(rollout_experts, ROLLOUT_EXPERTS)
    _check_ids(trainer_experts, TRAINER_EXPERTS)
    if trainer_experts.shape != rollout_experts.shape:
        raise ValueError(
            f"batch field `{TRAINER_EXPERTS}` has shape {tuple(trainer_experts.shape)} but `{ROLLOUT_EXPERTS}` "
            f"has shape {tuple(rollout_experts.shape)}"
        )


# ---------------------------------------------------------------------------------------------
# per-token comparisons (used by the controller too)
# ---------------------------------------------------------------------------------------------
def _top1_flips(rollout: Tensor, trainer: Tensor) -> Tensor:
    return rollout[..., 0] != trainer[..., 0]


def top1_flips_and_negatives(rollout: Tensor, trainer: Tensor, negative: Tensor | None = None
                             ) -> tuple[Tensor, Tensor]:
    """``([B, T, L] flips, [B, T] negative)`` from ``[B, T, L, K]`` ids (K may differ between the sides): the top-1
    expert differs, and the token holds a negative expert id on either side (no expert: a placeholder such as -1
    for a token the engine did not route or record, which compared as an expert would read as a router flip).

    Int64 ids are read as their int32 halves (a negative id has a negative high half; int64 ``amin`` is not
    vectorised on CPU), so an id of 2**31 or more reads as negative too. On CPU the tokens go in chunks: the
    per-token minimum reads a chunk from memory, the strided top-1 compare then from cache (the update measured at
    1.50x the strided compare alone at 4 x 2048 x 48 x 8 int64, against 1.7-2.8x for whole-batch passes; 1.55x at
    4 x 2048 x 32 x 2). ``negative``, when given (another reader's flags of the same ids), is returned as it is, and
    only the top-1 columns are compared.
    """
    if negative is not None:
        return _top1_flips(rollout, trainer), negative
    b, t, n_layers = rollout.shape[:3]
    tokens, device = b * t, rollout.device
    rows_of = [x.reshape(tokens, n_layers * x.shape[3]).contiguous() for x in (rollout, trainer)]  # (each its own K)
    halves = [_range_halves(x, 2**31) for x in rows_of]
    low = [torch.empty(tokens, dtype=x.dtype, device=device) for x in halves]
    flips = torch.empty((tokens, n_layers), dtype=torch.bool, device=device)
    width = max(x.shape[1] for x in rows_of) if tokens else 1
    rows = max(1, (_CPU_CHUNK_IDS if device.type == "cpu" else _DEVICE_CHUNK_IDS) // max(1, width))
    for start in range(0, tokens, rows):
        end = min(start + rows, tokens)
        for i in (0, 1):
            torch.amin(halves[i][start:end], dim=-1, out=low[i][start:end])
        r, tr = (x[start:end].view(end - start, n_layers, -1)[..., 0] for x in rows_of)
        torch.ne(r, tr, out=flips[start:end])
    return flips.view(b, t, n_layers), ((low[0] < 0) | (low[1] < 0)).view(b, t)


def _lane_sets_differ(
    rollout: Tensor, trainer: Tensor, pairs: Tensor, non_negative: bool, found: Tensor | None = None
) -> Tensor:
    """``[n]``, nonzero where the sets of the columns of ``rollout`` / ``trainer`` ``[K, n]`` (lane-major) differ.
    Exact; an id repeated in a column counts once, as in a set.

    ``pairs`` ``[K, K, n]`` receives every (trainer j, rollout i) comparison in one broadcast op; its reductions
    over i say whether trainer id j is among the rollout's, over j whether rollout id i is among the
    trainer's (reductions over an outer dim: contiguous, vectorised). ``non_negative`` ids (narrow copies)
    are compared by XOR in their own dtype (an id is in the other set where the minimum XOR is 0): int16
    compares into bool are not vectorised on CPU, 9x slower than uint8 ones. Other ids: ``==`` into uint8.
    ``found`` ``[2, K, n]`` (``pairs``' dtype), when given, receives the two reductions (no allocation).
    """
    if non_negative:
        torch.bitwise_xor(rollout.unsqueeze(0), trainer.unsqueeze(1), out=pairs)
        if found is None:
            return torch.maximum(pairs.amin(dim=0), pairs.amin(dim=1)).amax(dim=0)
        torch.amin(pairs, dim=0, out=found[0])
        torch.amin(pairs, dim=1, out=found[1])
        return found.amax(dim=(0, 1))  # a missing id in either direction
    torch.eq(rollout.unsqueeze(0), trainer.unsqueeze(1), out=pairs.view(torch.bool))
    found_ = torch.minimum(pairs.amax(dim=0), pairs.amax(dim=1))  # [K, n]: 1 where the id is in the other set
    return 1 - found_.amin(dim=0)


def _column_sets_equal(rollout: Tensor, trainer: Tensor) -> Tensor:
    """``[n]``: the sets of the rows of ``rollout`` / ``trainer`` ``[n, K]`` are equal, from the K x K
    comparisons of their columns (strided views, no copy): cheaper than lane-major copies for K <= 2."""
    k = rollout.shape[1]
    equal = [[rollout[:, i] == trainer[:, j] for j in range(k)] for i in range(k)]
    same = None
    for i in range(k):
        in_trainer, in_rollout = equal[i][0], equal[0][i]  # rollout id i among the trainer's; trainer id i
        for j in range(1, k):
            in_trainer = in_trainer | equal[i][j]
            in_rollout = in_rollout | equal[j][i]
        both = in_trainer & in_rollout
        same = both if same is None else same & both
    assert same is not None
    return same


def _byte_pairs_same(rollout: Tensor, trainer: Tensor, even: Tensor, work: Tensor, flips: Tensor | None = None
                     ) -> Tensor:
    """``[2n]`` uint8, both bytes of pair ``p`` 1 where the sets of the K = 2 id pairs ``rollout[2p : 2p + 2]``
    and ``trainer[2p : 2p + 2]`` (flat ``[2n]`` ids, contiguous: uint8 narrow copies, or the ids themselves) are
    equal: equal in order or crosswise (set equality with repeats too: {a, a} matches only itself). Every op runs
    over contiguous memory (vectorised; a strided column compare costs 13x a contiguous uint8 one): the crosswise
    compares are those of ``trainer`` shifted by one id either way, valid at even positions (``even``: 1, 0, 1, 0,
    ...). ``work`` ``[2, 2n]`` uint8. ``flips`` ``[n]`` bool, when given, receives the top-1 flips (the first ids of
    pair ``p`` differ), read off the in-order compare."""
    q = rollout.shape[0]
    in_order, cross = work[0, :q], work[1, :q]
    torch.eq(rollout, trainer, out=in_order.view(torch.bool))
    if flips is not None:
        torch.eq(in_order[0::2], 0, out=flips)
    torch.eq(rollout[:-1], trainer[1:], out=cross[:-1].view(torch.bool))  # r0 == t1 at even positions
    cross[:-1] &= torch.eq(rollout[1:], trainer[:-1]).view(torch.uint8)  # r1 == t0, at the same positions
    cross[-1:] = 0
    cross &= even
    in_order |= cross
    in_order[1:] |= cross[:-1]  # the crosswise result of pair p into its second byte too
    return in_order


_WORDS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fold(flags: Tensor, every: bool) -> Tensor:
    """``[rows]``: every (or any) flag of the rows of ``flags`` ``[rows, w]`` (bool, contiguous). 2, 4 or 8 flags
    are read as one word: ``all`` / ``any`` over rows that short cost ~1 ns per flag (K = 2: 0.1x the flip rate)."""
    width = flags.shape[1]
    if width == 1:
        return flags[:, 0]
    if width not in _WORDS:
        return flags.all(dim=-1) if every else flags.any(dim=-1)
    words = flags.view(_WORDS[width]).view(-1)
    return words == int.from_bytes(b"\x01" * width, "little") if every else words != 0


def _all_layers(same: Tensor, n_layers: int) -> Tensor:
    """``[tokens]``: every layer holds, from ``same`` ``[tokens * n_layers]`` (layers innermost).

    Bool flags are bytes 0/1, so with 2, 4 or a multiple of 8 layers a token's flags are compared as whole
    int16 / int32 / int64 words against bytes of 1 (at 4 layers 8x faster than ``all`` over rows that short).
    """
    rows = same.view(-1, n_layers)
    width = 8 if n_layers % 8 == 0 else n_layers if n_layers in _WORDS else 0
    if not width:
        return rows.all(dim=-1)
    return _fold(rows.view(_WORDS[width]) == int.from_bytes(b"\x01" * width, "little"), every=True)


def _any_layer(differ: Tensor, n_layers: int) -> Tensor:
    """``[tokens]``: some layer is nonzero, from ``differ`` ``[tokens * n_layers]`` (layers innermost), by whole
    words of its bytes as :func:`_all_layers` (a uint8 ``amax`` over rows of 48 costs 2x)."""
    rows = differ.view(-1, n_layers).view(torch.uint8)
    width = 8 if rows.shape[1] % 8 == 0 else rows.shape[1] if rows.shape[1] in _WORDS else 0
    if not width:
        return rows.amax(dim=-1) != 0
    return _fold(rows.view(_WORDS[width]) != 0, every=False)


# Up to this K the columns are compared in place (K = 2, 2M ids: 2.6x faster than the lane copies); above it
# the K^2 strided passes cost more than the copies (K = 8: 10x slower).
_COLUMN_MAX_K = 2

# Ids per chunk of the set comparison on CPU (2^16: 1.3x, 2^17: 1.1x, 2^19: 1.05x the time of 2^18).
# Measured with benchmarks/bench_controller_moe.py (one thread, 3.1M contiguous int64 ids, K = 8, E = 128),
# as multiples of the top-1 flip rate's update: 3.4-3.6x with num_experts, 4.1-4.4x without (int16), of which
# the range check ~1.1x (its first pass reads the ids from memory), the narrow copies ~0.25x, the lane
# transpose ~0.6x, the [K, K, n] compare and its reductions ~1x (benchmarks/README.md, MoE set disagreement).
# Before: per-j compares into bool masks (16 [K, n] compares + ORs) 4-5x, aminmax for the range ~1.5x
# alone (int64 amin is not vectorised: 8x an int64 amax; the int32 halves' amin costs what amax does), one
# transposing copy from int64 3x a contiguous narrowing copy plus a transpose of the narrow one, int64
# lanes without num_experts 15-17x. Tried and slower: int64 bitmasks (1 << id, OR tree over K: E = 64 0.93x,
# E = 128 with two words 1.5x, K = 2 1.2x the K x K compare),
# the K x K compare with inner [.., K, K] broadcasts 34x, bool any/all over a non-inner dim, SWAR zero-byte
# tests on 8 ids packed in an int64 word, float lanes, a [K, L, tokens] layout, folding the [K, K, n]
# comparisons by halves (1.4x the uint8 amin over the outer dim), torch.minimum(ids, E, out=uint8) as a
# clamping narrow copy (3x a plain copy, and negative ids still wrap), bool compares of int16 lanes (9x
# uint8 ones: not vectorised; XOR + min in int16 is 2x uint8), XOR instead of == for uint8 (the same).
_CPU_CHUNK_IDS = 1 << 18
# Elsewhere the chunks only bound the [K, K, ids / K] comparison buffer (128 MiB of uint8 at K = 8).
_DEVICE_CHUNK_IDS = 1 << 24


# Without ``num_experts`` the ids of K > 2 are compared as int16, which holds any real router's experts; ids
# outside [0, 2**15) are reported like ids outside [0, num_experts) (int64 lanes cost 3x as much).
UNKNOWN_EXPERTS_BOUND = 2**15


def lane_dtype(num_experts: int | None, ids_dtype: torch.dtype) -> torch.dtype:
    """The narrowest integer dtype holding every expert id in ``[0, num_experts)`` exactly (the ids' own
    dtype when ``num_experts`` is unknown or too large).

    Example:
        >>> [lane_dtype(e, torch.int64) for e in (8, 256, 257, 40000, None)]
        [torch.uint8, torch.uint8, torch.int16, torch.int64, torch.int64]
    """
    if num_experts is not None and num_experts <= 256:
        return torch.uint8
    if num_experts is not None and num_experts <= 2**15:
        return torch.int16
    return ids_dtype


def _range_halves(ids: Tensor, num_experts: int) -> Tensor:
    """The view whose minimum is negative exactly when an id is: the int32 halves of int64 ids below 2**31 (a
    negative id has a negative high half; int64 ``amin`` is not vectorised on CPU), else (and for strided rows, which
    have no such view) the ids."""
    halves = ids.dtype == torch.int64 and num_experts <= 2**31 and ids.stride(-1) == 1
    return ids.view(torch.int32) if halves else ids


def _set_differs_tokens(
    rollout: Tensor, trainer: Tensor, num_experts: int | None, check_range: bool = True, negative: Tensor | None = None,
    flips: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``([B, T] differs, [B, T] outside or None)``: the top-K set differs in at least one layer.

    The ids are copied in :func:`lane_dtype` (contiguous), then lane-major (``[K, tokens, L]``, one row per
    top-K column) and compared by :func:`_lane_sets_differ`; for K <= 2 their columns are compared in place.
    With ``check_range``, ``outside`` marks the tokens holding an id outside ``[0, num_experts)`` (``num_experts``
    None: ``[0, 2**15)`` for K > 2, a negative id for K <= 2), whose narrow copies may wrap: the caller reports
    them (reading it here would be a host sync). ``check_range=False`` with ``num_experts`` None compares any ids
    exactly in their own dtype. On CPU the tokens go in chunks that stay in cache; every chunk writes its
    per-token reductions into whole-batch buffers (``out=``), compared once at the end: fewer ops per chunk.
    ``negative`` ``[B, T]``, when given (:func:`top1_flips_and_negatives`' flags of the same ids: a negative id or
    one >= 2**31 on either side), stands for the per-token minima: used only with a bound of at most 2**31, where
    those ids are outside anyway. ``flips`` ``[B, T, L]`` bool, when given (K = 2 on CPU only), receives the top-1
    flips from the same compares.
    """
    b, t, n_layers, k = rollout.shape
    # Without num_experts: K > 2 ids are narrowed to int16, so ids outside [0, 2**15) are reported; K <= 2 ids are
    # compared in their own dtype, so only negative ids (a -1 placeholder is no expert) are (no maximum needed).
    negatives_only = num_experts is None and check_range and k <= _COLUMN_MAX_K  # (and ids >= 2**31: _range_halves)
    if num_experts is None and check_range:
        num_experts = 2**31 if negatives_only else UNKNOWN_EXPERTS_BOUND
    check_range = check_range and num_experts is not None
    if not check_range or num_experts is None or num_experts > 2**31:
        negative = None  # (a bound above 2**31 needs the exact minima)
    device, tokens = rollout.device, b * t
    if tokens == 0:
        none = torch.zeros((b, t), dtype=torch.bool, device=device)
        return none, none if check_range else None
    ids_dtype = torch.promote_types(rollout.dtype, trainer.dtype)
    dtype = lane_dtype(num_experts, ids_dtype)
    rollout, trainer = rollout.reshape(tokens, n_layers * k), trainer.reshape(tokens, n_layers * k)
    chunk = _CPU_CHUNK_IDS if device.type == "cpu" else _DEVICE_CHUNK_IDS
    rows = min(max(1, chunk // (n_layers * k)), tokens)
    if check_range:  # per token and side: the largest id, the smallest of _range_halves
        assert num_experts is not None
        high = [torch.empty(tokens, dtype=x.dtype, device=device) for x in (rollout, trainer)]
        low = [] if negative is not None else [
            torch.empty(tokens, dtype=_range_halves(x[:1], num_experts).dtype, device=device)
            for x in (rollout, trainer)
        ]
    # K = 2 on CPU: contiguous compares of the flat ids and of their one-off shifts (_byte_pairs_same), not strided
    # column ones; narrowed to uint8 first where num_experts allows, else in their own dtype
    byte_pairs = k == 2 and device.type == "cpu"
    narrow_pairs = byte_pairs and dtype == torch.uint8
    assert flips is None or byte_pairs, "top-1 flips come with the K = 2 pair compares on CPU"
    flip_rows = None if flips is None else flips.view(tokens, n_layers)
    if byte_pairs:
        narrow = torch.empty((2, rows * n_layers * k if narrow_pairs else 0), dtype=dtype, device=device)
        work = torch.empty((2, rows * n_layers * k), dtype=torch.uint8, device=device)
        even = torch.zeros((rows * n_layers, 2), dtype=torch.uint8, device=device)
        even[:, 0] = 1
        even = even.view(-1)
        differs = torch.empty(tokens, dtype=torch.bool, device=device)  # True: every pair of the token agrees
    elif k > _COLUMN_MAX_K:  # work buffers, reused by every chunk
        narrow = torch.empty((2, rows, n_layers, k), dtype=dtype, device=device)
        lanes = torch.empty((2, k, rows, n_layers), dtype=dtype, device=device)
        non_negative = num_experts is not None  # valid narrow ids lie in [0, num_experts); others are reported
        pair_dtype = dtype if non_negative else torch.uint8
        pairs = torch.empty((k, k, rows * n_layers), dtype=pair_dtype, device=device)
        found = torch.empty((2, k, rows * n_layers), dtype=pair_dtype, device=device)
        differs = torch.empty(tokens, dtype=torch.bool, device=device)  # True: the sets differ
    else:
        differs = torch.empty(tokens, dtype=torch.bool, device=device)  # True: the sets are equal
    for start in range(0, tokens, rows):
        r, tr = rollout[start : start + rows], trainer[start : start + rows]
        m = r.shape[0]
        if check_range:  # while the chunk is in cache
            assert num_experts is not None
            for i, x in enumerate((r, tr)):
                if not negatives_only:
                    torch.amax(x, dim=-1, out=high[i][start : start + m])
                if low:
                    torch.amin(_range_halves(x, num_experts), dim=-1, out=low[i][start : start + m])
        if byte_pairs:
            q = m * n_layers * k
            if narrow_pairs:
                for i, x in enumerate((r, tr)):
                    narrow[i, :q].view(m, n_layers * k).copy_(x)
                flat = (narrow[0, :q], narrow[1, :q])
            else:
                flat = (r.reshape(q), tr.reshape(q))
            same = _byte_pairs_same(*flat, even[:q], work,
                                    None if flip_rows is None else flip_rows[start : start + m].view(-1))
            differs[start : start + m] = _all_layers(same.view(torch.bool), n_layers * k)  # uint8 row amin: 10x
            continue
        if k <= _COLUMN_MAX_K:
            same = _column_sets_equal(r.reshape(-1, k), tr.reshape(-1, k))
            differs[start : start + m] = _all_layers(same, n_layers)
            continue
        # narrow first (a contiguous copy), then transpose the narrow copy: 3x cheaper than one transposing copy
        for i, x in enumerate((r, tr)):
            narrow[i, :m].view(m, n_layers * k).copy_(x)
        lanes[:, :, :m].copy_(narrow[:, :m].permute(0, 3, 1, 2))  # both sides in one op
        views = [lanes[i, :, :m].reshape(k, m * n_layers) for i in (0, 1)]
        differ = _lane_sets_differ(*views, pairs[:, :, : m * n_layers], non_negative, found[:, :, : m * n_layers])
        differs[start : start + m] = _any_layer(differ, n_layers)
    differs = (differs if k > _COLUMN_MAX_K and not byte_pairs else ~differs).view(b, t)
    if not check_range:
        return differs, None
    assert num_experts is not None
    outside = negative.reshape(tokens) if negative is not None else (low[0] < 0) | (low[1] < 0)
    if not negatives_only:
        outside |= (high[0] >= num_experts) | (high[1] >= num_experts)
    return differs, outside.view(b, t)


# Compiled (``compiled=True`` or a compiled collection, CPU, K > 2): one inductor loop over the (token, layer)
# pairs reads both sides' K int64 ids once and compares them in registers: no narrow copy, no range pass, no lane
# transpose. Lane i of a pair holds max(min_j r_i ^ t_j, min_j t_i ^ r_j): 0 exactly when rollout id i is among
# the trainer's and trainer id i among the rollout's. A lane holding an id outside [0, bound) is raised to
# _OUTSIDE_LANE, above any XOR of two ids in range (bound <= 2^30), so one per-token maximum says both things.
# K = 8 of E = 128, 3.1M ids, one thread: 1.6-2.0x the flip rate's update against 3.9-4.4x for the eager lanes
# (benchmarks/README.md, "MoE set disagreement, compiled"). The lanes are stored as int32 between the loop and
# the per-token maximum (inductor keeps them in a buffer: 4 bytes per id), hence the chunks.
_OUTSIDE_LANE = 1 << 30
_COMPILED_CHUNK_IDS = 1 << 22
_COMPILED_SETS: dict[str, Any] = {}


def _set_lanes_per_token(rollout: Tensor, trainer: Tensor, bound: int) -> tuple[Tensor, Tensor]:
    """``([tokens] differs, [tokens] outside)`` from ``[tokens, L, K]`` ids; traced by ``torch.compile``."""
    outside = (torch.maximum(rollout, trainer) >= bound) | (torch.minimum(rollout, trainer) < 0)
    r_missing = t_missing = None
    for j in range(rollout.shape[-1]):  # unrolled: K broadcasts of one id against the other side's K
        a, b = rollout ^ trainer[..., j : j + 1], trainer ^ rollout[..., j : j + 1]
        r_missing = a if r_missing is None else torch.minimum(r_missing, a)
        t_missing = b if t_missing is None else torch.minimum(t_missing, b)
    assert r_missing is not None and t_missing is not None
    # The outside flag enters between the two minima (not after them): so inductor computes it in the same loop
    # instead of reading the ids again in the per-token reduction.
    lanes = torch.maximum(torch.maximum(r_missing, torch.where(outside, _OUTSIDE_LANE, 0)), t_missing)
    per_token = lanes.clamp(max=_OUTSIDE_LANE).to(torch.int32).view(lanes.shape[0], -1).amax(dim=-1)
    return per_token != 0, per_token >= _OUTSIDE_LANE


def _compiled_set_differs(rollout: Tensor, trainer: Tensor, bound: int) -> tuple[Tensor, Tensor]:
    """``([B, T] differs, [B, T] outside)`` as :func:`_set_differs_tokens` with ``num_experts = bound``, from the
    compiled loop; ``differs`` agrees with the eager path on every token without an id outside ``[0, bound)``."""
    if "fn" not in _COMPILED_SETS:
        _COMPILED_SETS["fn"] = torch.compile(_set_lanes_per_token, fullgraph=True, dynamic=None)
    b, t, n_layers, k = rollout.shape
    tokens = b * t
    rollout, trainer = rollout.reshape(tokens, n_layers, k), trainer.reshape(tokens, n_layers, k)
    rows = max(1, _COMPILED_CHUNK_IDS // (n_layers * k))
    differs, outside = [], []
    for start in range(0, tokens, rows):
        r, tr = rollout[start : start + rows], trainer[start : start + rows]
        for x in (r, tr):  # one graph for every chunk length (the last chunk is shorter)
            torch._dynamo.maybe_mark_dynamic(x, 0)
        # one graph per K, L, bound and dtypes: more than dynamo's default 8 per function in a long-lived process
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
            d, o = _COMPILED_SETS["fn"](r, tr, bound)
        differs.append(d)
        outside.append(o)
    return torch.cat(differs).view(b, t), torch.cat(outside).view(b, t)


def router_top1_flips(rollout_experts: Tensor, trainer_experts: Tensor) -> Tensor:
    """``[B, T, L]`` bool: the top-1 (highest-weight) expert differs between rollout and trainer.

    No mask is applied: combine with ``response_mask`` yourself.

    Example:
        >>> import torch
        >>> r = torch.tensor([[[[1, 2], [3, 4]]]])  # B=1, T=1, L=2, K=2
        >>> t = torch.tensor([[[[2, 1], [3, 5]]]])
        >>> router_top1_flips(r, t)
        tensor([[[ True, False]]])
    """
    _check_pair(rollout_experts, trainer_experts)
    return _top1_flips(rollout_experts, trainer_experts)


def router_set_disagreement(rollout_experts: Tensor, trainer_experts: Tensor) -> Tensor:
    """``[B, T]`` bool: the top-K expert set differs in at least one layer.

    The order within the top-K does not matter (a swap of the top two experts is a top-1 flip but not
    a set disagreement), and an id repeated in a row counts once. No mask is applied.

    Example:
        >>> import torch
        >>> r = torch.tensor([[[[1, 2], [3, 4]]]])
        >>> router_set_disagreement(r, torch.tensor([[[[2, 1], [3, 4]]]]))
        tensor([[False]])
        >>> router_set_disagreement(r, torch.tensor([[[[2, 1], [3, 5]]]]))
        tensor([[True]])
        >>> router_set_disagreement(torch.tensor([[[[1, 1, 2]]]]), torch.tensor([[[[1, 2, 2]]]]))  # both {1, 2}
        tensor([[False]])
    """
    _check_pair(rollout_experts, trainer_experts)
    return _set_differs_tokens(rollout_experts, trainer_experts, None, check_range=False)[0]


# ---------------------------------------------------------------------------------------------
# moe/router/flip_rate, per layer and worst layer
# ---------------------------------------------------------------------------------------------
def _valid_counts_per_layer(flags: Tensor, mask: Tensor) -> Tensor:
    """``[L]`` float64: the valid tokens (``mask`` ``[B, T]``) with the flag set, per layer of ``flags`` ``[B, T, L]``.

    On CPU as a matrix-vector product (the mask's row against the flags' columns): a bool sum over the token dims
    with L innermost reduces L short strided columns (2.2x slower at L = 4, 1.3x at L = 48). Exact: every partial
    sum is an integer of at most B * T, and float32 holds those below 2**24.
    """
    b, t, n_layers = flags.shape
    if flags.device.type != "cpu":
        return (flags & mask.unsqueeze(-1)).sum(dim=(0, 1)).to(torch.float64)
    dtype = torch.float32 if b * t < 2**24 else torch.float64
    return torch.mv(flags.reshape(b * t, n_layers).t().to(dtype), mask.reshape(b * t).to(dtype)).to(torch.float64)


def _flip_rate_update(view: BatchView, num_layers: int, top_k: int | None = None, configured: bool = False) -> Stats:
    rollout, trainer, mask = router_inputs(view, top_k)
    n_layers = rollout.shape[2]
    if configured and n_layers > num_layers:  # host metadata: a model deeper than the user said, not pooled
        raise ValueError(
            f"batch fields `{ROLLOUT_EXPERTS}` / `{TRAINER_EXPERTS}` (or the router logits) have L = {n_layers} MoE "
            f"layers, more than num_layers = {num_layers}: set `num_layers` to the model's number of MoE layers "
            "(or leave it unset to key the layers seen)"
        )
    if top_k in view.requested(PAIR_SETS) and _uses_pair_sets(view, rollout, None):
        flips, negative, _ = _pair_statistics(view, top_k)
    else:
        flips, negative = top1_flips_and_negatives(rollout, trainer, view.cached(_negative_key(top_k)))
    view.shared(_negative_key(top_k), lambda: negative)  # for the set disagreement of the same ids
    per_layer = _valid_counts_per_layer(flips, mask)
    tokens = mask.sum().to(torch.float64)
    # Layers 0..num_layers-1 each get a bucket; the rest share bucket num_layers (fixed state size).
    bucket = torch.arange(n_layers, device=rollout.device).clamp(max=num_layers)
    layer_flips = torch.zeros(num_layers + 1, dtype=torch.float64, device=rollout.device)
    layer_pairs = torch.zeros_like(layer_flips)
    layer_flips.index_add_(0, bucket, per_layer)
    layer_pairs.index_add_(0, bucket, tokens.expand(n_layers))
    return {"layer_flips": layer_flips, "layer_pairs": layer_pairs,
            "negative_ids": (negative & mask).sum().to(torch.float64)}


def _flip_rate_compute(layer_flips: Tensor, layer_pairs: Tensor, negative_ids: Tensor | None = None
                       ) -> dict[str, Tensor]:
    """The flip-rate keys of the layers that saw a valid token in the window (one host read of the synced
    counts: a layer without data has no rate); the overflow key when layers beyond the capacity were seen.
    Raises when valid tokens held a negative expert id (``negative_ids``, one host read)."""
    if negative_ids is not None and bool(negative_ids > 0):
        raise ValueError(
            f"batch fields `{ROLLOUT_EXPERTS}` / `{TRAINER_EXPERTS}` held a negative expert id in {int(negative_ids)} "
            "valid tokens: expert ids are >= 0, and a placeholder such as -1 would count as a router flip. Set "
            "`response_mask` to 0 on tokens without routing data, or fill in their expert ids"
        )
    num_layers = layer_flips.shape[0] - 1
    rates = _safe_div(layer_flips, layer_pairs, 0.0)
    observed = layer_pairs > 0
    worst = torch.argmax(torch.where(observed, rates, torch.full_like(rates, -1.0)))  # first max on ties
    any_observed = observed.any()
    out = {
        FLIP_RATE_KEY: _safe_div(layer_flips.sum(), layer_pairs.sum(), 0.0),
        WORST_LAYER_KEY: torch.where(any_observed, worst.to(rates.dtype), torch.full_like(rates[0], -1.0)),
        WORST_LAYER_RATE_KEY: torch.where(any_observed, rates[worst], torch.zeros_like(rates[0])),
    }
    seen = observed.tolist()
    for i in range(num_layers):
        if seen[i]:
            out[layer_key(i)] = rates[i]
    if seen[num_layers]:
        out[LAYER_OVERFLOW_KEY] = rates[num_layers]
    return out


def _view_of(rollout: Tensor, trainer: Tensor, response_mask: Tensor | None) -> BatchView:
    """Put integer inputs in the expert-id fields and floating ones in the router-logit fields."""
    fields: dict[str, Tensor | None] = {RESPONSE_MASK: response_mask}
    for tensor, (ids_name, logits_name) in (
        (rollout, (ROLLOUT_EXPERTS, ROLLOUT_ROUTER_LOGITS)),
        (trainer, (TRAINER_EXPERTS, TRAINER_ROUTER_LOGITS)),
    ):
        is_logits = isinstance(tensor, Tensor) and tensor.is_floating_point()
        fields[logits_name if is_logits else ids_name] = tensor
    return BatchView(fields)


def router_flip_rate(
    rollout: Tensor,
    trainer: Tensor,
    response_mask: Tensor | None = None,
    *,
    num_layers: int | None = None,
    top_k: int | None = None,
) -> dict[str, Tensor]:
    r"""``moe/router/flip_rate``, the per-layer flip rates and the worst layer, for one batch.

    .. math:: \mathrm{flip\_rate} = \frac{\sum_{t, l} m_t\,[e^{roll}_{t,l,1} \ne e^{train}_{t,l,1}]}{L \sum_t m_t}

    Args:
        rollout: rollout expert ids ``[B, T, L, K]`` (integer) or router logits ``[B, T, L, E]`` (float).
        trainer: the trainer's, in either form.
        response_mask: ``[B, T]``; all ones when absent.
        num_layers: the model's number of MoE layers; ``L > num_layers`` raises a ``ValueError``
            (default: ``L``). A layer's key is there when the layer saw a valid token.
        top_k: K for router logits (required with logits).

    Example:
        >>> import torch
        >>> r = torch.tensor([[[[1, 2], [3, 4]], [[5, 6], [7, 0]]]])  # B=1, T=2, L=2, K=2
        >>> t = torch.tensor([[[[2, 1], [3, 4]], [[5, 6], [0, 7]]]])
        >>> out = router_flip_rate(r, t)
        >>> [out[k].item() for k in ("moe/router/flip_rate", "moe/router/layer_0/flip_rate",
        ...                          "moe/router/layer_1/flip_rate", "moe/router/worst_layer")]
        [0.5, 0.5, 0.5, 0.0]
        >>> router_flip_rate(r, t, torch.tensor([[0, 1]]))["moe/router/worst_layer"].item()
        1.0
    """
    view = _view_of(rollout, trainer, response_mask)
    top_k = check_top_k(top_k)
    configured = 0 if num_layers is None else check_count("num_layers", num_layers, optional=False)
    capacity = configured or router_inputs(view, top_k)[0].shape[2]
    stats = _flip_rate_update(view, capacity, top_k, configured=bool(configured))
    _require_tokens("router_flip_rate", stats["layer_pairs"].sum())
    return _flip_rate_compute(**stats)


def _require_tokens(function: str, count: Tensor) -> None:
    """The public functions' guard (:func:`~opbc_metrics.functional.statistics.require_data`) for a batch without
    a response token: its rates would be made-up zeros."""
    require_data(count, function, "response token",
                 "a batch with a token where `response_mask` is 1 (here `response_mask` is all 0, or the batch is "
                 "empty)")


# ---------------------------------------------------------------------------------------------
# moe/router/topk_disagreement_rate
# ---------------------------------------------------------------------------------------------
def _set_disagreement_update(
    view: BatchView, top_k: int | None = None, num_experts: int | None = None, compiled: bool = False
) -> Stats:
    rollout, trainer, mask = router_inputs(view, top_k)
    check_range = True
    if num_experts is None and not (view.has(ROLLOUT_EXPERTS) or view.has(TRAINER_EXPERTS)):
        # both sides are top-Ks of router logits: their ids are below the logits' width
        num_experts, check_range = max(view.field(name).shape[-1] for name in LOGIT_FIELDS), False
    bound = UNKNOWN_EXPERTS_BOUND if num_experts is None else num_experts  # as _set_differs_tokens
    if ((compiled or view.compiled) and rollout.device.type == "cpu" and rollout.shape[3] > _COLUMN_MAX_K
            and bound <= _OUTSIDE_LANE and rollout.numel() > 0):
        differs, outside_ = _compiled_set_differs(rollout, trainer, bound)
        outside = outside_ if check_range else None
    elif check_range and _uses_pair_sets(view, rollout, num_experts):
        _, outside, differs = _pair_statistics(view, top_k)
    else:
        differs, outside = _set_differs_tokens(rollout, trainer, num_experts, check_range,
                                               view.cached(_negative_key(top_k)))
    out_of_range = torch.zeros((), dtype=torch.float64, device=mask.device)
    if outside is not None:
        out_of_range = (outside & mask).sum().to(torch.float64)
    return {
        "disagreements": (differs & mask).sum().to(torch.float64),
        "tokens": mask.sum().to(torch.float64),
        "out_of_range": out_of_range,
    }


def _set_disagreement_compute(
    disagreements: Tensor, tokens: Tensor, out_of_range: Tensor | None = None, num_experts: int | None = None
) -> Tensor:
    """The rate; raises when valid tokens held expert ids outside ``[0, num_experts)`` (``[0, 2**15)`` without
    ``num_experts``) (one host read)."""
    if out_of_range is not None and bool(out_of_range > 0):
        if num_experts is None:
            raise ValueError(
                f"batch fields `{ROLLOUT_EXPERTS}` / `{TRAINER_EXPERTS}` held expert ids outside "
                f"[0, {UNKNOWN_EXPERTS_BOUND}) in {int(out_of_range)} valid tokens: without `num_experts` ids must "
                f"lie in [0, {UNKNOWN_EXPERTS_BOUND}); pass the model's number of experts as `num_experts`, and set "
                "`response_mask` to 0 on tokens without routing data (a -1 placeholder is no expert id)"
            )
        raise ValueError(
            f"batch fields `{ROLLOUT_EXPERTS}` / `{TRAINER_EXPERTS}` held expert ids out of range for "
            f"num_experts={num_experts} (outside [0, {num_experts})) in {int(out_of_range)} valid tokens: check that "
            "`num_experts` is the model's number of routed experts and that the ids are expert indices"
        )
    return _safe_div(disagreements, tokens, 0.0)


def router_topk_disagreement_rate(
    rollout: Tensor,
    trainer: Tensor,
    response_mask: Tensor | None = None,
    *,
    top_k: int | None = None,
    num_experts: int | None = None,
) -> Tensor:
    r"""``moe/router/topk_disagreement_rate``: share of valid tokens whose top-K set differs in some layer.

    .. math:: \frac{\sum_t m_t\,[\exists l: S^{roll}_{t,l} \ne S^{train}_{t,l}]}{\sum_t m_t}

    Args:
        rollout: rollout expert ids ``[B, T, L, K]`` (integer) or router logits ``[B, T, L, E]`` (float).
        trainer: the trainer's, in either form.
        response_mask: ``[B, T]``; all ones when absent.
        top_k: K for router logits (required with logits); cuts expert ids to their first ``top_k``.
        num_experts: the model's number of experts E, when known: the ids are compared in the narrowest
            dtype holding ``[0, E)`` (uint8 for E <= 256, cheaper than int16); an id outside ``[0, E)`` in a
            valid token raises. ``None``: K > 2 ids are compared as int16 and an id outside ``[0, 2**15)`` in a
            valid token raises; K <= 2 ids compare exactly, and a negative one in a valid token raises.

    Example:
        >>> import torch
        >>> r = torch.tensor([[[[1, 2], [3, 4]], [[5, 6], [7, 0]]]])
        >>> t = torch.tensor([[[[2, 1], [3, 4]], [[5, 6], [7, 1]]]])  # token 0: a swap; token 1: a new expert
        >>> router_topk_disagreement_rate(r, t)
        tensor(0.5000, dtype=torch.float64)
        >>> router_topk_disagreement_rate(r, t, num_experts=8)
        tensor(0.5000, dtype=torch.float64)
        >>> logits = torch.tensor([[[[0.0, 3.0, 2.0]]]])  # top-2 {1, 2}
        >>> router_topk_disagreement_rate(torch.tensor([[[[2, 1]]]]), logits, top_k=2)
        tensor(0., dtype=torch.float64)
    """
    view = _view_of(rollout, trainer, response_mask)
    num_experts = check_count("num_experts", num_experts)
    stats = _set_disagreement_update(view, check_top_k(top_k), num_experts)
    _require_tokens("router_topk_disagreement_rate", stats["tokens"])
    return _set_disagreement_compute(**stats, num_experts=num_experts)
