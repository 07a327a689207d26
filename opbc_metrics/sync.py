"""Packed distributed sync: a constant number of collectives for any number of metrics.

torchmetrics syncs state by state (an ``all_gather`` of the shapes and one of the data for each
state), so a collection of twenty metrics pays dozens of collectives. Every state in this library is
a fixed-size sufficient statistic reduced by sum, max or min, so the states of all metrics can be
flattened into one buffer per (reduction, dtype, device) and reduced with one ``all_reduce`` each:
at most three collectives for the whole collection, and the exact global statistics on every rank.

A collection syncs all its members this way before they compute (:func:`packed_sync`), then gives them
back their local states (:func:`restore_local_states`).

Before them, one more fixed-size collective compares a fingerprint of the metrics' configuration and
state layout across ranks (an ``all_reduce`` max of ``(h, -h)``): ranks built differently (other
sections, ``num_layers``, ``clamp``, ...) all raise the same :class:`RankMismatchError` instead of
aborting inside the backend on mismatched buffers or silently mixing statistics.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_max, dim_zero_min, dim_zero_sum
from torchmetrics.utilities.distributed import gather_all_tensors

_OPS = {dim_zero_sum: "sum", dim_zero_max: "max", dim_zero_min: "min"}
_DIST_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class SyncError(RuntimeError):
    """A collective of the packed sync failed (a rank died, timed out, or never called compute)."""


class RankMismatchError(ValueError):
    """The ranks hold metrics with different configurations or state layouts; nothing was reduced."""


# torchmetrics has no public view of a state's reduction: ``_reductions`` (state name -> reduce function,
# filled by ``add_state``) is read here and in packable / all_reduce_states / layout_fingerprint.
def reduce_kind(metric: Metric, name: str) -> str | None:
    """``'sum'``, ``'max'`` or ``'min'`` for a packable state, ``None`` for anything else."""
    fx = metric._reductions[name]
    value = getattr(metric, name)
    if isinstance(value, Tensor) and fx in _OPS:
        return _OPS[fx]
    return None


def packable(metric: Metric) -> bool:
    """Whether every state of ``metric`` is a tensor reduced by sum, max or min."""
    return all(reduce_kind(metric, name) is not None for name in metric._reductions)


def all_reduce_states(metrics: Iterable[Metric], group: Any = None) -> int:
    """All-reduce the states of ``metrics`` in place, one collective per (reduction, dtype, device).

    Every rank must pass the same metrics in the same order, configured alike (the states have fixed
    shapes that do not depend on the data); a first collective checks it, and a mismatch raises
    :class:`RankMismatchError` on every rank before any state changes. Returns the number of
    collectives issued.
    """
    metrics = list(metrics)
    buckets: dict[tuple[str, torch.dtype, torch.device], list[tuple[Metric, str, Tensor]]] = {}
    for metric in metrics:
        for name in metric._reductions:
            kind = reduce_kind(metric, name)
            if kind is None:
                raise TypeError(
                    f"{type(metric).__name__}.{name} is not a sum/max/min tensor state and cannot be packed"
                )
            value = getattr(metric, name)
            buckets.setdefault((kind, value.dtype, value.device), []).append((metric, name, value))
    if not buckets:
        return 0
    device = next(iter(buckets))[2]
    _check_same_layout(metrics, device, group)
    for (kind, _, _), entries in sorted(buckets.items(), key=lambda kv: (kv[0][0], str(kv[0][1]), str(kv[0][2]))):
        flat = torch.cat([value.reshape(-1) for _, _, value in entries])
        try:
            dist.all_reduce(flat, op=_DIST_OPS[kind], group=group)
        except (RuntimeError, ValueError) as err:  # DistBackendError and gloo timeouts are RuntimeErrors
            raise SyncError(
                f"opbc-metrics: the {kind}-reduce of {len(entries)} metric states failed; a rank probably "
                f"died or never reached compute() (the process group's timeout bounds the wait): {err}"
            ) from err
        offset = 0
        for metric, name, value in entries:
            n = value.numel()
            setattr(metric, name, flat[offset : offset + n].view_as(value).clone())
            offset += n
    return len(buckets) + 1


def layout_fingerprint(metrics: Iterable[Metric]) -> int:
    """A 62-bit hash of the metrics' classes, configurations and state layouts, in order."""
    digest = hashlib.sha256()
    for metric in metrics:
        config = getattr(metric, "fingerprint", None)
        if callable(config):
            digest.update(config().encode())
        else:
            layout = [(name, tuple(getattr(metric, name).shape)) for name in metric._reductions]
            digest.update(repr((type(metric).__qualname__, layout)).encode())
        digest.update(b"|")
    return int.from_bytes(digest.digest()[:8], "little") & ((1 << 62) - 1)


