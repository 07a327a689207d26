"""Shared machinery of the training-section metrics: the base class, deferred value checks, trainer
scalars, and per-rank slots."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from opbc_metrics.batch import BatchView
from opbc_metrics.functional import training as F
from opbc_metrics.functional.statistics import raise_if_invalid
from opbc_metrics.metric import MAX, MIN, SUM, OPBCMetric, table

DIAGNOSTIC = "none (diagnostic)"
NO_ACTION = "no OPBC action; a dashboard signal for the operator"

# Capacity of per-rank states when the world size is unknown at construction (e.g. a Lightning module
# built before the process group): one slot per rank, summed across ranks at sync.
DEFAULT_MAX_RANKS = 1024


class _TrainingMetric(OPBCMetric):
    """Base of the ``training`` section: optional inputs (a collection skips batches without the fields)
    and deferred value checks (``_deferred``: ``(state, field or fields, what)`` triples raised by ``compute``;
    a count shared by several fields names them all). Host-built statistics move to the states' device in
    :meth:`~opbc_metrics.metric.OPBCMetric.accumulate`."""

    optional_inputs = True
    _deferred: ClassVar[tuple[tuple[str, str | tuple[str, ...], str], ...]] = ()

    def check_deferred(self) -> None:
        """Raise the ``ValueError`` of any bad value counted by ``update()`` (reads the counts: compute only)."""
        for state, field, what in self._deferred:
            raise_if_invalid(field, getattr(self, state), what)


class _TurnCounts(_TrainingMetric):
    """Min, max and mean of a per-sample count with negative / non-finite entries counted (``invalid``)."""

    states = table(sum=SUM, max=MAX, min=MIN, count=SUM, invalid=SUM)


class _TrainerScalar(_TrainingMetric):
    """A scalar the trainer already has (loss, grad norm, learning rate), averaged over the window.

    The batch field (``required_fields[0]``) is a number, a 0-d tensor, or a list / 1-D tensor of several
    observations (e.g. one per micro-batch). Loss-like scalars (``weight_field = "loss_tokens"``) are
    weighted by the batch's ``loss_tokens`` when it is given (the tokens the loss was averaged over),
    so the result is the token mean of a token-mean loss across micro-batches and ranks; otherwise
    every observation weighs the same. No observation in the window: no key. Host values (numbers, lists) must be
    finite (a ``ValueError`` in ``update``); non-finite tensor observations (or non-finite / negative
    tensor weights) are left out and counted, and ``compute()`` raises a ``ValueError`` naming the field.
    """

    weight_field: ClassVar[str | None] = None
    states = table("sum_wx", "sum_w", "count", "nonfinite")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        fields = cls.required_fields + ((cls.weight_field,) if cls.weight_field else ())
        cls._deferred = (("nonfinite", fields, "non-finite observations (or non-finite / negative weights)"),)

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        return F._scalar_update(view, self.required_fields[0], self.weight_field, self.device)

    def compute(self) -> Tensor:
        self.check_deferred()
        return F._scalar_compute(**self.state_values(exclude=("nonfinite",)))


def dist_rank_world(group: Any = None) -> tuple[int, int]:
    """``(rank, world size)`` in ``group`` (the default group); ``(0, 1)`` without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


class _PerRank(_TrainingMetric):
    """A metric with states holding one slot per rank (each rank writes its own slot; sync sums them).

    ``world_size``: the number of ranks (slots). By default it is read from torch.distributed at
    construction; when the process group does not exist yet, :data:`DEFAULT_MAX_RANKS` slots are kept
    and the actual world size is read at ``compute()``.
    """

    def __init__(self, world_size: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if world_size is not None and (not isinstance(world_size, int) or isinstance(world_size, bool)
                                       or world_size < 1):
            raise ValueError(f"`world_size` must be a positive integer, got {world_size!r}")
        if world_size is None and dist.is_available() and dist.is_initialized():
            world_size = dist_rank_world(self.process_group)[1]
        self.world_size = world_size
        self.slots = world_size or DEFAULT_MAX_RANKS

    def current_rank(self) -> int:
        rank = dist_rank_world(self.process_group)[0]
        if rank >= self.slots:
            raise ValueError(
                f"rank {rank} has no slot: this metric holds {self.slots} ranks; pass world_size= or build it "
                "after init_process_group"
            )
        return rank

    def resolved_world_size(self, used: Tensor) -> int:
        """Ranks to report over: ``world_size``, else the process group's size at compute time, at least
        one past the last slot that received data (``used``: ``[slots]`` bool)."""
        w = self.world_size or dist_rank_world(self.process_group)[1]
        nz = torch.nonzero(used).flatten()
        last = int(nz[-1]) + 1 if nz.numel() else 1
        return max(w, last)

    def one_hot_row(self, rank: int, row: Tensor) -> Tensor:
        """``[slots, *row.shape]`` zeros with ``row`` at ``rank``."""
        out = torch.zeros((self.slots, *row.shape), dtype=row.dtype, device=row.device)
        out[rank] = row
        return out
