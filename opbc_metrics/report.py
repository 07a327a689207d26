"""A self-contained HTML report of one or several offline analyses: inline SVG charts, inline CSS, no JavaScript.

The report is rendered from the JSON results of ``opbc-metrics analyze`` (see :mod:`opbc_metrics.cli`),
so it can be regenerated from saved results; several results (streams: bf16, fp8 and async rollouts of
one run, or two runs) are overlaid in one page, one colour per stream. It needs no network and no
external file: open it in any browser, attach it to an issue, mail it. The charts are drawn with
matplotlib (the ``report`` extra) and inlined as SVG with their text kept as text; without matplotlib
the page says so and shows the tables.

What the page holds:

* one card per headline metric (:data:`HEADLINES`): each stream's value, the unit, the controller
  policy's threshold (read from the result's policy, i.e. :class:`opbc_metrics.controller.OPBCPolicy`),
  and one sentence of the metric's glossary entry saying what the value means; a metric a stream did
  not measure shows "—";
* ``chart-step-<key>``: the headline metrics over steps (:data:`STEP_KEYS`), one line per stream, the
  policy's thresholds drawn as dashed lines;
* ``chart-decision-mix`` (decisions per stream) and ``chart-decision-steps`` (the mix per step);
* ``chart-token-log-ratio`` and ``chart-sequence-log-ratio``: the log-ratio histograms (fixed
  symmetric log bins, :func:`symlog_edges`) with the clamp and veto thresholds;
* ``chart-per-layer-*`` / ``chart-per-round-*``: indexed series, when the input had more than one
  layer or round;
* the :data:`WORST_GROUPS` worst groups by ESS over all streams, with their decision and reasons
  (every group is in the JSON result), every metric in a folded table, and the input issues.

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
import functools
import html
import io
import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from opbc_metrics.functional.statistics import bin_counts

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
        counts = bin_counts(v, keep, self._boundaries)
        self.counts = [a + round(b) for a, b in zip(self.counts, counts.tolist())]

    def as_dict(self) -> dict[str, Any]:
        """JSON form: ``edges`` (inner), ``counts`` (``len(edges) + 1``), ``total``."""
        return {"edges": list(self.edges), "counts": list(self.counts), "total": self.total, "bins": "(lo, hi]"}


# ---------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------
def fmt(value: Any) -> str:
    """A compact human-readable number: 4 significant digits, integers as integers.

    A value that is not an integer never prints as a plain integer: it keeps the digits that tell it apart
    (an ESS of 0.99996 is not "1", which would read as exactly on-policy).

    Example:
        >>> fmt(0.123456), fmt(3.0), fmt(1.5e-7), fmt(float("inf")), fmt(None)
        ('0.1235', '3', '1.5e-07', 'inf', '-')
        >>> fmt(0.99996), fmt(1.0000004), fmt(2.99999999)
        ('0.99996', '1.0000004', '2.99999999')
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
    text = f"{value:.4g}"
    digits = 4
    while "e" not in text and float(text).is_integer() and digits < 17:  # (value is not an integer here)
        digits += 1  # rounded to a plain whole number: more digits until it no longer reads as one
        text = f"{value:.{digits}g}"
    return text


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
# What the report shows
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Headline:
    """A headline metric: its key, a label that says exactly what it is, the unit of its value, and the
    policy thresholds that act on it (``(OPBCPolicy field, action)``, compared ``direction`` the value)."""

    key: str
    label: str
    unit: str
    thresholds: tuple[tuple[str, str], ...] = ()
    direction: str = "above"  # the action fires when the value is "above" / "below" the threshold
    log_scale: bool = False