def _check_same_layout(metrics: list[Metric], device: torch.device, group: Any) -> None:
    own = layout_fingerprint(metrics)
    both = torch.tensor([own, -own], dtype=torch.int64, device=device)
    try:
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    except (RuntimeError, ValueError) as err:
        raise SyncError(
            f"opbc-metrics: the configuration check before the sync failed; a rank probably died or never "
            f"reached compute(): {err}"
        ) from err
    hi, lo = int(both[0]), -int(both[1])
    if hi != own or lo != own:
        raise RankMismatchError(
            f"opbc-metrics: the ranks hold differently configured metrics (configuration fingerprints range "
            f"from {lo:x} to {hi:x}); nothing was synced. "
            "Build the same collection on every rank: same sections, section_options (num_layers, capacity, "
            "...), clamp, veto and top_mass_bins"
        )


# -- torchmetrics' sync context, for a whole collection at once ---------------------------------------
# torchmetrics syncs a metric inside its compute() (sync_context: cache the local states, gather, compute,
# restore) one state at a time. A collection reduces all its members with one packed all_reduce first and
# then lets each member compute; these two functions do what torchmetrics' sync()/unsync() would, on its
# private flags: ``_to_sync`` (whether compute() syncs), ``_is_synced`` and ``_cache`` (the local states
# that unsync() puts back). They are the only writes of torchmetrics privates in this library, tested
# against the lowest and the newest torchmetrics that pyproject.toml allows (make test-torchmetrics-range).
def distributed(m: Metric) -> bool:
    """Whether torchmetrics would sync ``m``'s states in its compute: its ``distributed_available_fn`` says so."""
    available = m.distributed_available_fn
    return bool(callable(available) and available())


def packed_sync(metrics: Iterable[Metric]) -> list[Metric]:
    """Sync the states of every metric that would sync in its own compute(), with one packed all_reduce.

    Returns the metrics synced (none outside torch.distributed, or with a custom ``dist_sync_fn``, which
    keep torchmetrics' own per-state path); give them to :func:`restore_local_states` after computing.
    """
    candidates = [
        m for m in metrics if m._to_sync and m.dist_sync_fn in (None, gather_all_tensors) and not m._is_synced
    ]
    # Outside torch.distributed (the common case) only the first packable candidate is inspected.
    first = next((m for m in candidates if packable(m)), None)
    if first is None or not distributed(first):
        return []
    to_pack = [m for m in candidates if packable(m)]
    for m in to_pack:
        m._cache = m._copy_state_dict()
    all_reduce_states(to_pack, group=to_pack[0].process_group)
    for m in to_pack:
        m._is_synced = True
        m._to_sync = False  # already synced: the member's own compute must not sync again
    return to_pack


def restore_local_states(synced: Iterable[Metric]) -> None:
    """Undo :func:`packed_sync`: each metric gets its local (unsynced) states back and syncs on compute again."""
    for m in synced:
        m._to_sync = m.sync_on_compute
        if m._is_synced:
            m.unsync()
