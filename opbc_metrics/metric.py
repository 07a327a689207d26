"""The base class of every metric in this library, and the four-field glossary entry it carries."""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import warnings
from abc import ABCMeta
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_max, dim_zero_min, dim_zero_sum
from torchmetrics.utilities.distributed import gather_all_tensors

from opbc_metrics.batch import METRIC_CLASSES, BatchView, as_view, raise_if_bad_inputs
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


LIGHTNING_LOG_ADVICE = (
    "`self.log_dict(<OPBCCollection>)` / `self.log(name, <OPBC metric>)` hands OPBC metrics to Lightning, which "
    "cannot log them: each computes a dict of `section/group/metric` keys. Give the collection to the callback "
    "instead (`OPBCCallback('{attr}')` logs its global values every `log_every_n_steps` batches), or log its "
    "values yourself: `self.log_dict(self.{attr}.compute(), sync_dist=False)`, then `self.{attr}.reset()`."
)

_REGISTRY: list[type[OPBCMetric]] = METRIC_CLASSES  # (batch.py reads it to know every metric's fields)


def registered_metrics() -> list[type[OPBCMetric]]:
    """Every concrete metric class defined so far, in definition order."""
    return list(_REGISTRY)


class NoDataError(ValueError):
    """``compute()`` of a metric that saw no data (no valid token, sequence, pair or sample) in its window."""


# A state's reduction (across updates and ranks) and the value it starts from (cat: an empty list).
_FILLS = {"sum": 0.0, "max": float("-inf"), "min": float("inf"), "cat": None}

# One entry of a state's shape: a size, the name of a setting (a size, or a sequence: its length), or a function
# of the metric.
Size = int | str | Callable[[Any], int]


@dataclass(frozen=True)
class State:
    """One entry of a metric's state table: how the state reduces and its shape.

    ``reduce`` is ``"sum"`` (starts at 0), ``"max"`` (starts at -inf) or ``"min"`` (starts at +inf), across
    updates and ranks alike, or ``"cat"``: a list of every batch's values, which the metric's own update appends
    to (it grows with the data and is not packed into the one-collective sync; for exact modes on small data).
    ``shape`` entries are sizes, names of settings the constructor sets (``"slots"``; a sequence setting such
    as ``"names"`` gives its length), or functions of the metric (``lambda m: m.num_layers + 1``), resolved
    when the metric is built; the size is fixed from then on.
    """

    reduce: str
    shape: tuple[Size, ...] = ()

    def __post_init__(self) -> None:
        if self.reduce not in _FILLS:
            raise ValueError(f"unknown state reduction {self.reduce!r}: use one of {sorted(_FILLS)}")

    def of(self, *shape: Size) -> State:
        """The same reduction with a shape: ``SUM.of("slots", 5)``."""
        return State(self.reduce, shape)

    def resolve(self, metric: Any) -> tuple[int, ...]:
        def size(s: Size) -> int:
            if isinstance(s, str):
                value = getattr(metric, s)
                return len(value) if isinstance(value, Sized) else int(value)
            return int(s(metric)) if callable(s) else int(s)

        return tuple(size(s) for s in self.shape)


SUM, MAX, MIN, CAT = State("sum"), State("max"), State("min"), State("cat")


def table(*sums: str, **states: State) -> Mapping[str, State]:
    """A read-only state table: ``sums`` (scalar sums) first, then ``states`` in the order given.

    Example:
        >>> list(table("count", "total", min=MIN).items())[-1]
        ('min', State(reduce='min', shape=()))
    """
    return MappingProxyType({**dict.fromkeys(sums, SUM), **states})


class BySettings:
    """A class attribute (``keys``, ``required_fields``) whose value depends on the constructor's settings.

    On the class it is ``pattern`` (the glossary shows ``"sample_metrics/<name>/mean"``); on an instance it is
    ``build(instance)``, computed once, after the constructor.
    """

    def __init__(self, pattern: tuple[str, ...], build: Callable[[Any], tuple[str, ...]]) -> None:
        self.pattern, self.build = tuple(pattern), build

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}_by_settings"

    def __get__(self, metric: Any, owner: type | None = None) -> tuple[str, ...]:
        if metric is None:
            return self.pattern
        value = metric.__dict__.get(self.slot)
        if value is None:
            value = metric.__dict__[self.slot] = tuple(self.build(metric))
        return value