HEADLINES: tuple[Headline, ...] = (
    Headline("opbc/is/ess", "ESS (token)", "share of tokens, 0-1",
             (("min_ess", "quarantine"), ("replay_ess", "replay")), "below"),
    Headline("opbc/is/seq_ess", "ESS (sequence)", "share of sequences, 0-1"),
    Headline("opbc/logprob/abs_diff_mean", "mean |Δlogp|", "nats per token", log_scale=True),
    Headline("opbc/is/clipped_fraction", "clipped fraction (|r| > C)", "share of tokens",
             (("max_clipped", "train_with_correction"),)),
    Headline("opbc/is/veto_fraction", "vetoed fraction (|r| > V)", "share of tokens",
             (("max_veto_fraction", "quarantine"),)),
    Headline("moe/router/flip_rate", "router top-1 flip rate", "share of (token, layer) pairs",
             (("max_flip", "quarantine"),)),
    Headline("opbc/is/top_1pct_gradient_mass", "top-1% gradient mass", "share of the total weight"),
    Headline("opbc/kl/k3", "KL estimate k3", "nats per token"),
    Headline("opbc/input/nonfinite_count", "non-finite logprobs", "tokens"),
)
_HEADLINE_OF = {h.key: h for h in HEADLINES}
# The headline metrics recomputed per step for the time series (the CLI resets them at every step).
STEP_KEYS: tuple[str, ...] = (
    "opbc/is/ess",
    "opbc/is/seq_ess",
    "opbc/logprob/abs_diff_mean",
    "opbc/is/clipped_fraction",
    "opbc/is/veto_fraction",
    "moe/router/flip_rate",
)
WORST_GROUPS = 20
# Above this many steps the decision mix per step is drawn as filled bands rather than bars.
MAX_BARS = 150
MISSING = "—"
STREAM_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
_SEVERITY = {"quarantine": "bad", "reject": "bad", "replay": "warn", "train_with_correction": "warn"}


def policy_thresholds(result: Mapping[str, Any]) -> dict[str, float]:
    """The controller policy's numeric settings of a result (``controller.policy``), else the default
    :class:`~opbc_metrics.controller.OPBCPolicy`'s."""
    policy = (result.get("controller") or {}).get("policy")
    if not policy:
        try:
            from opbc_metrics.controller import OPBCPolicy
        except ImportError:
            return {}
        policy = OPBCPolicy().to_dict()
    return {k: float(v) for k, v in policy.items() if _number(v) is not None}


def threshold_lines(headline: Headline, policy: Mapping[str, float]) -> list[tuple[float, str]]:
    """``(value, "quarantine below 0.3")`` for each policy threshold on the headline metric.

    Example:
        >>> threshold_lines(_HEADLINE_OF["opbc/is/ess"], {"min_ess": 0.3, "replay_ess": 0.6})
        [(0.3, 'quarantine below 0.3'), (0.6, 'replay below 0.6')]
    """
    return [(policy[name], f"{action} {headline.direction} {fmt(policy[name])}")
            for name, action in headline.thresholds if name in policy]


def severity(headline: Headline, value: Any, policy: Mapping[str, float]) -> str:
    """``"bad"``, ``"warn"`` or ``"ok"``: the strictest action whose threshold the (window) value crosses;
    ``"none"`` for a metric without a threshold or a value that was not measured."""
    v = _number(value)
    if v is None or not headline.thresholds:
        return "none"
    worst = "ok"
    for name, action in headline.thresholds:
        limit = policy.get(name)
        crossed = limit is not None and (v < limit if headline.direction == "below" else v > limit)
        level = _SEVERITY.get(action, "ok") if crossed else "ok"
        worst = "bad" if "bad" in (worst, level) else ("warn" if "warn" in (worst, level) else worst)
    return worst


_MEANING = re.compile(r"\bmeans?\b|\bsuggests?\b|^[~<>≥≤0-9]")


def glossary_sentence(what: str) -> str:
    """The sentence of a glossary ``what`` that says how to read the value (else its first sentence).

    Example:
        >>> glossary_sentence("Fraction of X. ~0.01 means fine; > 0.05 means trouble.")
        '~0.01 means fine; > 0.05 means trouble.'
    """
    sentences = [x.strip() for x in re.split(r"(?<=[.!?])\s+(?=[A-Z0-9~<>(])", what.strip()) if x.strip()]
    if not sentences:
        return ""
    return next((x for x in sentences[1:] if _MEANING.search(x)), sentences[0])


def _glossary() -> dict[str, dict[str, Any]]:
    """Glossary entries by key (empty if the glossary cannot be imported: the report still renders)."""
    try:
        from opbc_metrics.glossary import glossary_dict
    except Exception:
        return {}
    return {key: {"name": name, **entry} for name, entry in glossary_dict().items() for key in entry["keys"]}


