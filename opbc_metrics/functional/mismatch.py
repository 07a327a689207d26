r"""Train-vs-rollout mismatch: pure functions over one batch.

Notation (per valid token t, i.e. ``response_mask = 1`` and both logprobs finite):
``r_t = trainer_logprobs - rollout_logprobs`` in nats, ``w_t = exp(clamp(r_t, -C, C))`` with clamp
``C`` (20 by default), ``N`` the number of valid tokens. Per sequence i: ``s_i = sum_t r_t``,
``n_i`` its valid tokens.

Each metric comes as a pair ``_x_update(view, ...) -> dict of sufficient statistics`` and
``_x_compute(**stats) -> value``; the stateful classes in :mod:`opbc_metrics.mismatch` sum (or
max/min) the statistics over updates and ranks and call the same ``_x_compute``, so the functional
value of one batch equals the class value after one update.

Over an empty window (no valid token, or no valid sequence) every metric returns its on-policy
value, the value identical logprobs would give: ESS, weight mean, second moment, perplexity ratio
and Pearson 1; differences, fractions, KL and chi-square terms 0.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from opbc_metrics.batch import DEFAULT_CLAMP, DEFAULT_VETO, BatchView

# The top-1% sketch bins log-weights over [-C, C]; 8192 bins keep its relative error under 0.5%.
DEFAULT_TOP_MASS_BINS = 8192
DEFAULT_TOP_FRACTION = 0.01

Stats = dict[str, Tensor]


def _view(trainer_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor | None) -> BatchView:
    return BatchView(
        trainer_logprobs=trainer_logprobs, rollout_logprobs=rollout_logprobs, response_mask=response_mask
    )


def _safe_div(num: Tensor, den: Tensor, empty: float) -> Tensor:
    """``num / den`` where ``den > 0``, else ``empty``."""
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny), torch.full_like(num, empty))


def _amax(x: Tensor) -> Tensor:
    """Max over all elements; -inf for an empty tensor (keeps update free of branches on data)."""
    return x.amax() if x.numel() else torch.full((), float("-inf"), dtype=x.dtype, device=x.device)


def _amin(x: Tensor) -> Tensor:
    return x.amin() if x.numel() else torch.full((), float("inf"), dtype=x.dtype, device=x.device)


# ---------------------------------------------------------------------------------------------
# opbc/is/*: importance weights
# ---------------------------------------------------------------------------------------------
def _ess_update(view: BatchView, clamp: float) -> Stats:
    sum_w, sum_w2 = view.weight_sums(clamp)
    return {"sum_w": sum_w, "sum_w2": sum_w2, "count": view.num_valid}


def _ess_compute(sum_w: Tensor, sum_w2: Tensor, count: Tensor) -> Tensor:
    # Cauchy-Schwarz gives ESS <= 1; the clamp only absorbs rounding.
    return _safe_div(sum_w * sum_w, count * sum_w2, 1.0).clamp(max=1.0)


def importance_ess(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None = None,
    clamp: float = DEFAULT_CLAMP,
) -> Tensor:
    r"""Token-level effective sample size of the importance weights (``opbc/is/ess``).

    .. math:: \mathrm{ESS} = \frac{(\sum_t w_t)^2}{N \sum_t w_t^2}, \quad w_t = e^{\mathrm{clamp}(r_t, -C, C)}

    1 means on-policy; toward 0, off-policy.

    Example:
        >>> import torch
        >>> t = torch.tensor([[-1.0, -1.0, -2.0]])
        >>> importance_ess(t, t)
        tensor(1., dtype=torch.float64)
        >>> importance_ess(t, t - torch.tensor([[0.0, 1.0, 0.0]])).round(decimals=4)
        tensor(0.7904, dtype=torch.float64)
    """
    return _ess_compute(**_f64(_ess_update(_view(trainer_logprobs, rollout_logprobs, response_mask), clamp)))


def _seq_ess_update(view: BatchView, clamp: float) -> Stats:
    w = view.seq_weights(clamp)
    return {"sum_w": w.sum(), "sum_w2": (w * w).sum(), "count": view.num_seqs}


def sequence_ess(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None = None,
    clamp: float = DEFAULT_CLAMP,
) -> Tensor:
    r"""Sequence-level ESS (``opbc/is/seq_ess``) with ``w_i = exp(clamp(s_i, -C, C))``.

    .. math:: \mathrm{ESS}_{seq} = \frac{(\sum_i w_i)^2}{M \sum_i w_i^2}

    over the M sequences with at least one valid token.

    Example:
        >>> import torch
        >>> t = torch.zeros(2, 2)
        >>> sequence_ess(t, t - torch.tensor([[1.0, 0.0], [0.0, 0.0]])).round(decimals=4)
        tensor(0.8240, dtype=torch.float64)
    """
    stats = _seq_ess_update(_view(trainer_logprobs, rollout_logprobs, response_mask), clamp)
    return _ess_compute(**_f64(stats))


def _weight_moments_update(view: BatchView, clamp: float) -> Stats:
    sum_w, sum_w2 = view.weight_sums(clamp)
    return {"sum_w": sum_w, "sum_w2": sum_w2, "count": view.num_valid}


def _second_moment_compute(sum_w2: Tensor, count: Tensor, **_: Any) -> Tensor:
    return _safe_div(sum_w2, count, 1.0)


def _weight_mean_compute(sum_w: Tensor, count: Tensor, **_: Any) -> Tensor:
    return _safe_div(sum_w, count, 1.0)


def importance_weight_second_moment(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None = None,
    clamp: float = DEFAULT_CLAMP,
) -> Tensor:
    r"""``opbc/is/second_moment``: :math:`E[w^2] = \frac{1}{N}\sum_t w_t^2`.

    Example:
        >>> import torch
        >>> t = torch.zeros(1, 2)
        >>> importance_weight_second_moment(t, torch.tensor([[0.0, -1.0]])).round(decimals=4)
        tensor(4.1945, dtype=torch.float64)
    """
    stats = _weight_moments_update(_view(trainer_logprobs, rollout_logprobs, response_mask), clamp)
    return _second_moment_compute(**_f64(stats))


def importance_weight_mean(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None = None,
    clamp: float = DEFAULT_CLAMP,
) -> Tensor:
    r"""``opbc/is/weight_mean``: :math:`\frac{1}{N}\sum_t w_t`.

    Example:
        >>> import torch
        >>> t = torch.zeros(1, 2)
        >>> importance_weight_mean(t, torch.tensor([[0.0, -1.0]])).round(decimals=4)
        tensor(1.8591, dtype=torch.float64)
    """
    stats = _weight_moments_update(_view(trainer_logprobs, rollout_logprobs, response_mask), clamp)
    return _weight_mean_compute(**_f64(stats))


def _threshold_update(view: BatchView, threshold: float) -> Stats:
    return {"hits": view.count_above(threshold), "count": view.num_valid}


def _fraction_compute(hits: Tensor, count: Tensor) -> Tensor:
    return _safe_div(hits, count, 0.0)


def clipped_fraction(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None = None,
    clamp: float = DEFAULT_CLAMP,
) -> Tensor:
    r"""``opbc/is/clipped_fraction``: share of valid tokens with :math:`|r_t| > C` (exceeded the clamp).

    Example:
        >>> import torch
        >>> t = torch.zeros(1, 4)
        >>> clipped_fraction(t, torch.tensor([[0.0, -25.0, 3.0, 21.0]]))
        tensor(0.5000, dtype=torch.float64)
    """
    stats = _threshold_update(_view(trainer_logprobs, rollout_logprobs, response_mask), clamp)
    return _fraction_compute(**_f64(stats))


def veto_fraction(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None = None,
    veto: float = DEFAULT_VETO,
) -> Tensor:
    r"""``opbc/is/veto_fraction``: share of valid tokens with :math:`|r_t| > V` (30 nats by default).

    Example:
        >>> import torch
        >>> t = torch.zeros(1, 4)
        >>> veto_fraction(t, torch.tensor([[0.0, -25.0, 3.0, 9999.0]]))
        tensor(0.2500, dtype=torch.float64)
    """
    stats = _threshold_update(_view(trainer_logprobs, rollout_logprobs, response_mask), veto)
    return _fraction_compute(**_f64(stats))


# ---------------------------------------------------------------------------------------------
# opbc/is/top_1pct_gradient_mass
# ---------------------------------------------------------------------------------------------
def top_k_count(count: Tensor, fraction: float = DEFAULT_TOP_FRACTION) -> Tensor:
    """``k = max(1, floor(fraction * N))``."""
    return torch.floor(count * fraction + 1e-9).clamp_min(1.0)


def _top_mass_sketch_update(view: BatchView, clamp: float, bins: int) -> Stats:
    width = 2.0 * clamp / bins
    idx = ((view.clamped_log_ratio(clamp) + clamp) / width).floor().clamp(0, bins - 1).long().reshape(-1)
    counts = torch.zeros(bins, dtype=view.dtype, device=view.device)
    mass = torch.zeros(bins, dtype=view.dtype, device=view.device)
    counts.index_add_(0, idx, view.valid_f.reshape(-1))
    mass.index_add_(0, idx, view.weights(clamp).reshape(-1))
    return {"bin_count": counts, "bin_mass": mass}


def _top_mass_sketch_compute(bin_count: Tensor, bin_mass: Tensor, fraction: float = DEFAULT_TOP_FRACTION) -> Tensor:
    """Walk the histogram from the top bin: whole bins while they fit in k, then part of one bin.

    A bin's tokens all have weights within a factor ``e^h`` of each other (``h = 2C / bins``, the bin
    width in log-weight), and the part taken from the last bin is valued at that bin's mean weight,
    which is at most the true mean of its largest tokens. So the sketch never overestimates and its
    relative error is at most ``e^h - 1``.
    """
    counts, mass = bin_count.flip(0), bin_mass.flip(0)
    total_count, total_mass = counts.sum(), mass.sum()
    k = top_k_count(total_count, fraction)
    before = torch.cumsum(counts, 0) - counts
    take = torch.minimum((k - before).clamp_min(0.0), counts)
    top = (take * _safe_div(mass, counts, 0.0)).sum()
    return _safe_div(top, total_mass, 0.0).clamp(0.0, 1.0)


def sketch_relative_error_bound(clamp: float = DEFAULT_CLAMP, bins: int = DEFAULT_TOP_MASS_BINS) -> float:
    """The sketch's relative error bound ``e^h - 1`` with bin width ``h = 2C / bins``.

    Example:
        >>> round(sketch_relative_error_bound(20.0, 8192), 5)
        0.00489
    """
    return math.expm1(2.0 * clamp / bins)


def _top_mass_exact_compute(weights: Tensor, count: Tensor, fraction: float = DEFAULT_TOP_FRACTION) -> Tensor:
    """Exact top-k mass from all weights (invalid tokens carry weight 0 and sort last)."""
    if weights.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=weights.device)
    k = int(top_k_count(count, fraction).item())
    top = torch.topk(weights.reshape(-1), min(k, weights.numel())).values.sum()
    return _safe_div(top.to(torch.float64), weights.sum().to(torch.float64), 0.0).clamp(0.0, 1.0)


def top_gradient_mass(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None = None,
    clamp: float = DEFAULT_CLAMP,
    fraction: float = DEFAULT_TOP_FRACTION,
    bins: int | None = None,
) -> Tensor:
    r"""``opbc/is/top_1pct_gradient_mass``: share of :math:`\sum_t w_t` carried by the ``k`` largest weights.

    ``k = max(1, floor(fraction * N))``. With ``bins=None`` the value is exact (a sort); with ``bins``
    it is the histogram sketch the stateful metric uses, which underestimates by a relative error of
    at most ``e^{2C/bins} - 1``.

    Example:
        >>> import torch
        >>> t = torch.zeros(1, 4)
        >>> top_gradient_mass(t, torch.tensor([[0.0, 0.0, 0.0, -1.0]])).round(decimals=4)
        tensor(0.4754, dtype=torch.float64)
    """
    view = _view(trainer_logprobs, rollout_logprobs, response_mask)
    if bins is None:
        return _top_mass_exact_compute(view.weights(clamp), view.num_valid, fraction)
    return _top_mass_sketch_compute(**_f64(_top_mass_sketch_update(view, clamp, bins)), fraction=fraction)


# ---------------------------------------------------------------------------------------------
# opbc/logprob/*, opbc/log_ratio/*
# ---------------------------------------------------------------------------------------------
LOGPROB_KEYS = ("opbc/logprob/abs_diff_mean", "opbc/logprob/abs_diff_max", "opbc/logprob/diff_mean")
LOG_RATIO_KEYS = ("opbc/log_ratio/min", "opbc/log_ratio/max", "opbc/log_ratio/max_abs")


def _logprob_diff_update(view: BatchView) -> Stats:
    neg_inf = torch.full((), float("-inf"), dtype=view.dtype, device=view.device)
    return {
        "sum_abs": view.abs_log_ratio.sum(),
        "sum_diff": view.log_ratio.sum(),
        "max_abs": _amax(torch.where(view.valid, view.abs_log_ratio, neg_inf)),
        "count": view.num_valid,
    }


def _logprob_diff_compute(sum_abs: Tensor, sum_diff: Tensor, max_abs: Tensor, count: Tensor) -> dict[str, Tensor]:
    return {
        LOGPROB_KEYS[0]: _safe_div(sum_abs, count, 0.0),
        LOGPROB_KEYS[1]: torch.where(count > 0, max_abs, torch.zeros_like(max_abs)),
        LOGPROB_KEYS[2]: _safe_div(sum_diff, count, 0.0),
    }


def logprob_diff(
    trainer_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor | None = None
) -> dict[str, Tensor]:
    r"""``opbc/logprob/*``: mean :math:`|r|`, max :math:`|r|` and mean :math:`r` over valid tokens.

    Example:
        >>> import torch
        >>> out = logprob_diff(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]]))
        >>> {k.split('/')[-1]: round(v.item(), 3) for k, v in out.items()}
        {'abs_diff_mean': 0.75, 'abs_diff_max': 1.0, 'diff_mean': -0.25}
    """
    return _logprob_diff_compute(**_f64(_logprob_diff_update(_view(trainer_logprobs, rollout_logprobs, response_mask))))


def _log_ratio_range_update(view: BatchView) -> Stats:
    inf = torch.full((), float("inf"), dtype=view.dtype, device=view.device)
    return {
        "min": _amin(torch.where(view.valid, view.log_ratio, inf)),
        "max": _amax(torch.where(view.valid, view.log_ratio, -inf)),
        "count": view.num_valid,
    }


def _log_ratio_range_compute(min: Tensor, max: Tensor, count: Tensor) -> dict[str, Tensor]:
    zero = torch.zeros_like(min)
    lo, hi = torch.where(count > 0, min, zero), torch.where(count > 0, max, zero)
    return {LOG_RATIO_KEYS[0]: lo, LOG_RATIO_KEYS[1]: hi, LOG_RATIO_KEYS[2]: torch.maximum(lo.abs(), hi.abs())}


def log_ratio_range(
    trainer_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor | None = None
) -> dict[str, Tensor]:
    r"""``opbc/log_ratio/*``: min, max and max-abs of the raw (unclamped) log ratio :math:`r`.

    Example:
        >>> import torch
        >>> out = log_ratio_range(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]]))
        >>> [round(v.item(), 2) for v in out.values()]
        [-1.0, 0.5, 1.0]
    """
    view = _view(trainer_logprobs, rollout_logprobs, response_mask)
    return _log_ratio_range_compute(**_f64(_log_ratio_range_update(view)))


# ---------------------------------------------------------------------------------------------
# opbc/sequence/*
# ---------------------------------------------------------------------------------------------
SEQUENCE_KEYS = (
    "opbc/sequence/log_ratio_mean",
    "opbc/sequence/log_ratio_abs_mean",
    "opbc/sequence/log_ratio_max_abs",
    "opbc/sequence/geo_log_ratio_mean",
)


def _sequence_update(view: BatchView) -> Stats:
    s = view.seq_log_ratio
    neg_inf = torch.full((), float("-inf"), dtype=view.dtype, device=view.device)
    return {
        "sum_s": s.sum(),
        "sum_abs_s": s.abs().sum(),
        "max_abs_s": _amax(torch.where(view.seq_valid, s.abs(), neg_inf)),
        "sum_geo": view.seq_mean_log_ratio.sum(),
        "count": view.num_seqs,
    }


def _sequence_compute(
    sum_s: Tensor, sum_abs_s: Tensor, max_abs_s: Tensor, sum_geo: Tensor, count: Tensor
) -> dict[str, Tensor]:
    return {
        SEQUENCE_KEYS[0]: _safe_div(sum_s, count, 0.0),
        SEQUENCE_KEYS[1]: _safe_div(sum_abs_s, count, 0.0),
        SEQUENCE_KEYS[2]: torch.where(count > 0, max_abs_s, torch.zeros_like(max_abs_s)),
        SEQUENCE_KEYS[3]: _safe_div(sum_geo, count, 0.0),
    }


def sequence_log_ratio(
    trainer_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor | None = None
) -> dict[str, Tensor]:
    r"""``opbc/sequence/*`` over sequences :math:`s_i = \sum_t r_t`.

    Mean :math:`s_i`, mean :math:`|s_i|`, max :math:`|s_i|`, and the length-normalised (geometric)
    mean of :math:`s_i / n_i`, over sequences with at least one valid token.

    Example:
        >>> import torch
        >>> out = sequence_log_ratio(torch.tensor([[0.0, 0.0], [0.0, 0.0]]),
        ...                          torch.tensor([[-1.0, -1.0], [0.5, 0.0]]))
        >>> [round(v.item(), 3) for v in out.values()]
        [0.75, 1.25, 2.0, 0.375]
    """
    return _sequence_compute(**_f64(_sequence_update(_view(trainer_logprobs, rollout_logprobs, response_mask))))


# ---------------------------------------------------------------------------------------------
# opbc/kl/*
# ---------------------------------------------------------------------------------------------
KL_KEYS = ("opbc/kl/k1", "opbc/kl/k2", "opbc/kl/k3")
CHI2_KEYS = ("opbc/kl/chi2_token", "opbc/kl/chi2_seq")


def _kl_update(view: BatchView, clamp: float) -> Stats:
    rc = view.clamped_log_ratio(clamp)
    return {
        "sum_k1": -rc.sum(),
        "sum_k2": 0.5 * (rc * rc).sum(),
        # exp(rc) - 1 - rc is 0 on invalid tokens (rc = 0 there), so no extra mask is needed.
        "sum_k3": (torch.expm1(rc) - rc).sum(),
        "count": view.num_valid,
    }


def _kl_compute(sum_k1: Tensor, sum_k2: Tensor, sum_k3: Tensor, count: Tensor) -> dict[str, Tensor]:
    return {
        KL_KEYS[0]: _safe_div(sum_k1, count, 0.0),
        KL_KEYS[1]: _safe_div(sum_k2, count, 0.0),
        KL_KEYS[2]: _safe_div(sum_k3, count, 0.0),
    }


def kl_estimators(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None = None,
    clamp: float = DEFAULT_CLAMP,
) -> dict[str, Tensor]:
    r"""``opbc/kl/k1, k2, k3``: Schulman's estimators of KL(rollout || trainer), tokens sampled from the rollout.

    With :math:`\tilde r = \mathrm{clamp}(r, -C, C)`: ``k1 = mean(-r~)``, ``k2 = mean(r~^2 / 2)``,
    ``k3 = mean(exp(r~) - 1 - r~)``.

    Example:
        >>> import torch
        >>> out = kl_estimators(torch.tensor([[0.0, -1.0]]), torch.tensor([[-1.0, 0.0]]))
        >>> [round(v.item(), 4) + 0.0 for v in out.values()]
        [0.0, 0.5, 0.5431]
    """
    view = _view(trainer_logprobs, rollout_logprobs, response_mask)
    return _kl_compute(**_f64(_kl_update(view, clamp)))


def _chi2_update(view: BatchView, clamp: float) -> Stats:
    ws = view.seq_weights(clamp)
    return {
        "sum_w2": view.weight_sums(clamp)[1],
        "count": view.num_valid,
        "sum_seq_w2": (ws * ws).sum(),
        "seq_count": view.num_seqs,
    }


def _chi2_compute(sum_w2: Tensor, count: Tensor, sum_seq_w2: Tensor, seq_count: Tensor) -> dict[str, Tensor]:
    return {
        CHI2_KEYS[0]: _safe_div(sum_w2, count, 1.0) - 1.0,
        CHI2_KEYS[1]: _safe_div(sum_seq_w2, seq_count, 1.0) - 1.0,
    }


def chi_square(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None = None,
    clamp: float = DEFAULT_CLAMP,
) -> dict[str, Tensor]:
    r"""``opbc/kl/chi2_token`` = :math:`E_t[w_t^2] - 1` and ``opbc/kl/chi2_seq`` = :math:`E_i[w_i^2] - 1`.

    Example:
        >>> import torch
        >>> out = chi_square(torch.zeros(1, 2), torch.tensor([[0.0, -1.0]]))
        >>> [round(v.item(), 4) for v in out.values()]
        [3.1945, 6.3891]
    """
    return _chi2_compute(**_f64(_chi2_update(_view(trainer_logprobs, rollout_logprobs, response_mask), clamp)))


# ---------------------------------------------------------------------------------------------
# opbc/ppl/*
# ---------------------------------------------------------------------------------------------
PPL_KEYS = ("opbc/ppl/log_ppl_diff", "opbc/ppl/log_ppl_abs_diff", "opbc/ppl/ratio")


def _ppl_update(view: BatchView) -> Stats:
    # d_i = mean_t rollout - mean_t trainer = -s_i / n_i. exp() in float64: d_i can be large.
    d = -view.seq_mean_log_ratio.to(torch.float64)
    return {
        "sum_d": d.sum(),
        "sum_abs_d": d.abs().sum(),
        "sum_exp_d": (d.exp() * view.seq_valid.to(torch.float64)).sum(),
        "count": view.num_seqs,
    }


def _ppl_compute(sum_d: Tensor, sum_abs_d: Tensor, sum_exp_d: Tensor, count: Tensor) -> dict[str, Tensor]:
    return {
        PPL_KEYS[0]: _safe_div(sum_d, count, 0.0),
        PPL_KEYS[1]: _safe_div(sum_abs_d, count, 0.0),
        PPL_KEYS[2]: _safe_div(sum_exp_d, count, 1.0),
    }


def perplexity_gap(
    trainer_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor | None = None
) -> dict[str, Tensor]:
    r"""``opbc/ppl/*``: per sequence :math:`d_i = \overline{\log p_{roll}} - \overline{\log p_{train}}`.

    ``log_ppl_diff`` = mean :math:`d_i` (log of trainer-over-rollout perplexity), ``log_ppl_abs_diff`` =
    mean :math:`|d_i|`, ``ratio`` = mean :math:`e^{d_i}` (perplexity ratio).

    Example:
        >>> import torch
        >>> out = perplexity_gap(torch.tensor([[-1.0, -1.0]]), torch.tensor([[-0.5, -0.5]]))
        >>> [round(v.item(), 4) for v in out.values()]
        [0.5, 0.5, 1.6487]
    """
    return _ppl_compute(**_f64(_ppl_update(_view(trainer_logprobs, rollout_logprobs, response_mask))))


# ---------------------------------------------------------------------------------------------
# opbc/prob/*
# ---------------------------------------------------------------------------------------------
PROB_KEYS = ("opbc/prob/abs_diff_mean", "opbc/prob/abs_diff_max", "opbc/prob/pearson")


def _prob_update(view: BatchView) -> Stats:
    trainer, rollout, _ = view.token_inputs
    m = view.valid_f
    zero = torch.zeros((), dtype=view.dtype, device=view.device)
    # Logprobs above 0 are invalid; capping them keeps p in [0, 1] instead of overflowing to inf.
    # Shift by 0.5 (the middle of [0, 1]) so the raw-moment formula of the covariance cancels less.
    p = torch.where(view.valid, trainer.clamp(max=0.0).exp() - 0.5, zero)
    q = torch.where(view.valid, rollout.clamp(max=0.0).exp() - 0.5, zero)
    diff = (p - q).abs()
    return {
        "sum_p": p.sum(),
        "sum_q": q.sum(),
        "sum_pp": (p * p).sum(),
        "sum_qq": (q * q).sum(),
        "sum_pq": (p * q).sum(),
        "sum_abs": diff.sum(),
        "max_abs": _amax(torch.where(m > 0, diff, -torch.ones((), dtype=view.dtype, device=view.device))),
        "count": view.num_valid,
    }


def _prob_compute(
    sum_p: Tensor,
    sum_q: Tensor,
    sum_pp: Tensor,
    sum_qq: Tensor,
    sum_pq: Tensor,
    sum_abs: Tensor,
    max_abs: Tensor,
    count: Tensor,
) -> dict[str, Tensor]:
    n = count.clamp_min(1.0)
    cov = sum_pq / n - (sum_p / n) * (sum_q / n)
    var_p = (sum_pp / n - (sum_p / n) ** 2).clamp_min(0.0)
    var_q = (sum_qq / n - (sum_q / n) ** 2).clamp_min(0.0)
    den = torch.sqrt(var_p * var_q)
    # Zero variance leaves Pearson undefined: report 1 when the probabilities are identical, else 0.
    degenerate = torch.where(sum_abs > 0, torch.zeros_like(den), torch.ones_like(den))
    pearson = torch.where(den > 0, (cov / den.clamp_min(1e-300)).clamp(-1.0, 1.0), degenerate)
    return {
        PROB_KEYS[0]: _safe_div(sum_abs, count, 0.0),
        PROB_KEYS[1]: torch.where(count > 0, max_abs.clamp_min(0.0), torch.zeros_like(max_abs)),
        PROB_KEYS[2]: torch.where(count > 0, pearson, torch.ones_like(pearson)),
    }


def probability_diff(
    trainer_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor | None = None
) -> dict[str, Tensor]:
    r"""``opbc/prob/*`` on probabilities :math:`p = e^{\log p}`: mean and max :math:`|p_{train} - p_{roll}|`, Pearson.

    Pearson's correlation of the two probability vectors over valid tokens; with zero variance it is
    1 if the probabilities are identical, else 0. Logprobs above 0 (invalid) are read as 0. Pearson
    is computed from mergeable raw moments (shifted by 0.5) in float64, so its rounding error is about
    ``1e-16 * mean^2 / variance``: negligible for real token probabilities, ~1e-8 when one side's
    probabilities are all nearly equal.

    Example:
        >>> import torch
        >>> out = probability_diff(torch.tensor([[0.0, -1.0, -2.0]]), torch.tensor([[0.0, -1.1, -2.0]]))
        >>> [round(v.item(), 4) for v in out.values()]
        [0.0117, 0.035, 0.9991]
    """
    return _prob_compute(**_f64(_prob_update(_view(trainer_logprobs, rollout_logprobs, response_mask))))


# ---------------------------------------------------------------------------------------------
# opbc/input/*
# ---------------------------------------------------------------------------------------------
INPUT_KEYS = ("opbc/input/nonfinite_count", "opbc/input/num_tokens", "opbc/input/num_sequences")


def _input_update(view: BatchView) -> Stats:
    return {"nonfinite": view.nonfinite_count, "tokens": view.num_valid, "sequences": view.num_seqs}


def _input_compute(nonfinite: Tensor, tokens: Tensor, sequences: Tensor) -> dict[str, Tensor]:
    return {INPUT_KEYS[0]: nonfinite, INPUT_KEYS[1]: tokens, INPUT_KEYS[2]: sequences}


def _f64(stats: Stats) -> Stats:
    return {k: v.to(torch.float64) for k, v in stats.items()}