class _BuildStates(ABCMeta):
    """Registers a metric's declared states once its whole ``__init__`` chain has run (shapes may use settings)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        metric = super().__call__(*args, **kwargs)
        metric._register_states()
        return metric


class OPBCMetric(Metric, metaclass=_BuildStates):
    """A ``torchmetrics.Metric`` whose states are fixed-size sufficient statistics.

    Subclasses declare ``keys`` (the ``section/group/metric`` keys they produce), a ``glossary``
    entry, the batch fields they need, ``data_counts`` (the states
    that count their data), their ``states`` and implement ``statistics(view)`` and ``compute()``.
    ``update`` accepts a batch mapping, keyword fields, or a shared :class:`~opbc_metrics.batch.BatchView`.

    **States are declared once**, in the class-level table ``states`` (``{name: SUM | MAX | MIN}``, with
    ``.of(shape)`` for vectors; see :class:`State`); :meth:`state_table` returns it and a class whose state
    names depend on its settings overrides that. The base class registers the states after the
    constructor (so shapes may read settings); ``update`` folds :meth:`statistics` into them by each
    state's reduction (:meth:`accumulate`), and :meth:`state_values` hands them to a ``_x_compute``
    by name. ``_x_update`` (in ``functional/``) has one meaning everywhere: one batch (a ``BatchView``
    and the metric's settings) to a dict of that batch's statistics named like the states.

    States are float64 tensors reduced by sum, max or min (a ``CAT`` list only in exact modes), so that DDP
    sync is exact (global sums and extremes, never a mean of per-rank means) and packs into at most one
    collective per reduction kind (see :mod:`opbc_metrics.sync`).

    **No made-up values.** A metric that saw no data in its window (decided on the synced states, so
    the same on every rank) has no value: :meth:`compute_dict` returns ``{}`` (a collection leaves its
    keys out), :meth:`compute` raises :class:`NoDataError`, and ``forward`` on a batch without data
    returns ``None`` (its states still accumulate). ``data_counts`` names the count states (valid
    tokens, sequences, pairs, samples, and counts of bad values that ``compute()`` must report): the
    metric saw data when any entry of them is non-zero. Names that are not states of the instance are
    skipped, so a base class can list its subclasses' counts. ``()`` means it always reports (input
    accounting); ``None`` (undeclared) means "some state moved off its default". ``key_counts`` pairs a
    key counted by another state (``chi2_seq``: sequences, where the metric counts tokens) to that state:
    the key is left out while it is zero (or, with a third entry ``at_least``, while it is below that:
    ``pearson`` needs two tokens).

    **Checkpoints and merges are checked.** :meth:`config` (class, settings, state layout) travels in
    the state dict as extra state (``<name>._extra_state``); :meth:`load_state_dict` and
    :meth:`merge_state` validate keys, shapes, dtypes and configuration before touching any state and
    raise a ``ValueError`` naming the first difference, and both drop any cached result.
    """

    full_state_update: bool = False
    is_differentiable: bool = False
    higher_is_better: bool | None = None
    keys: ClassVar[tuple[str, ...]] = ()
    states: ClassVar[Mapping[str, State]] = MappingProxyType({})
    glossary: ClassVar[GlossaryEntry | None] = None
    required_fields: ClassVar[tuple[str, ...]] = ()
    # Fields the metric reads when the batch has them, besides required_fields (a collection's report of the fields
    # none of its members read names the section of the metrics that declare them: collection.field_readers).
    optional_fields: ClassVar[tuple[str, ...]] = ()
    optional_inputs: ClassVar[bool] = False
    # With optional_inputs: the fields any one of which makes a collection update the metric (a missing partner then
    # raises, naming it, rather than the batch being skipped); empty: all of required_fields.
    trigger_fields: ClassVar[tuple[str, ...]] = ()
    data_counts: ClassVar[tuple[str, ...] | None] = None
    key_counts: ClassVar[tuple[tuple[str, str] | tuple[str, str, int], ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.keys:  # classes without keys are abstract bases
            _REGISTRY.append(cls)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        object.__setattr__(self, "_allow_empty", False)
        self._install_compute()
        # Attributes set after this point by subclasses are their settings (see config()).
        object.__setattr__(self, "_base_attributes", frozenset(self.__dict__) | {"_base_attributes"})

    def _install_compute(self) -> None:
        wrapped = self.compute  # torchmetrics' caching/syncing wrapper around the subclass's compute

        def compute() -> Any:
            with warnings.catch_warnings():
                # torchmetrics warns when update() never ran; NoDataError (or a loaded state) says more.
                warnings.filterwarnings("ignore", message=r".*was called before the ``update`` method.*")
                value = wrapped()
            if value is None and not self._allow_empty:
                raise NoDataError(
                    f"{type(self).__name__} saw no data since the last reset (on any rank): it has no value. "
                    "compute_dict() returns {} in this case, and OPBCCollection.compute() leaves its keys out."
                    + self.no_data_hint()
                )
            return value

        compute.__doc__ = wrapped.__doc__
        object.__setattr__(self, "_compute_or_none", wrapped)
        object.__setattr__(self, "compute", compute)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in super().__getstate__().items() if k not in ("_compute_or_none", "_checked_compute")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # re-wraps the class's compute
        self._install_compute()

    # -- states ---------------------------------------------------------------------------
    def state_table(self) -> Mapping[str, State]:
        """The metric's states, ``{name: State}``, in registration (and state dict) order."""
        return self.states

    def _register_states(self) -> None:
        for name, state in self.state_table().items():
            if not isinstance(state, State):
                raise TypeError(f"{type(self).__name__}.states[{name!r}] must be a State (SUM, MAX, ...): {state!r}")
            fill = _FILLS[state.reduce]
            default = [] if fill is None else torch.full(state.resolve(self), fill, dtype=torch.float64)
            self.add_state(name, default=default, dist_reduce_fx=state.reduce, persistent=True)

    def no_data_hint(self) -> str:
        """More words for the :class:`NoDataError` of a window without data (why there was none), or ``""``."""
        return ""

    def state_values(self, *names: str, exclude: tuple[str, ...] = ()) -> dict[str, Tensor]:
        """``{name: state}`` for ``names`` (default: every state but ``exclude``), to pass to a ``_x_compute``."""
        return {name: getattr(self, name) for name in names or self._defaults if name not in exclude}

    def accumulate(self, **stats: Tensor) -> None:
        """Fold one batch's statistics into the states, by each state's reduction.

        Statistics built on the host (CPU) move to the states' device. Statistics of a batch on another
        accelerator than the states raise a ``ValueError``: moving them would be a hidden device-to-host
        copy (a sync), and adding them in place would fail inside torch (or, on ``meta``, do nothing).
        """
        fold_statistics(self.checked_statistics(stats))

    def checked_statistics(self, stats: Mapping[str, Tensor]) -> list[tuple[Tensor, Tensor, Callable]]:
        """``(state, statistic, reduction)`` for one batch's ``stats``, each statistic on its state's device and
        dtype, for :func:`fold_statistics`: every statistic checked before any state is touched (no partial update
        on refusal). Raises the ``ValueError`` s described in :meth:`accumulate`."""
        reductions = self._reductions
        unknown = [name for name in stats if name not in reductions]
        if unknown:
            raise ValueError(
                f"{type(self).__name__}: the batch statistics {unknown} are not states of the metric "
                f"(its states: {list(reductions)}); the kernel and the state table disagree"
            )
        triples = [(getattr(self, name), value, reductions[name]) for name, value in stats.items()]
        for state, value, _ in triples:
            if value.device != state.device and value.device.type != "cpu":
                fields = ", ".join(f"`{f}`" for f in self.required_fields) or "the batch"
                raise ValueError(
                    f"batch field(s) {fields} are on {value.device} but the states of {type(self).__name__} "
                    f"are on {state.device}; move the metric to the batch's device (metric.to(device))"
                )
        for i, (state, value, fx) in enumerate(triples):
            if value.dtype != state.dtype:  # (on the host for host statistics: fold_statistics moves them)
                triples[i] = (state, value.to(state.dtype), fx)
        return triples

    def folds_statistics(self) -> bool:
        """Whether a collection may update this metric by folding its :meth:`statistics` into its states with the
        other members' (:func:`fold_statistics`) instead of calling :meth:`update`: true where the update is
        ``statistics`` + ``accumulate`` (the base ``_update_view``), false for a subclass outside this library that
        overrides ``update`` and for torchmetrics' ``_enable_grad`` / ``compute_on_cpu`` options."""
        return type(self)._update_view is OPBCMetric._update_view and library_update(self)

    def _fold_done(self) -> None:
        """What torchmetrics' update wrapper records after an update, for a member updated by a collection's fold."""
        self._computed = None
        self._update_count += 1

    # torchmetrics sets these plain attributes on every update and reset, and sets every state on reset (a new
    # tensor each); nn.Module's __setattr__ (parameter/buffer/module bookkeeping) costs ~3 us each: 30 calls per
    # collection update, ~190 per reset (100 states), which made reset() ~0.55 ms of a step at 64 x 4096.
    _PLAIN_ATTRIBUTES: ClassVar[frozenset[str]] = frozenset(
        {"_computed", "_update_count", "_allow_empty", "_forward_cache", "_cache", "_is_synced"}
    )

    def __setattr__(self, name: str, value: Any) -> None:
        if name in OPBCMetric._PLAIN_ATTRIBUTES or (
            # a state (a plain tensor or list, as add_state made it): what Module.__setattr__ would do with it
            (type(value) is Tensor or type(value) is list)
            and name in self.__dict__.get("_defaults", ())
            and name not in self.__dict__["_buffers"]
        ):
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    # Lightning's ``self.log(name, metric)`` / ``self.log_dict(collection)`` (the torchmetrics habit) reads a
    # metric's ``_forward_cache`` at once and calls ``compute()`` at epoch end, expecting one scalar; an OPBC
    # metric computes a dict of keys, so Lightning would log nothing or fail at epoch end. Reading the cache
    # from Lightning's code raises at the first ``log`` call instead, saying what to do.
    @property
    def _forward_cache(self) -> Any:
        if sys._getframe(1).f_globals.get("__name__", "").startswith(("lightning.", "pytorch_lightning.")):
            raise TypeError(LIGHTNING_LOG_ADVICE.format(attr="opbc"))
        return self.__dict__.get("_opbc_forward_cache")

    @_forward_cache.setter
    def _forward_cache(self, value: Any) -> None:
        self.__dict__["_opbc_forward_cache"] = value

    # -- update / compute -----------------------------------------------------------------
    def update(self, batch: Any = None, **fields: Any) -> None:
        """Accumulate one batch (a mapping, a dataclass, keyword fields or a shared BatchView)."""
        view = as_view(batch, **fields).check_fields()
        if view is batch:  # a shared view: whoever made it checks what was read
            self._update_view(view)
        elif type(self)._update_view is OPBCMetric._update_view:
            stats = self.statistics(view)
            view.check_unread()  # before any state moves
            self.accumulate(**stats)
        else:
            self._update_view(view)
            view.check_unread()

    def _update_view(self, view: BatchView) -> None:
        self.accumulate(**self.statistics(view))

    def statistics(self, view: BatchView) -> Mapping[str, Tensor]:
        """One batch's statistics named like the states (the section's functional ``_x_update``)."""
        raise NotImplementedError

    def request_shared(self, view: BatchView) -> None:
        """Ask ``view`` (:meth:`BatchView.request`) for what this metric reads from the batch's shared
        pre-computations; a collection calls it on every member before any member updates. Default: nothing."""

    def accepts(self, view: BatchView) -> bool:
        """Whether a collection should update this metric with ``view``.

        Metrics with ``optional_inputs`` skip batches that lack their fields (all of ``required_fields``, or every
        one of ``trigger_fields`` when set: a lone rollout-side expert field then updates and raises); the others
        always update (and raise a ``ValueError`` naming a missing field).
        """
        if not self.optional_inputs:
            return True
        if self.trigger_fields:
            return any(view.has(name) for name in self.trigger_fields)
        return view.has(*self.required_fields)

    def has_data(self) -> bool:
        """Whether any state differs from its default, i.e. some update changed a state."""
        return any(
            not isinstance(default, torch.Tensor) or not torch.equal(getattr(self, name), default.to(self.device))
            for name, default in self._defaults.items()
        )

    def saw_data(self) -> bool:
        """Whether the window holds data for this metric: a non-zero entry in a ``data_counts`` state.

        Reads the states to the host: ``compute()`` time only. Called on synced states, it gives the same
        answer on every rank.
        """
        if self.data_counts is None:
            return self.has_data()
        if not self.data_counts:
            return True
        # A base class may list the counts of all its subclasses; each metric has at least one of them.
        counts = [getattr(self, name) for name in self.data_counts if name in self._defaults]
        if not counts:
            raise TypeError(f"{type(self).__name__} has none of its data_counts states {self.data_counts}")
        return any(bool(torch.count_nonzero(c)) for c in counts)

    def _wrap_compute(self, compute: Callable) -> Callable:
        # Inside torchmetrics' sync context (states synced): no data -> None, which the public compute()
        # turns into NoDataError. Raising here would skip torchmetrics' unsync (its context has no finally).
        def checked(*args: Any, **kwargs: Any) -> Any:
            # A collection reads every member's counts to the host at once (read_presence); alone, read them here.
            known = self.__dict__.pop("_presence", None)
            if not (self.saw_data() if known is None else known[0]):
                return None
            value = compute(*args, **kwargs)
            if self.key_counts:
                if known is None:
                    empty = {key for key, *count in self.key_counts
                             if not bool(torch.count_nonzero(_reached(self, *count)))}
                else:
                    empty = known[1]
                if isinstance(value, dict):
                    value = {k: v for k, v in value.items() if k not in empty}
                elif len(self.keys) == 1 and self.keys[0] in empty:
                    return None  # a one-key metric whose key has too little data: no value
            # A dict without a key (every key lacked its data) is no value: NoDataError alone, as for an empty window.
            return None if isinstance(value, dict) and not value else value

        # The compute without torchmetrics' wrapper (no sync, cache or clone of each value), for a collection that
        # has synced the states itself and copies all the values at once (OPBCCollection.compute).
        object.__setattr__(self, "_checked_compute", checked)
        return super()._wrap_compute(checked)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Accumulate the batch and return its own value; ``None`` when the batch carried no data.

        A batch refused by its update or compute (bad input) leaves the window and the sync settings as they were:
        torchmetrics' forward swaps the window's states for the batch's and its DDP sync settings for local ones and
        restores neither when the batch raises (the metric would then hold only the refused batch and stop syncing
        across ranks).
        """
        self._allow_empty = True
        flags = self.forward_flags()
        try:
            return super().forward(*args, **kwargs)
        except BaseException:
            self.restore_window(flags)
            raise
        finally:
            self._allow_empty = False
            if not self.__dict__.get("_keep_window_copy"):
                self.__dict__.pop("_window_copy", None)

    def forward_flags(self) -> dict[str, Any]:
        """The torchmetrics settings a forward changes, to pass to :meth:`restore_window`."""
        return {name: getattr(self, name) for name in _FORWARD_FLAGS}

    def restore_window(self, flags: dict[str, Any]) -> None:
        """Put back the window (the states copied by the last forward) and the settings ``flags``."""
        for name, value in self.__dict__.get("_window_copy", {}).items():
            setattr(self, name, value)
        for name, value in flags.items():
            setattr(self, name, value)

    def _copy_state_dict(self) -> dict[str, Any]:
        cache = super()._copy_state_dict()
        if self._allow_empty and "_window_copy" not in self.__dict__:  # forward's copy of the window (see forward)
            self.__dict__["_window_copy"] = cache
        return cache

    def compute_dict(self) -> dict[str, Tensor]:
        """:meth:`compute` as a dict keyed by the full ``section/group/metric`` keys; ``{}`` without data."""
        with quiet_compute():
            return self.as_dict(self._compute_or_none())

    def as_dict(self, value: Any) -> dict[str, Tensor]:
        """Key a value returned by :meth:`compute` or :meth:`forward` (``None``, no data, gives ``{}``)."""
        if value is None:
            return {}
        if isinstance(value, dict):
            return value
        (key,) = self.keys
        return {key: value}

    def plot(self, val: Any = None, ax: Any = None) -> Any:
        """Plot a value, a dict of values, or a list of them (a time series) with torchmetrics' plotting.

        Args:
            val: a :meth:`compute` / :meth:`forward` result or a list of them; default :meth:`compute`.
            ax: a matplotlib axis to draw on; default a new figure.

        Returns:
            ``(figure, axis)``. Needs matplotlib (``pip install matplotlib``).
        """
        if val is None:
            val = self.compute()
        elif isinstance(val, list | tuple) and val and isinstance(val[0], dict) and len(self.keys) == 1:
            val = [v[self.keys[0]] for v in val]
        elif isinstance(val, dict) and len(val) == 1 and len(self.keys) == 1:
            val = next(iter(val.values()))
        return plot_values(
            val,
            ax=ax,
            name=type(self).__name__,
            higher_is_better=self.higher_is_better,
            lower_bound=self.plot_lower_bound,
            upper_bound=self.plot_upper_bound,
        )

    # -- configuration, checkpoints, merges -----------------------------------------------
    # torchmetrics/nn.Module bookkeeping and execution options that are not part of the configuration.
    _NOT_CONFIG: ClassVar[frozenset[str]] = frozenset({"compiled"})

    def config(self) -> dict[str, Any]:
        """The configuration a state belongs to: class, settings and state layout (JSON-serialisable).

        Two metrics can merge states or share a checkpoint only when their configurations are equal.
        """
        # Scalars first, so a difference is named by its setting (num_layers) before what derives from it (keys).
        settings = {
            name: _plain(value)
            for name, value in sorted(self.__dict__.items(), key=lambda kv: (not _is_scalar(kv[1]), kv[0]))
            if name not in self._base_attributes
            and name not in self._defaults
            and not name.startswith("_")
            and name not in self._NOT_CONFIG
        }
        states = {}
        for name in self._defaults:
            value = getattr(self, name)
            reduce = getattr(self._reductions[name], "__name__", str(self._reductions[name]))
            if isinstance(value, Tensor):
                states[name] = [reduce, list(value.shape), str(value.dtype)]
            else:
                states[name] = [reduce, "list", ""]
        return {"class": f"{type(self).__module__}.{type(self).__qualname__}", "settings": settings, "states": states}

    def fingerprint(self) -> str:
        """A short stable hash of :meth:`config`."""
        return hashlib.sha256(_config_text(self.config()).encode()).hexdigest()[:16]

    def get_extra_state(self) -> Tensor:
        """The configuration, saved with the states (``<name>._extra_state``): JSON text as a uint8 tensor,
        so a state dict stays a dict of tensors (``torch.load(weights_only=True)``, ``.to(device)`` loops)."""
        return torch.tensor(list(_config_text(self.config()).encode()), dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        problem = self._config_problem(state)
        if problem:
            raise ValueError(f"load_state_dict: {problem}")

    def _config_problem(self, saved: Any, where: str = "") -> str | None:
        """``None`` when ``saved`` (a config, its JSON text or :meth:`get_extra_state`) equals :meth:`config`,
        else what differs first."""
        label = where or type(self).__name__
        if isinstance(saved, Tensor) and saved.dtype == torch.uint8 and saved.ndim == 1:
            saved = bytes(saved.tolist()).decode(errors="replace")
        if isinstance(saved, str):
            try:
                saved = json.loads(saved)
            except ValueError:
                saved = None
        if not isinstance(saved, Mapping):
            return f"{label}: the state carries no opbc-metrics configuration (a foreign or older checkpoint)"
        return _first_difference(self.config(), dict(saved), label)

    def state_problem(self, state: Mapping[str, Any], where: str = "", config: Any = None) -> str | None:
        """What makes ``state`` (``{state name: value}``) unfit for this metric, or ``None``.

        Checks the state names (none missing, none unknown), each tensor's shape and dtype, and
        ``config`` (a config dict or its JSON text) against :meth:`config` when given.
        """
        label = where or type(self).__name__
        if config is not None:
            problem = self._config_problem(config, label)
            if problem:
                return problem
        for name in self._defaults:
            if name not in state:
                return f"{label}.{name} is missing from the incoming state"
        for name in state:
            if name not in self._defaults:
                return f"{label}.{name} is not a state of {type(self).__name__}"
        for name, value in state.items():
            own = getattr(self, name)
            if isinstance(own, Tensor):
                if not isinstance(value, Tensor):
                    return f"{label}.{name} must be a tensor, got {type(value).__name__}"
                if value.shape != own.shape:
                    return f"{label}.{name} has shape {tuple(value.shape)}, expected {tuple(own.shape)}"
                if value.dtype != own.dtype:
                    return f"{label}.{name} has dtype {value.dtype}, expected {own.dtype}"
            elif not isinstance(value, list | tuple) or not all(isinstance(v, Tensor) for v in value):
                return f"{label}.{name} must be a list of tensors"
        return None

    def merge_state(self, incoming_state: dict[str, Any] | Metric) -> None:
        """Fold another metric's states (or a ``{state name: value}`` dict) into this one.

        Checked before any state changes: same class and configuration (for a metric), same state names,
        shapes and dtypes; a ``ValueError`` names the first difference. Drops any cached result.
        """
        if isinstance(incoming_state, Metric):
            if not isinstance(incoming_state, type(self)):
                raise ValueError(
                    f"merge_state: expected a {type(self).__name__}, got {type(incoming_state).__name__}"
                )
            state = {name: getattr(incoming_state, name) for name in incoming_state._defaults}
            problem = self.state_problem(state, config=incoming_state.config())
        elif isinstance(incoming_state, Mapping):
            state = dict(incoming_state)
            problem = self.state_problem(state, config=state.pop("_extra_state", None))
        else:
            kind = type(incoming_state).__name__
            raise ValueError(f"merge_state: expected a dict or a {type(self).__name__}, got {kind}")
        if problem:
            raise ValueError(f"merge_state: {problem}")
        if self.dist_sync_on_step:  # (as torchmetrics refuses it)
            raise RuntimeError("merge_state is not supported for metrics with dist_sync_on_step=True")
        self._computed = None
        # torchmetrics' fold (by each state's reduction; a metric may override it), which its merge_state calls:
        # merge_state itself came in torchmetrics 1.5, this library allows 1.4.
        self._reduce_states({k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in state.items()})

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load states saved by :meth:`state_dict`; checked before anything changes (see :meth:`merge_state`).

        The checkpoint must hold every state and the configuration (``_extra_state``) of this metric:
        ``strict=False`` is refused, since a partial load would mix two windows.
        """
        state = dict(state_dict)
        if not strict:
            raise ValueError("load_state_dict: strict=False is not supported (a partial load mixes two windows)")
        if "_extra_state" not in state:
            raise ValueError(
                f"load_state_dict: {type(self).__name__}: the state carries no opbc-metrics configuration "
                "(`_extra_state`; an empty, foreign or older checkpoint)"
            )
        config = state.pop("_extra_state")
        problem = self.state_problem(state, config=config)
        if problem:
            raise ValueError(f"load_state_dict: {problem}")
        self._computed = None
        return super().load_state_dict(state_dict, strict=True, assign=assign)

    # -- distributed ----------------------------------------------------------------------
    def _sync_dist(self, dist_sync_fn: Any = gather_all_tensors, process_group: Any = None) -> None:
        # A custom dist_sync_fn (or a non-packable state) takes torchmetrics' per-state path.
        if dist_sync_fn is gather_all_tensors and packable(self):
            all_reduce_states([self], group=process_group or self.process_group)
        else:
            super()._sync_dist(dist_sync_fn, process_group)


