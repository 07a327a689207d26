"""A self-contained HTML report of an offline analysis: inline SVG charts, inline CSS, no JavaScript.

The report is rendered from the JSON result of ``opbc-metrics analyze`` (see :mod:`opbc_metrics.cli`),
so it can be regenerated from a saved result. It needs no network and no external file: open it in
any browser, attach it to an issue, mail it.

Charts (each an ``<svg>`` with a stable ``id`` and a ``<title>``):

* ``chart-token-log-ratio`` and ``chart-sequence-log-ratio``: histograms of the token log ratio
  ``r_t`` and the sequence log ratio ``s_i = sum_t r_t``, accumulated while streaming in fixed
  symmetric log-spaced bins (:func:`symlog_edges`), so tiny bf16 mismatches and -9999 sentinels fit on
  one axis; the clamp and veto thresholds are drawn as dashed lines.
* ``chart-decision-mix``: the OPBC decisions per group (when the controller ran).
* ``chart-per-round-*`` and ``chart-per-layer-*``: one bar chart per indexed series found among the
  metric keys, e.g. ``per_round/round_{i}_abs_diff_mean`` or a per-layer router flip-rate vector
  under ``moe/router/``; whatever such keys the run produced are drawn.

Example:
    >>> hist = FixedHistogram(symlog_edges())
    >>> import torch
    >>> hist.update(torch.tensor([0.0, 0.5, -0.5, 50.0]))
    >>> hist.total, hist.counts[hist.bin_of(0.5)]
    (4, 1)
    >>> html = render_html({"input": {"path": "x.jsonl"}, "metrics": {"opbc/is/ess": 0.97},
    ...                     "histograms": {"token_log_ratio": hist.as_dict()}})
    >>> 'id="chart-token-log-ratio"' in html and "<script" not in html
    True
"""

from __future__ import annotations

import bisect
import html
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

DECISIONS: tuple[str, ...] = ("train", "train_with_correction", "replay", "quarantine", "reject")
DECISION_COLOURS = {
    "train": "#2e7d32",
    "train_with_correction": "#00838f",
    "replay": "#f9a825",
    "quarantine": "#ef6c00",
    "reject": "#c62828",
}
_INDEXED = re.compile(r"^(?P<prefix>.*?)(?P<kind>round|layer)_?(?P<idx>\d+)(?P<suffix>.*)$")


# ---------------------------------------------------------------------------------------------
# Streaming fixed-bin histograms
# ---------------------------------------------------------------------------------------------
def symlog_edges(smallest: float = 1e-4, largest: float = 1e3, per_decade: int = 4) -> list[float]:
    """Inner bin edges, symmetric and log-spaced: ``-largest .. -smallest, smallest .. largest``.

    With the defaults: 28 edges per side, so 59 bins: ``(-inf, -1e3]``, ..., ``(-1e-4, 1e-4]`` (the
    zero bin), ..., ``(1e3, inf)``. Bins are half-open ``(lo, hi]``.

    Example:
        >>> edges = symlog_edges(1e-2, 1.0, per_decade=1)
        >>> edges
        [-1.0, -0.1, -0.01, 0.01, 0.1, 1.0]
    """
    if not (0 < smallest < largest) or per_decade < 1:
        raise ValueError("symlog_edges needs 0 < smallest < largest and per_decade >= 1")
    lo, hi = math.log10(smallest), math.log10(largest)
    steps = round((hi - lo) * per_decade)
    pos = [float(f"{10 ** (lo + k / per_decade):.6g}") for k in range(steps + 1)]
    return [-p for p in reversed(pos)] + pos


