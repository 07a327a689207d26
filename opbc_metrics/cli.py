"""The ``opbc-metrics`` command: offline analysis of rollout dumps, and the glossary.

Usage::

    opbc-metrics analyze FILE [FILE ...] [--out DIR] [--clamp C] [--veto V] [--batch-size N]
                         [--on-error skip|fail] [--max-bad-fraction F]
    opbc-metrics glossary [--format md|json]
    python -m opbc_metrics.cli ...

``analyze`` streams each rollout dump (JSONL, one sample per line, or a JSON array, either gzipped or
not, a file or ``-`` for standard input; or a ``.pt`` dict of tensors loaded with
``weights_only=True``; the schema is in :mod:`opbc_metrics.io` and in ``--help``) in batches that keep
each prompt group's consecutive samples together (and each step's samples apart), through:

* an :class:`~opbc_metrics.collection.OPBCCollection`: the collection's default sections plus
  ``rollout`` (rewards, advantages, lengths, stop and discard reasons), or ``--sections``; a member
  whose fields the file lacks is listed under ``not_computed``;
* the same headline metrics (:data:`opbc_metrics.report.STEP_KEYS`) reset at every step (the
  ``step`` field; without it, every batch), for the report's time series;
* the Off-Policy Budget Controller (:class:`opbc_metrics.controller.OPBCController`, when the package
  has it; otherwise the result says so), which decides each group and adds its budget metrics
  (``opbc/decision/*``);
* fixed-bin histograms of the token and sequence log ratios.

It prints a summary table and writes ``DIR/result.json`` and ``DIR/report.html`` (self-contained, see
:mod:`opbc_metrics.report`). With several files it writes ``DIR/result-<name>.json`` for each and one
report comparing them (``<name>``: the file name without extensions).

The JSON result::

    {"version", "input": {path, format, samples, batches, groups, rounds_seen, layers_seen,
                          issues_total, bad_samples, bad_fraction, issues: [{where, line, message}, ...]},
     "settings": {clamp, veto, batch_size, on_error, sections, preset, limit},
     "metrics": {key: number | list | "inf" | "-inf" | "nan"},   # float(value) always works
     "not_computed": {key: "needs <fields>" | "no data in the input"},
     "histograms": {"token_log_ratio": {edges, counts, total}, "sequence_log_ratio": {...}},
     "steps": {axis: "step" | "batch", points: [{x, samples, metrics: {key: number}, decisions}]},
     "controller": {available, note, policy, decision_mix: {decision: groups},
                    groups: [{group, decision, reasons, batches, step, stats: {ess, clipped_fraction, ...}}]}}

A key missing from ``metrics`` or from a step's ``metrics`` was not measured (no data for it).

Input problems (malformed JSON on line N, a cut last line, wrong types, invalid values such as a NaN
reward, trainer/rollout lengths that differ) are reported with their line numbers on stderr and in
the result, then skipped (``--on-error skip``, the default) or fatal (``--on-error fail``). Exit
status: 0 success; 1 the input could not be analysed (refused or unreadable file, no valid sample, an
issue under ``--on-error fail``) or more than ``--max-bad-fraction`` (0.1) of the samples were bad
(the outputs are written first); 2 usage errors (unknown option, missing file, unknown extension).

Example:
    >>> import io, contextlib
    >>> buf = io.StringIO()
    >>> with contextlib.redirect_stdout(buf):
    ...     status = main(["glossary", "--format", "md"])
    >>> status, buf.getvalue().splitlines()[0]
    (0, '# opbc-metrics glossary')
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from torch import Tensor

from opbc_metrics.batch import DEFAULT_CLAMP, DEFAULT_VETO, BatchView
from opbc_metrics.io import (
    Batch,
    GroupIndex,
    InputFormatError,
    InputIssue,
    detect_format,
    is_stdin,
    read_batches,
)
from opbc_metrics.naming import parse_key
from opbc_metrics.report import (
    DECISIONS,
    STEP_KEYS,
    FixedHistogram,
    charts_available,
    fmt,
    indexed_series,
    render_report,
    symlog_edges,
)

# Sections run by default besides the collection's defaults: statistics a rollout dump carries (rewards,
# advantages, lengths, stop and discard reasons), computed only when the file has their fields.
OFFLINE_SECTIONS = ("rollout",)

# Above this share of bad (skipped) samples, analyze exits with status 1 after writing its outputs.
DEFAULT_MAX_BAD_FRACTION = 0.1
# Issues kept in the JSON result (all are counted) and printed on stderr.
MAX_ISSUES_KEPT = 1000
DEFAULT_ISSUES_SHOWN = 20

SCHEMA_HELP = """\
input schema
  JSONL (.jsonl, .ndjson): one JSON object per line, blank lines ignored, unknown keys ignored; or a JSON
  array of such objects (.json); either may be gzipped (.gz); - reads standard input.
    trainer_logprobs   list[float] (T)     log pi_trainer per token                      required
    rollout_logprobs   list[float] (T)     log pi_rollout per token (same length)        required
    response_mask      list[0/1] (T)       1 = policy token; runs of 1s are rounds        default all 1
    group_id           int | str           prompt (GRPO) group                            default: own group
    rollout_experts    list[T][L][K] int   routed expert ids, highest weight first        optional (both)
    trainer_experts    list[T][L][K] int
    policy_lag         number >= 0         trainer steps behind the rollout policy        optional
    step               int >= 0            training step (x axis of the report's charts)  optional
    reward, advantage  finite number       scalars per sample                             optional
    prompt_length, response_length  int    token counts                                   optional
    stop_reason        str                 e.g. "length" marks truncation                 optional
    discard_reason     str                 "kept", "max_async" or "zero_advantage"        optional
    Logprobs may be NaN/Infinity/-Infinity or null (missing): counted in opbc/input/nonfinite_count.
  .pt (.pt, .pth): torch.load(weights_only=True) only, files needing pickle are refused. A dict of
    tensors in the batch schema (trainer_logprobs [B,T], rollout_logprobs [B,T], response_mask [B,T],
    group_ids [B], rollout_experts/trainer_experts [B,T,L,K], policy_lag/rewards/... [B]) or a list of
    such dicts.
  Fields of verl (old_log_probs, ...) or TRL (old_per_token_logps, ...) batches: convert them with
    opbc_metrics.integrations.verl.verl_to_batch / opbc_metrics.integrations.trl.trl_to_batch first.

outputs
  DIR/result.json   every metric key, per-step series, histograms, decision mix and per-group decisions
                    (DIR/result-<name>.json per file when several are given)
  DIR/report.html   self-contained report (inline SVG charts, no network); several files are overlaid
  exit status 0 ok, 1 input could not be analysed or more than --max-bad-fraction bad samples, 2 usage error
"""


class AnalysisError(Exception):
    """The input cannot be analysed (the message says why); the CLI exits with status 1."""


# ---------------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# The controller, when the package has one
# ---------------------------------------------------------------------------------------------
CONTROLLER_MISSING = (
    "Decisions not computed: the OPBC controller (opbc_metrics.controller) is not available in this "
    "installation; the metrics above are complete."
)
# Report statistics shown per group (from GroupReport), in this order.
GROUP_STATS = ("num_sequences", "num_response_tokens", "ess", "clipped_fraction", "veto_fraction",
               "max_abs_log_ratio", "router_flip_rate", "policy_lag", "nonfinite_count")


class ControllerStep:
    """Runs :class:`opbc_metrics.controller.OPBCController` on every batch when the package has it.

    The controller decides the groups of each batch (the readers keep a run of one group's samples in
    one batch). A group whose samples were split over several batches (interleaved in the file, or more
    than the readers' slack) gets the strictest of its decisions and the union of the reasons, and
    ``batches`` says how many decisions were merged. Without the controller, :attr:`note` says why.
    """

    def __init__(self, clamp: float, veto: float, preset: str = "default") -> None:
        self.note = CONTROLLER_MISSING
        self.impl: Any = None
        self.decisions: dict[int, dict[str, Any]] = {}
        self.window_of: dict[int, int] = {}  # group id -> the step (or batch) it was first decided in
        try:
            module = importlib.import_module("opbc_metrics.controller")
        except ImportError as e:
            if e.name not in ("opbc_metrics.controller", None):
                self.note = f"Decisions not computed: the controller failed to import ({e})."
            return
        needed = ("OPBCController", "OPBCPolicy", "Action", "DECISIONS_FIELD")
        if not all(hasattr(module, n) for n in needed):
            self.note = "Decisions not computed: opbc_metrics.controller lacks " + ", ".join(
                n for n in needed if not hasattr(module, n)
            )
            return
        self.module = module
        try:
            policy = module.OPBCPolicy.preset(preset, clamp=clamp, veto=veto)
        except ValueError as e:
            raise AnalysisError(f"controller policy: {e}") from None
        self.impl = module.OPBCController(policy)
        self.policy = policy

    @property
    def available(self) -> bool:
        return self.impl is not None

    def evaluate(self, view: BatchView) -> Any:
        """Decide this batch's groups (pure: no state changes; raises ValueError on bad fields)."""
        return None if self.impl is None else self.impl.evaluate(view)

    def commit(self, out: Any, window: int) -> None:
        """Fold an evaluated batch of step (or batch number) ``window`` into the budget metrics and the
        per-group decisions."""
        if out is None:
            return
        if self.impl.budget is not None:
            self.impl.budget.update({self.module.DECISIONS_FIELD: out})
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
        if self.impl is None or self.impl.budget is None:
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
        if self.impl is None:
            return {"available": False, "note": self.note, "decision_mix": None, "groups": []}
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


# ---------------------------------------------------------------------------------------------
# Analysis
# ---------------------------------------------------------------------------------------------
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
    step_axis: str = "batch"
    step_points: list[dict[str, Any]] = field(default_factory=list)
    _window: int | None = None
    _window_samples: int = 0

    def __post_init__(self) -> None:
        from opbc_metrics.collection import DEFAULT_SECTIONS, SECTIONS, OPBCCollection
        from opbc_metrics.functional.mismatch import DEFAULT_TOP_MASS_BINS

        if self.sections is None:  # the collection's defaults and the rollout-dump statistics
            names = [*DEFAULT_SECTIONS, *(s for s in OFFLINE_SECTIONS if s in SECTIONS and s not in DEFAULT_SECTIONS)]
        elif list(self.sections) == ["all"]:
            names = list(SECTIONS)
        else:
            names = list(dict.fromkeys(self.sections))
        unknown = [s for s in names if s not in SECTIONS]
        if unknown:
            raise AnalysisError(f"unknown sections {unknown}; known: {', '.join(sorted(SECTIONS))}")
        settings = dict(clamp=self.clamp, veto=self.veto, top_mass_bins=DEFAULT_TOP_MASS_BINS)
        self.sections = names
        self.collection = OPBCCollection([m for name in names for m in SECTIONS[name](**settings)])
        self.members = self.collection.members()
        # The headline metrics again, reset at every step: the report's time series.
        step_members = [m for name in ("mismatch", "moe") for m in SECTIONS[name](**settings)
                        if set(m.keys) & set(STEP_KEYS)]
        self.step_collection = OPBCCollection(step_members)
        self.token_hist = FixedHistogram(symlog_edges())
        self.seq_hist = FixedHistogram(symlog_edges())
        self.controller = ControllerStep(self.clamp, self.veto, self.preset)
        self.groups = GroupIndex()

    def add_issue(self, issue: InputIssue, rows: int = 1) -> None:
        self.issues_total += 1
        self.bad_samples += rows
        if len(self.issues) < MAX_ISSUES_KEPT:
            self.issues.append(issue)

    def _snapshot(self) -> list[tuple[Any, dict[str, Tensor], int]]:
        members = [*self.members, *self.step_collection.members()]
        return [(m, {k: getattr(m, k).clone() for k in m._defaults}, m._update_count) for m in members]

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
            for m, states, count in snapshot:
                for k, v in states.items():
                    setattr(m, k, v)
                m._update_count = count
            return _one_line(e)
        if batch.step is not None:
            self.step_axis = "step"
        self._window = window
        self._window_samples += len(batch.group_labels)
        self.controller.commit(decided, window)
        self.token_hist.update(view.log_ratio, view.valid)
        self.seq_hist.update(view.seq_log_ratio, view.seq_valid)
        self.samples += len(batch.group_labels)
        self.batches += 1
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
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                values = self.step_collection.compute()
            except ValueError:  # bad values the whole-run metrics will report; the step gets no point
                values = {}
        seen = {k for m in self.step_collection.members() if m._update_count for k in m.keys}
        metrics = {k: _jsonable(v) for k, v in values.items() if k in seen and k in STEP_KEYS}
        self.step_points.append({"x": self._window, "samples": self._window_samples, "metrics": metrics})
        self.step_collection.reset()
        self._window, self._window_samples = None, 0

    def steps(self) -> dict[str, Any]:
        """The per-step series: ``{"axis": "step" | "batch", "points": [{x, samples, metrics, decisions}]}``."""
        self.close_window()
        mixes = self.controller.mix_per_window() if self.controller.available else {}
        points = [{**p, "decisions": mixes.get(p["x"])} if mixes else p for p in self.step_points]
        return {"axis": self.step_axis, "points": points}

    def metrics(self) -> tuple[dict[str, Any], dict[str, str]]:
        """``(metrics, not_computed)``: values of members that saw data; the others with their needs."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                values = self.collection.compute()
            except ValueError as e:  # a member validating host data at compute time
                raise AnalysisError(f"computing the metrics failed: {_one_line(e)}") from None
        out: dict[str, Any] = {}
        missing: dict[str, str] = {}
        for m in self.members:
            produced = any(key in values for key in m.keys)  # a member may leave out keys it has no value for
            for key in m.keys:
                if m._update_count == 0:
                    missing[key] = "needs " + ", ".join(m.required_fields)
                elif key in values:
                    out[key] = _jsonable(values[key])
                elif not produced:  # updated, but every batch it saw was empty for it
                    missing[key] = "no data in the input"
        for key, value in self.controller.budget().items():
            out.setdefault(key, _jsonable(value))
        return out, missing


def _one_line(e: BaseException) -> str:
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
        AnalysisError: an input issue under ``on_error="fail"``, or no valid sample at all.
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

    def report(issue: InputIssue, rows: int = 1) -> None:
        nonlocal shown
        analysis.add_issue(issue, rows)
        if on_error == "fail":
            raise AnalysisError(f"{issue} (--on-error fail)")
        if issue_stream is not None and shown < issues_shown:
            issue_stream.write(f"skipped: {issue}\n")
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
    if issue_stream is not None and analysis.issues_total > shown:
        issue_stream.write(f"skipped: ... {analysis.issues_total - shown} more issue(s), all listed in the result\n")
    if analysis.samples == 0:
        if analysis.issues_total:
            raise AnalysisError(f"{path}: no valid sample ({analysis.issues_total} issue(s), all skipped)")
        raise AnalysisError(f"{path}: empty file, no samples")

    metrics, not_computed = analysis.metrics()
    labels = analysis.groups.labels
    from opbc_metrics import __version__

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
        "steps": analysis.steps(),
        "controller": analysis.controller.result(labels),
    }


# ---------------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------------
def _glossary_names() -> dict[str, str]:
    from opbc_metrics.glossary import glossary_dict

    return {k: name for name, e in glossary_dict().items() for k in e["keys"]}


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The printed summary: input line, one block per ``section/group``, indexed series collapsed."""
    inp, settings, metrics = result["input"], result["settings"], result["metrics"]
    names = _glossary_names()
    lines = [
        f"opbc-metrics analyze {inp['path']}",
        f"  input     {inp['format']}: {inp['samples']} samples in {inp['batches']} batches, {inp['groups']} groups"
        + (f", {inp['issues_total']} issue(s) skipped" if inp["issues_total"] else ""),
        f"  settings  clamp C = {fmt(settings['clamp'])} nats, veto = {fmt(settings['veto'])} nats, "
        f"batch size {settings['batch_size']}",
        "",
    ]
    series = indexed_series(metrics)
    collapsed: set[str] = set()
    series_rows: dict[str, list[str]] = {}
    for s in series.values():
        limit = inp.get("layers_seen") if s["kind"] == "layer" else inp.get("rounds_seen")
        values = {i: v for i, v in s["values"].items() if not limit or i < limit}
        template = s["title"]
        for i in s["values"]:
            collapsed.add(template.replace("{i}", str(i)))
        if not values:
            continue
        worst = max(values, key=lambda i: values[i])
        text = f"[{len(values)} {s['kind']}s] max {fmt(values[worst])} at {s['kind']} {worst}"
        series_rows.setdefault(template, []).append(text)
    width = max([len(parse_key(k).metric) for k in metrics] + [24])
    blocks: dict[str, list[str]] = {}  # section/group -> rows, in order of first appearance
    for key, value in metrics.items():
        if key in collapsed:
            template = next((t for t in series_rows if _matches(t, key)), None)
            if template is None:
                continue
            key, shown, name = template, series_rows.pop(template)[0], ""
        else:
            shown = fmt(value)
            if isinstance(value, list):
                nums = [float(v) for v in value if isinstance(v, (int, float))]
                shown = f"[{len(value)} values]" + (f" max {fmt(max(nums))}" if nums else "")
            name = names.get(key, "")
        k = parse_key(key.replace("{i}", "0"))
        head = f"{k.section}/{k.group}" if k.group else k.section
        metric = key[len(head) + 1 :] if key.startswith(head + "/") else key
        blocks.setdefault(head, []).append(f"  {metric:<{width}}  {shown:>12}  {name}".rstrip())
    for head, rows in blocks.items():
        lines += [head, *rows]
    if result.get("not_computed"):
        count = len(result["not_computed"])
        lines += ["", f"  {count} keys not computed (the input lacks their fields); see result.json"]
    controller = result["controller"]
    lines.append("")
    if controller.get("available"):
        mix = controller["decision_mix"]
        total = sum(mix.values()) or 1
        parts = [f"{d} {c} ({100 * c / total:.1f}%)" for d, c in mix.items() if c]
        lines.append(f"decisions ({sum(mix.values())} groups): " + ", ".join(parts))
    else:
        lines.append(controller.get("note", CONTROLLER_MISSING))
    return lines


def _matches(template: str, key: str) -> bool:
    prefix, _, suffix = template.partition("{i}")
    middle = key[len(prefix) : len(key) - len(suffix)] if len(key) > len(prefix) + len(suffix) else ""
    return key.startswith(prefix) and key.endswith(suffix) and middle.isdigit()


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------
def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="opbc-metrics",
        description="Distributed-exact train/rollout mismatch metrics and the Off-Policy Budget Controller.",
    )
    from opbc_metrics import __version__

    parser.add_argument("--version", action="version", version=f"opbc-metrics {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    a = sub.add_parser(
        "analyze",
        help="analyse a rollout dump (JSONL or .pt): summary, JSON result, HTML report",
        description="Stream a rollout dump through every metric and the controller; print a summary, write "
        "DIR/result.json and a self-contained DIR/report.html.",
        epilog=SCHEMA_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a.add_argument("files", nargs="+", metavar="FILE",
                   help="rollout dump: .jsonl/.ndjson (one sample per line), .json (an array), either with .gz, "
                   "- for standard input, or .pt/.pth; several files make one comparison report")
    a.add_argument("--out", metavar="DIR",
                   help="output folder (default: ./opbc-report-<FILE stem>, or ./opbc-report for several files)")
    a.add_argument("--clamp", type=_positive, default=DEFAULT_CLAMP, metavar="C",
                   help=f"log-ratio clamp C in nats (default {DEFAULT_CLAMP:g})")
    a.add_argument("--veto", type=_positive, default=DEFAULT_VETO, metavar="V",
                   help=f"veto threshold in nats (default {DEFAULT_VETO:g})")
    a.add_argument("--batch-size", type=_count, default=64, metavar="N", help="samples per batch (default 64)")
    a.add_argument("--on-error", choices=("skip", "fail"), default="skip",
                   help="bad lines/records: report and skip (default), or stop with exit status 1")
    a.add_argument("--max-bad-fraction", type=_fraction, default=DEFAULT_MAX_BAD_FRACTION, metavar="F",
                   help="exit with status 1 (after writing the outputs) when more than this share of the samples "
                   f"was bad and skipped (default {DEFAULT_MAX_BAD_FRACTION:g})")
    a.add_argument("--sections", metavar="S[,S...]",
                   help="metric sections to run, comma-separated, or 'all' (default: the collection's default "
                   "sections and rollout; a metric runs when the file has its fields)")
    a.add_argument("--preset", default="default", metavar="NAME",
                   help="controller policy preset: default, truncated_is, masked_is (default: default)")
    a.add_argument("--limit", type=_count, metavar="N", help="stop after N samples")
    a.add_argument("--no-html", action="store_true", help="write result.json only")
    a.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="show a progress bar (tqdm; default: when stderr is a terminal)")
    a.add_argument("--no-progress", dest="progress", action="store_false", help="never show a progress bar")
    a.add_argument("--max-issues-shown", type=int, default=DEFAULT_ISSUES_SHOWN, metavar="N",
                   help=f"input issues printed on stderr (default {DEFAULT_ISSUES_SHOWN}; all go to the result)")
    a.add_argument("--debug", action="store_true", help="show a traceback on unexpected errors")
    g = sub.add_parser("glossary", help="print the metric glossary", description="Print the four-field glossary.")
    g.add_argument("--format", choices=("md", "json"), default="md", help="markdown (default) or JSON")
    return parser


def import_all_metrics(stream: TextIO | None = None) -> list[str]:
    """Import every ``opbc_metrics`` submodule, so that every metric class registers for the glossary.

    Returns the modules that failed to import (each reported on ``stream``); the glossary then lacks
    their entries but still prints.
    """
    import pkgutil

    import opbc_metrics

    failed = []
    for info in pkgutil.walk_packages(opbc_metrics.__path__, "opbc_metrics."):
        try:
            importlib.import_module(info.name)
        except Exception as e:  # an optional dependency missing, a broken module: report, go on
            failed.append(info.name)
            if stream is not None:
                stream.write(f"opbc-metrics: warning: {info.name} not imported ({type(e).__name__}: {e})\n")
    return failed


def _cmd_glossary(args: argparse.Namespace) -> int:
    from opbc_metrics.glossary import glossary_dict, glossary_markdown

    import_all_metrics(sys.stderr)

    if args.format == "json":
        sys.stdout.write(json.dumps(glossary_dict(), indent=2, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write(glossary_markdown() + "\n")
    return 0


def stream_names(paths: Sequence[str]) -> list[str]:
    """A short unique name per input: the file name without its extensions (``stdin`` for ``-``).

    Example:
        >>> stream_names(["runs/bf16.jsonl.gz", "fp8.pt", "-", "other/bf16.jsonl"])
        ['bf16', 'fp8', 'stdin', 'bf16-2']
    """
    names: list[str] = []
    for path in paths:
        base = "stdin" if is_stdin(path) else os.path.basename(path)
        stem = base.split(".")[0] or base
        name, n = stem, 1
        while name in names:
            n += 1
            name = f"{stem}-{n}"
        names.append(name)
    return names


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _cmd_analyze(args: argparse.Namespace) -> int:
    sections = [s.strip() for s in args.sections.split(",") if s.strip()] if args.sections else None
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    files: list[str] = args.files
    try:
        if sum(1 for f in files if is_stdin(f)) > 1:
            raise InputFormatError("standard input can be read only once")
        for f in files:
            detect_format(f)
            if not is_stdin(f) and not os.path.exists(f):
                raise InputFormatError(f"{f}: no such file")
    except InputFormatError as e:
        _error(str(e))
        return 2
    names = stream_names(files)
    results: dict[str, dict[str, Any]] = {}
    status = 0
    for name, path in zip(names, files):
        try:
            results[name] = analyze_file(
                path,
                clamp=args.clamp,
                veto=args.veto,
                batch_size=args.batch_size,
                on_error=args.on_error,
                sections=sections,
                preset=args.preset,
                limit=args.limit,
                progress=progress,
                issue_stream=sys.stderr,
                issues_shown=max(args.max_issues_shown, 0),
            )
        except (InputFormatError, AnalysisError) as e:
            _error(str(e))
            status = 1
    if not results:
        return 1
    single = len(files) == 1
    out_dir = args.out or ("opbc-report-" + names[0] if single else "opbc-report")
    written = []
    try:
        os.makedirs(out_dir, exist_ok=True)
        for name, result in results.items():
            json_path = os.path.join(out_dir, "result.json" if single else f"result-{name}.json")
            _write(json_path, json.dumps(result, indent=1, allow_nan=False) + "\n")
            written.append(json_path)
        if not args.no_html:
            html_path = os.path.join(out_dir, "report.html")
            _write(html_path, render_report(results))
            written.append(html_path)
    except OSError as e:
        _error(f"cannot write to {out_dir}: {e.strerror or e}")
        return 1
    if not args.no_html and not charts_available():
        sys.stderr.write('opbc-metrics: note: the report has no charts: they need matplotlib (pip install ".[report]" '
                         "in a checkout of opbc-metrics)\n")
    lines = []
    for result in results.values():
        lines += [*summary_lines(result), ""]
    lines += [f"wrote {p}" for p in written]
    sys.stdout.write("\n".join(lines) + "\n")
    for result in results.values():
        inp = result["input"]
        if inp["bad_fraction"] > args.max_bad_fraction:
            _error(f"{inp['path']}: {inp['bad_samples']} of {inp['bad_samples'] + inp['samples']} samples "
                   f"({inp['bad_fraction']:.1%}) were bad and skipped, more than --max-bad-fraction "
                   f"{args.max_bad_fraction:g}; the outputs above hold the rest")
            status = 1
    return status


def _error(message: str) -> None:
    sys.stderr.write(f"opbc-metrics: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``opbc-metrics`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if args.command == "glossary":
            return _cmd_glossary(args)
        return _cmd_analyze(args)
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except BrokenPipeError:
        with contextlib.suppress(Exception):  # the reader went away: silence the flush at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:
        if getattr(args, "debug", False):
            raise
        _error(f"unexpected {type(e).__name__}: {_one_line(e)} (run with --debug for the traceback)")
        return 1


if __name__ == "__main__":
    sys.exit(main())