def plot_values(val: Any, ax: Any = None, **kwargs: Any) -> Any:
    """torchmetrics' ``plot_single_or_multi_val`` with a clear error when matplotlib is missing."""
    from torchmetrics.utilities.imports import _MATPLOTLIB_AVAILABLE

    if not _MATPLOTLIB_AVAILABLE:
        raise ImportError(
            "plot() needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'opbc-metrics[dev]')"
        )
    from torchmetrics.utilities.plot import plot_single_or_multi_val

    if isinstance(val, dict) and not val:
        raise NoDataError("nothing to plot: no metric saw data in the window")
    return plot_single_or_multi_val(val, ax=ax, **kwargs)


def _plain(value: Any) -> Any:
    """A setting as JSON data (tuples and sets as lists, other objects by their repr)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted(_plain(v) for v in value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    return repr(value)


@contextlib.contextmanager
def quiet_compute() -> Iterator[None]:
    """Without torchmetrics' warning for a compute before any update (such a metric has no data: no keys)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*was called before the ``update`` method.*")
        yield


def read_presence(metrics: Iterable[OPBCMetric]) -> None:
    """What :meth:`OPBCMetric.saw_data` and the ``key_counts`` filter need, for every metric at once: their count
    states are compared with 0 on their device and read to the host in one copy per device (each metric's own
    read is a host-device sync: ~30 for the default collection). Each metric's next compute takes its answer;
    metrics whose ``data_counts`` is undeclared (None) read their states themselves."""
    by_device: dict[torch.device, list[tuple[OPBCMetric, list[int], list[int], list[Tensor]]]] = {}
    for m in metrics:
        if not isinstance(m, OPBCMetric) or m.data_counts is None:
            continue
        counts = [getattr(m, name) for name in m.data_counts if name in m._defaults]
        if m.data_counts and not counts:
            continue  # saw_data() raises its TypeError
        keyed = [_reached(m, *count) for _, *count in m.key_counts]
        parts = [*counts, *keyed]
        if not parts:  # data_counts = (): it always has a value
            m.__dict__["_presence"] = (True, set())
            continue
        by_device.setdefault(parts[0].device, []).append(
            (m, [c.numel() for c in counts], [k.numel() for k in keyed], parts))
    for entries in by_device.values():
        nonzero = (torch.cat([p.reshape(-1) for *_, parts in entries for p in parts]) != 0).tolist()
        at = 0
        for m, count_sizes, key_sizes, _ in entries:
            n = sum(count_sizes)
            saw = any(nonzero[at : at + n]) if m.data_counts else True
            at += n
            empty = set()
            for (key, *_), size in zip(m.key_counts, key_sizes, strict=True):
                if not any(nonzero[at : at + size]):
                    empty.add(key)
                at += size
            m.__dict__["_presence"] = (saw, empty)


