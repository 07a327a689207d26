"""The ``opbc-metrics`` command: offline analysis of rollout dumps, and the glossary.

Usage::

    opbc-metrics analyze FILE [--out DIR] [--clamp C] [--veto V] [--batch-size N] [--on-error skip|fail]
    opbc-metrics glossary [--format md|json]
    python -m opbc_metrics.cli ...

``analyze`` streams a rollout dump (JSONL, one sample per line, or a ``.pt`` dict of tensors loaded
with ``weights_only=True``; the schema is in :mod:`opbc_metrics.io` and in ``--help``) in batches
that keep each prompt group's consecutive samples together, through:

* an :class:`~opbc_metrics.collection.OPBCCollection`: the collection's default sections plus
  ``rollout`` (rewards, advantages, lengths, stop and discard reasons), or ``--sections``; a member
  whose fields the file lacks is listed under ``not_computed``;
* the Off-Policy Budget Controller (:class:`opbc_metrics.controller.OPBCController`, when the package
  has it; otherwise the result says so), which decides each group and adds its budget metrics
  (``opbc/decision/*``);
* fixed-bin histograms of the token and sequence log ratios.

It prints a summary table and writes ``DIR/result.json`` and ``DIR/report.html`` (self-contained, see
:mod:`opbc_metrics.report`).

The JSON result::

    {"version", "input": {path, format, samples, batches, groups, rounds_seen, layers_seen,
                          issues_total, issues: [{where, line, message}, ...]},
     "settings": {clamp, veto, batch_size, on_error, sections, preset, limit},
     "metrics": {key: number | list | "inf" | "-inf" | "nan"},   # float(value) always works
     "not_computed": {key: "needs <fields>" | "no data in the input"},
     "histograms": {"token_log_ratio": {edges, counts, total}, "sequence_log_ratio": {...}},
     "controller": {available, note, policy, decision_mix: {decision: groups},
                    groups: [{group, decision, reasons, batches, stats: {ess, clipped_fraction, ...}}]}}

Input problems (malformed JSON on line N, a cut last line, wrong types, trainer/rollout lengths that
differ) are reported with their line numbers on stderr and in the result, then skipped
(``--on-error skip``, the default) or fatal (``--on-error fail``). Exit status: 0 success, 1 the
input could not be analysed (refused or unreadable file, no valid sample, an issue under
``--on-error fail``), 2 usage errors (unknown option, missing file, unknown extension).

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
import time
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
    read_batches,
)
from opbc_metrics.naming import parse_key
from opbc_metrics.report import DECISIONS, FixedHistogram, fmt, indexed_series, render_html, symlog_edges

# Sections run by default besides the collection's defaults: statistics a rollout dump carries (rewards,
# advantages, lengths, stop and discard reasons), computed only when the file has their fields.
OFFLINE_SECTIONS = ("rollout",)

# Issues kept in the JSON result (all are counted) and printed on stderr.
MAX_ISSUES_KEPT = 1000
DEFAULT_ISSUES_SHOWN = 20

SCHEMA_HELP = """\
input schema
  JSONL (.jsonl, .ndjson): one JSON object per line, blank lines ignored, unknown keys ignored.
    trainer_logprobs   list[float] (T)     log pi_trainer per token                      required
    rollout_logprobs   list[float] (T)     log pi_rollout per token (same length)        required
    response_mask      list[0/1] (T)       1 = policy token; runs of 1s are rounds        default all 1
    group_id           int | str           prompt (GRPO) group                            default: own group
    rollout_experts    list[T][L][K] int   routed expert ids, highest weight first        optional (both)
    trainer_experts    list[T][L][K] int
    policy_lag         number >= 0         trainer steps behind the rollout policy        optional
    reward, advantage  number              scalars per sample                             optional
    prompt_length, response_length  int    token counts                                   optional
    stop_reason        str                 e.g. "length" marks truncation                 optional
    discard_reason     str                 "kept", "max_async" or "zero_advantage"        optional
    Logprobs may be NaN/Infinity/-Infinity or null (missing): counted in opbc/input/nonfinite_count.
  .pt (.pt, .pth): torch.load(weights_only=True) only, files needing pickle are refused. A dict of
    tensors in the batch schema (trainer_logprobs [B,T], rollout_logprobs [B,T], response_mask [B,T],
    group_ids [B], rollout_experts/trainer_experts [B,T,L,K], policy_lag/rewards/... [B]) or a list of
    such dicts.

outputs
  DIR/result.json   every metric key, histograms, decision mix and per-group decisions
  DIR/report.html   self-contained report (inline SVG charts, no network)
  exit status 0 ok, 1 input could not be analysed, 2 usage error
