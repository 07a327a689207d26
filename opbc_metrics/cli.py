"""The ``opbc-metrics`` command: offline analysis of rollout dumps, and the glossary.

Usage::

    opbc-metrics analyze FILE [FILE ...] [--out DIR] [--clamp C] [--veto V] [--batch-size N]
                         [--on-error skip|fail] [--max-bad-fraction F]
    opbc-metrics glossary [--format md|json]
    python -m opbc_metrics ...        (or python -m opbc_metrics.cli ...)

``analyze`` streams each rollout dump (JSONL, one sample per line, or a JSON array, either gzipped or
not, a file or ``-`` for standard input; or a ``.pt`` dict of tensors loaded with
``weights_only=True``; the schema is in :mod:`opbc_metrics.io` and in ``--help``) through the metrics,
the per-step headline series, the controller and the log-ratio histograms of
:mod:`opbc_metrics.analysis`.

It prints a summary table and writes ``DIR/result.json`` and ``DIR/report.html`` (self-contained, see
:mod:`opbc_metrics.report`). With several files it writes ``DIR/result-<name>.json`` for each and one
report comparing them (``<name>``: the file name without extensions).

The JSON result::

    {"version", "input": {path, format, samples, batches, groups, rounds_seen, layers_seen,
                          issues_total, bad_samples, bad_fraction, issues: [{where, line, message}, ...],
                          ignored_keys: {key: samples carrying it}},
     "settings": {clamp, veto, batch_size, on_error, sections, preset, limit},
     "metrics": {key: number | list | "inf" | "-inf" | "nan"},   # float(value) always works
     "not_computed": {key: "needs <fields>" | "no data in the input" | "computing failed: <error>"},
     "histograms": {"token_log_ratio": {edges, counts, total}, "sequence_log_ratio": {...}},
     "steps": {axis: "step" | "batch", points: [{x, samples, metrics: {key: number}, decisions}]},
     "controller": {available, note, policy, decision_mix: {decision: groups},
                    groups: [{group, decision, reasons, batches, step, stats: {ess, clipped_fraction, ...}}]}}

A key of the input outside the schema (``prompt``, ``uid``) is ignored and listed, with the number of samples that
carried it, in ``ignored_keys`` and in the summary; one that looks meant for a schema key (``mask``,
``respons_mask``, the batch name ``rewards`` in a JSONL sample) is an input issue instead, since ignoring it would
change the result.

A key missing from ``metrics`` or from a step's ``metrics`` was not measured (no data for it); a group's
statistic is ``null`` when the group had no data for it (no ESS for a group without a valid token).

Input problems (malformed JSON on line N, a cut last line, wrong types, invalid values such as a NaN
reward, trainer/rollout lengths that differ, a misspelt key) are reported with their line numbers on stderr and in
the result, then skipped (``--on-error skip``, the default) or fatal (``--on-error fail``). A metric whose
computation refuses the values it saw is left out (``not_computed``: ``computing failed: <error>``, and an issue
naming the step or batch); the others are kept. Exit status: 0 success; 1 the input could not be analysed
(refused or unreadable file, no valid sample, an issue under ``--on-error fail``), more than
``--max-bad-fraction`` (0.1) of the samples were bad, or a metric's computation failed (the outputs are
written first); 2 usage errors (unknown option, missing file, unknown extension).

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
from collections.abc import Sequence
from typing import Any, TextIO

from opbc_metrics.analysis import COMPUTE_FAILED, DEFAULT_ISSUES_SHOWN, AnalysisError, analyze_file, one_line
from opbc_metrics.batch import DEFAULT_CLAMP, DEFAULT_VETO, close_name
from opbc_metrics.collection import SECTIONS
from opbc_metrics.io import InputFormatError, detect_format, is_stdin
from opbc_metrics.naming import parse_key
from opbc_metrics.policy import PRESETS, OPBCPolicy
from opbc_metrics.report import charts_available, fmt, indexed_series, render_report

__all__ = ["AnalysisError", "analyze_file", "build_parser", "import_all_metrics", "main", "summary_lines"]

# Above this share of bad (skipped) samples, analyze exits with status 1 after writing its outputs.
DEFAULT_MAX_BAD_FRACTION = 0.1

SCHEMA_HELP = """\
input schema
  JSONL (.jsonl, .ndjson): one JSON object per line, blank lines ignored; or a JSON array of such objects
  (.json); either may be gzipped (.gz); - reads standard input. Other keys are ignored and listed in the
  summary, except one that looks like a misspelt schema key (mask, respons_mask, rewards): that sample is
  an input issue.
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
    group_ids [B], rollout_experts/trainer_experts [B,T,L,K], policy_lag/rewards/... [B], step int) or a
    list of such dicts; other keys are treated as in JSONL (reward, group_id, mask: an issue of the record).
  Fields of verl (old_log_probs, ...) or TRL (old_per_token_logps, ...) batches: convert them with
    opbc_metrics.integrations.verl.verl_to_batch / opbc_metrics.integrations.trl.trl_to_batch first.

outputs
  DIR/result.json   every metric key, per-step series, histograms, decision mix and per-group decisions
                    (DIR/result-<name>.json per file when several are given)
  DIR/report.html   self-contained report (inline SVG charts, no network); several files are overlaid
  exit status 0 ok, 1 input could not be analysed or more than --max-bad-fraction bad samples, 2 usage error
