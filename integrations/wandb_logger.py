"""Weights & Biases logging of the flat ``section/group/metric`` keys (the ``wandb`` extra).

* Scalars are logged under their keys unchanged. W&B builds its panel sections from the text before
  the first ``/``, so each section (``opbc``, ``moe``, ...) becomes a dashboard with no configuration.
* One key per quantity: keys that are a fixed function of others (``opbc/log_ratio/max_abs`` =
  ``opbc/logprob/abs_diff_max``, ``opbc/kl/chi2_token`` = ``opbc/is/second_moment - 1``, ...) are written
  only from the first step they differ from it, and counts of events that stayed zero (overflows,
  decisions other than ``train`` and their reasons, clipped or vetoed tokens) from their first nonzero
  value; until then such a count is 0 in the run summary (see :mod:`opbc_metrics.integrations.dashboard`;
  ``log_all=True`` writes everything). Keys missing from the computed values are never written or
  filled in.
* Sharing a run: when a W&B run is already active (``wandb.init`` by your script, Lightning's
  ``WandbLogger``, verl's tracker) the logger writes into it, says so once, and never finishes it.
  Every row carries the logger's own step metric (``opbc/step``: the ``step`` you pass, else a row
  counter) and every key is charted against it, so the logger never passes ``step=`` to W&B: rows are
  never dropped as behind W&B's step, whoever else logs, with or without ``step=``.
* Summaries (``define_metric(summary=...)``): every key keeps its last value; a key with a direction also
  keeps its worst value over the run (``min`` of ESS, ``max`` of the veto fraction), and the objective
  (reward, score, validation accuracy) its best (``max`` of ``rollout/reward/mean``); signed keys get
  nothing extra (see :func:`summaries_for`).
* Distributions are logged as ``wandb.Histogram`` with at most 512 bins (W&B's limit,
  ``wandb.Histogram.MAX_LENGTH``): from :class:`DistributionHistograms` (fixed-bin states summed over a
  window and over all ranks: exact under DDP), from one batch (:func:`batch_histograms`, numpy,
  rank-local), from any 1-D tensor a metric returns, and on request (``layer_bars=True``) from per-layer
  scalars ``<prefix>/layer_<i>/<name>`` drawn as one bar per layer under ``<prefix>/<name>_by_layer``.
* The glossary goes to the run once, as one ``wandb.Table`` under ``opbc/glossary`` (one row per entry:
  keys, definition, unit, cap, action, aliases, the identities of the keys not written). The run config
  holds ``config["opbc"]``: the chart ranges of every key (the metric classes'
  ``plot_lower_bound``/``plot_upper_bound``, a member's ``chart_ranges()``, ranges you declare), widened
  as the run observes more, and the histogram bins.

Nothing here reaches a server by itself: pass ``mode="offline"`` (or set ``WANDB_MODE=offline``) for
runs without network. ``wandb`` is imported only when a run is created or a histogram is built.

Example (offline)::

    from opbc_metrics import OPBCCollection
    from opbc_metrics.integrations.wandb_logger import DistributionHistograms, OPBCWandbLogger

    metrics = OPBCCollection()
    logger = OPBCWandbLogger(collection=metrics, distributions=DistributionHistograms(),
                             project="opbc", mode="offline", dir="runs")
    for step, batch in enumerate(loader):
        metrics.update(batch)
        logger.update(batch)                      # feeds the distribution histograms
        if (step + 1) % 50 == 0:
            logger.log(metrics.compute(), step=step)   # on every rank: both are collectives
            metrics.reset()
    logger.finish()                               # finishes the run only if the logger started it
"""

from __future__ import annotations

import logging
import math
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from opbc_metrics.batch import ROLLOUT_LOGPROBS, TRAINER_LOGPROBS, BatchView, as_view, host_floats
from opbc_metrics.functional.statistics import bin_counts
from opbc_metrics.integrations.dashboard import ALIASES, KeyFilter
from opbc_metrics.metric import SUM, OPBCMetric, State, registered_metrics, table
from opbc_metrics.rollout import chart_ranges as member_chart_ranges

__all__ = [
    "BEST_SUMMARY_PATTERNS",
    "KEY_DIRECTIONS",
    "LAST_VALUE_SUFFIXES",
    "MAX_HISTOGRAM_BINS",
    "DistributionHistograms",
    "OPBCWandbLogger",
    "batch_histograms",
    "chart_ranges",
    "glossary_rows",
    "layer_histograms",
    "metric_directions",
    "summaries_for",
    "summary_for",
    "vector_histogram",
]

_LOG = logging.getLogger(__name__)

MAX_HISTOGRAM_BINS = 512  # wandb.Histogram.MAX_LENGTH
STEP_METRIC = "opbc/step"
GLOSSARY_KEY = "opbc/glossary"

