"""Packed distributed sync: a constant number of collectives for any number of metrics.

torchmetrics syncs state by state (an ``all_gather`` of the shapes and one of the data for each
state), so a collection of twenty metrics pays dozens of collectives. Every state in this library is
a fixed-size sufficient statistic reduced by sum, max or min, so the states of all metrics can be
flattened into one buffer per (reduction, dtype, device) and reduced with one ``all_reduce`` each:
at most three collectives for the whole collection, and the exact global statistics on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_max, dim_zero_min, dim_zero_sum

_OPS = {dim_zero_sum: "sum", dim_zero_max: "max", dim_zero_min: "min"}
_DIST_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class SyncError(RuntimeError):
    """A collective of the packed sync failed (a rank died, timed out, or never called compute)."""


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

    Every rank must pass the same metrics in the same order (true by construction: the states
    have fixed shapes that do not depend on the data). Returns the number of collectives issued.
    """
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
    return len(buckets)
