"""OPBCCollection: every metric behind one ``update(batch)``, one flat dict of keys, one packed sync."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import MetricCollection

from opbc_metrics.agent import agent_section
from opbc_metrics.batch import (
    DEFAULT_CLAMP,
    DEFAULT_VETO,
    METRIC_CLASSES,
    BatchView,
    UnreadFieldWarning,
    as_view,
    known_field_names,
    stacked_scalars,
)
from opbc_metrics.endpoint import endpoint_section
from opbc_metrics.functional.mismatch import DEFAULT_TOP_MASS_BINS
from opbc_metrics.metric import (
    OPBCMetric,
    fold_statistics,
    forget_presence,
    plot_values,
    quiet_compute,
    read_presence,
    reset_states,
)
from opbc_metrics.mismatch import MISMATCH_METRICS, TopGradientMass
from opbc_metrics.moe import moe_section
from opbc_metrics.per_round import per_round_section
from opbc_metrics.rollout import rollout_section
from opbc_metrics.sync import distributed, packed_sync, restore_local_states
from opbc_metrics.training import training_section


def _mismatch_section(exact: bool = False, **kwargs: Any) -> list[OPBCMetric]:
    # `exact` is the top-1% mass's own option (TopGradientMass(exact=True)); every other option goes to every member.
    return [cls(**kwargs, **({"exact": exact} if issubclass(cls, TopGradientMass) else {})) for cls in MISMATCH_METRICS]


# Section name -> factory(**metric_kwargs, **section_options) -> metrics: each gets its own options only (the
# collection's clamp, veto and top_mass_bins are the mismatch section's).
# The default sections are the OPBC glossary's (seeds 000 and 003). Members with optional inputs skip
# batches without their fields, and compute() leaves out the keys of those that never saw data, so a
# dense model's run shows no MoE keys and a run without trajectories no agent keys.
# mismatch: section_options {"exact": True} gives the top-1% gradient mass its exact mode (every weight kept and
# sorted at compute: state grows with the tokens, for small data; same key); other options reach every member.
SECTIONS: dict[str, Callable[..., list[OPBCMetric]]] = {"mismatch": _mismatch_section}
# moe: router members (expert ids or router logits); section_options {"num_layers": None, "top_k": None,
# "num_experts": None} (num_experts: compares the top-K sets in the narrowest integer dtype that holds the ids).
SECTIONS["moe"] = moe_section
# per_round: needs only the core logprob fields; section_options {"capacity": 16}.
SECTIONS["per_round"] = per_round_section
# agent, endpoint: host-data members (trajectory_pairs; endpoint_responses).
SECTIONS["agent"] = agent_section
SECTIONS["endpoint"] = endpoint_section
# rollout: per-sample/per-group statistics with optional inputs (rewards, advantages, lengths, group_ids,
# stop_reasons, discard_reasons). Opt-in: it validates the values of fields that other sections and
# adapters also carry (a NaN reward or a negative length raises at compute()).
SECTIONS["rollout"] = rollout_section
# training: actor/critic/lengths/DPO/RM/validation/load-balance/timing members, all with optional inputs.
# Opt-in (it reads fields that a mismatch-only user never feeds);
# settings via section_options={"training": {"max_response_length": ..., "data_sources": [...], ...}}.
SECTIONS["training"] = training_section
DEFAULT_SECTIONS: tuple[str, ...] = ("mismatch", "moe", "per_round", "agent", "endpoint")


# Known fields that metrics read when present without declaring them on their class (required_fields,
# trigger_fields, optional_fields, weight_field): the section whose metrics read each.
_UNDECLARED_READERS: dict[str, str] = {
    "rank_ids": "training", "timing_s": "training", "agent_tool_calls_s": "training", "logits": "training",
    "val_mask": "training",
}


def field_readers() -> dict[str, tuple[str, ...]]:
    """Every known batch field (:func:`~opbc_metrics.batch.known_field_names`) -> the sections whose metrics read it,
    in the order of :data:`SECTIONS` (a metric class from outside the library by its class name; ``()``: no section
    reads it). What a collection names for a field that none of its members read (:func:`unread_fields_message`).

    Example:
        >>> field_readers()["rewards"][0], field_readers()["rollout_token_ids"]
        ('rollout', ('mismatch',))
    """
    found: dict[str, list[str]] = {name: [] for name in known_field_names()}
    for cls in METRIC_CLASSES:
        parts = cls.__module__.split(".")
        reader = parts[1] if parts[0] == "opbc_metrics" and len(parts) > 2 and parts[1] in SECTIONS else cls.__name__
        fields = (*cls.required_fields, *cls.trigger_fields, *getattr(cls, "optional_fields", ()),
                  getattr(cls, "weight_field", None))
        for name in fields:
            if name in found and reader not in found[name]:
                found[name].append(reader)
    for name, reader in _UNDECLARED_READERS.items():
        if name in found and reader not in found[name]:
            found[name].append(reader)
    order = {name: i for i, name in enumerate(SECTIONS)}
    return {name: tuple(sorted(readers, key=lambda r: order.get(r, len(order)))) for name, readers in found.items()}


def unread_fields_message(names: list[str]) -> str:
    """The report of known fields that no metric of a collection read (:meth:`BatchView.check_unread`), each with
    the sections that read it."""
    readers = field_readers()
    parts = []
    for name in names:
        sections = [r for r in readers.get(name, ()) if r in SECTIONS]
        by = [f"the {' and '.join(sections)} section{'s' * (len(sections) > 1)}"] if sections else []
        by += [r for r in readers.get(name, ()) if r not in SECTIONS]  # metric classes of no section
        parts.append(f"`{name}` (read by {', '.join(by)})" if by else f"`{name}` (read by no section of opbc-metrics)")
    first = next((r for name in names for r in readers.get(name, ()) if r in SECTIONS), None)
    hint = f' To measure them, add the section that reads them: OPBCCollection(sections=[..., "{first}"]).'
    return (f"batch field(s) {', '.join(parts)} not read by any metric of this collection: ignored."
            f"{hint if first else ''} Reported once per field and collection.")


def _own_copies(values: dict[str, Tensor]) -> dict[str, Tensor]:
    """``values`` in storage of their own, as torchmetrics' compute gives them (a value may be a state itself):
    the single-element ones squeezed to 0-dim and copied in one stack per device and dtype (views of it), the
    others cloned. torchmetrics clones each value: ~80 copies per compute of the default collection, a kernel
    launch each on a GPU."""
    out = {key: v.clone() for key, v in values.items() if isinstance(v, Tensor) and v.numel() != 1}
    for keys, stacked in stacked_scalars(values):
        out.update(zip(keys, stacked.unbind(0), strict=True))
    return {key: out.get(key, values[key]) for key in values}


class OPBCCollection(MetricCollection):
    """All metrics behind one ``update(batch)``, computed into one flat ``section/group/metric`` dict.

    * ``update(batch)`` wraps the batch in one :class:`~opbc_metrics.batch.BatchView`, so the per-token
      log ratio, mask and weights are computed once and shared by every member. A member whose
      required fields are absent from the batch raises a ``ValueError`` naming the field, unless it
      declares its inputs optional (then it skips that batch).
    * ``compute()`` syncs the states of all members with one ``all_reduce`` per reduction kind
      (sum, max, min) instead of torchmetrics' per-state gathers, then returns
      ``dict[str, Tensor]`` keyed exactly as in the design's tables.
    * ``forward(batch)`` returns the batch's own values while accumulating, as torchmetrics does.
    * No made-up values: a member that saw no data in the window (no valid token, sequence, pair or
      sample on any rank; decided on the synced states, so the key set is the same on every rank)
      contributes no keys. The input-accounting keys (``opbc/input/*``) always report, 0 included.
    * ``merge_state`` / ``load_state_dict`` check every member's states and configuration before
      changing anything (a ``ValueError`` names the first difference) and drop cached results; the
      state dict carries each member's configuration (``<member>._extra_state``).
    * ``collection["opbc/is/ess"]`` returns the member that produces a key; member names work too.
    * No field passed is silently ignored: a batch field no member reads is reported with a warning
      (:class:`~opbc_metrics.batch.UnreadFieldWarning`); a schema field (``rewards``, ``group_ids``, ...) once per
      collection and field, naming the section that reads it (e.g. ``sections=[..., "rollout"]``); a misspelt
      schema name is refused. ``rollout_token_ids`` / ``trainer_token_ids`` (both ``[B, T]`` integer, as the
      logprobs) are compared on the response tokens by the mismatch section (:class:`InputHealth`): logprobs of
      different tokens are refused at ``compute()`` with the count of differing tokens over all ranks.

    Args:
        metrics: the members; default: every metric of ``sections``.
        sections: names from :data:`SECTIONS` used when ``metrics`` is not given.
        clamp: C, the log-ratio clamp in nats, for every default member (20).
        veto: the veto threshold in nats (30).
        top_mass_bins: bins of the top-1% gradient-mass sketch (8192).
        compiled: run the shared pre-computations (the mismatch kernel, which the per-round section shares)
            and, on CPU, the MoE top-K set comparison under ``torch.compile`` (the first call compiles).
        section_options: per-section constructor options, e.g. ``{"moe": {"num_layers": 48, "top_k": 8}}``;
            ``{"mismatch": {"exact": True}}`` gives ``opbc/is/top_1pct_gradient_mass`` its exact mode (every weight
            kept and sorted at compute: the state grows with the tokens and is synced apart from the one-collective
            sync; for small data) instead of the histogram sketch, the key and every other member unchanged.
        prefix, postfix: strings added before / after every output key, as in torchmetrics'
            ``MetricCollection`` (e.g. ``prefix="bf16/"`` to compare engines side by side).
        metric_kwargs: torchmetrics ``Metric`` arguments passed to every default member.

    Example:
        >>> import torch
        >>> metrics = OPBCCollection()
        >>> t = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -9.0]])
        >>> metrics.update({"trainer_logprobs": t, "rollout_logprobs": t - 0.1,
        ...                 "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])})
        >>> out = metrics.compute()
        >>> round(out["opbc/is/ess"].item(), 6), round(out["opbc/logprob/abs_diff_mean"].item(), 3)
        (1.0, 0.1)
    """

    def __init__(
        self,
        metrics: Sequence[OPBCMetric] | dict[str, OPBCMetric] | None = None,
        *,
        sections: Iterable[str] = DEFAULT_SECTIONS,
        clamp: float = DEFAULT_CLAMP,
        veto: float = DEFAULT_VETO,
        top_mass_bins: int = DEFAULT_TOP_MASS_BINS,
        compiled: bool = False,
        section_options: dict[str, dict[str, Any]] | None = None,
        prefix: str | None = None,
        postfix: str | None = None,
        **metric_kwargs: Any,
    ) -> None:
        if metrics is None:
            sections = tuple(sections)
            unknown = [s for s in sections if s not in SECTIONS]
            if unknown:
                raise ValueError(f"unknown sections {unknown}; known: {sorted(SECTIONS)}")
            options = section_options or {}
            unknown = sorted(set(options) - set(sections))
            if unknown:
                raise ValueError(f"section_options for sections not in the collection: {unknown}")
            own: dict[str, dict[str, Any]] = {"mismatch": dict(clamp=clamp, veto=veto, top_mass_bins=top_mass_bins),
                                              "per_round": {}}
            # The mismatch section's InputHealth refuses positive logprobs and non-0/1 masks once for the collection:
            # its other members and per_round need not (unless the options say otherwise).
            for name, checks in (("mismatch", False), ("per_round", "mismatch" not in sections)):
                if "input_checks" not in metric_kwargs and "input_checks" not in options.get(name, {}):
                    own[name]["input_checks"] = checks
            metrics = [
                m for s in sections for m in SECTIONS[s](**metric_kwargs, **own.get(s, {}), **options.get(s, {}))
            ]
        members = list(metrics.values()) if isinstance(metrics, dict) else list(metrics)
        for m in members:
            if not isinstance(m, OPBCMetric):
                raise TypeError(f"OPBCCollection members must be OPBCMetric instances, got {type(m).__name__}")
        keys = [k for m in members for k in m.keys]
        duplicated = sorted({k for k in keys if keys.count(k) > 1})
        if duplicated:
            raise ValueError(f"two members produce the same keys: {duplicated}")
        super().__init__(metrics, compute_groups=False, prefix=prefix, postfix=postfix)
        self.compiled = bool(compiled)
        # The schema fields no member read that have been reported (BatchView.check_unread): once per collection.
        self._reported_fields: set[str] = set()

    def members(self) -> list[OPBCMetric]:
        """The member metrics, in order."""
        return list(self.values(copy_state=False))  # type: ignore[arg-type]

    @property
    def keys_produced(self) -> list[str]:
        """Every key :meth:`compute` can return (with the prefix/postfix); members without data leave theirs out."""
        return [self._set_name(k) for m in self.members() for k in m.keys]

    def _named(self, values: dict[str, Tensor]) -> dict[str, Tensor]:
        if not self.prefix and not self.postfix:
            return values
        return {self._set_name(k): v for k, v in values.items()}

    def __getitem__(self, key: str, copy_state: bool = True) -> OPBCMetric:  # type: ignore[override]
        """The member named ``key``, or the member that produces the output key ``key``."""
        if key in self._modules:
            return self._modules[key]  # type: ignore[return-value]
        for m in self.members():
            if key in m.keys or key in [self._set_name(k) for k in m.keys]:
                return m
        try:
            return super().__getitem__(key, copy_state)  # type: ignore[return-value]
        except KeyError:
            raise KeyError(f"{key!r} is neither a member name nor a key this collection produces") from None

    def plot(self, val: Any = None, ax: Any = None, together: bool = True) -> Any:
        """Plot the scalar values (torchmetrics' plotting; needs matplotlib).

        Args:
            val: a :meth:`compute`/:meth:`forward` result or a list of them (a time series); default:
                :meth:`compute`.
            ax: a matplotlib axis (``together=True``) or one per member with values (``together=False``).
            together: all keys in one figure, or one figure per member.
        """
        val = self.compute() if val is None else val
        if together:
            return plot_values(val, ax=ax, name=type(self).__name__)
        series = val if isinstance(val, Sequence) else [val]
        out = []
        for i, m in enumerate(m for m in self.members() if any(self._set_name(k) in series[0] for k in m.keys)):
            own = [{k: v[k] for k in map(self._set_name, m.keys) if k in v} for v in series]
            out.append(m.plot(own if isinstance(val, Sequence) else own[0], ax=None if ax is None else ax[i]))
        return out

    def _active(self, view: BatchView) -> list[OPBCMetric]:
        active = [m for m in self.members() if m.accepts(view)]
        # Every member asks for its part of the shared pre-computations before any updates, so each runs
        # once for all of them (the mismatch kernel: the union of the statistic groups, the per-round sums).
        view.compiled = view.compiled or self.compiled
        for m in active:
            m.request_shared(view)
        return active

    def update(self, batch: Any = None, **fields: Any) -> None:  # type: ignore[override]
        """Accumulate one batch (a mapping, dataclass, or keyword fields with the batch-schema names)."""
        view = as_view(batch, **fields).check_fields()
        own_view = view is not batch
        folded: list[OPBCMetric] = []
        triples: list[tuple[Tensor, Tensor, Callable]] = []
        with torch.no_grad():  # (torchmetrics' update runs without gradients unless a metric asks for them)
            for m in self._active(view):
                if m.folds_statistics():
                    triples += m.checked_statistics(m.statistics(view))
                    folded.append(m)
                else:
                    m.update(view)
            if own_view:  # every member has read the batch; nothing is folded yet
                self._warn_unread(view.check_unread(self._reported_fields))
            # Every member's statistics into the states at once: a few multi-tensor ops, not one op per state.
            fold_statistics(triples)
        for m in folded:
            m._fold_done()

    @staticmethod
    def _warn_unread(names: list[str]) -> None:
        if names:  # (stacklevel: the caller of update / forward)
            warnings.warn(unread_fields_message(names), UnreadFieldWarning, stacklevel=3)

    def forward(self, batch: Any = None, **fields: Any) -> dict[str, Tensor]:  # type: ignore[override]
        """Accumulate one batch and return that batch's own values (local, not synced)."""
        view = as_view(batch, **fields).check_fields()
        out: dict[str, Tensor] = {}
        # A batch one member refuses changes no member: the members that took it get their window back (each keeps
        # torchmetrics' copy of it until the loop ends).
        done: list[tuple[OPBCMetric, dict[str, Any]]] = []
        try:
            for m in self._active(view):
                m.__dict__["_keep_window_copy"] = True
                done.append((m, m.forward_flags()))
                out.update(m.as_dict(m(view)))
            if view is not batch:
                self._warn_unread(view.check_unread(self._reported_fields))
        except BaseException:
            for m, flags in done:
                m.restore_window(flags)
            raise
        finally:
            for m, _ in done:
                m.__dict__.pop("_keep_window_copy", None)
                m.__dict__.pop("_window_copy", None)
        return self._named(out)

    def compute(self) -> dict[str, Tensor]:
        """Sync all members at once (one all_reduce per reduction kind) and return the flat dict."""
        members = self.members()
        synced = packed_sync(members)
        out: dict[str, Tensor] = {}
        try:
            # States are synced here, so every rank leaves out the same members (no data anywhere). Which members
            # saw data: one host read for all of them (those that still sync in their own compute read their own).
            ready = [m for m in members if not (m._to_sync and distributed(m))]
            read_presence(ready)
            direct = {id(m) for m in ready if m._computed is None}
            with quiet_compute():
                for m in members:
                    # Members whose states need no further sync compute directly, their values copied below all at
                    # once; the others (and cached results) through torchmetrics' wrapper, which copies each value.
                    value = m._checked_compute() if id(m) in direct else m._compute_or_none()
                    out.update(m.as_dict(value))
            out = _own_copies(out)
        finally:
            forget_presence(members)
            restore_local_states(synced)
        return self._named(out)

    def reset(self) -> None:
        """Reset every member (their states refilled in one multi-tensor copy; see :func:`reset_states`)."""
        reset_states(self.members())

    def merge_state(self, incoming: OPBCCollection | Mapping[str, Any]) -> None:
        """Fold another collection's states into this one (the single-controller pattern).

        Workers (Ray actors, verl's worker groups) each accumulate their own collection and ship it,
        or its ``state_dict()``, to one controller process, which merges them: the result equals one
        collection updated with all the workers' data. Every member's states and configuration are
        checked before any state changes: a ``ValueError`` names the first difference and the
        collection is left as it was. Cached results are dropped.
        """
        if isinstance(incoming, OPBCCollection):
            names, theirs = list(self._modules), list(incoming._modules)
            if names != theirs:
                raise ValueError(f"merge_state: {_first_name_difference(names, theirs)}")
            pairs = [(m, incoming._modules[name]) for name, m in self.items(keep_base=True, copy_state=False)]
            for m, other in pairs:
                state = dict(other.metric_state)
                problem = m.state_problem(state, where=_member_name(self, m), config=other.config())
                if problem:
                    raise ValueError(f"merge_state: {problem}")
            for m, other in pairs:
                m.merge_state(other)
            return
        if not isinstance(incoming, Mapping):
            kind = type(incoming).__name__
            raise ValueError(f"merge_state: expected an OPBCCollection or its state_dict(), got {kind}")
        states = self._split_state_dict(incoming, "merge_state", require_config=True)
        for name, m in self.items(keep_base=True, copy_state=False):
            m.merge_state(states[name])

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Load a ``state_dict()`` of a collection with the same members and configuration.

        Everything is checked first (no member missing or extra, every state present with its shape and
        dtype, each member's saved configuration equal to its own): a ``ValueError`` names the first
        difference and nothing is loaded. An empty or partial checkpoint, or ``strict=False``, is refused.
        """
        if not strict:
            raise ValueError("load_state_dict: strict=False is not supported (a partial load mixes two windows)")
        self._split_state_dict(state_dict, "load_state_dict", require_config=True)
        for m in self.members():
            m._computed = None
        return super().load_state_dict(state_dict, strict=True, assign=assign)

    def _split_state_dict(
        self, state_dict: Mapping[str, Any], what: str, require_config: bool
    ) -> dict[str, dict[str, Any]]:
        """``{member name: {state: value}}`` of a collection state dict, validated against every member."""
        if not state_dict:
            raise ValueError(f"{what}: the state dict is empty")
        names = list(self._modules)
        states: dict[str, dict[str, Any]] = {name: {} for name in names}
        for key, value in state_dict.items():
            name, _, state = str(key).rpartition(".")
            if name not in states:
                raise ValueError(f"{what}: {key!r} does not belong to any member of this collection ({names[:3]}...)")
            states[name][state] = value
        for name, m in self.items(keep_base=True, copy_state=False):
            if not states[name]:
                raise ValueError(f"{what}: member {name!r} is missing from the incoming state dict")
            own = dict(states[name])
            config = own.pop("_extra_state", None)
            if config is None and require_config:
                raise ValueError(
                    f"{what}: {name}: the checkpoint carries no opbc-metrics configuration ({name}._extra_state); "
                    "it is partial, foreign or from an older version"
                )
            problem = m.state_problem(own, where=name, config=config)
            if problem:
                raise ValueError(f"{what}: {problem}")
        return states


def _member_name(collection: OPBCCollection, member: OPBCMetric) -> str:
    return next(name for name, m in collection._modules.items() if m is member)


def _first_name_difference(own: list[str], other: list[str]) -> str:
    for i, (a, b) in enumerate(zip(own, other)):
        if a != b:
            return f"member {i} is {b!r} in the incoming collection, {a!r} here"
    if len(other) > len(own):
        return f"the incoming collection has an extra member {other[len(own)]!r}"
    return f"the incoming collection lacks member {own[len(other)]!r}"