LOG_RATIO_HIST = "opbc/dist/log_ratio"
SEQ_LOG_RATIO_HIST = "opbc/dist/seq_log_ratio"
LAYER_FLIP_HIST = "moe/dist/layer_flip_rate"

# Keys whose direction is not their class's single ``higher_is_better``: signed quantities (ideal 0 or 1,
# bad both ways: ``None``) and extremes or spreads inside a directed class.
KEY_DIRECTIONS: dict[str, bool | None] = {
    "opbc/logprob/diff_mean": None,
    "opbc/sequence/log_ratio_mean": None,
    "opbc/sequence/geo_log_ratio_mean": None,
    "opbc/ppl/log_ppl_diff": None,
    "opbc/ppl/ratio": None,
    "opbc/is/weight_mean": None,
    "opbc/kl/k1": None,
    "opbc/log_ratio/min": True,  # the most negative log ratio: worse the lower
    "opbc/prob/pearson": True,
    "rollout/reward/std": None,
    "critic/rewards/std": None,
    "critic/score/std": None,
}

# The objective of training: its summary is its best value, not its worst.
BEST_SUMMARY_PATTERNS: tuple[re.Pattern[str], ...] = (
    re.compile(r"(^|/)rollout/reward/(mean|min|max)$"),
    re.compile(r"(^|/)critic/(rewards|score)/(mean|min|max)$"),
    re.compile(r"(^|/)critic/vf_explained_var$"),
    re.compile(r"(^|/)val-(core|aux)/.*/(acc|reward)/"),
    re.compile(r"(^|/)rm/accuracy$"),
)

# Indices and sample sizes have no worst case: their summary is the last value. Matched on the end of
# the key (``moe/router/worst_layer``, ``per_round/max_round_diff``, ``per_round/round_3_token_count``...).
LAST_VALUE_SUFFIXES: tuple[str, ...] = (
    "/worst_layer",
    "/max_round_diff",
    "/total_rounds",
    "_token_count",
    "/num_tokens",
    "/num_sequences",
    "/num_groups",
)

# ``<prefix>/layer_<i>/<name>`` scalars (e.g. ``moe/router/layer_3/flip_rate``) can also be drawn as one
# per-layer bar chart ``<prefix>/<name>_by_layer``.
_LAYER_KEY = re.compile(r"^(?P<prefix>.+)/layer_(?P<index>\d+)/(?P<name>[^/]+)$")


# ------------------------------------------------------------------------------------------------
# Summaries and chart ranges
# ------------------------------------------------------------------------------------------------
def summary_for(higher_is_better: bool | None, best: bool = False) -> str:
    """The W&B summary of a key: its last value, plus its worst (or, with ``best``, its best) value.

    Example:
        >>> summary_for(True), summary_for(False), summary_for(None), summary_for(True, best=True)
        ('min,last', 'max,last', 'last', 'max,last')
    """
    if higher_is_better is None:
        return "last"
    return f"{'max' if higher_is_better == best else 'min'},last"


def _members(source: Any) -> list[Any]:
    if source is None:
        return []
    if hasattr(source, "members"):
        return list(source.members())
    if isinstance(source, OPBCMetric):
        return [source]
    return list(source)


def metric_directions(source: Any = None) -> dict[str, bool | None]:
    """``{key: higher_is_better}`` for the keys of a collection (or metrics); every registered metric
    class when ``source`` is ``None``. :data:`KEY_DIRECTIONS` corrects keys whose class is too coarse.

    Example:
        >>> directions = metric_directions()
        >>> directions["opbc/is/ess"], directions["opbc/is/veto_fraction"], directions["opbc/kl/k1"]
        (True, False, None)
    """
    pairs = (
        [(m.keys, m.higher_is_better) for m in _members(source)]
        if source is not None
        else [(cls.keys, cls.higher_is_better) for cls in registered_metrics()]
    )
    out = {key: direction for keys, direction in pairs for key in keys}
    out.update({k: v for k, v in KEY_DIRECTIONS.items() if k in out})
    return out


