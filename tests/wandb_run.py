"""Read an offline W&B run back from its ``.wandb`` file, and count what its dashboard shows.

wandb >= 0.19 writes offline runs with its Go core and ships no Python reader for the transaction log,
so :func:`read_offline_run` parses it here: a LevelDB-log-style file (a 7-byte header ``":W&B"``,
magic ``0xBEE1``, version 0, then 32 KiB blocks of records with a 7-byte header: CRC32C, length,
type FULL/FIRST/MIDDLE/LAST) whose payloads are ``wandb.proto.wandb_internal_pb2.Record`` messages.
"""

from __future__ import annotations

import glob
import itertools
import json
import math
import struct
import time
from pathlib import Path
from typing import Any


def _records(path: str) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), "not a wandb transaction log"
    block, header = 32768, 7
    pos, pending, payloads = 7, b"", []
    while pos + header <= len(data):
        left = block - pos % block
        if left < header:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        if kind == 0 and length == 0:
            pos += left
            continue
        if pos + header + length > len(data):  # a record wandb-core is still writing: not read yet
            break
        pending += data[pos + header : pos + header + length]  # FIRST and MIDDLE parts wait for the LAST
        pos += header + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            payloads.append(pending)
            pending = b""
    return [wandb_internal_pb2.Record.FromString(payload) for payload in payloads]


def _items(items: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        value = json.loads(item.value_json)
        if item.key or len(item.nested_key) == 1:
            out[item.key or item.nested_key[0]] = value
        else:
            parent, child = "/".join(item.nested_key[:-1]), item.nested_key[-1]
            out.setdefault(parent, {})[child] = value
    return out


def run_file(root: str | Path) -> str:
    """The ``.wandb`` file of the one offline run under ``root`` (the ``dir`` given to ``wandb.init``)."""
    (path,) = glob.glob(str(Path(root) / "wandb" / "offline-run-*" / "run-*.wandb"))
    return path


def read_offline_run(root: str | Path, timeout: float = 30.0) -> dict[str, Any]:
    """History rows, final summary, merged config and ``define_metric`` records of the one offline run.

    wandb-core may still be flushing the log when ``run.finish()`` returns (seen on a loaded machine),
    so the file is re-read until its ``exit`` record is there; a record cut off at the end of the file, or one
    that does not decode (a write torn mid-flush, seen once in CI), means the same.
    """
    from google.protobuf.message import DecodeError

    path = run_file(root)
    deadline = time.monotonic() + timeout
    while True:
        try:
            records = _records(path)
        except DecodeError:  # a torn write read mid-flush (seen in CI): read the file again, up to the deadline
            if time.monotonic() >= deadline:
                raise
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    run: dict[str, Any] = {"history": [], "summary": {}, "config": {}, "metrics": {}, "path": path}
    run["kinds"] = sorted(r.WhichOneof("record_type") for r in records)
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            run["history"].append(_items(record.history.item))
        elif kind == "summary":
            run["summary"].update(_items(record.summary.update))
        elif kind == "config":
            run["config"].update(_items(record.config.update))
        elif kind == "metric":
            m = record.metric
            run["metrics"][m.name] = {
                "summary": {f for f in ("min", "max", "mean", "last", "best") if getattr(m.summary, f)},
                "step_metric": m.step_metric,
                "hidden": m.options.hidden,
            }
    return run


# -- What the dashboard shows --------------------------------------------------------------------
def read_back(row: dict[str, Any], key: str) -> tuple[float, float]:
    """``(value, relative tolerance)`` of a computed key in a logged row: the logged value, or the value the
    rule that left the key out gives (an alias from its sources, a quiet event count that stayed zero, a
    per-round key of a single-round window). Raises ``KeyError`` for a key that is missing without a rule."""
    from opbc_metrics.integrations.dashboard import ROUND_REL_TOL, SPARSE_PATTERNS, resolve_alias, single_round_value

    if key in row:
        return row[key], 1e-12
    alias = resolve_alias(key)
    if alias is not None:
        return alias.value(lambda k: read_back(row, k)[0]), 1e-12
    if any(p.search(key) for p in SPARSE_PATTERNS):
        return 0.0, 0.0
    derived = single_round_value(key, row.get)  # round 0 is the whole response (the logger's own rule)
    if derived is not None:
        return derived, ROUND_REL_TOL
    raise KeyError(f"{key} was not logged")


def assert_logged(row: dict[str, Any], want: dict[str, float], suffix: str = "", rel: float = 1e-9,
                  abs_: float = 1e-12) -> None:
    """Every value of ``want`` is in the logged ``row`` (under ``key + suffix``), or given by the rule that left
    it out (:func:`read_back`), within ``rel`` (at least the rule's own tolerance) and ``abs_``."""
    assert want, "nothing to compare"
    row = {k[: len(k) - len(suffix)]: v for k, v in row.items() if k.endswith(suffix)} if suffix else row
    for key, value in want.items():
        got, tol = read_back(row, key)
        assert math.isclose(got, value, rel_tol=max(tol, rel), abs_tol=abs_), (key, got, value)


def scalar_series(run: dict[str, Any]) -> dict[str, dict[int, float]]:
    """``{key: {row index: value}}`` of every numeric key W&B draws a line chart for (``_step`` and metrics
    defined ``hidden``, such as a step metric, excluded)."""
    hidden = {k for k, m in run["metrics"].items() if m.get("hidden")}
    out: dict[str, dict[int, float]] = {}
    for i, row in enumerate(run["history"]):
        for key, value in row.items():
            if key.startswith("_") or key in hidden or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            out.setdefault(key, {})[i] = float(value)
    return out


def equal_pairs(
    series: dict[str, dict[int, float]], min_rows: int = 2, rel_tol: float = 1e-6
) -> list[tuple[str, str, str]]:
    """Pairs of keys logged on the same rows (at least ``min_rows``) with equal or opposite values on all of them.

    Returns ``(key_a, key_b, "equal" | "negated")``; pairs where both keys are one constant are left out
    (two counters that stay 0 are two quantities, not one). ``rel_tol`` 1e-6 also catches one quantity
    computed twice in different precisions.
    """
    out = []
    for a, b in itertools.combinations(sorted(series), 2):
        sa, sb = series[a], series[b]
        if sa.keys() != sb.keys() or len(sa) < min_rows:
            continue
        if _constant(sa, rel_tol) and _constant(sb, rel_tol):
            continue
        for sign, name in ((1.0, "equal"), (-1.0, "negated")):
            if all(_close(sa[i], sign * sb[i], rel_tol) for i in sa):
                out.append((a, b, name))
                break
    return out


def _constant(series: dict[int, float], rel_tol: float) -> bool:
    first = next(iter(series.values()))
    return all(_close(v, first, rel_tol) for v in series.values())


def _close(x: float, y: float, rel_tol: float) -> bool:
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    return math.isclose(x, y, rel_tol=rel_tol, abs_tol=1e-12)


def chart_report(run: dict[str, Any]) -> dict[str, Any]:
    """Counts of a run's dashboard: rows, scalar charts, tables and the pairs of keys equal on every row."""
    series = scalar_series(run)
    media = {(k, v.get("_type")) for row in run["history"] for k, v in row.items() if isinstance(v, dict)}
    return {"rows": len(run["history"]), "scalar_charts": len(series), "pairs": equal_pairs(series),
            "tables": sum(1 for _, kind in media if kind == "table-file")}