# ---------------------------------------------------------------------------------------------
# Charts (matplotlib, inlined as SVG)
# ---------------------------------------------------------------------------------------------
def charts_available() -> bool:
    """Whether matplotlib (the ``report`` extra) can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


_RC = {
    "svg.fonttype": "none",  # text stays text: selectable, searchable, small
    "svg.hashsalt": "opbc-metrics",  # stable ids: the same result renders the same page
    "font.family": ["DejaVu Sans", "sans-serif"],
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.titleweight": "bold",
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#e6e8ef",
    "grid.linewidth": 0.6,
    "legend.fontsize": 8,
    "legend.frameon": False,
}


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=96, layout="constrained")


def _svg(fig: Any, chart_id: str, title: str) -> str:
    """The figure as an inline ``<svg id=chart_id>`` with a ``<title>``; its internal ids prefixed by chart_id."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context(_RC):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    text = buf.getvalue()
    text = text[text.index("<svg") :]
    text = re.sub(r'id="([^"]+)"', lambda m: f'id="{chart_id}-{m[1]}"', text)
    text = re.sub(r"url\(#([^)]+)\)", lambda m: f"url(#{chart_id}-{m[1]})", text)
    text = re.sub(r'href="#([^"]+)"', lambda m: f'href="#{chart_id}-{m[1]}"', text)
    text = re.sub(r'<svg ([^>]*?)width="[^"]*" height="[^"]*"', r"<svg \1", text, count=1)
    head = f'<svg id="{_esc(chart_id)}" class="chart" role="img" aria-label="{_esc(title)}" '
    text = text.replace("<svg ", head, 1)
    close = text.index(">") + 1
    text = text[:close] + f"<title>{_esc(title)}</title>" + text[close:]
    return f'<figure class="fig">{text}</figure>'


def _styled(draw: Any) -> Any:
    """Run a figure-building function under the report's matplotlib style.

    matplotlib is imported when a chart is drawn, not when this module is imported: the CLI and the analysis
    import this module and must work without the ``report`` extra (they then leave the charts out).
    """

    @functools.wraps(draw)
    def wrapped(*args: Any, **kwargs: Any) -> str:
        import matplotlib

        with matplotlib.rc_context(_RC):
            return draw(*args, **kwargs)

    return wrapped


def _colours(names: Sequence[str]) -> dict[str, str]:
    return {n: STREAM_COLOURS[i % len(STREAM_COLOURS)] for i, n in enumerate(names)}


@_styled
def step_chart(headline: Headline, series: Mapping[str, tuple[list[float], list[float]]], axis: str,
               policy: Mapping[str, float], colours: Mapping[str, str]) -> str:
    """One headline metric over steps: a line per stream, the policy's thresholds dashed."""
    fig = _figure(5.2, 2.7)
    ax = fig.add_subplot()
    values: list[float] = []
    for name, (xs, ys) in series.items():
        # Markers with few points or any gap (a point between two gaps has no segment to show it).
        few = len(xs) <= 30 or any(math.isnan(y) for y in ys)
        ax.plot(xs, ys, color=colours[name], lw=1.4, marker="o" if few else None, ms=3, label=name,
                gid=f"series-{name}")
        values += [y for y in ys if math.isfinite(y)]
    for n, (value, text) in enumerate(threshold_lines(headline, policy)):
        ax.axhline(value, color="#555", ls=(0, (4, 3)), lw=1, gid=f"threshold-{n}")
        ax.annotate(text, (1, value), xycoords=("axes fraction", "data"), xytext=(-2, 2), textcoords="offset points",
                    ha="right", va="bottom", fontsize=8, color="#444")
        values.append(value)
    if headline.log_scale and values and min(values) > 0:
        ax.set_yscale("log")
    elif headline.key.endswith("ess"):
        ax.set_ylim(0, 1.05)
    else:
        top = max(values, default=0.0)
        ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)
    ax.set_title(headline.label, loc="left")
    ax.set_xlabel(axis)
    ax.set_ylabel(headline.unit)
    ax.xaxis.get_major_locator().set_params(integer=True)
    if len(series) > 1:
        fig.legend(loc="outside upper right", ncol=len(series))
    return _svg(fig, f"chart-step-{_slug(headline.key)}", f"{headline.label} over {_plural(axis)}")


@_styled
def decision_mix_chart(mixes: Mapping[str, Mapping[str, int]]) -> str:
    """One horizontal bar per stream: the share of groups per decision, counts written in the segments."""
    names = list(mixes)
    fig = _figure(9.6, 1.1 + 0.45 * len(names))
    ax = fig.add_subplot()
    for row, name in enumerate(names):
        mix = mixes[name]
        total = sum(mix.values()) or 1
        left = 0.0
        for d in [*DECISIONS, *(d for d in mix if d not in DECISIONS)]:
            count = int(mix.get(d, 0))
            if not count:
                continue
            share = count / total
            ax.barh(row, share, left=left, color=DECISION_COLOURS.get(d, "#607d8b"), height=0.6,
                    label=d if d not in ax.get_legend_handles_labels()[1] else None, gid=f"bar-{name}-{d}")
            if share >= 0.06:
                ax.text(left + share / 2, row, f"{share:.0%}", ha="center", va="center", color="white", fontsize=8)
            left += share
    ax.set_yticks(range(len(names)), [f"{n} ({sum(mixes[n].values())} groups)" for n in names])
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.xaxis.set_major_formatter(_percent())
    ax.set_xlabel("share of groups")
    ax.grid(axis="y", visible=False)
    fig.legend(loc="outside upper right", ncol=5)
    fig.suptitle("OPBC decisions (share of groups)", x=0.01, ha="left", fontsize=10, fontweight="bold")
    return _svg(fig, "chart-decision-mix", "OPBC decision mix per stream")