def summaries_for(
    keys: Iterable[str], directions: Mapping[str, bool | None], overrides: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The summary of each key: ``overrides``, then its direction (:func:`summary_for`), else ``"last"``.

    Directions are looked up for the key, then for the key without a leading prefix (a collection's
    ``prefix``, e.g. ``bf16/opbc/is/ess``) and without the ``_epoch`` suffix of Lightning's epoch
    aggregates. Indices and counts (:data:`LAST_VALUE_SUFFIXES`) keep only their last value.

    Example:
        >>> summaries_for(["opbc/is/ess", "opbc/is/veto_fraction", "rollout/reward/mean", "opbc/kl/k1", "loss"],
        ...               metric_directions())
        {'opbc/is/ess': 'min,last', 'opbc/is/veto_fraction': 'max,last', 'rollout/reward/mean': 'max,last', \
'opbc/kl/k1': 'last', 'loss': 'last'}
    """
    return {key: _summary_of(key, directions, overrides) for key in keys}


def _summary_of(key: str, directions: Mapping[str, bool | None], overrides: Mapping[str, str] | None) -> str:
    if overrides and key in overrides:
        return overrides[key]
    base = key[: -len("_epoch")] if key.endswith("_epoch") else key
    if base.endswith(LAST_VALUE_SUFFIXES):
        return "last"
    parts = base.split("/")
    for i in range(len(parts)):  # the key, then without a leading prefix
        candidate = "/".join(parts[i:])
        if candidate in directions:
            best = any(p.search(candidate) for p in BEST_SUMMARY_PATTERNS)
            return summary_for(directions[candidate], best=best)
    return "last"


def chart_ranges(
    source: Any = None, declared: Mapping[str, tuple[float | None, float | None]] | None = None
) -> dict[str, list[float | None]]:
    """Declared ``[min, max]`` chart ranges per key.

    From each member's ``plot_lower_bound``/``plot_upper_bound`` (torchmetrics' plotting attributes,
    applied to every key of the member), then a member's ``chart_ranges()`` mapping if it defines one,
    then ``declared`` (e.g. ``{"rollout/reward/mean": (reward_min, reward_max)}``), later sources winning.
    Keys without a declaration are absent: charts use the observed range.

    Example:
        >>> from opbc_metrics import OPBCCollection
        >>> ranges = chart_ranges(OPBCCollection(), declared={"rollout/reward/mean": (0.0, 2.0)})
        >>> ranges["opbc/is/ess"], ranges["rollout/reward/mean"]
        ([0.0, 1.0], [0.0, 2.0])
    """
    members = _members(source)
    out: dict[str, list[float | None]] = {}
    for m in members:
        lo, hi = getattr(m, "plot_lower_bound", None), getattr(m, "plot_upper_bound", None)
        if lo is not None or hi is not None:
            for key in m.keys:
                if not key.endswith(LAST_VALUE_SUFFIXES):  # indices and counts keep their own scale
                    out[key] = [_opt_float(lo), _opt_float(hi)]
    for key, (lo, hi) in [*member_chart_ranges(members).items(), *(declared or {}).items()]:
        out[key] = [_opt_float(lo), _opt_float(hi)]
    return out


def _opt_float(x: Any) -> float | None:
    return None if x is None else float(x)


# ------------------------------------------------------------------------------------------------
# Histograms
# ------------------------------------------------------------------------------------------------
def _check_bins(bins: int) -> int:
    if not isinstance(bins, int) or isinstance(bins, bool) or not 1 <= bins <= MAX_HISTOGRAM_BINS:
        raise ValueError(f"`bins` must be an integer in [1, {MAX_HISTOGRAM_BINS}] (W&B's limit), got {bins!r}")
    return bins


def vector_histogram(values: Any, max_bins: int = MAX_HISTOGRAM_BINS) -> tuple[np.ndarray, np.ndarray]:
    """A 1-D vector (e.g. per-layer flip rates) as ``(heights, edges)``: one bar per index ``[i, i + 1)``.

    Longer vectors are averaged over runs of ``ceil(n / max_bins)`` consecutive indices.

    Example:
        >>> heights, edges = vector_histogram([0.1, 0.0, 0.3])
        >>> heights.tolist(), edges.tolist()
        ([0.1, 0.0, 0.3], [0.0, 1.0, 2.0, 3.0])
        >>> heights, edges = vector_histogram(list(range(10)), max_bins=4)
        >>> heights.tolist(), edges.tolist()
        ([1.0, 4.0, 7.0, 9.0], [0.0, 3.0, 6.0, 9.0, 10.0])
    """
    _check_bins(max_bins)
    v = _to_numpy(values).astype(np.float64).reshape(-1)
    n = v.size
    if n == 0:
        raise ValueError("cannot build a histogram of an empty vector")
    group = math.ceil(n / max_bins)
    starts = np.arange(0, n, group)
    sums = np.add.reduceat(v, starts)
    counts = np.diff(np.append(starts, n))
    edges = np.append(starts, n).astype(np.float64)
    return sums / counts, edges


def layer_histograms(
    values: Mapping[str, Any], num_layers: int | None = None
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-layer bar charts from ``<prefix>/layer_<i>/<name>`` scalars: ``<prefix>/<name>_by_layer``.

    Layers ``0..max index`` (the first ``num_layers`` when given; a missing index counts 0).

    Example:
        >>> vals = {"moe/router/layer_0/flip_rate": 0.1, "moe/router/layer_1/flip_rate": 0.3,
        ...         "moe/router/layer_2/flip_rate": 0.0, "moe/router/flip_rate": 0.13}
        >>> heights, edges = layer_histograms(vals, num_layers=2)["moe/router/flip_rate_by_layer"]
        >>> heights.tolist(), edges.tolist()
        ([0.1, 0.3], [0.0, 1.0, 2.0])
    """
    groups: dict[str, dict[int, float]] = {}
    for key, value in values.items():
        match = _LAYER_KEY.match(key)
        scalar = _scalar(value) if match else None
        if match and scalar is not None:
            name = f"{match['prefix']}/{match['name']}_by_layer"
            groups.setdefault(name, {})[int(match["index"])] = scalar
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, by_index in groups.items():
        n = max(by_index) + 1 if num_layers is None else num_layers
        if n >= 1:
            out[name] = vector_histogram([by_index.get(i, 0.0) for i in range(n)])
    return out