class FixedHistogram:
    """Counts of values in fixed bins given by sorted inner edges; mergeable, memory independent of data.

    Non-finite values are not counted (the batch view already excludes them from valid tokens).

    Args:
        edges: sorted inner edges; ``len(edges) + 1`` bins, the outer two open-ended.
    """

    def __init__(self, edges: Sequence[float]) -> None:
        self.edges = [float(e) for e in edges]
        if any(b <= a for a, b in zip(self.edges, self.edges[1:])):
            raise ValueError("histogram edges must be strictly increasing")
        self._boundaries = torch.tensor(self.edges, dtype=torch.float64)
        self.counts = [0] * (len(self.edges) + 1)

    @property
    def total(self) -> int:
        return sum(self.counts)

    def bin_of(self, value: float) -> int:
        """Index of the bin holding ``value`` (bins are ``(lo, hi]``)."""
        return bisect.bisect_left(self.edges, value)

    def update(self, values: Tensor, weights: Tensor | None = None) -> None:
        """Count ``values`` (any shape); ``weights`` (0/1, same shape) selects which ones count."""
        v = values.detach().to(torch.float64).reshape(-1)
        keep = torch.isfinite(v)
        if weights is not None:
            keep = keep & (weights.reshape(-1) != 0)
        idx = torch.bucketize(v, self._boundaries)
        counts = torch.zeros(len(self.counts), dtype=torch.int64).scatter_add_(0, idx, keep.to(torch.int64))
        self.counts = [a + b for a, b in zip(self.counts, counts.tolist())]

    def as_dict(self) -> dict[str, Any]:
        """JSON form: ``edges`` (inner), ``counts`` (``len(edges) + 1``), ``total``."""
        return {"edges": list(self.edges), "counts": list(self.counts), "total": self.total, "bins": "(lo, hi]"}


# ---------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------
def fmt(value: Any) -> str:
    """A compact human-readable number: 4 significant digits, integers as integers.

    Example:
        >>> fmt(0.123456), fmt(3.0), fmt(1.5e-7), fmt(float("inf")), fmt(None)
        ('0.1235', '3', '1.5e-07', 'inf', '-')
    """
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return f"[{len(value)} values]"
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == int(value) and abs(value) < 1e7:
        return str(int(value))
    return f"{value:.4g}"


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "-", text).strip("-") or "series"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