@_styled
def decision_steps_chart(points: Mapping[str, list[dict[str, Any]]], axis: str) -> str:
    """Per stream, stacked bars of the groups decided at each step, by decision."""
    names = [n for n, p in points.items() if any(q.get("decisions") for q in p)]
    fig = _figure(9.6, 0.9 + 1.5 * len(names))
    axes = fig.subplots(len(names), 1, sharex=True, squeeze=False)[:, 0]
    for ax, name in zip(axes, names):
        xs = [p["x"] for p in points[name] if p.get("decisions")]
        gap = min((b - a for a, b in itertools.pairwise(xs) if b > a), default=1)
        bottom = [0.0] * len(xs)
        for d in DECISIONS:
            counts = [float((p["decisions"] or {}).get(d, 0)) for p in points[name] if p.get("decisions")]
            if not any(counts):
                continue
            top = [a + b for a, b in zip(bottom, counts)]
            if len(xs) > MAX_BARS:  # one filled band per decision instead of thousands of bars
                ax.fill_between(xs, bottom, top, step="mid", color=DECISION_COLOURS[d], lw=0, label=d,
                                gid=f"steps-{name}-{d}")
            else:
                ax.bar(xs, counts, bottom=bottom, width=0.85 * gap, color=DECISION_COLOURS[d], label=d,
                       gid=f"steps-{name}-{d}")
            bottom = top
        ax.set_title(name, loc="left", fontsize=9)
        ax.set_ylabel("groups")
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.grid(axis="x", visible=False)
    handles: dict[str, Any] = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    order = [d for d in DECISIONS if d in handles]
    fig.legend([handles[d] for d in order], order, loc="outside upper right", ncol=5)
    axes[-1].set_xlabel(axis)
    axes[-1].xaxis.get_major_locator().set_params(integer=True)
    return _svg(fig, "chart-decision-steps", f"OPBC decisions per {axis} (groups, by the step they were decided in)")


_HIST_TICKS = (-1000.0, -10.0, -0.1, -0.001, 0.0, 0.001, 0.1, 10.0, 1000.0)


@_styled
def histogram_chart(chart_id: str, title: str, hists: Mapping[str, Mapping[str, Any]],
                    markers: Sequence[tuple[float, str]], colours: Mapping[str, str], what: str) -> str:
    """Overlaid log-ratio histograms (share of the stream's values per fixed bin), clamp and veto marked."""
    import numpy as np

    fig = _figure(9.6, 3.0)
    ax = fig.add_subplot()
    edges = list(next(iter(hists.values()))["edges"])
    outer = [-10 * abs(edges[0]), *edges, 10 * abs(edges[-1])]  # the open outer bins drawn one decade wide
    for name, hist in hists.items():
        counts = np.asarray(hist["counts"], dtype=float)
        total = counts.sum()
        share = np.where(counts > 0, counts / max(total, 1), np.nan)
        ax.stairs(share, outer, color=colours[name], lw=1.4, label=f"{name} ({int(total)} {what})",
                  baseline=None, gid=f"hist-{name}")
    linthresh = min(abs(e) for e in edges if e)
    ax.set_xscale("symlog", linthresh=linthresh, linscale=0.6)
    ax.set_yscale("log")
    ax.set_xticks(list(_HIST_TICKS), [_tick_label(t) for t in _HIST_TICKS])
    ax.minorticks_off()
    ax.set_xlim(outer[0], outer[-1])
    for n, (value, label) in enumerate(markers):
        for v in (-value, value):
            ax.axvline(v, color="#555", ls=(0, (4, 3)), lw=1, gid=f"marker-{label.split()[0]}")
        ax.annotate(label, (value, 1), xycoords=("data", "axes fraction"), xytext=(3, -2 - 11 * n),
                    textcoords="offset points", ha="left", va="top", fontsize=8, color="#444")
    ax.set_xlabel("log ratio r = log p_trainer - log p_rollout (nats; symmetric log axis, |r| < "
                  f"{fmt(linthresh)} in the middle bin)")
    ax.set_ylabel(f"share of {what}")
    ax.set_title(title, loc="left")
    fig.legend(loc="outside upper right", ncol=len(hists))
    return _svg(fig, chart_id, title)