"""


class AnalysisError(Exception):
    """The input cannot be analysed (the message says why); the CLI exits with status 1."""


# ---------------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------------
class _Progress:
    """tqdm when installed (it comes with lightning), else a minimal throttled stderr line."""

    def __init__(self, total: int | None, unit: str, enabled: bool, stream: TextIO) -> None:
        self.enabled, self.stream, self.total, self.unit = enabled, stream, total, unit
        self.done, self._last, self._bar = 0, 0.0, None
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        scale = unit == "B"
        self._bar = tqdm(total=total, unit=unit, unit_scale=scale, file=stream, desc="analyze", leave=False)

    def advance_to(self, done: int) -> None:
        if not self.enabled:
            return
        step, self.done = done - self.done, done
        if self._bar is not None:
            self._bar.update(step)
            return
        now = time.monotonic()
        if now - self._last >= 0.2 or (self.total is not None and done >= self.total):
            self._last = now
            share = f" ({100 * done / self.total:.0f}%)" if self.total else ""
            self.stream.write(f"\ranalyze: {done} {self.unit}{share}")
            self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self.done:
            self.stream.write("\n")
            self.stream.flush()


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

    def commit(self, out: Any) -> None:
        """Fold an evaluated batch into the budget metrics and the per-group decisions."""
        if out is None:
            return
        if self.impl.budget is not None:
            self.impl.budget.update({self.module.DECISIONS_FIELD: out})
        for d in out.decisions:
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

    def result(self, labels: list[str]) -> dict[str, Any]:
        if self.impl is None:
            return {"available": False, "note": self.note, "decision_mix": None, "groups": []}
        groups = []
        for gid in sorted(self.decisions):
            d = self.decisions[gid]
            label = labels[gid] if 0 <= gid < len(labels) else str(gid)
            stats = {k: d["report"].get(k) for k in GROUP_STATS if k in d["report"]}
            groups.append({"group": label, "decision": d["decision"], "reasons": d["reasons"], "batches": d["batches"],
                           "stats": stats})
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
        self.token_hist = FixedHistogram(symlog_edges())
        self.seq_hist = FixedHistogram(symlog_edges())
        self.controller = ControllerStep(self.clamp, self.veto, self.preset)
        self.groups = GroupIndex()

    def add_issue(self, issue: InputIssue) -> None:
        self.issues_total += 1
        if len(self.issues) < MAX_ISSUES_KEPT:
            self.issues.append(issue)

    def _snapshot(self) -> list[tuple[Any, dict[str, Tensor], int]]:
        return [(m, {k: getattr(m, k).clone() for k in m._defaults}, m._update_count) for m in self.members]

    def update(self, batch: Batch) -> str | None:
        """Fold one batch in; on bad values, roll every member back and return the problem."""
        view = BatchView(batch.tensors)
        snapshot = self._snapshot()
        try:
            _ = view.token_inputs  # validate the core fields before touching any state
            decided = self.controller.evaluate(view)  # pure; raises on fields it cannot use
            self.collection.update(view)  # members with optional inputs skip batches lacking their fields
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
        self.controller.commit(decided)
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
    size = os.path.getsize(path) if os.path.isfile(path) else None
    jsonl = fmt_name == "jsonl"
    bar = _Progress(size if jsonl else None, "B" if jsonl else "samples", progress, sys.stderr)
    shown = 0

    def report(issue: InputIssue) -> None:
        nonlocal shown
        analysis.add_issue(issue)
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
                report(InputIssue(path, item.where, problem))
            bar.advance_to(item.num_bytes if jsonl else analysis.samples)
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
    a.add_argument("file", metavar="FILE", help="rollout dump: .jsonl/.ndjson (one sample per line) or .pt/.pth")
    a.add_argument("--out", metavar="DIR", help="output folder (default: ./opbc-report-<FILE stem>)")
    a.add_argument("--clamp", type=_positive, default=DEFAULT_CLAMP, metavar="C",
                   help=f"log-ratio clamp C in nats (default {DEFAULT_CLAMP:g})")
    a.add_argument("--veto", type=_positive, default=DEFAULT_VETO, metavar="V",
                   help=f"veto threshold in nats (default {DEFAULT_VETO:g})")
    a.add_argument("--batch-size", type=_count, default=64, metavar="N", help="samples per batch (default 64)")
    a.add_argument("--on-error", choices=("skip", "fail"), default="skip",
                   help="bad lines/records: report and skip (default), or stop with exit status 1")
    a.add_argument("--sections", metavar="S[,S...]",
                   help="metric sections to run, comma-separated, or 'all' (default: the collection's default "
                   "sections and rollout; a metric runs when the file has its fields)")
    a.add_argument("--preset", default="default", metavar="NAME",
                   help="controller policy preset: default, truncated_is, masked_is (default: default)")
    a.add_argument("--limit", type=_count, metavar="N", help="stop after N samples")
    a.add_argument("--no-html", action="store_true", help="write result.json only")
    a.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="show a progress bar (default: when stderr is a terminal)")
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


def _cmd_analyze(args: argparse.Namespace) -> int:
    sections = [s.strip() for s in args.sections.split(",") if s.strip()] if args.sections else None
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    try:
        detect_format(args.file)
        if not os.path.exists(args.file):
            raise InputFormatError(f"{args.file}: no such file")
    except InputFormatError as e:
        _error(str(e))
        return 2
    try:
        result = analyze_file(
            args.file,
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
        return 1
    stem = os.path.splitext(os.path.basename(args.file))[0]
    out_dir = args.out or f"opbc-report-{stem}"
    try:
        os.makedirs(out_dir, exist_ok=True)
        json_path = os.path.join(out_dir, "result.json")
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, allow_nan=False)
            f.write("\n")
        written = [json_path]
        if not args.no_html:
            html_path = os.path.join(out_dir, "report.html")
            with open(html_path, "w", encoding="utf-8") as f:
                f.write(render_html(result))
            written.append(html_path)
    except OSError as e:
        _error(f"cannot write to {out_dir}: {e.strerror or e}")
        return 1
    lines = summary_lines(result)
    lines += ["", *(f"wrote {p}" for p in written)]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


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
