r"""Load balance (``global_seqlen/*``), timing (``timing_s/*``, ``timing_per_token_ms/*``) and
performance (``perf/*``): pure functions.

**Load balance.** A sequence's workload is its token count ``prompt_length + response_length`` (verl
sums the attention mask). ``global_seqlen/{min,max,mean}`` are the smallest, largest and mean total
workload of the ranks as the work was actually assigned, ``minmax_diff = max - min``;
``balanced_{min,max}`` are the smallest and largest totals after re-partitioning the same sequences over
the same ranks with the Karmarkar-Karp largest-differencing method (Karmarkar & Karp 1982; the k-way
generalisation used by verl's ``get_seqlen_balanced_partitions``), with equal sequence counts per rank
by default. LPT (longest processing time first, Graham 1969) is the alternative. Partitioning is a
host computation over integers: it runs in ``compute()``, never in ``update()``.

**FLOPs and MFU.** A transformer's forward pass costs about :math:`2 N_{active}` FLOPs per token
(one multiply-add per active matmul parameter: the dense weights, or for a mixture of experts the
attention, router, shared and the ``k`` routed experts' weights) plus the attention score and value
products, :math:`4 d_{attn} L \sum_i s_i^2` for sequences of length :math:`s_i` (full score matrix;
halve it for a causal count). Training costs three forward passes (forward + backward). MFU =
achieved FLOPs / (seconds x GPUs x peak FLOPs), with the peak from :data:`PEAK_FLOPS`.

**No made-up values.** :func:`seqlen_balance` of no sequence and :func:`mfu` of no measured time raise a
``ValueError`` (:func:`~opbc_metrics.functional.statistics.require_data`) rather than return 0; the metric
classes leave those keys out.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from opbc_metrics.functional.statistics import require_data

# ---------------------------------------------------------------------------------------------
# partitioning: Karmarkar-Karp and LPT
# ---------------------------------------------------------------------------------------------
PARTITION_ALGORITHMS = ("karmarkar_karp", "lpt")


def _check_partition_args(k: int, algorithm: str | None = None) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"the number of partitions must be a positive integer, got {k!r}")
    if algorithm is not None and algorithm not in PARTITION_ALGORITHMS:
        raise ValueError(f"`algorithm` must be one of {PARTITION_ALGORITHMS}, got {algorithm!r}")


def _padded(lengths: Sequence[float], k: int, equal_size: bool) -> list[tuple[float, int]]:
    """``(length, index)`` ascending; with ``equal_size``, zero-length fillers (index -1) make the count a
    multiple of ``k``."""
    items = sorted((float(v), i) for i, v in enumerate(lengths))
    if equal_size:
        items = [(0.0, -1)] * ((-len(items)) % k) + items
    return items


def karmarkar_karp(lengths: Sequence[float], k: int, equal_size: bool = True) -> list[list[int]]:
    r"""Partition item indices into ``k`` sets of near-equal total length (largest differencing method).

    Every item starts as a partial solution of ``k`` sets (with ``equal_size``: each run of ``k``
    consecutive items in sorted order forms one solution, one item per set, so all sets end with the
    same count; a count that ``k`` does not divide is padded with zero-length fillers). Repeatedly the
    two solutions with the largest spread (max set sum - min set sum; ties: the older first) are merged,
    pairing the largest set of one with the smallest of the other, until one solution is left.

    Example:
        >>> parts = karmarkar_karp([8, 7, 6, 5, 4, 3], 2)
        >>> sorted(sum([8, 7, 6, 5, 4, 3][i] for i in p) for p in parts)
        [16, 17]
        >>> karmarkar_karp([5, 5, 4, 3, 3], 2, equal_size=False)  # a heuristic: 11 / 9 where 10 / 10 exists
        [[1, 3, 4], [0, 2]]
    """
    _check_partition_args(k)
    counter = itertools.count()
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []

    def push(sets: list[tuple[float, list[int]]]) -> None:
        sets.sort(key=lambda s: -s[0])  # stable: equal sums keep their order
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), next(counter), sets))

    items = _padded(lengths, k, equal_size)
    if equal_size:
        for off in range(0, len(items), k):
            push([(v, [i]) for v, i in items[off : off + k]])
    else:
        for v, i in items:
            push([(v, [i])] + [(0.0, []) for _ in range(k - 1)])
    while len(heap) > 1:
        a = heapq.heappop(heap)[2]
        b = heapq.heappop(heap)[2]
        merged = []
        for j in range(k):
            (sa, ia), (sb, ib) = a[j], b[k - 1 - j]
            big, small = (ia, ib) if len(ia) >= len(ib) else (ib, ia)
            big.extend(small)
            merged.append((sa + sb, big))
        push(merged)
    if not heap:
        return [[] for _ in range(k)]
    return [sorted(i for i in idx if i >= 0) for _, idx in heap[0][2]]


def lpt_partition(lengths: Sequence[float], k: int, equal_size: bool = True) -> list[list[int]]:
    """Longest processing time first: items in decreasing length, each to the lightest set (ties: the
    lowest set index); with ``equal_size`` a set stops taking items at ``ceil(n / k)``.

    Example:
        >>> lpt_partition([8, 7, 6, 5, 4, 3], 2)
        [[0, 3, 4], [1, 2, 5]]
    """
    _check_partition_args(k)
    n = len(lengths)
    cap = math.ceil(n / k) if equal_size else n
    heap = [(0.0, j) for j in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(n), key=lambda i: (-float(lengths[i]), i)):
        skipped = []
        while True:
            load, j = heapq.heappop(heap)
            if len(parts[j]) < cap:
                break
            skipped.append((load, j))
        parts[j].append(i)
        heapq.heappush(heap, (load + float(lengths[i]), j))
        for s in skipped:
            heapq.heappush(heap, s)
    return [sorted(p) for p in parts]


def partition(lengths: Sequence[float], k: int, algorithm: str = "karmarkar_karp",
              equal_size: bool = True) -> list[list[int]]:
    """Indices of each of ``k`` balanced partitions, by ``algorithm`` (``"karmarkar_karp"`` or ``"lpt"``).

    Example:
        >>> partition([1, 2, 3, 4], 2, algorithm="lpt")
        [[0, 3], [1, 2]]
    """
    _check_partition_args(k, algorithm)
    fn = karmarkar_karp if algorithm == "karmarkar_karp" else lpt_partition
    return fn(lengths, k, equal_size)


def partition_loads(lengths: Sequence[float], k: int, algorithm: str = "karmarkar_karp",
                    equal_size: bool = True) -> list[float]:
    """Total length of each balanced partition.

    Example:
        >>> partition_loads([8, 7, 6, 5, 4, 3], 3)
        [11.0, 11.0, 11.0]
    """
    return [float(sum(float(lengths[i]) for i in p)) for p in partition(lengths, k, algorithm, equal_size)]


SEQLEN_KEYS = ("global_seqlen/min", "global_seqlen/max", "global_seqlen/minmax_diff", "global_seqlen/balanced_min",
               "global_seqlen/balanced_max", "global_seqlen/mean")


def seqlen_balance_from_loads(rank_loads: Sequence[float], balanced: Sequence[float]) -> dict[str, float]:
    """The six ``global_seqlen/*`` values from the actual per-rank loads and the balanced loads."""
    lo, hi = min(rank_loads), max(rank_loads)
    values = (lo, hi, hi - lo, min(balanced), max(balanced), float(sum(rank_loads)) / len(rank_loads))
    return {key: float(v) for key, v in zip(SEQLEN_KEYS, values, strict=True)}


def seqlen_balance(seqlens: Sequence[float], num_ranks: int, rank_ids: Sequence[int] | None = None,
                   algorithm: str = "karmarkar_karp", equal_size: bool = True) -> dict[str, float]:
    """``global_seqlen/*`` for one step, from every sequence's token count (host data).

    ``rank_ids`` gives the rank each sequence was assigned to; without it the sequences are dealt to
    ranks in contiguous near-equal chunks (sequence ``i`` to rank ``i * num_ranks // N``), verl's
    default dispatch. No sequence (an empty ``seqlens``): a ``ValueError``.

    Example:
        >>> out = seqlen_balance([900, 800, 100, 200, 300, 300], num_ranks=2)
        >>> [out[k] for k in ("global_seqlen/min", "global_seqlen/max", "global_seqlen/minmax_diff")]
        [800.0, 1800.0, 1000.0]
        >>> [out[k] for k in ("global_seqlen/balanced_min", "global_seqlen/balanced_max", "global_seqlen/mean")]
        [1300.0, 1300.0, 1300.0]
        >>> seqlen_balance([], num_ranks=2)
        Traceback (most recent call last):
        ...
        ValueError: seqlen_balance(): no sequence in the batch, so there is no value to return (a number would be ...
    """
    _check_partition_args(num_ranks, algorithm)
    n = len(seqlens)
    require_data(n, "seqlen_balance", "sequence", "at least one token count in `seqlens`")
    if any(float(v) < 0 or not math.isfinite(float(v)) for v in seqlens):
        raise ValueError("`seqlens` must be finite and non-negative")
    if rank_ids is None:
        rank_ids = [i * num_ranks // n for i in range(n)] if n else []
    if len(rank_ids) != n:
        raise ValueError(f"`rank_ids` has {len(rank_ids)} entries but `seqlens` has {n}")
    loads = [0.0] * num_ranks
    for r, v in zip(rank_ids, seqlens):
        if not 0 <= int(r) < num_ranks:
            raise ValueError(f"`rank_ids` entries must be in [0, {num_ranks}), got {r}")
        loads[int(r)] += float(v)
    return seqlen_balance_from_loads(loads, partition_loads(seqlens, num_ranks, algorithm, equal_size))


# ---------------------------------------------------------------------------------------------
# FLOPs, peak FLOPs, MFU
# ---------------------------------------------------------------------------------------------
# Dense (no 2:4 sparsity) bf16 peak FLOP/s per device (H100: the SXM part), from the vendors' data sheets. Matched
# case-insensitively against the device name, longest entry first ("GH200" before "H200" before "H20").
PEAK_FLOPS: dict[str, float] = {
    "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H800": 989e12, "H200": 989e12, "GH200": 989e12,
    "H20": 148e12, "A100": 312e12, "A800": 312e12, "A40": 149.7e12,
    "L40S": 362.05e12, "L40": 181.05e12, "L20": 119.5e12, "L4": 121e12,
    "B100": 1.75e15, "B200": 2.25e15, "GB200": 2.5e15,
    "MI250X": 383e12, "MI300X": 1307.4e12, "MI325X": 1307.4e12, "MI355X": 2.5e15,
    "TPU v4": 275e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
    "RTX 4090": 165.2e12,
}


def _norm(name: str) -> str:
    return "".join(ch for ch in name.upper() if ch.isalnum())


def peak_flops(accelerator: str, table: dict[str, float] | None = None) -> float:
    """Dense bf16 peak FLOP/s of an accelerator named like ``torch.cuda.get_device_name()`` returns.

    Example:
        >>> peak_flops("NVIDIA H100 80GB HBM3"), peak_flops("NVIDIA GH200 480GB"), peak_flops("AMD Instinct MI300X")
        (989000000000000.0, 989000000000000.0, 1307400000000000.0)
    """
    table = PEAK_FLOPS if table is None else table
    target = _norm(accelerator)
    for key in sorted(table, key=lambda k: -len(_norm(k))):
        if _norm(key) in target:
            return float(table[key])
    raise ValueError(
        f"no peak-FLOPs entry matches accelerator {accelerator!r}; pass `peak_flops=` (FLOP/s per device) "
        f"or one of {sorted(table)}"
    )


def detect_accelerator() -> str:
    """The current CUDA/ROCm device's name; a ``ValueError`` when there is none."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    raise ValueError("no accelerator found to read the peak FLOPs from; pass `accelerator=` or `peak_flops=`")


@dataclass(frozen=True)
class TransformerFlops:
    r"""FLOPs of a decoder-only transformer: :math:`2 N_{active}` per token plus attention.

    Args:
        active_params: matmul parameters each token goes through (a dense model: all linear weights
            including the LM head; a mixture of experts: attention, router, shared experts and the
            ``k`` routed experts). :meth:`from_config` counts them from the architecture.
        num_layers: transformer layers.
        attention_dim: query width, ``num_heads * head_dim``.
        causal: count only the causal half of the score matrix (default False: the full matrix, as
            verl's counter and most MFU reports do).

    Example:
        >>> f = TransformerFlops(active_params=1e9, num_layers=2, attention_dim=64)
        >>> f.forward_flops(tokens=10, sum_sq_seqlen=50)  # 2e9*10 + 4*64*2*50
        20000025600.0
        >>> f.flops(tokens=10, sum_sq_seqlen=50, mode="train") == 3 * f.forward_flops(10, 50)
        True
    """

    active_params: float
    num_layers: int
    attention_dim: int
    causal: bool = False

    def __post_init__(self) -> None:
        if not self.active_params > 0 or not self.num_layers > 0 or not self.attention_dim > 0:
            raise ValueError("`active_params`, `num_layers` and `attention_dim` must be positive")

    def forward_flops(self, tokens: float, sum_sq_seqlen: float) -> float:
        """Forward FLOPs for ``tokens`` tokens in sequences whose squared lengths sum to ``sum_sq_seqlen``."""
        attn = 4.0 * self.attention_dim * self.num_layers * sum_sq_seqlen * (0.5 if self.causal else 1.0)
        return 2.0 * self.active_params * tokens + attn

    def flops(self, tokens: float, sum_sq_seqlen: float, mode: str | float = "train") -> float:
        """``mode``: ``"train"`` (3 forward passes: forward + backward), ``"forward"`` (1), or a multiple."""
        return flops_multiplier(mode) * self.forward_flops(tokens, sum_sq_seqlen)

    @classmethod
    def from_config(cls, *, hidden_size: int, num_layers: int, num_heads: int, vocab_size: int,
                    intermediate_size: int = 0, num_kv_heads: int | None = None, head_dim: int | None = None,
                    num_experts: int = 0, experts_per_token: int = 0, moe_intermediate_size: int | None = None,
                    shared_experts: int = 0, mlp_matrices: int = 3, count_embedding: bool = False,
                    causal: bool = False) -> TransformerFlops:
        """Count active matmul parameters from a Llama/Qwen-style config (GQA attention, gated MLP).

        Per layer: attention ``hidden * (2 q + 2 kv)`` with ``q = heads * head_dim``,
        ``kv = kv_heads * head_dim``; MLP ``mlp_matrices * hidden * intermediate`` (3 for SwiGLU), or for
        a mixture of experts ``mlp_matrices * hidden * moe_intermediate * (experts_per_token +
        shared_experts) + hidden * num_experts`` (router). Plus the LM head ``vocab * hidden``; the
        embedding lookup does no matmul and is left out unless ``count_embedding`` (verl counts it).

        Example:
            >>> f = TransformerFlops.from_config(hidden_size=8, num_layers=2, num_heads=2, vocab_size=10,
            ...                                  intermediate_size=16)
            >>> f.active_params  # 2 * (8*(8+8+8+8) + 3*8*16) + 10*8
            1360.0
        """
        head_dim = head_dim or hidden_size // num_heads
        num_kv_heads = num_kv_heads or num_heads
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        attn = hidden_size * (2 * q + 2 * kv)
        if num_experts:
            if not 0 < experts_per_token <= num_experts:
                raise ValueError("`experts_per_token` must be in [1, num_experts] for a mixture of experts")
            inter = moe_intermediate_size or intermediate_size
            mlp = mlp_matrices * hidden_size * inter * (experts_per_token + shared_experts) + hidden_size * num_experts
        else:
            mlp = mlp_matrices * hidden_size * intermediate_size
        head = vocab_size * hidden_size * (2 if count_embedding else 1)
        active = float(num_layers * (attn + mlp) + head)
        return cls(active_params=active, num_layers=num_layers, attention_dim=q, causal=causal)


def flops_multiplier(mode: str | float) -> float:
    """Forward passes a stage costs: ``"train"`` = 3 (forward + backward), ``"forward"`` = 1, or a number."""
    if mode == "train":
        return 3.0
    if mode == "forward":
        return 1.0
    if isinstance(mode, (int, float)) and not isinstance(mode, bool) and mode > 0:
        return float(mode)
    raise ValueError(f"a FLOPs mode must be 'train', 'forward' or a positive multiple of a forward pass, got {mode!r}")


def mfu(flops: float, seconds: float, num_gpus: int, peak: float) -> float:
    """Model FLOPs utilisation ``flops / (seconds * num_gpus * peak)``; a ``ValueError`` when no time was measured
    (``seconds`` not above 0).

    Example:
        >>> mfu(flops=4.5e15, seconds=10.0, num_gpus=1, peak=989e12) < 1
        True
        >>> mfu(flops=4.5e15, seconds=0.0, num_gpus=1, peak=989e12)
        Traceback (most recent call last):
        ...
        ValueError: mfu(): no measured time in the batch, so there is no value to return (a number would be made ...
    """
    require_data(float(seconds > 0), "mfu", "measured time", "the `seconds` the FLOPs took, above 0")
    return flops / (seconds * num_gpus * peak)


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
# verl's stage names (ray_trainer's timing_raw); "step" is the whole step.
DEFAULT_STAGES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor",
                  "update_weights", "step")
# Stages that get timing_per_token_ms/*; "gen" is normalised by response tokens, the others by all.
DEFAULT_PER_TOKEN_STAGES = ("gen", "ref", "values", "adv", "update_critic", "update_actor")
DEFAULT_RESPONSE_TOKEN_STAGES = ("gen",)


def slowest_rank_per_step(time: Tensor, steps: Tensor) -> Tensor:
    """``[S]``: over ranks, the largest mean seconds per step (``time`` ``[W, S]``; ``steps`` ``[W]``, or
    ``[W, S]``: the steps that timed each stage).

    Ranks that recorded no step (of a stage) are ignored; 0 when none did (the metrics leave such a stage out).

    Example:
        >>> import torch
        >>> slowest_rank_per_step(torch.tensor([[4.0, 1.0], [3.0, 3.0]]), torch.tensor([2.0, 1.0]))
        tensor([3., 3.])
        >>> slowest_rank_per_step(torch.tensor([[4.0, 1.0], [3.0, 0.0]]), torch.tensor([[2.0, 1.0], [1.0, 0.0]]))
        tensor([3., 1.])
    """
    steps = steps[:, None].expand_as(time) if steps.ndim == 1 else steps
    per_step = time / steps.clamp_min(1.0)
    per_step = torch.where(steps > 0, per_step, torch.zeros_like(per_step))
    return per_step.amax(dim=0) if per_step.shape[0] else torch.zeros(time.shape[1:], dtype=time.dtype)