def _tick_label(x: float) -> str:
    return "0" if x == 0 else f"{x:g}"


def _percent() -> Any:
    from matplotlib.ticker import PercentFormatter

    return PercentFormatter(1.0, decimals=0)


@_styled
def indexed_chart(chart_id: str, title: str, kind: str, series: Mapping[str, Mapping[int, float]],
                  colours: Mapping[str, str]) -> str:
    """An indexed series (per layer, per round): a line with markers per stream."""
    fig = _figure(5.2, 2.5)
    ax = fig.add_subplot()
    for name, values in series.items():
        xs = list(values)
        ax.plot(xs, [values[i] for i in xs], color=colours[name], marker="o", ms=4, lw=1.2, label=name,
                gid=f"series-{name}")
    ax.set_xlabel(kind)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylim(bottom=0)
    ax.set_title(title, loc="left")
    if len(series) > 1:
        fig.legend(loc="outside upper right", ncol=len(series))
    return _svg(fig, chart_id, title)


# ---------------------------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------------------------
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1100px;
color:#1d2330;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:30px 0 8px;border-bottom:1px solid #dde;padding-bottom:4px}
.sub{color:#5a6275}.note{background:#fff8e1;border-left:4px solid #f9a825;padding:8px 12px;margin:12px 0}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(250px,1fr));gap:10px;margin:14px 0}
.card{border:1px solid #dde;border-radius:6px;padding:8px 12px;background:#fff}
.card h3{font-size:14px;margin:0 0 4px}.card .row{display:flex;align-items:baseline;gap:8px}
.card .v{font-size:19px;font-weight:600;font-variant-numeric:tabular-nums}
.card .meta{color:#5a6275;font-size:12px;margin-top:4px}.card .means{font-size:12px;margin-top:4px}
.sw{display:inline-block;width:10px;height:10px;border-radius:2px}.sn{font-size:12px;color:#5a6275;min-width:60px}
.ok{color:#1b5e20}.warn{color:#e65100}.bad{color:#b71c1c}.chip{font-size:11px}th.num{text-align:right}
.grid2{display:grid;grid-template-columns:repeat(auto-fill,minmax(480px,1fr));gap:8px}
figure.fig{margin:6px 0}svg.chart{width:100%;height:auto;display:block}
table{border-collapse:collapse;width:100%;font-size:13px}
td,th{border-bottom:1px solid #eef;padding:3px 6px;text-align:left;vertical-align:top}
td.num{text-align:right;font-variant-numeric:tabular-nums}.nw,th{white-space:nowrap}code{font-size:12px}
details summary{cursor:pointer;color:#3f51b5;margin:8px 0}
.issues li{font-family:ui-monospace,Menlo,monospace;font-size:12px}
"""


def render_html(result: Mapping[str, Any]) -> str:
    """The report page of one result, as written by ``opbc-metrics analyze``."""
    name = str((result.get("input") or {}).get("path") or "input").rsplit("/", 1)[-1].split(".")[0] or "input"
    return render_report({name: result})


def render_report(results: Mapping[str, Mapping[str, Any]]) -> str:
    """The report page of one or several results (``{stream name: result}``), overlaid per stream."""
    names = list(results)
    colours = _colours(names)
    glossary = _glossary()
    policy = policy_thresholds(next(iter(results.values()), {}))
    charts = charts_available()
    title = ", ".join(names)
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>opbc-metrics report: {_esc(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>opbc-metrics report</h1>",
        _inputs_table(results, colours),
    ]
    if not charts:
        out.append('<p class="note">Charts need matplotlib, which is not installed: install the package with its '
                   '<code>report</code> extra (<code>pip install ".[report]"</code> in a checkout) and render '
                   "again.</p>")
    for name, r in results.items():
        n_issues = int((r.get("input") or {}).get("issues_total", 0) or 0)
        if n_issues:
            out.append(f'<p class="note">{_esc(name)}: {n_issues} input issue(s) were skipped; see '
                       '<a href="#issues">input issues</a>.</p>')

    out.append('<h2>Headline</h2><div class="cards" id="headline">')
    for h in HEADLINES:
        if any(h.key in (r.get("metrics") or {}) for r in results.values()):
            out.append(_card(h, results, colours, glossary, policy))
    out.append("</div>")
    out.append('<p class="sub">Values over the whole input. Thresholds are the controller policy\'s, which applies '
               "them to each prompt group; a window value past one says that some groups are likely affected.</p>")

    steps = {n: r.get("steps") or {} for n, r in results.items()}
    axis = next((s.get("axis") for s in steps.values() if s.get("axis")), "step")
    if charts and any(s.get("points") for s in steps.values()):
        out.append(f"<h2>Over {_plural(axis)}</h2><div class=\"grid2\">")
        for h in HEADLINES:
            if h.key not in STEP_KEYS:
                continue
            series = {}
            for n, s in steps.items():
                pts = [(p["x"], _number(p["metrics"].get(h.key))) for p in s.get("points", [])]
                if any(y is not None for _, y in pts):
                    # A step without the value is a gap in the line (NaN), not a segment drawn across it.
                    series[n] = ([float(x) for x, _ in pts], [math.nan if y is None else y for _, y in pts])
            if series:
                out.append(step_chart(h, series, axis, policy, colours))
        out.append("</div>")
        if axis == "batch":
            out.append('<p class="sub">The input has no <code>step</code> field: each point is one batch.</p>')

    out.append("<h2>Decisions</h2>")
    controllers = {n: r.get("controller") or {} for n, r in results.items()}
    mixes = {n: c["decision_mix"] for n, c in controllers.items() if c.get("available") and c.get("decision_mix")}
    if mixes:
        if charts:
            out.append(decision_mix_chart(mixes))
            points = {n: steps[n].get("points", []) for n in mixes}
            if any(p.get("decisions") for ps in points.values() for p in ps):
                out.append(decision_steps_chart(points, axis))
        out.append(_mix_table(mixes))
    for n, c in controllers.items():
        if not c.get("available"):
            out.append(f'<p class="note">{_esc(n)}: {_esc(c.get("note", "the controller did not run."))}</p>')
        elif c.get("note"):
            out.append(f'<p class="sub">{_esc(n)}: {_esc(c["note"])}</p>')

    hist_results = {n: r.get("histograms") or {} for n, r in results.items()}
    if charts and any(hist_results.values()):
        out.append("<h2>Log-ratio distributions</h2>")
        markers = [(policy[k], f"{label} {fmt(policy[k])}")
                   for k, label in (("clamp", "clamp C ="), ("veto", "veto V =")) if k in policy]
        for key, chart_id, chart_title, what in (
            ("token_log_ratio", "chart-token-log-ratio", "Token log ratio r (valid tokens)", "tokens"),
            ("sequence_log_ratio", "chart-sequence-log-ratio", "Sequence log ratio s = Σ r (valid sequences)",
             "sequences"),
        ):
            hists = {n: h[key] for n, h in hist_results.items() if key in h and h[key].get("total")}
            if hists:
                out.append(histogram_chart(chart_id, chart_title, hists, markers, colours, what))

    if charts:
        out += _indexed_charts(results, colours)
    out.append(_worst_groups(results, colours))
    out.append(_metrics_table(results, glossary))
    out += _issues(results)
    versions = sorted({str(r.get("version", "")) for r in results.values()})
    out.append(f'<p class="sub">Generated by opbc-metrics {_esc(", ".join(versions))}.</p>')
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _plural(axis: str) -> str:
    return "batches" if axis == "batch" else axis + "s"


def _swatch(colour: str) -> str:
    return f'<span class="sw" style="background:{colour}"></span>'


def _inputs_table(results: Mapping[str, Mapping[str, Any]], colours: Mapping[str, str]) -> str:
    rows = ['<table id="inputs"><tr><th>stream</th><th>input</th><th class="num">samples</th><th class="num">groups'
            '</th><th class="num">valid tokens</th><th class="num">steps</th><th class="num">skipped</th>'
            "<th>settings</th></tr>"]
    for name, r in results.items():
        inp, st = r.get("input") or {}, r.get("settings") or {}
        points = (r.get("steps") or {}).get("points") or []
        rows.append(
            f"<tr><td>{_swatch(colours[name])} {_esc(name)}</td><td><code>{_esc(inp.get('path', ''))}</code> "
            f"({_esc(inp.get('format', ''))})</td><td class=\"num\">{_esc(fmt(inp.get('samples')))}</td>"
            f"<td class=\"num\">{_esc(fmt(inp.get('groups')))}</td>"
            f"<td class=\"num\">{_esc(fmt((r.get('metrics') or {}).get('opbc/input/num_tokens')))}</td>"
            f"<td class=\"num\">{len(points) or MISSING}</td>"
            f"<td class=\"num\">{_esc(fmt(inp.get('issues_total', 0)))}</td>"
            f"<td>clamp C = {_esc(fmt(st.get('clamp')))}, veto V = {_esc(fmt(st.get('veto')))} nats; "
            f"preset {_esc(st.get('preset', 'default'))}</td></tr>"
        )
    rows.append("</table>")
    return "\n".join(rows)


def _value(value: Any) -> str:
    return MISSING if value is None else fmt(value)


def _card(h: Headline, results: Mapping[str, Mapping[str, Any]], colours: Mapping[str, str],
          glossary: Mapping[str, Mapping[str, Any]], policy: Mapping[str, float]) -> str:
    entry = glossary.get(h.key) or {}
    rows = []
    for name, r in results.items():
        value = (r.get("metrics") or {}).get(h.key)
        level = severity(h, value, policy)
        chip = {"bad": "past a quarantine threshold", "warn": "past a threshold"}.get(level, "")
        rows.append(f'<div class="row">{_swatch(colours[name])}<span class="sn">{_esc(name)}</span>'
                    f'<span class="v {level}" data-stream="{_esc(name)}">{_esc(_value(value))}</span>'
                    f'<span class="chip {level}">{_esc(chip)}</span></div>')
    lines = threshold_lines(h, policy)
    threshold = ("per group: " + "; ".join(text for _, text in lines)) if lines else "no controller threshold"
    sentence = glossary_sentence(entry.get("what", ""))
    return (f'<div class="card" id="card-{_slug(h.key)}"><h3>{_esc(h.label)}</h3>{"".join(rows)}'
            f'<div class="meta">unit: {_esc(h.unit)} · {_esc(threshold)}</div>'
            f'<div class="means">{_esc(sentence)}</div><div class="meta"><code>{_esc(h.key)}</code></div></div>')


def _mix_table(mixes: Mapping[str, Mapping[str, int]]) -> str:
    head = "".join(f"<th class=\"num\">{_esc(d)}</th>" for d in DECISIONS)
    rows = [f'<table id="decision-table"><tr><th>stream</th><th class="num">groups</th>{head}</tr>']
    for name, mix in mixes.items():
        total = sum(mix.values()) or 1
        cells = "".join(f'<td class="num">{int(mix.get(d, 0))} ({mix.get(d, 0) / total:.0%})</td>' for d in DECISIONS)
        rows.append(f"<tr><td>{_esc(name)}</td><td class=\"num\">{sum(mix.values())}</td>{cells}</tr>")
    rows.append("</table>")
    return "\n".join(rows)


def _indexed_charts(results: Mapping[str, Mapping[str, Any]], colours: Mapping[str, str]) -> list[str]:
    """Per-layer / per-round charts, only when some stream saw more than one layer / round."""
    merged: dict[str, dict[str, Any]] = {}
    for name, r in results.items():
        inp = r.get("input") or {}
        for cid, s in indexed_series(r.get("metrics") or {}).items():
            seen = inp.get("rounds_seen" if s["kind"] == "round" else "layers_seen") or 0
            values = {i: v for i, v in s["values"].items() if not seen or i < seen}
            if len(values) > 1:
                entry = merged.setdefault(cid, {"kind": s["kind"], "title": s["title"], "series": {}})
                entry["series"][name] = values
    out = []
    for kind, heading in (("layer", "Per layer"), ("round", "Per round")):
        charts = {cid: e for cid, e in merged.items() if e["kind"] == kind}
        if charts:
            out.append(f'<h2>{heading}</h2><div class="grid2">')
            for cid, e in charts.items():
                out.append(indexed_chart(cid, e["title"], kind, e["series"], colours))
            out.append("</div>")
    return out


_GROUP_COLUMNS = (
    ("num_response_tokens", "tokens"),
    ("ess", "ESS"),
    ("clipped_fraction", "clipped"),
    ("veto_fraction", "vetoed"),
    ("max_abs_log_ratio", "max |r|"),
    ("router_flip_rate", "flip rate"),
    ("policy_lag", "lag"),
)


def worst_groups(groups: Sequence[Mapping[str, Any]], limit: int = WORST_GROUPS) -> list[Mapping[str, Any]]:
    """The ``limit`` groups with the lowest ESS (groups without an ESS, e.g. rejected ones, first).

    Example:
        >>> worst_groups([{"group": "a", "stats": {"ess": 0.9}}, {"group": "b", "stats": {}},
        ...               {"group": "c", "stats": {"ess": 0.2}}], limit=2)
        [{'group': 'b', 'stats': {}}, {'group': 'c', 'stats': {'ess': 0.2}}]
    """
    def rank(g: Mapping[str, Any]) -> float:
        ess = _number((g.get("stats") or {}).get("ess"))
        return -1.0 if ess is None else ess

    return sorted(groups, key=rank)[:limit]


def _worst_groups(results: Mapping[str, Mapping[str, Any]], colours: Mapping[str, str]) -> str:
    streams = {n: (r.get("controller") or {}).get("groups") or [] for n, r in results.items()}
    tagged = [{**g, "_stream": n} for n, groups in streams.items() for g in groups]
    if not tagged:
        return ""
    head = "".join(f'<th class="num">{_esc(t)}</th>' for _, t in _GROUP_COLUMNS)
    total = len(tagged)
    out = [f"<h2>Worst groups by ESS ({min(WORST_GROUPS, total)} of {total})</h2>",
           f'<table id="groups-table"><tr><th>stream</th><th>group</th><th class="num">step</th><th>decision</th>'
           f"<th>reasons</th>{head}</tr>"]
    for g in worst_groups(tagged):
        stats = g.get("stats") or {}
        reasons = g.get("reasons") or []
        text = ", ".join(str(x) for x in reasons) if isinstance(reasons, list) else str(reasons)
        cells = "".join(f'<td class="num">{_esc(_value(stats.get(k)))}</td>' for k, _ in _GROUP_COLUMNS)
        colour = DECISION_COLOURS.get(str(g.get("decision")), "#607d8b")
        name = g["_stream"]
        out.append(f'<tr><td class="nw">{_swatch(colours[name])} {_esc(name)}</td>'
                   f"<td><code>{_esc(g.get('group'))}</code></td><td class=\"num\">{_esc(_value(g.get('step')))}</td>"
                   f'<td style="color:{colour};font-weight:600">{_esc(g.get("decision"))}</td>'
                   f"<td>{_esc(text or MISSING)}</td>{cells}</tr>")
    out.append("</table>")
    if total > WORST_GROUPS:
        out.append(f'<p class="sub">The other {total - WORST_GROUPS} groups are in the JSON result '
                   "(<code>controller.groups</code>).</p>")
    return "\n".join(out)


def _metrics_table(results: Mapping[str, Mapping[str, Any]], glossary: Mapping[str, Mapping[str, Any]]) -> str:
    """Every key of every stream (indexed series and vectors summarised), "—" where a stream lacks it."""
    keys: list[str] = []
    hidden: set[str] = set()
    for r in results.values():
        metrics = r.get("metrics") or {}
        hidden |= series_keys(metrics)
        keys += [k for k in metrics if k not in keys]
    head = "".join(f'<th class="num">{_esc(n)}</th>' for n in results)
    rows = [f"<details><summary>All metrics ({len(keys) - len(hidden & set(keys))} keys; "
            "per-layer and per-round keys are in the charts and the JSON)</summary>",
            f'<table id="metrics-table"><tr><th>key</th>{head}<th>glossary entry</th></tr>']
    for key in keys:
        if key in hidden:
            continue
        cells = []
        for r in results.values():
            value = (r.get("metrics") or {}).get(key)
            if isinstance(value, list):
                nums = [v for v in value if _number(v) is not None]
                shown = f"[{len(value)} values] max {fmt(max(nums))}" if nums else f"[{len(value)} values]"
            else:
                shown = _value(value)
            cells.append(f'<td class="num">{_esc(shown)}</td>')
        entry = glossary.get(key) or {}
        rows.append(f"<tr><td><code>{_esc(key)}</code></td>{''.join(cells)}"
                    f'<td title="{_esc(entry.get("what", ""))}">{_esc(entry.get("name", ""))}</td></tr>')
    rows.append("</table>")
    not_computed = sorted({k for r in results.values() for k in (r.get("not_computed") or {})})
    if not_computed:
        rows.append('<p class="sub">Not measured (the input lacks their fields or had no data for them): '
                    + ", ".join(f"<code>{_esc(k)}</code>" for k in not_computed) + "</p>")
    rows.append("</details>")
    return "\n".join(rows)


def _issues(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    out: list[str] = []
    for name, r in results.items():
        inp = r.get("input") or {}
        total = int(inp.get("issues_total", 0) or 0)
        if not total:
            continue
        if not out:
            out.append('<h2 id="issues">Input issues</h2>')
        listed = inp.get("issues", [])
        out.append(f"<p>{_esc(name)}: {total} skipped</p><ul class=\"issues\">")
        out += [f"<li>{_esc(i.get('where'))}: {_esc(i.get('message'))}</li>" for i in listed]
        if total > len(listed):
            out.append(f"<li>... {total - len(listed)} more</li>")
        out.append("</ul>")
    return out
