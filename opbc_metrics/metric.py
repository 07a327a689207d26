"""The base class of every metric in this library, and the four-field glossary entry it carries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_max, dim_zero_sum
from torchmetrics.utilities.distributed import gather_all_tensors

from opbc_metrics.batch import BatchView, as_view
from opbc_metrics.sync import all_reduce_states, packable


@dataclass(frozen=True)
class GlossaryEntry:
    """The four fields of a glossary entry (verl's train-inference correction format).

    Attributes:
        name: the name used on dashboards and in the source glossary, e.g. ``"ESS"``.
        what: what the metric is.
        unit: the unit it aggregates over (tokens, sequences, (token, layer) pairs, ...).
        cap: the cap that triggers an OPBC action, or ``"none (diagnostic)"``.
        action: what happens when the cap fires.
        aliases: other names that resolve to this entry.
    """

    name: str
    what: str
    unit: str
    cap: str
    action: str
    aliases: tuple[str, ...] = ()


_REGISTRY: list[type[OPBCMetric]] = []


def registered_metrics() -> list[type[OPBCMetric]]:
    """Every concrete metric class defined so far, in definition order."""
    return list(_REGISTRY)


class OPBCMetric(Metric):
    """A ``torchmetrics.Metric`` whose states are fixed-size sufficient statistics.

    Subclasses declare ``keys`` (the ``section/group/metric`` keys they produce), a ``glossary``
    entry, the ``section`` they belong to, the batch fields they need, and implement
    ``_update_view(view)`` and ``compute()``. ``update`` accepts a batch mapping, keyword fields, or a
    shared :class:`~opbc_metrics.batch.BatchView`.

    All states are float64 tensors reduced by sum, max or min, so that DDP sync is exact (global sums
    and extremes, never a mean of per-rank means) and packs into at most one collective per
    reduction kind (see :mod:`opbc_metrics.sync`).
    """

    full_state_update: bool = False
    is_differentiable: bool = False
    higher_is_better: bool | None = None
    keys: ClassVar[tuple[str, ...]] = ()
    glossary: ClassVar[GlossaryEntry | None] = None
    section: ClassVar[str] = ""
    required_fields: ClassVar[tuple[str, ...]] = ()
    optional_inputs: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.keys:  # classes without keys are abstract bases
            _REGISTRY.append(cls)

    # -- states ---------------------------------------------------------------------------
    def _add(self, name: str, reduce: str, fill: float = 0.0, shape: tuple[int, ...] = ()) -> None:
        default = torch.full(shape, fill, dtype=torch.float64)
        self.add_state(name, default=default, dist_reduce_fx=reduce, persistent=True)

    def add_sum(self, name: str, shape: tuple[int, ...] = ()) -> None:
        """A float64 state reduced by sum across updates and ranks."""
        self._add(name, "sum", 0.0, shape)

    def add_max(self, name: str, shape: tuple[int, ...] = ()) -> None:
        """A float64 state reduced by max, starting at -inf."""
        self._add(name, "max", float("-inf"), shape)

    def add_min(self, name: str, shape: tuple[int, ...] = ()) -> None:
        """A float64 state reduced by min, starting at +inf."""
        self._add(name, "min", float("inf"), shape)

    def accumulate(self, **stats: Tensor) -> None:
        """Fold one batch's statistics into the states, by each state's reduction.

        Statistics built on the host (CPU) move to the states' device. Statistics of a batch on another
        accelerator than the states raise a ``ValueError``: moving them would be a hidden device-to-host
        copy (a sync), and adding them in place would fail inside torch (or, on ``meta``, do nothing).
        """
        # Runs once per metric per batch, 15+ times per collection update: one pass over the states,
        # checked before any is touched (no partial update on refusal), then folded in.
        pairs = [(getattr(self, name), value, self._reductions[name]) for name, value in stats.items()]
        for state, value, _ in pairs:
            if value.device != state.device and value.device.type != "cpu":
                fields = ", ".join(f"`{f}`" for f in self.required_fields) or "the batch"
                raise ValueError(
                    f"batch field(s) {fields} are on {value.device} but the states of {type(self).__name__} "
                    f"are on {state.device}; move the metric to the batch's device (metric.to(device))"
                )
        for state, value, fx in pairs:
            if value.dtype != state.dtype or value.device != state.device:
                value = value.to(device=state.device, dtype=state.dtype)
            if fx is dim_zero_sum:
                state.add_(value)
            elif fx is dim_zero_max:
                torch.maximum(state, value, out=state)
            else:
                torch.minimum(state, value, out=state)

    # torchmetrics' update wrapper sets these two plain attributes on every update; nn.Module's
    # __setattr__ (parameter/buffer/module bookkeeping) costs ~3 us each, 30 calls per collection update.
    _PLAIN_ATTRIBUTES: ClassVar[frozenset[str]] = frozenset({"_computed", "_update_count"})

    def __setattr__(self, name: str, value: Any) -> None:
        if name in OPBCMetric._PLAIN_ATTRIBUTES:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    # -- update / compute -----------------------------------------------------------------
    def update(self, batch: Any = None, **fields: Any) -> None:
        """Accumulate one batch (a mapping, a dataclass, keyword fields or a shared BatchView)."""
        self._update_view(as_view(batch, **fields))

    def _update_view(self, view: BatchView) -> None:
        raise NotImplementedError

    def accepts(self, view: BatchView) -> bool:
        """Whether a collection should update this metric with ``view``.

        Metrics with ``optional_inputs`` skip batches that lack their fields; the others always update
        (and raise a ``ValueError`` naming a missing field).
        """
        return not self.optional_inputs or view.has(*self.required_fields)

    def has_data(self) -> bool:
        """Whether any state differs from its default, i.e. some update carried data."""
        return any(
            not isinstance(default, torch.Tensor) or not torch.equal(getattr(self, name), default.to(self.device))
            for name, default in self._defaults.items()
        )

    def compute_dict(self) -> dict[str, Tensor]:
        """:meth:`compute` as a dict keyed by the full ``section/group/metric`` keys."""
        return self.as_dict(self.compute())

    def as_dict(self, value: Any) -> dict[str, Tensor]:
        """Key a value returned by :meth:`compute` or :meth:`forward`."""
        if isinstance(value, dict):
            return value
        (key,) = self.keys
        return {key: value}

    # -- distributed ----------------------------------------------------------------------
    def _sync_dist(self, dist_sync_fn: Any = gather_all_tensors, process_group: Any = None) -> None:
        # A custom dist_sync_fn (or a non-packable state) takes torchmetrics' per-state path.
        if dist_sync_fn is gather_all_tensors and packable(self):
            all_reduce_states([self], group=process_group or self.process_group)
        else:
            super()._sync_dist(dist_sync_fn, process_group)