def _to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x)


def batch_histograms(batch: Any, bins: int = 64) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Histograms of one batch (numpy, on the host; rank-local): the valid tokens' log ratio, the valid
    sequences' log ratio ``s_i = sum_t r_t``, and, when the batch has ``rollout_experts`` and
    ``trainer_experts`` ``[B, T, L, K]``, the per-layer top-1 flip rate over response tokens.

    Each is ``(counts, edges)`` with ``bins`` bins over the observed range (at most 512, W&B's limit);
    a distribution with no values is left out.

    Example:
        >>> import torch
        >>> b = {"trainer_logprobs": torch.tensor([[-1.0, -1.0, -2.0]]),
        ...      "rollout_logprobs": torch.tensor([[-1.5, -1.0, -1.0]]), "response_mask": torch.tensor([[1, 1, 0]])}
        >>> counts, edges = batch_histograms(b, bins=2)["opbc/dist/log_ratio"]
        >>> counts.tolist(), edges.tolist()
        ([1, 1], [0.0, 0.25, 0.5])
    """
    _check_bins(bins)
    view = as_view(batch)
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    valid = view.valid.cpu().numpy()
    r = view.log_ratio.detach().to("cpu", torch.float64).numpy()[valid]
    if r.size:
        out[LOG_RATIO_HIST] = np.histogram(r, bins=bins)
    seq_valid = view.seq_valid.cpu().numpy()
    s = view.seq_log_ratio.detach().to("cpu", torch.float64).numpy()[seq_valid]
    if s.size:
        out[SEQ_LOG_RATIO_HIST] = np.histogram(s, bins=bins)
    if view.has("rollout_experts", "trainer_experts"):
        flips, tokens = _layer_flips(view)
        if float(tokens) > 0:
            out[LAYER_FLIP_HIST] = vector_histogram((flips / tokens).cpu())
    return out


def _layer_flips(view: BatchView, num_layers: int | None = None) -> tuple[Tensor, Tensor]:
    """Per-layer top-1 mismatches over response tokens ``[L]`` and the number of response tokens."""
    _, _, mask = view.token_inputs
    tops = []
    for name in ("rollout_experts", "trainer_experts"):
        e = view.tensor(name)
        if e.ndim != 4 or tuple(e.shape[:2]) != tuple(mask.shape):
            raise ValueError(
                f"batch field `{name}` must have shape [B, T, L, K] with [B, T] = {tuple(mask.shape)}, "
                f"got {tuple(e.shape)}"
            )
        if e.is_floating_point() or e.is_complex():
            raise ValueError(f"batch field `{name}` must hold integer expert ids, got {e.dtype}")
        if num_layers is not None and e.shape[2] != num_layers:
            raise ValueError(f"batch field `{name}` has {e.shape[2]} layers, expected num_layers={num_layers}")
        tops.append(e[..., 0])
    if tops[0].shape != tops[1].shape:
        raise ValueError(
            f"batch field `rollout_experts` has {tuple(tops[0].shape)} top-1 ids but `trainer_experts` has "
            f"{tuple(tops[1].shape)}"
        )
    flipped = (tops[0] != tops[1]) & mask.unsqueeze(-1)
    return flipped.to(torch.float64).sum(dim=(0, 1)), mask.to(torch.float64).sum()


class DistributionHistograms(OPBCMetric):
    r"""Fixed-bin histograms of the log ratio, the sequence log ratio and the per-layer router flip rate,
    accumulated over a window and synced exactly across ranks (sum states).

    * ``opbc/dist/log_ratio``: counts of valid tokens' :math:`r_t` in ``bins`` equal bins over
      ``[-log_ratio_range, log_ratio_range]`` nats;
    * ``opbc/dist/seq_log_ratio``: counts of valid sequences' :math:`s_i = \sum_t r_t` over
      ``[-seq_log_ratio_range, seq_log_ratio_range]``;
    * ``moe/dist/layer_flip_rate`` (only with ``num_layers``, for batches carrying ``rollout_experts``
      and ``trainer_experts`` ``[B, T, L, K]``): per layer, top-1 mismatches / response tokens.

    The two end bins are open: they also count the values beyond the range, so nothing is dropped (the
    exact extremes are ``opbc/log_ratio/{min,max}`` and ``opbc/sequence/log_ratio_max_abs``). An empty
    window gives all-zero counts and rates. These are chart data, not glossary metrics: the class declares
    no glossary ``keys`` (so it is not registered); its outputs are :attr:`histogram_keys`.

    Args:
        bins: bins per distribution, at most 512 (W&B's limit).
        log_ratio_range: half-width R of the token histogram, nats (1.0).
        seq_log_ratio_range: half-width of the sequence histogram, nats (10.0).
        num_layers: MoE layers L for the flip-rate histogram; ``None`` disables it.
        kwargs: torchmetrics ``Metric`` arguments.

    Example:
        >>> import torch
        >>> hist = DistributionHistograms(bins=4, log_ratio_range=1.0, seq_log_ratio_range=2.0)
        >>> hist.update(trainer_logprobs=torch.tensor([[-1.0, -1.0, -2.0]]),
        ...             rollout_logprobs=torch.tensor([[-1.6, -1.0, -5.0]]))
        >>> out = hist.compute()
        >>> out["opbc/dist/log_ratio"].tolist()  # r = 0.6, 0.0, 3.0 (3.0 lands in the open top bin)
        [0.0, 0.0, 1.0, 2.0]
        >>> out["opbc/dist/seq_log_ratio"].tolist()  # s = 3.6, beyond 2.0
        [0.0, 0.0, 0.0, 1.0]
        >>> hist.edges("opbc/dist/log_ratio").tolist()
        [-1.0, -0.5, 0.0, 0.5, 1.0]
    """

    keys: ClassVar[tuple[str, ...]] = ()
    required_fields: ClassVar[tuple[str, ...]] = (TRAINER_LOGPROBS, ROLLOUT_LOGPROBS)
    data_counts: ClassVar[tuple[str, ...]] = ()  # histograms() drops empty distributions itself

    def __init__(
        self,
        bins: int = 128,
        log_ratio_range: float = 1.0,
        seq_log_ratio_range: float = 10.0,
        num_layers: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.bins = _check_bins(bins)
        for name, value in (("log_ratio_range", log_ratio_range), ("seq_log_ratio_range", seq_log_ratio_range)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"`{name}` must be a positive finite number, got {value!r}")
        self.log_ratio_range = float(log_ratio_range)
        self.seq_log_ratio_range = float(seq_log_ratio_range)
        if num_layers is not None and (not isinstance(num_layers, int) or not 1 <= num_layers <= MAX_HISTOGRAM_BINS):
            raise ValueError(f"`num_layers` must be an integer in [1, {MAX_HISTOGRAM_BINS}], got {num_layers!r}")
        self.num_layers = num_layers

    def state_table(self) -> dict[str, State]:
        counts = table(token_counts=SUM.of("bins"), seq_counts=SUM.of("bins"))
        flips = table(layer_flips=SUM.of("num_layers"), router_tokens=SUM) if self.num_layers is not None else {}
        return {**counts, **flips}

    @property
    def histogram_keys(self) -> tuple[str, ...]:
        """The keys :meth:`compute` returns."""
        keys = (LOG_RATIO_HIST, SEQ_LOG_RATIO_HIST)
        return (*keys, LAYER_FLIP_HIST) if self.num_layers is not None else keys

    def _bin_counts(self, values: Tensor, weights: Tensor, half_width: float) -> Tensor:
        inner = torch.linspace(-half_width, half_width, self.bins + 1, dtype=torch.float64, device=values.device)
        return bin_counts(values.to(torch.float64), weights, inner[1:-1], right=True)  # [lo, hi) bins

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        stats = {
            "token_counts": self._bin_counts(view.log_ratio, view.valid_f, self.log_ratio_range),
            "seq_counts": self._bin_counts(view.seq_log_ratio, view.seq_valid_f, self.seq_log_ratio_range),
        }
        if self.num_layers is not None and view.has("rollout_experts", "trainer_experts"):
            stats["layer_flips"], stats["router_tokens"] = _layer_flips(view, self.num_layers)
        return stats

    def compute(self) -> dict[str, Tensor]:
        out = {LOG_RATIO_HIST: self.token_counts.clone(), SEQ_LOG_RATIO_HIST: self.seq_counts.clone()}
        if self.num_layers is not None:
            tokens = self.router_tokens
            self._synced_router_tokens = tokens.clone()  # the window's (synced) count, for histograms()
            out[LAYER_FLIP_HIST] = torch.where(
                tokens > 0, self.layer_flips / tokens.clamp_min(1.0), torch.zeros_like(self.layer_flips)
            )
        return out

    def edges(self, key: str) -> np.ndarray:
        """Bin edges of one histogram key."""
        if key == LOG_RATIO_HIST:
            return np.linspace(-self.log_ratio_range, self.log_ratio_range, self.bins + 1)
        if key == SEQ_LOG_RATIO_HIST:
            return np.linspace(-self.seq_log_ratio_range, self.seq_log_ratio_range, self.bins + 1)
        if key == LAYER_FLIP_HIST and self.num_layers is not None:
            return np.arange(self.num_layers + 1, dtype=np.float64)
        raise KeyError(key)

    def histograms(self, skip_empty: bool = False) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``{key: (values, edges)}`` from :meth:`compute` (synced across ranks: call on every rank).

        With ``skip_empty``, distributions that saw no value in the window (over all ranks) are left out.
        """
        with warnings.catch_warnings():  # an empty window is a normal case here, not a user error
            warnings.filterwarnings("ignore", message=r".*was called before the ``update`` method.*")
            values = self.compute()
        out = {key: (_to_numpy(v), self.edges(key)) for key, v in values.items()}
        if skip_empty:
            for key in (LOG_RATIO_HIST, SEQ_LOG_RATIO_HIST):
                if not np.any(out[key][0]):
                    del out[key]
            tokens = getattr(self, "_synced_router_tokens", None)
            if LAYER_FLIP_HIST in out and (tokens is None or float(tokens) == 0.0):
                del out[LAYER_FLIP_HIST]
        return out


# ------------------------------------------------------------------------------------------------
# The logger
# ------------------------------------------------------------------------------------------------
def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("W&B logging needs the `wandb` package: `pip install \".[wandb]\"` in a checkout of "
                          "opbc-metrics (it is not on PyPI), or `pip install wandb`") from e
    return wandb


def _is_rank_zero() -> bool:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0


def glossary_rows() -> tuple[list[str], list[list[Any]]]:
    """Columns and rows of the glossary table: one row per entry, with the identities of its keys that
    the loggers do not write (:data:`~opbc_metrics.integrations.dashboard.ALIASES`).

    Example:
        >>> columns, rows = glossary_rows()
        >>> columns[:3]
        ['entry', 'keys', 'identities']
        >>> next(r for r in rows if r[0] == "kl")[2]
        'opbc/kl/k1 = -opbc/logprob/diff_mean when opbc/is/clipped_fraction is 0'
    """
    from opbc_metrics.glossary import glossary_dict

    columns = ["entry", "keys", "identities", "what", "unit", "cap", "action", "aliases", "higher_is_better"]
    rows = []
    for name, e in glossary_dict().items():
        identities = "; ".join(a.describe() for a in ALIASES if a.key in e["keys"])
        rows.append(
            [name, ", ".join(e["keys"]), identities, e["what"], e["unit"], e["cap"], e["action"],
             ", ".join(e["aliases"]), str(e["higher_is_better"])]
        )
    return columns, rows


class OPBCWandbLogger:
    """Writes computed ``section/group/metric`` values, histograms and metadata to a W&B run.

    Only global rank 0 writes (and creates or attaches to the run); every rank may call :meth:`log`, and
    must when ``distributions`` is set, since computing the histograms syncs them across ranks.

    Args:
        run: a W&B run to write to (e.g. ``trainer.logger.experiment``); never finished by this logger.
            When ``None``: the active run (``wandb.run``) if there is one, else a new run from
            ``init_kwargs``, created on rank 0 at the first write and finished by :meth:`finish`.
        collection: the :class:`~opbc_metrics.OPBCCollection` (or metrics) whose directions and chart
            ranges are used.
        distributions: a :class:`DistributionHistograms` fed by :meth:`update` and logged (then reset)
            by :meth:`log`.
        ranges: declared chart ranges ``{key: (min, max)}`` added to the config.
        summaries: per-key summary overrides, e.g. ``{"opbc/is/ess": "min,max,last"}``.
        step_metric: the key each row carries its step under, the x-axis of every chart this logger
            makes (``"opbc/step"``; ``"trainer/global_step"`` shares Lightning's).
        num_layers: the model's MoE layer count, for the per-layer bar charts.
        layer_bars: also draw ``.../layer_<i>/...`` scalars as one per-layer bar chart (they duplicate
            the per-layer scalars, so off by default).
        log_all: write every key, aliases and event counts that stayed zero included.
        log_glossary: log the glossary table ``opbc/glossary`` with the first row.
        init_kwargs: ``wandb.init`` arguments (``project``, ``mode="offline"``, ``dir``, ...).

    Example:
        >>> logger = OPBCWandbLogger(run=None, mode="offline")
        >>> logger.summaries_for(["opbc/is/ess", "opbc/is/veto_fraction", "opbc/is/weight_mean"])
        {'opbc/is/ess': 'min,last', 'opbc/is/veto_fraction': 'max,last', 'opbc/is/weight_mean': 'last'}
    """

    def __init__(
        self,
        run: Any = None,
        *,
        collection: Any = None,
        distributions: DistributionHistograms | None = None,
        ranges: Mapping[str, tuple[float | None, float | None]] | None = None,
        summaries: Mapping[str, str] | None = None,
        step_metric: str = STEP_METRIC,
        num_layers: int | None = None,
        layer_bars: bool = False,
        log_all: bool = False,
        log_glossary: bool = True,
        **init_kwargs: Any,
    ) -> None:
        self._run = run
        self._owns_run = False
        self._init_kwargs = init_kwargs
        self.collection = collection
        self.distributions = distributions
        self.declared_ranges = dict(ranges or {})
        self.summary_overrides = dict(summaries or {})
        self.step_metric = step_metric
        self.num_layers = num_layers
        self.layer_bars = layer_bars
        self.log_glossary = log_glossary
        self.key_filter = KeyFilter(log_all=log_all)
        self._directions = metric_directions()
        if collection is not None:
            self._directions.update(metric_directions(collection))
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        self._defined: set[str] = set()
        self._configured = False
        self._ranges: dict[str, list[float | None]] = {}
        self._ranges_written = False
        self._rows = 0
        self._open_row: int | None = None  # W&B step of this logger's last row while it may still be open
        self._open_step: int | None = None
        self._zero_summaries: set[str] = set()  # quiet keys put in the summary as 0

    # -- run handling ------------------------------------------------------------------------
    @property
    def is_writer(self) -> bool:
        """Whether this process writes to W&B (global rank 0)."""
        return _is_rank_zero()

    @property
    def owns_run(self) -> bool:
        """Whether this logger started its run (and :meth:`finish` ends it)."""
        return self._owns_run

    @property
    def run(self) -> Any:
        """The W&B run (attached or created on first access on rank 0); ``None`` on other ranks."""
        if self._run is None and self.is_writer:
            wandb = _import_wandb()
            if wandb.run is not None:
                self._run = wandb.run
                ignored = f"; ignoring {sorted(self._init_kwargs)}" if self._init_kwargs else ""
                _LOG.warning(
                    "OPBCWandbLogger: writing to the active W&B run %r%s. It stays open: finish it where it "
                    "was started.",
                    getattr(self._run, "id", None),
                    ignored,
                )
            else:
                self._run = wandb.init(**self._init_kwargs)
                self._owns_run = True
        return self._run if self.is_writer else None

    def finish(self) -> None:
        """Finish the run if this logger started it; either way, detach from it."""
        if self._owns_run and self._run is not None:
            self._run.finish()
        self._run = None
        self._owns_run = False
        self._reset_run_state()

    # -- metadata ----------------------------------------------------------------------------
    def summaries_for(self, keys: Iterable[str]) -> dict[str, str]:
        """The summary each key gets (see :func:`summaries_for`)."""
        return summaries_for(keys, self._directions, self.summary_overrides)

    def _configure(self, run: Any, data: dict[str, Any]) -> None:
        if self._configured:
            return
        self._configured = True
        run.define_metric(self.step_metric, hidden=True)
        if self.log_glossary:
            columns, rows = glossary_rows()
            data[GLOSSARY_KEY] = _import_wandb().Table(columns=columns, data=rows)

    def _meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"chart_ranges": self._ranges}
        if self.distributions is not None:
            meta["histograms"] = {
                key: {
                    "bins": len(self.distributions.edges(key)) - 1,
                    "edges": [float(self.distributions.edges(key)[0]), float(self.distributions.edges(key)[-1])],
                }
                for key in self.distributions.histogram_keys
            }
        return meta

    def _update_ranges(self, run: Any) -> None:
        """Widen the recorded chart ranges by what is declared and observed now; write them when they changed."""
        changed = not self._ranges_written
        self._ranges_written = True
        for key, (lo, hi) in chart_ranges(self.collection, self.declared_ranges).items():
            old = self._ranges.get(key)
            new = [_widen(None if old is None else old[0], lo, min), _widen(None if old is None else old[1], hi, max)]
            if new != old:
                self._ranges[key] = new
                changed = True
        if changed:
            run.config.update({"opbc": self._meta()}, allow_val_change=True)

    def _define(self, run: Any, keys: Iterable[str]) -> None:
        new = [k for k in keys if k not in self._defined and k != self.step_metric]
        summaries = self.summaries_for(new)
        for key in new:
            kwargs: dict[str, Any] = {"step_metric": self.step_metric}
            if key in summaries:
                kwargs["summary"] = summaries[key]
            run.define_metric(key, **kwargs)
        self._defined.update(new)

    # -- data --------------------------------------------------------------------------------
    def update(self, batch: Any = None, **fields: Any) -> None:
        """Feed one batch to ``distributions`` (no-op without it). No host sync."""
        if self.distributions is not None:
            with torch.no_grad():
                self.distributions.update(batch, **fields)

    def log(self, values: Mapping[str, Any], step: int | None = None, *, commit: bool | None = None) -> None:
        """Log computed values (scalars as numbers, 1-D tensors as per-index histograms) and, if set,
        the window's ``distributions`` (then reset them; an empty window logs no histogram).

        ``step`` is written under ``step_metric``; without it, rows are numbered 0, 1, 2, ... Keys absent
        from ``values`` are not written. Call on every rank when ``distributions`` is set (their compute
        is a collective).
        """
        hists: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        if self.distributions is not None:
            # Synced counts: the same on every rank, so every rank skips an empty window alike.
            hists.update(self.distributions.histograms(skip_empty=True))
            self.distributions.reset()
        run = self.run
        if run is None:
            return
        values = self.key_filter(values)
        floats = host_floats(values)  # one device-to-host copy, not one sync per key
        if self.layer_bars:
            hists.update(layer_histograms({**values, **floats}, self.num_layers))
        data: dict[str, Any] = {}
        for key, value in values.items():
            scalar = floats[key] if key in floats else _scalar(value)
            if scalar is not None:
                data[key] = scalar
            elif isinstance(value, (Tensor, np.ndarray, list, tuple)) and np.ndim(_to_numpy(value)) == 1:
                hists[key] = vector_histogram(value)
            else:
                warnings.warn(f"OPBCWandbLogger: skipping `{key}`: not a scalar or a 1-D vector", stacklevel=2)
        # A quiet key charted for the first time: W&B keeps only the last value of a key whose summary was
        # set by hand (the 0 below), which would lose its worst value; defining it again restores `max,last`.
        revived = self._zero_summaries & data.keys()
        self._defined -= revived
        self._zero_summaries -= revived
        wandb = _import_wandb() if hists else None
        for key, (heights, edges) in hists.items():
            data[key] = wandb.Histogram(np_histogram=(np.asarray(heights), np.asarray(edges)))
        self._write(run, data, step, commit)
        zeros = self.key_filter.zero_so_far - self._zero_summaries
        if zeros and self._configured:  # not charted while 0, but the summary answers "was anything vetoed?"
            self._define(run, zeros)
            run.summary.update(dict.fromkeys(sorted(zeros), 0.0))
            self._zero_summaries |= zeros

    def log_batch_distributions(self, batch: Any, step: int | None = None, bins: int = 64) -> None:
        """Log :func:`batch_histograms` of one batch (rank-local: this rank's batch only)."""
        run = self.run
        if run is None:
            return
        wandb = _import_wandb()
        data = {
            key: wandb.Histogram(np_histogram=(np.asarray(c), np.asarray(e)))
            for key, (c, e) in batch_histograms(batch, bins).items()
        }
        self._write(run, data, step, None)

    def _write(self, run: Any, data: dict[str, Any], step: int | None, commit: bool | None) -> None:
        """One row, into whatever row W&B has open, never with ``step=``.

        W&B drops a row whose ``step=`` is behind its own counter, which other writers advance (a
        ``wandb.log`` without ``step=`` commits and advances it). So this logger writes with
        ``commit=False`` into the open row (the next writer's commit, or the run's end, closes it) and
        advances W&B's step only to close its own previous row when nobody did, which is never behind
        anyone. The x-axis is ``step_metric``, which each row carries.
        """
        if not data:
            return
        self._configure(run, data)
        self._define(run, data)
        self._update_ranges(run)
        data[self.step_metric] = step if step is not None else self._rows
        self._rows += 1
        try:
            current = run.step
        except Exception:  # e.g. a run in W&B's "shared" mode has no single step counter: commit each row
            run.log(data)
            return
        if self._open_row == current and (step is None or step != self._open_step):
            run.log({}, commit=True)  # our previous row is still open: close it so this one does not overwrite it
            current += 1
        run.log(data, commit=bool(commit))
        self._open_row, self._open_step = (None, None) if commit else (current, step)


def _widen(old: float | None, new: float | None, pick: Any) -> float | None:
    if new is not None and not math.isfinite(new):  # a bound not observed yet
        new = None
    if old is None or new is None:
        return old if new is None else new
    return float(pick(old, new))


def _scalar(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float, np.integer, np.floating)):
        return float(value)
    if isinstance(value, Tensor) and value.numel() == 1:
        return float(value.detach().reshape(()).item())
    if isinstance(value, np.ndarray) and value.size == 1:
        return float(value.reshape(()))
    return None
