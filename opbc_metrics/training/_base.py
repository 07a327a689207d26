"""Shared machinery of the training-section metrics: the base class, deferred value checks, trainer
scalars, and per-rank slots."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from opbc_metrics.batch import BatchView, check_count
from opbc_metrics.functional.statistics import raise_if_invalid
from opbc_metrics.functional.training import LOSS_TOKENS, _scalar_compute, _scalar_update
from opbc_metrics.metric import MAX, MIN, SUM, GlossaryEntry, OPBCMetric, table

DIAGNOSTIC = "none (diagnostic)"
NO_ACTION = "no OPBC action; a dashboard signal for the operator"

# Capacity of per-rank states when the world size is unknown at construction (e.g. a Lightning module
# built before the process group): one slot per rank, summed across ranks at sync.
DEFAULT_MAX_RANKS = 1024


def diagnostic(name: str, *, what: str, unit: str, aliases: tuple[str, ...] = ()) -> GlossaryEntry:
    """The glossary entry of a training metric: a diagnostic, no OPBC cap or action."""
    return GlossaryEntry(name=name, what=what, unit=unit, cap=DIAGNOSTIC, action=NO_ACTION, aliases=aliases)


class _TrainingMetric(OPBCMetric):
    """Base of the ``training`` section: optional inputs (a collection skips batches without the fields),
    deferred value checks, and the update and compute from a functional kernel pair.

    ``_deferred``: ``(state, field or fields, what)`` triples that every ``compute`` raises first when the
    count is not zero (a count shared by several fields names them all). ``kernel = (_x_update,
    _x_compute)``: ``statistics`` is ``_x_update(view, *settings named by update_args)``, ``compute`` is
    ``_x_compute(*settings named by compute_args, **states but the deferred counts)``. Host-built statistics
    move to the states' device in :meth:`~opbc_metrics.metric.OPBCMetric.accumulate`."""

    optional_inputs = True
    _deferred: ClassVar[tuple[tuple[str, str | tuple[str, ...], str], ...]] = ()
    kernel: ClassVar[tuple[Callable[..., Any], Callable[..., Any]]]
    update_args: ClassVar[tuple[str, ...]] = ()
    compute_args: ClassVar[tuple[str, ...]] = ()

    @property
    def field(self) -> str:
        """The batch field the metric is about (the first required one)."""
        return self.required_fields[0]

    def _wrap_compute(self, compute: Callable) -> Callable:
        # Every compute (on synced states, once the window is known to hold data) first raises the ValueError
        # of any bad value update() counted: reading the counts is a host sync, so it waits for compute.
        def checked(*args: Any, **kwargs: Any) -> Any:
            if self._deferred:  # every count in one host read; the raising one is read again to be named
                counts = torch.stack([getattr(self, state).sum().to(torch.float64) for state, _, _ in self._deferred])
                for (state, field, what), n in zip(self._deferred, counts.tolist(), strict=True):
                    if n:
                        raise_if_invalid(field, getattr(self, state), what)
            return compute(*args, **kwargs)

        return super()._wrap_compute(checked)

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        return self.kernel[0](view, *(getattr(self, name) for name in self.update_args))

    def compute(self) -> Any:
        counts = tuple(state for state, _, _ in self._deferred)
        return self.kernel[1](*(getattr(self, name) for name in self.compute_args), **self.state_values(exclude=counts))


class _TurnCounts(_TrainingMetric):
    """Min, max and mean of a per-sample count (the ``field`` class keyword) with negative / non-finite entries
    counted (``invalid``)."""

    states = table(sum=SUM, max=MAX, min=MIN, count=SUM, invalid=SUM)

    def __init_subclass__(cls, field: str, **kwargs: Any) -> None:
        cls.required_fields = (field,)
        cls._deferred = (("invalid", field, "negative or non-finite turn counts"),)
        super().__init_subclass__(**kwargs)


class _TrainerScalar(_TrainingMetric):
    """A scalar the trainer already has (loss, grad norm, learning rate), averaged over the window.

    The batch field (``required_fields[0]``) is a number, a 0-d tensor, or a list / 1-D tensor of several
    observations (e.g. one per micro-batch). Loss-like scalars (``weight_field = "loss_tokens"``) are
    weighted by the batch's ``loss_tokens`` when it is given (the tokens the loss was averaged over),
    so the result is the token mean of a token-mean loss across micro-batches and ranks; otherwise
    every observation weighs the same. No observation in the window, or only observations of weight 0: no key
    (a mean over no token would be made up). Host values (numbers, lists) must be
    finite (a ``ValueError`` in ``update``); non-finite tensor observations (or non-finite / negative
    tensor weights) are left out and counted, and ``compute()`` raises a ``ValueError`` naming the field.
    """

    weight_field: ClassVar[str | None] = None
    states = table("sum_wx", "sum_w", "count", "nonfinite")
    # Data is a positive weight (observations whose `loss_tokens` are all 0 have no mean: no key, not 0), or a
    # counted bad value (so compute raises it).
    data_counts = ("sum_w", "nonfinite")
    kernel = (_scalar_update, _scalar_compute)
    update_args = ("field", "weight_field", "device")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        fields = cls.required_fields + ((cls.weight_field,) if cls.weight_field else ())
        cls._deferred = (("nonfinite", fields, "non-finite observations (or non-finite / negative weights)"),)


@dataclass(frozen=True)
class Scalar:
    """One trainer scalar of :func:`trainer_scalars`: the class name, its key and batch field, whether
    ``loss_tokens`` weights it, its docstring (``doc``, then ``note``, then an example of ``updates``, the
    keyword arguments of each ``update`` call, printing ``result``) and its glossary text."""

    name: str
    key: str
    field: str
    doc: str
    updates: tuple[str, ...]
    result: str
    what: str
    unit: str
    weighted: bool = False
    higher_is_better: bool | None = None
    note: str = ""
    aliases: tuple[str, ...] = ()


def trainer_scalars(module: str, *rows: Scalar) -> tuple[type[_TrainerScalar], ...]:
    """One :class:`_TrainerScalar` subclass per row, defined in ``module`` (to import from there)."""
    classes = []
    for row in rows:
        how = "token-weighted by ``loss_tokens`` when given" if row.weighted else "mean over observations"
        example = "".join(f"\n        >>> metric.update({u})" for u in row.updates)
        note = f"    {row.note}\n\n" if row.note else ""
        doc = (f"{row.doc} ``{row.key}`` (batch field ``{row.field}``; {how}).\n\n{note}"
               f"    Example:\n        >>> metric = {row.name}(){example}\n        >>> metric.compute()\n"
               f"        {row.result}\n    ")
        attrs = {"__module__": module, "__qualname__": row.name, "__doc__": doc, "keys": (row.key,),
                 "required_fields": (row.field,), "weight_field": LOSS_TOKENS if row.weighted else None,
                 "higher_is_better": row.higher_is_better,
                 "glossary": diagnostic(row.key, what=row.what, unit=row.unit, aliases=row.aliases)}
        classes.append(type(row.name, (_TrainerScalar,), attrs))
    return tuple(classes)


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
        world_size = check_count("world_size", world_size)
        if world_size is None and dist.is_available() and dist.is_initialized():
            world_size = dist_rank_world(self.process_group)[1]
        self.world_size = world_size
        self.slots = world_size or DEFAULT_MAX_RANKS

    def current_rank(self) -> int:
        rank = dist_rank_world(self.process_group)[0]
        if rank >= self.slots:
            raise ValueError(f"rank {rank} has no slot: this metric holds {self.slots} ranks; pass world_size= or "
                             "build it after init_process_group")
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