def _reached(metric: OPBCMetric, state: str, at_least: int = 1) -> Tensor:
    """A ``key_counts`` count state, non-zero exactly where it reaches ``at_least`` (the state itself for 1)."""
    count = getattr(metric, state)
    return count if at_least == 1 else (count >= at_least).to(count.dtype)


def forget_presence(metrics: Iterable[OPBCMetric]) -> None:
    """Drop the answers :func:`read_presence` left (a metric whose compute returned its cached value kept one)."""
    for m in metrics:
        m.__dict__.pop("_presence", None)


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + " ...]"


def _config_text(config: Mapping[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def _first_difference(own: Any, other: Any, path: str) -> str | None:
    """The first place where two JSON-like values differ, as ``"path: incoming X, expected Y"``."""
    if isinstance(own, Mapping) and isinstance(other, Mapping):
        for key in list(own) + [k for k in other if k not in own]:
            if key not in other:
                return f"{path}.{key} is missing from the incoming configuration"
            if key not in own:
                return f"{path}.{key} is not in this configuration (incoming {_short(other[key])})"
            found = _first_difference(own[key], other[key], f"{path}.{key}")
            if found:
                return found
        return None
    if own != other:
        return f"{path} differs: incoming {_short(other)}, expected {_short(own)}"
    return None


# What a metric that reads trainer / rollout logprobs checks at compute (InputHealth always; the others when used
# alone, since in a collection InputHealth checks once for all): response_mask entries other than 0 and 1, and the
# min / max of the trainer's and the rollout's logprobs on the logprob sample (a side above 0 holds probabilities or
# logits); and the response tokens with a non-finite logprob (excluded from every statistic), which word a window
# without data whose tokens were all such.
INPUT_CHECK_STATES = MappingProxyType({"mask_other": SUM, "logprob_min": MIN.of(2), "logprob_max": MAX.of(2),
                                       "nonfinite": SUM})


class LogprobInputChecks:
    """Mixin of the metrics that read ``trainer_logprobs`` / ``rollout_logprobs``: with ``input_checks`` (set by the
    constructor), three more states record the window's :attr:`~opbc_metrics.batch.BatchView.logprob_range` and
    :attr:`~opbc_metrics.batch.BatchView.mask_other_values`, and :meth:`raise_on_bad_inputs` refuses probabilities,
    logits and non-0/1 masks at compute (one host read), as InputHealth does in a collection. The metric declares
    its own states in ``states`` (or :meth:`own_state_table`) and adds :meth:`input_check_statistics` to its batch
    statistics."""

    input_checks: bool = True
    states: Mapping[str, State]

    def own_state_table(self) -> Mapping[str, State]:
        return self.states

    def state_table(self) -> Mapping[str, State]:
        own = self.own_state_table()
        return {**own, **INPUT_CHECK_STATES} if self.input_checks else own

    def input_check_statistics(self, view: BatchView) -> dict[str, Tensor]:
        if not self.input_checks:
            return {}
        low, high = view.logprob_range
        return {"mask_other": view.mask_other_values, "logprob_min": low, "logprob_max": high,
                "nonfinite": self.nonfinite_tokens(view)}

    def nonfinite_tokens(self, view: BatchView) -> Tensor:
        """The batch's response tokens with a NaN or infinite logprob (0-dim), from the metric's kernel statistics."""
        raise NotImplementedError

    def no_data_hint(self) -> str:
        if not self.input_checks or not bool(self.nonfinite > 0):  # (on the way to NoDataError only)
            return ""
        return (f" Its window held {int(self.nonfinite)} response token(s) on this rank whose trainer or rollout "
                "logprob is NaN or infinite: such tokens are excluded from every statistic (a collection counts them "
                "in opbc/input/nonfinite_count).")

    def raise_on_bad_inputs(self) -> None:
        if self.input_checks:
            raise_if_bad_inputs(self.logprob_min, self.logprob_max, self.mask_other)


_LIBRARY_UPDATE: dict[type, bool] = {}
# torchmetrics' settings its forward changes for the batch's own value (restored by OPBCMetric.forward on a refusal).
_FORWARD_FLAGS = ("_update_count", "_to_sync", "_should_unsync", "_enable_grad", "compute_on_cpu", "_computed",
                  "_is_synced")


def library_update(metric: OPBCMetric) -> bool:
    """Whether ``metric`` updates as this library wrote it: no ``update`` / ``_update_view`` / ``accumulate``
    override from outside the library in its class hierarchy (the library's own ``update`` overrides only document
    their fields), and neither of torchmetrics' ``_enable_grad`` / ``compute_on_cpu`` options (which its update
    wrapper applies)."""
    cls = type(metric)
    if cls not in _LIBRARY_UPDATE:
        _LIBRARY_UPDATE[cls] = all(
            k.__module__.startswith("opbc_metrics.") for k in cls.__mro__
            if issubclass(k, OPBCMetric) and any(name in vars(k) for name in ("update", "_update_view", "accumulate"))
        )
    return _LIBRARY_UPDATE[cls] and not metric._enable_grad and not metric.compute_on_cpu


def fold_statistics(triples: Iterable[tuple[Tensor, Tensor, Callable]]) -> None:
    """Fold ``(state, statistic, reduction)`` triples (:meth:`OPBCMetric.checked_statistics`) into their states in
    place: one multi-tensor op per reduction kind (``_foreach_add_`` / ``_maximum_`` / ``_minimum_``), where one op
    per state cost ~1 us each on the CPU and a kernel launch each on a GPU (~90 per default-collection update).

    Example:
        >>> from opbc_metrics import ClippedFraction
        >>> m = ClippedFraction()
        >>> fold_statistics(m.checked_statistics({"hits": torch.tensor(2.0), "count": torch.tensor(5.0)}))
        >>> m.hits, m.count
        (tensor(2., dtype=torch.float64), tensor(5., dtype=torch.float64))
    """
    triples = _to_state_devices(list(triples))
    groups: dict[Callable, tuple[list[Tensor], list[Tensor]]] = {}
    for state, value, fx in triples:
        states, values = groups.setdefault(fx, ([], []))
        states.append(state)
        values.append(value)
    for fx, (states, values) in groups.items():
        if fx is dim_zero_sum:
            torch._foreach_add_(states, values)
        elif fx is dim_zero_max:
            torch._foreach_maximum_(states, values)
        elif fx is dim_zero_min:
            torch._foreach_minimum_(states, values)
        else:  # a list state (cat): its metric appends in its own _update_view
            raise ValueError(f"fold_statistics: a state reduced by {fx} cannot take batch statistics in place")


def _to_state_devices(triples: list[tuple[Tensor, Tensor, Callable]]) -> list[tuple[Tensor, Tensor, Callable]]:
    """Statistics built on the host, for states on an accelerator, moved there in one copy per device and dtype (a
    collection's agent and endpoint sections build ~25 on the host): non-blocking, as a blocking copy waits for
    every kernel queued before it."""
    moves: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (state, value, _) in enumerate(triples):
        if value.device != state.device:
            moves.setdefault((state.device, value.dtype), []).append(i)
    for (device, _), rows in moves.items():
        values = [triples[i][1] for i in rows]
        moved = torch.cat([v.reshape(-1) for v in values]).to(device, non_blocking=True)
        for i, v, part in zip(rows, values, moved.split([v.numel() for v in values]), strict=True):
            triples[i] = (triples[i][0], part.view(v.shape), triples[i][2])
    return triples


def reset_states(metrics: Iterable[Metric]) -> None:
    """``reset()`` of every metric, the states of those that keep torchmetrics' reset refilled from their defaults
    by one ``torch._foreach_copy_`` into new tensors (what ``Metric.reset`` does with a clone per state: ~100 for
    the default collection, a kernel launch each on a GPU, against one multi-tensor launch).

    Example:
        >>> from opbc_metrics import ClippedFraction
        >>> m = ClippedFraction()
        >>> m.update(trainer_logprobs=torch.tensor([[0.0]]), rollout_logprobs=torch.tensor([[-25.0]]),
        ...          response_mask=torch.tensor([[1]]))
        >>> m.hits, m.count
        (tensor(1., dtype=torch.float64), tensor(1., dtype=torch.float64))
        >>> reset_states([m])
        >>> m.hits, m.count
        (tensor(0., dtype=torch.float64), tensor(0., dtype=torch.float64))
    """
    fresh: list[Tensor] = []
    defaults: list[Tensor] = []
    for m in metrics:
        plain = type(m).reset is Metric.reset and all(
            isinstance(d, Tensor) and isinstance(getattr(m, n), Tensor) and getattr(m, n).device == d.device
            for n, d in m._defaults.items()
        )
        if not plain:
            m.reset()
            continue
        m._update_count = 0
        m._forward_cache = None
        m._computed = None
        for name, default in m._defaults.items():
            state = torch.empty_like(default)
            setattr(m, name, state)
            fresh.append(state)
            defaults.append(default)
        m._cache = None
        m._is_synced = False
    if fresh:
        torch._foreach_copy_(fresh, defaults)
