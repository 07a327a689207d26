"""Offline analysis of rollout dumps: the engine behind ``opbc-metrics analyze``.

:func:`analyze_file` streams one dump (:mod:`opbc_metrics.io` reads it in batches that keep each prompt
group's consecutive samples together, and each step's samples apart) through:

* an :class:`~opbc_metrics.collection.OPBCCollection`: the collection's default sections plus
  ``rollout`` (rewards, advantages, lengths, stop and discard reasons), or the sections asked for; a
  member whose fields the file lacks is listed under ``not_computed``;
* the same headline metrics (:data:`opbc_metrics.report.STEP_KEYS`) reset at every step (the ``step``
  field; without it, every batch), for the report's time series;
* the Off-Policy Budget Controller (:class:`~opbc_metrics.controller.OPBCController`), which decides each
  group and adds its budget metrics (``opbc/decision/*``);
* fixed-bin histograms of the token and sequence log ratios.

A batch with bad values (a ``ValueError`` naming the field) changes nothing: every metric is rolled back to
its states before the batch (through torchmetrics' public ``metric_state``, ``reset`` and ``merge_state``),
and the problem is reported as an input issue. A metric whose ``compute()`` refuses the values it saw (a
``ValueError``, for the whole run or for one step) is left out, with the error in ``not_computed`` and an
input issue naming the step (or batch); the other metrics are kept. The result is the JSON document described
in :mod:`opbc_metrics.cli`.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from torch import Tensor

from opbc_metrics import __version__
from opbc_metrics.batch import DEFAULT_CLAMP, DEFAULT_VETO, BatchView
from opbc_metrics.collection import DEFAULT_SECTIONS, SECTIONS, OPBCCollection
from opbc_metrics.controller import DECISIONS_FIELD, OPBCController, OPBCPolicy
from opbc_metrics.io import Batch, GroupLabels, InputIssue, detect_format, is_stdin, read_batches
from opbc_metrics.metric import OPBCMetric
from opbc_metrics.report import DECISIONS, STEP_KEYS, FixedHistogram, symlog_edges

# Sections run by default besides the collection's defaults: statistics a rollout dump carries (rewards,
# advantages, lengths, stop and discard reasons), computed only when the file has their fields.
OFFLINE_SECTIONS = ("rollout",)

# Issues kept in the JSON result (all are counted) and printed on stderr.
MAX_ISSUES_KEPT = 1000
DEFAULT_ISSUES_SHOWN = 20
# The ``not_computed`` reason of a key whose metric's compute() raised (followed by the error).
COMPUTE_FAILED = "computing failed: "
# Report statistics shown per group (from GroupReport), in this order.
GROUP_STATS = ("num_sequences", "num_response_tokens", "ess", "clipped_fraction", "veto_fraction",
               "max_abs_log_ratio", "router_flip_rate", "policy_lag", "nonfinite_count")


class AnalysisError(Exception):
    """The input cannot be analysed (the message says why); the CLI exits with status 1."""


class _Progress:
    """A tqdm bar on ``stream`` (bytes of the file when its size is known, else samples), or nothing."""

    def __init__(self, total: int | None, unit: str, enabled: bool, stream: TextIO, desc: str) -> None:
        self.done, self._bar = 0, None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit=unit, unit_scale=unit == "B", file=stream, desc=desc, leave=False)

    def advance_to(self, done: int) -> None:
        if self._bar is not None and done > self.done:
            self._bar.update(done - self.done)
            self.done = done

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class ControllerStep:
    """Runs :class:`opbc_metrics.controller.OPBCController` on every batch.

    The controller decides the groups of each batch (the readers keep a run of one group's samples in
    one batch). A group whose samples were split over several batches (interleaved in the file, or more
    than the readers' slack) gets the strictest of its decisions and the union of the reasons, and
    ``batches`` says how many decisions were merged.
    """

    def __init__(self, clamp: float, veto: float, preset: str = "default") -> None:
        self.decisions: dict[int, dict[str, Any]] = {}
        self.window_of: dict[int, int] = {}  # group id -> the step (or batch) it was first decided in
        try:
            self.policy = OPBCPolicy.preset(preset, clamp=clamp, veto=veto)
        except ValueError as e:
            raise AnalysisError(f"controller policy: {e}") from None
        self.impl = OPBCController(self.policy)

    def evaluate(self, view: BatchView) -> Any:
        """Decide this batch's groups (pure: no state changes; raises ValueError on bad fields)."""
        return self.impl.evaluate(view)

    def commit(self, out: Any, window: int) -> None:
        """Fold an evaluated batch of step (or batch number) ``window`` into the budget metrics and the
        per-group decisions."""
        if self.impl.budget is not None:
            self.impl.budget.update({DECISIONS_FIELD: out})
        for d in out.decisions:
            self.window_of.setdefault(d.group_id, window)
            report = d.report.to_dict() if d.report is not None else {}
            new = {"decision": d.action.value, "reasons": [r.value for r in d.reasons], "report": report,
                   "batches": 1, "_strictness": d.action.strictness}
            old = self.decisions.get(d.group_id)
            if old is None:
                self.decisions[d.group_id] = new
                continue
            keep = new if new["_strictness"] > old["_strictness"] else old
            reasons = list(dict.fromkeys(old["reasons"] + new["reasons"]))
            self.decisions[d.group_id] = {**keep, "reasons": reasons, "batches": old["batches"] + 1}

    def budget(self) -> dict[str, Tensor]:
        if self.impl.budget is None:
            return {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self.impl.compute_budget()

    def mix_per_window(self) -> dict[int, dict[str, int]]:
        """``{step: {decision: groups}}``, each group counted once, at the step it was first decided in."""
        out: dict[int, dict[str, int]] = {}
        for gid, d in self.decisions.items():
            mix = out.setdefault(self.window_of[gid], dict.fromkeys(DECISIONS, 0))
            mix[d["decision"]] = mix.get(d["decision"], 0) + 1
        return out

    def result(self, labels: list[str]) -> dict[str, Any]:
        groups = []
        for gid in sorted(self.decisions):
            d = self.decisions[gid]
            label = labels[gid] if 0 <= gid < len(labels) else str(gid)
            stats = {k: d["report"].get(k) for k in GROUP_STATS if k in d["report"]}
            groups.append({"group": label, "decision": d["decision"], "reasons": d["reasons"], "batches": d["batches"],
                           "step": self.window_of.get(gid), "stats": stats})
        mix = {name: 0 for name in DECISIONS}
        for g in groups:
            mix[g["decision"]] = mix.get(g["decision"], 0) + 1
        split = sum(1 for g in groups if g["batches"] > 1)
        note = f"{split} group(s) were split across batches: strictest decision kept." if split else ""
        return {"available": True, "note": note, "policy": self.policy.to_dict(), "decision_mix": mix,
                "groups": groups}


@dataclass
class Analysis:
    """Streams batches into the collection, the histograms and the controller."""

    clamp: float = DEFAULT_CLAMP
    veto: float = DEFAULT_VETO
    sections: Sequence[str] | None = None
    preset: str = "default"
    samples: int = 0
    batches: int = 0
    rounds_seen: int = 0
    layers_seen: int = 0
    group_ids_seen: set[int] = field(default_factory=set)
    issues: list[InputIssue] = field(default_factory=list)
    issues_total: int = 0
    bad_samples: int = 0
    # Keys outside the input schema that the analysed samples carried (ignored): key -> samples.
    ignored_keys: dict[str, int] = field(default_factory=dict)
    step_axis: str = "batch"
    step_points: list[dict[str, Any]] = field(default_factory=list)
    # (where, message) of each compute() that raised: "step 3" / the batch's lines, or "whole run".
    compute_failures: list[tuple[str, str]] = field(default_factory=list)
    _window: int | None = None
    _window_samples: int = 0
    _window_where: str = ""
    # Members that took at least one batch: of the whole run, and of the current step.
    _updated: set[int] = field(default_factory=set)
    _step_updated: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.sections is None:  # the collection's defaults and the rollout-dump statistics
            names = [*DEFAULT_SECTIONS, *(s for s in OFFLINE_SECTIONS if s in SECTIONS and s not in DEFAULT_SECTIONS)]
        elif list(self.sections) == ["all"]:
            names = list(SECTIONS)
        else:
            names = list(dict.fromkeys(self.sections))
        unknown = [s for s in names if s not in SECTIONS]
        if unknown:
            raise AnalysisError(f"unknown sections {unknown}; known: {', '.join(sorted(SECTIONS))}")
        self.sections = names
        self.collection = OPBCCollection(sections=names, clamp=self.clamp, veto=self.veto)
        self.members = self.collection.members()
        # The headline metrics again, reset at every step: the report's time series.
        headline = OPBCCollection(sections=("mismatch", "moe"), clamp=self.clamp, veto=self.veto).members()
        self.step_collection = OPBCCollection([m for m in headline if set(m.keys) & set(STEP_KEYS)])
        self.token_hist = FixedHistogram(symlog_edges())
        self.seq_hist = FixedHistogram(symlog_edges())
        self.controller = ControllerStep(self.clamp, self.veto, self.preset)
        self.groups = GroupLabels()

    def add_issue(self, issue: InputIssue, rows: int = 1) -> None:
        self.issues_total += 1
        self.bad_samples += rows
        if len(self.issues) < MAX_ISSUES_KEPT:
            self.issues.append(issue)

    def _snapshot(self) -> list[tuple[OPBCMetric, dict[str, Tensor]]]:
        """Every member's states, copied through torchmetrics' public ``metric_state``."""
        members = [*self.members, *self.step_collection.members()]
        return [(m, {k: v.clone() for k, v in m.metric_state.items()}) for m in members]

    @staticmethod
    def _restore(snapshot: list[tuple[OPBCMetric, dict[str, Tensor]]]) -> None:
        """Put the states back: ``reset`` to the defaults, then ``merge_state`` the copies (exact for the
        sum, max and min states every member has)."""
        for m, states in snapshot:
            m.reset()
            m.merge_state(states)

    def update(self, batch: Batch) -> str | None:
        """Fold one batch in; on bad values, roll every member back and return the problem."""
        view = BatchView(batch.tensors)
        window = batch.step if batch.step is not None else self.batches
        if window != self._window:
            self.close_window()
        snapshot = self._snapshot()
        try:
            _ = view.token_inputs  # validate the core fields before touching any state
            decided = self.controller.evaluate(view)  # pure; raises on fields it cannot use
            self.collection.update(view)  # members with optional inputs skip batches lacking their fields
            self.step_collection.update(view)
        except (ValueError, TypeError) as e:
            # Bad batch values raise a ValueError (or TypeError) naming the field in backticks; anything
            # else is a bug and propagates.
            if isinstance(e, TypeError) and "`" not in str(e):
                raise
            self._restore(snapshot)
            return one_line(e)
        # A collection updates exactly the members that accept the view.
        self._updated.update(id(m) for m in self.members if m.accepts(view))
        self._step_updated.update(id(m) for m in self.step_collection.members() if m.accepts(view))
        if batch.step is not None:
            self.step_axis = "step"
        self._window = window
        self._window_where = f"step {window}" if batch.step is not None else batch.where
        self._window_samples += len(batch.group_labels)
        self.controller.commit(decided, window)
        self.token_hist.update(view.log_ratio, view.valid)
        self.seq_hist.update(view.seq_log_ratio, view.seq_valid)
        self.samples += len(batch.group_labels)
        self.batches += 1
        for key, count in batch.ignored_keys.items():
            self.ignored_keys[key] = self.ignored_keys.get(key, 0) + count
        self.group_ids_seen.update(batch.tensors["group_ids"].tolist())
        mask = view.token_inputs[2]
        if mask.shape[1]:
            starts = mask[:, :1].sum(1) + (mask[:, 1:] & ~mask[:, :-1]).sum(1)
            self.rounds_seen = max(self.rounds_seen, int(starts.max()))
        experts = batch.tensors.get("rollout_experts")
        if isinstance(experts, Tensor) and experts.ndim == 4:
            self.layers_seen = max(self.layers_seen, int(experts.shape[2]))
        return None

    def close_window(self) -> None:
        """Record the headline metrics of the current step (keys of members without data left out), reset."""
        if self._window is None or self._window_samples == 0:
            return
        values, failed = _compute_each(self.step_collection)
        for m, problem in failed.values():
            self.compute_failures.append((self._window_where, f"computing {', '.join(m.keys)} failed: {problem}"))
        seen = {k for m in self.step_collection.members() if id(m) in self._step_updated for k in m.keys}
        metrics = {k: _jsonable(v) for k, v in values.items() if k in seen and k in STEP_KEYS}
        self.step_points.append({"x": self._window, "samples": self._window_samples, "metrics": metrics})
        self.step_collection.reset()
        self._step_updated.clear()
        self._window, self._window_samples, self._window_where = None, 0, ""

    def steps(self) -> dict[str, Any]:
        """The per-step series: ``{"axis": "step" | "batch", "points": [{x, samples, metrics, decisions}]}``."""
        self.close_window()
        mixes = self.controller.mix_per_window()
        points = [{**p, "decisions": mixes.get(p["x"])} if mixes else p for p in self.step_points]
        return {"axis": self.step_axis, "points": points}

    def metrics(self) -> tuple[dict[str, Any], dict[str, str]]:
        """``(metrics, not_computed)``: values of members that saw data; the others with their needs."""
        values, failed = _compute_each(self.collection)
        for m, problem in failed.values():
            self.compute_failures.append(("whole run", f"computing {', '.join(m.keys)} failed: {problem}"))
        out: dict[str, Any] = {}
        missing: dict[str, str] = {}
        for m in self.members:
            produced = any(key in values for key in m.keys)  # a member may leave out keys it has no value for
            for key in m.keys:
                if id(m) in failed:
                    missing[key] = COMPUTE_FAILED + failed[id(m)][1]
                elif id(m) not in self._updated:
                    missing[key] = "needs " + ", ".join(m.required_fields)
                elif key in values:
                    out[key] = _jsonable(values[key])
                elif not produced:  # updated, but every batch it saw was empty for it
                    missing[key] = "no data in the input"
        for key, value in self.controller.budget().items():
            out.setdefault(key, _jsonable(value))
        return out, missing


def _compute_each(collection: OPBCCollection) -> tuple[dict[str, Tensor], dict[int, tuple[OPBCMetric, str]]]:
    """``collection.compute()``; when a member raises a ``ValueError`` (values it refuses at compute), every member
    on its own (one process: no sync), so that one bad member leaves out only its own keys: ``(values, {id(member):
    (member, error)})`` (by id: a torchmetrics ``Metric`` hashes its states and overloads ``==``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return collection.compute(), {}
        except ValueError:
            pass
        values: dict[str, Tensor] = {}
        failed: dict[int, tuple[OPBCMetric, str]] = {}
        for m in collection.members():
            try:
                values.update(m.compute_dict())
            except ValueError as e:
                failed[id(m)] = (m, one_line(e))
        return values, failed


def one_line(e: BaseException) -> str:
    """An exception's message on one line (its type's name when it has none)."""
    text = " ".join(str(e).split())
    return text or type(e).__name__


def _jsonable(value: Any) -> Any:
    """Tensors to numbers or lists; non-finite floats as the strings ``"inf"``, ``"-inf"``, ``"nan"``."""
    if isinstance(value, Tensor):
        value = value.detach().cpu().tolist()
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def analyze_file(
    path: str,
    *,
    clamp: float = DEFAULT_CLAMP,
    veto: float = DEFAULT_VETO,
    batch_size: int = 64,
    on_error: str = "skip",
    sections: Sequence[str] | None = None,
    preset: str = "default",
    limit: int | None = None,
    progress: bool = False,
    issue_stream: TextIO | None = None,
    issues_shown: int = DEFAULT_ISSUES_SHOWN,
) -> dict[str, Any]:
    """Analyse one dump and return the JSON result (see the module docstring).

    Raises:
        InputFormatError: unknown extension, missing file, unreadable or pickle-needing ``.pt``.
        AnalysisError: an input issue (or a metric refusing its values at compute) under ``on_error="fail"``, or
            no valid sample at all.
    """
    if on_error not in ("skip", "fail"):
        raise ValueError(f"on_error must be 'skip' or 'fail', got {on_error!r}")
    fmt_name = detect_format(path)
    analysis = Analysis(clamp=clamp, veto=veto, sections=sections, preset=preset)
    size = os.path.getsize(path) if fmt_name != "pt" and os.path.isfile(path) else None
    by_bytes = size is not None
    name = "stdin" if is_stdin(path) else os.path.basename(path)
    bar = _Progress(size, "B" if by_bytes else "samples", progress, sys.stderr, name)
    shown = 0

    def report(issue: InputIssue, rows: int = 1, what: str = "skipped") -> None:
        nonlocal shown
        analysis.add_issue(issue, rows)
        if on_error == "fail":
            raise AnalysisError(f"{issue} (--on-error fail)")
        if issue_stream is not None and shown < issues_shown:
            issue_stream.write(f"{what}: {issue}\n")
            shown += 1

    try:
        items: Iterator[Batch | InputIssue] = read_batches(path, batch_size, analysis.groups, limit)
        for item in items:
            if isinstance(item, InputIssue):
                report(item)
                continue
            problem = analysis.update(item)
            if problem is not None:
                report(InputIssue(path, item.where, problem), len(item.group_labels))
            bar.advance_to(item.num_bytes if by_bytes else analysis.samples)
    except OSError as e:
        raise AnalysisError(f"{path}: cannot read ({e.strerror or e})") from None
    finally:
        bar.close()
    if analysis.samples == 0:
        if analysis.issues_total:
            raise AnalysisError(f"{path}: no valid sample ({analysis.issues_total} issue(s), all skipped)")
        raise AnalysisError(f"{path}: empty file, no samples")

    steps = analysis.steps()  # first: the last step's failures come before the whole run's
    metrics, not_computed = analysis.metrics()
    for where, message in analysis.compute_failures:  # 0 bad samples: only the failing metrics' keys are lost
        report(InputIssue(path, where, message), 0, "not computed")
    if issue_stream is not None and analysis.issues_total > shown:
        issue_stream.write(f"... {analysis.issues_total - shown} more issue(s), all listed in the result\n")
    labels = analysis.groups.labels
    return {
        "version": __version__,
        "input": {
            "path": path,
            "format": fmt_name,
            "samples": analysis.samples,
            "batches": analysis.batches,
            "groups": len(analysis.group_ids_seen),
            "rounds_seen": analysis.rounds_seen,
            "layers_seen": analysis.layers_seen,
            "issues_total": analysis.issues_total,
            "bad_samples": analysis.bad_samples,
            "bad_fraction": analysis.bad_samples / (analysis.bad_samples + analysis.samples),
            "issues": [i.as_dict() for i in analysis.issues],
            "ignored_keys": dict(sorted(analysis.ignored_keys.items(), key=lambda kv: (-kv[1], kv[0]))),
        },
        "settings": {
            "clamp": clamp,
            "veto": veto,
            "batch_size": batch_size,
            "on_error": on_error,
            "sections": list(analysis.sections or ()),
            "preset": preset,
            "limit": limit,
        },
        "metrics": metrics,
        "not_computed": not_computed,
        "histograms": {
            "token_log_ratio": analysis.token_hist.as_dict(),
            "sequence_log_ratio": analysis.seq_hist.as_dict(),
        },
        "steps": steps,
        "controller": analysis.controller.result(labels),
    }