"""


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
    ]
    if inp.get("ignored_keys"):  # said once, so that no key of the input is ignored silently
        ignored = ", ".join(f"{k} ({n} samples)" for k, n in inp["ignored_keys"].items())
        lines.append(f"  ignored   keys outside the schema: {ignored}")
    lines += [
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
    failed = _failed_keys(result)
    if len(result.get("not_computed", ())) > len(failed):
        count = len(result["not_computed"]) - len(failed)
        lines += ["", f"  {count} keys not computed (the input lacks their fields); see result.json"]
    if failed:
        lines += ["", f"  {len(failed)} keys not computed: computing them failed on the input's values (see the "
                  "issues above and result.json)"]
    mix = result["controller"]["decision_mix"]
    total = sum(mix.values()) or 1
    parts = [f"{d} {c} ({100 * c / total:.1f}%)" for d, c in mix.items() if c]
    lines += ["", f"decisions ({sum(mix.values())} groups): " + ", ".join(parts)]
    return lines


def _failed_keys(result: dict[str, Any]) -> list[str]:
    """Keys whose metric's computation refused the input's values."""
    return [k for k, why in result.get("not_computed", {}).items() if why.startswith(COMPUTE_FAILED)]


def _matches(template: str, key: str) -> bool:
    prefix, _, suffix = template.partition("{i}")
    middle = key[len(prefix) : len(key) - len(suffix)] if len(key) > len(prefix) + len(suffix) else ""
    return key.startswith(prefix) and key.endswith(suffix) and middle.isdigit()


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------
def _checked_number(convert: type, ok: Any, expected: str) -> Any:
    """An argparse ``type``: ``convert(text)``, refused unless ``ok(value)``."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if convert is int else 'a number'}, got {text!r}"
            ) from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive = _checked_number(float, lambda v: v > 0 and math.isfinite(v), "a positive finite number")
_fraction = _checked_number(float, lambda v: 0.0 <= v <= 1.0, "a fraction in [0, 1]")
_count = _checked_number(int, lambda v: v >= 1, "an integer >= 1")
_non_negative_count = _checked_number(int, lambda v: v >= 0, "an integer >= 0")


def _sections(text: str) -> list[str]:
    """An argparse ``type`` for ``--sections``: a comma-separated list of known section names, or ``all``."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    known = sorted(SECTIONS)
    choices = f"choose from {', '.join(map(repr, known))}, comma-separated, or 'all'"
    if not names:
        raise argparse.ArgumentTypeError(f"expected at least one section, got {text!r}; {choices}")
    if "all" in names:
        if names != ["all"]:
            raise argparse.ArgumentTypeError(f"'all' cannot be combined with other sections, got {text!r}")
        return names
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        hints = [f"{n!r} (did you mean {close!r}?)" if (close := close_name(n, known)) else repr(n) for n in unknown]
        raise argparse.ArgumentTypeError(f"unknown section(s) {', '.join(hints)}; {choices}")
    return names


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
    a.add_argument("--sections", type=_sections, metavar="S[,S...]",
                   help=f"metric sections to run ({', '.join(sorted(SECTIONS))}), comma-separated, or 'all' "
                   "(default: the collection's default "
                   "sections and rollout; a metric runs when the file has its fields)")
    a.add_argument("--preset", default="default", choices=sorted(PRESETS), metavar="NAME",
                   help=f"controller policy preset: {', '.join(sorted(PRESETS))} (default: default)")
    a.add_argument("--limit", type=_count, metavar="N", help="stop after N samples")
    a.add_argument("--no-html", action="store_true", help="write result.json only")
    a.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="show a progress bar (tqdm; default: when stderr is a terminal)")
    a.add_argument("--no-progress", dest="progress", action="store_false", help="never show a progress bar")
    a.add_argument("--max-issues-shown", type=_non_negative_count, default=DEFAULT_ISSUES_SHOWN, metavar="N",
                   help=f"input issues printed on stderr (default {DEFAULT_ISSUES_SHOWN}; all go to the result)")
    a.add_argument("--debug", action="store_true", help="show a traceback on unexpected errors")
    a.set_defaults(usage_error=a.error)
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


def _check_policy(args: argparse.Namespace) -> None:
    """The option values that are valid alone but not together (``--veto`` below ``--clamp``, or a value the
    ``--preset`` refuses) as a usage error (exit status 2), before any input is read."""
    try:
        with warnings.catch_warnings():  # the analysis builds the policy again and shows its warnings
            warnings.simplefilter("ignore")
            OPBCPolicy.preset(args.preset, clamp=args.clamp, veto=args.veto)
    except ValueError as e:
        args.usage_error(f"argument --clamp/--veto/--preset: {e}")


def _cmd_analyze(args: argparse.Namespace) -> int:
    sections = args.sections
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
        failed = _failed_keys(result)
        if failed:
            _error(f"{inp['path']}: {len(failed)} key(s) not computed: their computation refused the input's values "
                   "(see the issues above); the outputs above hold the rest")
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
        _check_policy(args)
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
        _error(f"unexpected {type(e).__name__}: {one_line(e)} (run with --debug for the traceback)")
        return 1


if __name__ == "__main__":
    sys.exit(main())