# ---------------------------------------------------------------------------------------------
# Indexed series (per round, per layer) found among metric keys
# ---------------------------------------------------------------------------------------------
def indexed_series(metrics: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Group keys with a round/layer index into series, and vector values into series.

    Returns ``{chart id: {"kind": "round"|"layer", "title": str, "values": {index: value}}}``.

    Example:
        >>> s = indexed_series({"per_round/round_0_abs_diff_mean": 0.1, "per_round/round_1_abs_diff_mean": 0.3,
        ...                     "moe/router/flip_rate_per_layer": [0.0, 0.2], "opbc/is/ess": 0.9})
        >>> sorted(s)
        ['chart-per-layer-moe-router-flip_rate_per_layer', 'chart-per-round-per_round-abs_diff_mean']
        >>> s["chart-per-round-per_round-abs_diff_mean"]["values"]
        {0: 0.1, 1: 0.3}
    """
    out: dict[str, dict[str, Any]] = {}
    for key, value in metrics.items():
        if isinstance(value, list):
            kind = "layer" if "layer" in key else "round" if "round" in key else None
            if kind is None or key.startswith("opbc/"):
                continue
            values = {i: v for i, v in enumerate(value) if _number(v) is not None}
            out[f"chart-per-{kind}-{_slug(key)}"] = {"kind": kind, "title": key, "values": values}
            continue
        m = _INDEXED.match(key)
        if m is None or _number(value) is None:
            continue
        kind, template = m["kind"], f"{m['prefix']}{m['kind']}_{{i}}{m['suffix']}"
        chart_id = f"chart-per-{kind}-{_slug(m['prefix'] + m['suffix'].lstrip('_'))}"
        series = out.setdefault(chart_id, {"kind": kind, "title": template, "values": {}})
        series["values"][int(m["idx"])] = float(value)
    for series in out.values():
        series["values"] = dict(sorted(series["values"].items()))
    return out


def series_keys(metrics: dict[str, Any]) -> set[str]:
    """The scalar keys that belong to an indexed series (shown as charts rather than table rows)."""
    return {k for k, v in metrics.items() if not isinstance(v, list) and _INDEXED.match(k) and _number(v) is not None}


# ---------------------------------------------------------------------------------------------
# SVG charts
# ---------------------------------------------------------------------------------------------
_W, _H = 760, 260
_ML, _MR, _MT, _MB = 56, 16, 28, 48


def _svg_open(chart_id: str, title: str, width: int = _W, height: int = _H) -> list[str]:
    return [
        f'<svg id="{_esc(chart_id)}" class="chart" xmlns="http://www.w3.org/2000/svg" role="img" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" aria-labelledby="{_esc(chart_id)}-t">',
        f'<title id="{_esc(chart_id)}-t">{_esc(title)}</title>',
        f'<text x="{_ML}" y="18" class="ct">{_esc(title)}</text>',
    ]


def _edge_label(x: float) -> str:
    if x == 0:
        return "0"
    e = math.log10(abs(x))
    if abs(e - round(e)) > 1e-9:
        return ""
    e = round(e)
    mag = {0: "1", 1: "10", 2: "100", -1: "0.1"}.get(e, f"1e{e}")
    return ("-" if x < 0 else "") + mag


def _x_of_value(edges: list[float], value: float, x0: float, bw: float) -> float | None:
    """x of a value on a histogram axis where bin j spans [x0 + j*bw, x0 + (j+1)*bw]; log interpolation."""
    j = bisect.bisect_left(edges, value)
    if j == 0 or j == len(edges):
        return None
    lo, hi = edges[j - 1], edges[j]
    if lo <= 0 <= hi:
        frac = 0.5
    else:  # both edges on one side of 0: interpolate the magnitude on a log scale
        a, b, v = (math.log10(abs(t)) for t in (lo, hi, value))
        frac = (v - a) / (b - a)
    return x0 + (j + frac) * bw


def histogram_svg(
    chart_id: str, title: str, hist: dict[str, Any], markers: Iterable[tuple[float, str]] = (), unit: str = "nats"
) -> str:
    """A bar chart of a :meth:`FixedHistogram.as_dict`, counts on a log scale, bins as equal-width bars."""
    edges, counts = list(hist["edges"]), list(hist["counts"])
    parts = _svg_open(chart_id, title)
    x0, y0, pw, ph = _ML, _MT, _W - _ML - _MR, _H - _MT - _MB
    bw = pw / len(counts)
    peak = max(counts) if counts else 0
    top = math.log10(1 + peak) if peak else 1.0
    # y axis: decades of counts
    parts.append(f'<line x1="{x0}" y1="{y0 + ph}" x2="{x0 + pw}" y2="{y0 + ph}" class="ax"/>')
    decade = 1
    while decade <= max(peak, 1):
        y = y0 + ph - ph * math.log10(1 + decade) / top
        parts.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + pw}" y2="{y:.1f}" class="grid"/>')
        parts.append(f'<text x="{x0 - 4}" y="{y + 4:.1f}" class="tk" text-anchor="end">{fmt(decade)}</text>')
        decade *= 10
    for j, c in enumerate(counts):
        lo = "-inf" if j == 0 else fmt(edges[j - 1])
        hi = "inf" if j == len(edges) else fmt(edges[j])
        h = ph * math.log10(1 + c) / top if c else 0.0
        x = x0 + j * bw
        parts.append(
            f'<rect x="{x + 0.5:.1f}" y="{y0 + ph - h:.1f}" width="{max(bw - 1, 0.5):.1f}" height="{h:.1f}" '
            f'class="bar"><title>({lo}, {hi}] {unit}: {c} </title></rect>'
        )
    for j, e in enumerate(edges):
        label = _edge_label(e)
        if label and (abs(e) >= 1 or round(math.log10(abs(e))) % 2 == 0):
            x = x0 + (j + 1) * bw
            parts.append(f'<line x1="{x:.1f}" y1="{y0 + ph}" x2="{x:.1f}" y2="{y0 + ph + 4}" class="ax"/>')
            parts.append(f'<text x="{x:.1f}" y="{y0 + ph + 16}" class="tk" text-anchor="middle">{label}</text>')
    zero = bisect.bisect_left(edges, 0.0)
    if 0 < zero < len(edges) and edges[zero - 1] < 0 < edges[zero]:
        x = x0 + (zero + 0.5) * bw
        parts.append(f'<text x="{x:.1f}" y="{y0 + ph + 28}" class="tk" text-anchor="middle">0</text>')
    for n, (value, name) in enumerate(markers):
        for v in (-value, value):
            x = _x_of_value(edges, v, x0, bw)
            if x is not None:
                parts.append(f'<line x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{y0 + ph}" class="mk"/>')
                anchor = "start" if v > 0 else "end"
                tx = x + 3 if v > 0 else x - 3
                parts.append(
                    f'<text x="{tx:.1f}" y="{y0 + 10 + 12 * n}" class="mkt" text-anchor="{anchor}">{_esc(name)}</text>'
                )
    parts.append(
        f'<text x="{x0 + pw / 2}" y="{_H - 8}" class="tk" text-anchor="middle">{_esc(unit)} '
        f"(symmetric log bins; counts on a log scale; total {hist.get('total', sum(counts))})</text>"
    )
    parts.append("</svg>")
    return "\n".join(parts)


def bar_svg(chart_id: str, title: str, values: dict[int, float], xlabel: str) -> str:
    """Vertical bars of ``{index: value}`` (linear scale), the largest highlighted."""
    parts = _svg_open(chart_id, title)
    x0, y0, pw, ph = _ML, _MT, _W - _ML - _MR, _H - _MT - _MB
    items = list(values.items())
    hi = max((v for _, v in items), default=0.0)
    lo = min((v for _, v in items), default=0.0)
    top = max(hi, 0.0) or 1.0
    bottom = min(lo, 0.0)
    span = (top - bottom) or 1.0
    zero_y = y0 + ph * top / span
    parts.append(f'<line x1="{x0}" y1="{zero_y:.1f}" x2="{x0 + pw}" y2="{zero_y:.1f}" class="ax"/>')
    for frac in (0.5, 1.0):
        y = zero_y - ph * frac * top / span
        parts.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + pw}" y2="{y:.1f}" class="grid"/>')
        parts.append(f'<text x="{x0 - 4}" y="{y + 4:.1f}" class="tk" text-anchor="end">{fmt(top * frac)}</text>')
    bw = min(pw / max(len(items), 1), 60.0)
    step = max(1, math.ceil(len(items) / 24))
    worst = max(items, key=lambda kv: kv[1])[0] if items else None
    for n, (i, v) in enumerate(items):
        h = ph * abs(v) / span
        y = zero_y - h if v >= 0 else zero_y
        cls = "bar hi" if i == worst else "bar"
        x = x0 + n * bw
        parts.append(
            f'<rect x="{x + 1:.1f}" y="{y:.1f}" width="{max(bw - 2, 0.5):.1f}" height="{h:.1f}" class="{cls}">'
            f"<title>{_esc(xlabel)} {i}: {fmt(v)}</title></rect>"
        )
        if n % step == 0:
            parts.append(f'<text x="{x + bw / 2:.1f}" y="{y0 + ph + 16}" class="tk" text-anchor="middle">{i}</text>')
    parts.append(f'<text x="{x0 + pw / 2}" y="{_H - 8}" class="tk" text-anchor="middle">{_esc(xlabel)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def decision_svg(chart_id: str, title: str, mix: dict[str, int]) -> str:
    """Horizontal bars, one per decision, in the controller's order, with counts and shares."""
    names = [d for d in DECISIONS] + [d for d in mix if d not in DECISIONS]
    height = _MT + 30 * len(names) + 16
    parts = _svg_open(chart_id, title, height=height)
    total = sum(mix.values()) or 1
    left, pw = 170, _W - 170 - 120
    for n, name in enumerate(names):
        c = int(mix.get(name, 0))
        y = _MT + 8 + 30 * n
        w = pw * c / total
        colour = DECISION_COLOURS.get(name, "#607d8b")
        parts.append(f'<text x="{left - 8}" y="{y + 15}" class="lb" text-anchor="end">{_esc(name)}</text>')
        parts.append(
            f'<rect x="{left}" y="{y}" width="{max(w, 0.0):.1f}" height="20" fill="{colour}" class="dbar">'
            f"<title>{_esc(name)}: {c}</title></rect>"
        )
        parts.append(f'<text x="{left + w + 6:.1f}" y="{y + 15}" class="lb">{c} ({100 * c / total:.1f}%)</text>')
    parts.append("</svg>")
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------------------------
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1000px;
color:#1d2330;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #dde;padding-bottom:4px}
.sub{color:#5a6275}.note{background:#fff8e1;border-left:4px solid #f9a825;padding:8px 12px;margin:12px 0}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:14px 0}.card{border:1px solid #dde;border-radius:6px;
padding:8px 12px;min-width:150px}.card .v{font-size:20px;font-weight:600}.card .k{color:#5a6275;font-size:12px}
table{border-collapse:collapse;width:100%;font-size:13px}td,th{border-bottom:1px solid #eef;padding:3px 6px;
text-align:left;vertical-align:top}td.num{text-align:right;font-variant-numeric:tabular-nums}
code{font-size:12px}.chart{max-width:100%;height:auto;display:block;margin:8px 0}
.ct{font-weight:600;font-size:13px}.tk{font-size:11px;fill:#5a6275}.lb{font-size:12px}
.ax{stroke:#9aa3b5}.grid{stroke:#eef0f5}.bar{fill:#3f6fb5}.bar.hi{fill:#c62828}
.mk{stroke:#c62828;stroke-dasharray:4 3}.mkt{font-size:10px;fill:#c62828}
.issues li{font-family:ui-monospace,Menlo,monospace;font-size:12px}
"""

_HEADLINE = (
    "opbc/is/ess",
    "opbc/is/seq_ess",
    "opbc/logprob/abs_diff_mean",
    "opbc/is/clipped_fraction",
    "opbc/is/veto_fraction",
    "opbc/is/top_1pct_gradient_mass",
    "moe/router/flip_rate",
    "moe/router/topk_disagreement_rate",
    "opbc/input/nonfinite_count",
    "per_round/max_diff_value",
)


def _glossary_names() -> dict[str, tuple[str, str]]:
    try:
        from opbc_metrics.glossary import glossary_dict
    except Exception:  # the report must render even if a section fails to import
        return {}
    out: dict[str, tuple[str, str]] = {}
    for name, entry in glossary_dict().items():
        for key in entry["keys"]:
            out[key] = (name, entry["what"])
    return out


def _metrics_table(metrics: dict[str, Any], glossary: dict[str, tuple[str, str]]) -> str:
    hidden = series_keys(metrics)
    rows = ["<table id=\"metrics-table\"><tr><th>key</th><th>value</th><th>glossary</th></tr>"]
    for key, value in metrics.items():
        if key in hidden:
            continue
        name, what = glossary.get(key, ("", ""))
        shown = fmt(value)
        if isinstance(value, list):
            nums = [v for v in value if _number(v) is not None]
            shown = f"[{len(value)} values] max {fmt(max(nums))}" if nums else f"[{len(value)} values]"
        rows.append(
            f'<tr><td><code>{_esc(key)}</code></td><td class="num">{_esc(shown)}</td>'
            f'<td title="{_esc(what)}">{_esc(name)}</td></tr>'
        )
    rows.append("</table>")
    return "\n".join(rows)


_GROUP_COLUMNS = (
    ("num_response_tokens", "tokens"),
    ("ess", "ESS"),
    ("clipped_fraction", "clipped"),
    ("veto_fraction", "vetoed"),
    ("max_abs_log_ratio", "max |r|"),
    ("router_flip_rate", "flip rate"),
    ("policy_lag", "lag"),
)


def _groups_table(groups: list[dict[str, Any]], limit: int = 200) -> str:
    """Groups, strictest decision first (then lowest ESS), with the controller's statistics."""
    order = {d: i for i, d in enumerate(DECISIONS)}

    def rank(g: dict[str, Any]) -> tuple[int, float]:
        ess = _number((g.get("stats") or {}).get("ess"))
        return (-order.get(str(g.get("decision")), -1), ess if ess is not None else 1.0)

    shown = sorted(groups, key=rank)[:limit]
    head = "".join(f"<th>{_esc(title)}</th>" for _, title in _GROUP_COLUMNS)
    rows = [f'<table id="groups-table"><tr><th>group</th><th>decision</th><th>reasons</th>{head}</tr>']
    for g in shown:
        reasons = g.get("reasons") or []
        reasons_text = "; ".join(str(r) for r in reasons) if isinstance(reasons, list) else str(reasons)
        stats = g.get("stats") or {}
        cells = "".join(f'<td class="num">{_esc(fmt(stats.get(k)))}</td>' for k, _ in _GROUP_COLUMNS)
        colour = DECISION_COLOURS.get(str(g.get("decision")), "#607d8b")
        rows.append(
            f"<tr><td><code>{_esc(g.get('group'))}</code></td>"
            f'<td style="color:{colour};font-weight:600">{_esc(g.get("decision"))}</td>'
            f"<td>{_esc(reasons_text)}</td>{cells}</tr>"
        )
    rows.append("</table>")
    if len(groups) > limit:
        rows.append(f'<p class="sub">{len(groups) - limit} more groups in the JSON result (worst shown first).</p>')
    return "\n".join(rows)


def render_html(result: dict[str, Any]) -> str:
    """The full report page for a result dict as written by ``opbc-metrics analyze``."""
    inp = result.get("input", {})
    settings = result.get("settings", {})
    metrics = result.get("metrics", {})
    hists = result.get("histograms", {})
    controller = result.get("controller", {})
    glossary = _glossary_names()
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>opbc-metrics report: {_esc(inp.get('path', ''))}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>opbc-metrics report</h1>",
        f'<p class="sub"><code>{_esc(inp.get("path", ""))}</code> ({_esc(inp.get("format", ""))}): '
        f"{fmt(inp.get('samples'))} samples, {fmt(inp.get('groups'))} groups, "
        f"{fmt(metrics.get('opbc/input/num_tokens'))} valid tokens, {fmt(inp.get('batches'))} batches; "
        f"clamp C = {fmt(settings.get('clamp'))}, veto = {fmt(settings.get('veto'))} nats.</p>",
    ]
    n_issues = int(inp.get("issues_total", 0) or 0)
    if n_issues:
        out.append(f'<p class="note">{n_issues} input issue(s) were skipped; see <a href="#issues">below</a>.</p>')
    cards = [k for k in _HEADLINE if k in metrics]
    if cards:
        out.append('<div class="cards" id="headline">')
        for key in cards:
            name = glossary.get(key, (key, ""))[0]
            out.append(
                f'<div class="card" title="{_esc(key)}"><div class="v">{_esc(fmt(metrics[key]))}</div>'
                f'<div class="k">{_esc(name)}<br><code>{_esc(key)}</code></div></div>'
            )
        out.append("</div>")

    out.append("<h2>Decisions</h2>")
    if controller.get("available") and controller.get("decision_mix") is not None:
        out.append(decision_svg("chart-decision-mix", "OPBC decision mix (groups)", controller["decision_mix"]))
        if controller.get("note"):
            out.append(f'<p class="sub">{_esc(controller["note"])}</p>')
    else:
        out.append(f'<p class="note">{_esc(controller.get("note", "The controller did not run."))}</p>')

    out.append("<h2>Distributions</h2>")
    clamp, veto = settings.get("clamp"), settings.get("veto")
    markers = [(float(v), f"{n} {fmt(v)}") for v, n in ((clamp, "clamp"), (veto, "veto")) if _number(v)]
    if "token_log_ratio" in hists:
        out.append(
            histogram_svg(
                "chart-token-log-ratio", "Token log ratio r = trainer - rollout (valid tokens)",
                hists["token_log_ratio"], markers,
            )
        )
    if "sequence_log_ratio" in hists:
        out.append(
            histogram_svg(
                "chart-sequence-log-ratio", "Sequence log ratio s = sum_t r_t (valid sequences)",
                hists["sequence_log_ratio"], markers,
            )
        )
    series = indexed_series(metrics)
    for kind, heading in (("round", "Per round"), ("layer", "Per layer")):
        charts = {cid: s for cid, s in series.items() if s["kind"] == kind}
        if not charts:
            continue
        out.append(f"<h2>{heading}</h2>")
        # Fixed-capacity series report every slot; draw the rounds/layers the input actually had.
        seen = inp.get("rounds_seen" if kind == "round" else "layers_seen")
        for cid, s in charts.items():
            values = {i: v for i, v in s["values"].items() if not seen or i < seen}
            out.append(bar_svg(cid, s["title"], values, kind))

    out.append("<h2>All metrics</h2>")
    out.append(_metrics_table(metrics, glossary))
    not_computed = result.get("not_computed") or {}
    if not_computed:
        out.append("<p class=\"sub\">Not computed (the input lacks their fields): "
                   + ", ".join(f"<code>{_esc(k)}</code>" for k in not_computed) + "</p>")
    groups = controller.get("groups") or []
    if groups:
        out.append("<h2>Groups</h2>")
        out.append(_groups_table(groups))
    if n_issues:
        out.append('<h2 id="issues">Input issues</h2><ul class="issues">')
        for issue in inp.get("issues", []):
            out.append(f"<li>{_esc(issue.get('where'))}: {_esc(issue.get('message'))}</li>")
        if n_issues > len(inp.get("issues", [])):
            out.append(f"<li>... {n_issues - len(inp.get('issues', []))} more</li>")
        out.append("</ul>")
    out.append(f'<p class="sub">Generated by opbc-metrics {_esc(result.get("version", ""))}.</p>')
    out.append("</body></html>")
    return "\n".join(out) + "\n"
