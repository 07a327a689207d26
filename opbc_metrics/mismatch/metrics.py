"""Stateful train-vs-rollout mismatch metrics (section ``opbc``), thin classes over
:mod:`opbc_metrics.functional.mismatch`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor
from torchmetrics.utilities.data import dim_zero_cat

from opbc_metrics.batch import (
    DEFAULT_CLAMP,
    DEFAULT_VETO,
    RESPONSE_MASK,
    ROLLOUT_LOGPROBS,
    ROLLOUT_TOKEN_IDS,
    TRAINER_LOGPROBS,
    TRAINER_TOKEN_IDS,
    BatchView,
    check_positive,
    check_same_shape,
    raise_if_bad_inputs,
    raise_if_not_logprobs,
)
from opbc_metrics.functional.controller import token_ids_differ
from opbc_metrics.functional.mismatch import (
    CHI2_KEYS,
    DEFAULT_TOP_FRACTION,
    DEFAULT_TOP_MASS_BINS,
    INPUT_KEYS,
    KL_KEYS,
    LOG_RATIO_KEYS,
    LOGPROB_KEYS,
    PPL_KEYS,
    PROB_KEYS,
    SEQUENCE_KEYS,
    TOKEN_STATISTICS,
    Stats,
    _chi2_compute,
    _chi2_update,
    _clipped_update,
    _ess_compute,
    _ess_update,
    _fraction_compute,
    _input_compute,
    _input_update,
    _kl_compute,
    _kl_update,
    _log_ratio_range_compute,
    _log_ratio_range_update,
    _logprob_diff_compute,
    _logprob_diff_update,
    _ppl_compute,
    _ppl_update,
    _prob_compute,
    _prob_update,
    _second_moment_compute,
    _seq_ess_update,
    _sequence_compute,
    _sequence_update,
    _top_mass_exact_compute,
    _top_mass_sketch_compute,
    _top_mass_sketch_update,
    _vetoed_update,
    _weight_mean_compute,
    _weight_moments_update,
    _weight_std_compute,
    batch_statistics,
    check_bins,
    settings_need,
    sketch_relative_error_bound,
)
from opbc_metrics.metric import (
    CAT,
    INPUT_CHECK_STATES,
    MAX,
    MIN,
    SUM,
    GlossaryEntry,
    LogprobInputChecks,
    OPBCMetric,
    State,
    library_update,
    table,
)

_TOKEN_FIELDS = (TRAINER_LOGPROBS, ROLLOUT_LOGPROBS)  # response_mask is optional (all ones)
_TOKENS = "valid response tokens (response_mask = 1, finite logprobs), summed over the window and all ranks"
_SEQUENCES = "sequences with at least one valid token, over the window and all ranks"
_DIAGNOSTIC = "none (diagnostic)"
_NO_ACTION = "no OPBC action; read alongside ESS and the clipped/veto fractions"
# Sums of u = w - 1, u^2, w and w^2: the first two keep the digits near on-policy, the raw ones when every
# weight is small (functional.mismatch._weight_moments picks by the mean weight).
_WEIGHT_MOMENTS = table("sum_u", "sum_u2", "sum_w", "sum_w2", "count")


class _MismatchMetric(LogprobInputChecks, OPBCMetric):
    """Base of the token-mismatch metrics: reads trainer/rollout logprobs and the response mask.

    Every metric of the section takes the section's settings (``clamp`` C, ``veto``, ``top_mass_bins``
    and ``compiled``, which runs the fused kernel under ``torch.compile``), so that members of a
    collection share one fused computation per batch. ``statistic_groups`` names the optional parts of
    that computation a metric reads (probabilities, the histogram): a metric used alone skips the rest.
    The weights ``w = exp(clamp(r, -C, C))`` are summed with their squares in the inputs' float dtype: with float32
    (or bfloat16 / float16) inputs ``C`` may be at most 40 nats (``w^2`` within float32's range; C = 20 by default),
    a larger C is refused unless the inputs are float64 (:func:`~opbc_metrics.batch.check_clamp_dtype`).

    A metric names its two functional steps: ``from_kernel`` (the shared statistics of a batch -> its own,
    named like its ``states``) and ``formula`` (its states, passed by name -> its value).

    ``input_checks`` (default on): the metric also refuses at compute, as :class:`InputHealth` does, a window
    whose logprobs held positive values (probabilities, logits) or whose ``response_mask`` held values other than
    0 and 1. The collection turns it off for the members of a section that has InputHealth, which checks once.
    """

    required_fields = _TOKEN_FIELDS
    optional_fields: ClassVar[tuple[str, ...]] = (RESPONSE_MASK,)
    data_counts = ("count", "n", "bin_count")  # valid tokens (sequences for sequence metrics)
    from_kernel: ClassVar[Callable[[Stats], Stats]]
    formula: ClassVar[Callable[..., Any]]

    def __init__(self, clamp: float = DEFAULT_CLAMP, veto: float = DEFAULT_VETO,
                 top_mass_bins: int = DEFAULT_TOP_MASS_BINS, compiled: bool = False, input_checks: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.input_checks = bool(input_checks) or isinstance(self, InputHealth)  # (InputHealth: the collection's check)
        self.clamp = check_positive("clamp", clamp)
        self.veto = check_positive("veto", veto)
        self.top_mass_bins = check_bins(top_mass_bins)
        self.compiled = bool(compiled)
        # The optional statistic groups this metric reads (STATISTIC_GROUPS): only the core by default.
        self.statistic_groups: frozenset[str] = frozenset()

    def request_shared(self, view: BatchView) -> None:
        """Ask for the statistic groups this metric reads and the settings it reads them with."""
        need = settings_need(self.clamp, self.veto, self.top_mass_bins)
        view.request(TOKEN_STATISTICS, need, *self.statistic_groups)

    def _stats(self, view: BatchView) -> Stats:
        """The section's fused statistics of this batch, shared through the view's cache."""
        return batch_statistics(view, self.clamp, self.veto, self.top_mass_bins, self.compiled, self.statistic_groups)

    def nonfinite_tokens(self, view: BatchView) -> Tensor:
        return _input_update(self._stats(view))["nonfinite"]

    def update(self, batch: Any = None, **fields: Any) -> None:
        """Accumulate a batch with ``trainer_logprobs`` [B, T], ``rollout_logprobs`` [B, T] and an
        optional ``response_mask`` [B, T] (all ones when absent)."""
        super().update(batch, **fields)

    # -- the metric's own statistics and value (subclasses override these); the input checks around them --------
    def own_statistics(self, view: BatchView) -> Stats:
        return self.from_kernel(self._stats(view))

    def value(self) -> Any:
        return self.formula(**self.state_values(exclude=tuple(INPUT_CHECK_STATES)))

    def statistics(self, view: BatchView) -> Stats:
        return {**self.own_statistics(view), **self.input_check_statistics(view)}

    def compute(self) -> Any:
        self.raise_on_bad_inputs()
        return self.value()


class _Fraction(_MismatchMetric):  # a value in [0, 1]
    higher_is_better = False
    plot_lower_bound, plot_upper_bound = 0.0, 1.0


class _ESS(_Fraction):
    higher_is_better = True
    states = _WEIGHT_MOMENTS
    formula = staticmethod(_ess_compute)


class ImportanceSamplingESS(_ESS):
    r"""Effective sample size of the token importance weights, ``opbc/is/ess``.

    .. math:: \mathrm{ESS} = \frac{(\sum_t w_t)^2}{N \sum_t w_t^2}, \quad w_t = e^{\mathrm{clamp}(r_t, -C, C)}

    Args:
        clamp: C, the log-ratio clamp in nats (20).
        kwargs: torchmetrics ``Metric`` arguments (``process_group``, ``sync_on_compute``, ...).

    Example:
        >>> import torch
        >>> metric = ImportanceSamplingESS()
        >>> t = torch.tensor([[-1.0, -1.0, -2.0]])
        >>> metric.update(trainer_logprobs=t, rollout_logprobs=t)
        >>> metric.update(trainer_logprobs=t, rollout_logprobs=t - torch.tensor([[0.0, 1.0, 0.0]]))
        >>> metric.compute().round(decimals=4)
        tensor(0.8014, dtype=torch.float64)
    """

    keys = ("opbc/is/ess",)
    from_kernel = staticmethod(_ess_update)
    glossary = GlossaryEntry(
        name="ESS",
        what="Effective sample size of the importance weights w = exp(clamp(trainer_logp - rollout_logp)): "
        "how usable a rollout is for off-policy training. 1 = rollout matches the trainer's policy; "
        "toward 0 = increasingly off-policy.",
        unit=_TOKENS,
        cap="ESS < min_ess (0.30) quarantines the group; ESS < replay_ess (0.60) sends it to replay",
        action="quarantine: the group is excluded from the step; replay: it is re-scored against the "
        "current trainer before use",
    )


class SequenceESS(_ESS):
    r"""Sequence-level ESS, ``opbc/is/seq_ess``, with ``w_i = exp(clamp(sum_t r_t, -C, C))``.

    .. math:: \mathrm{ESS}_{seq} = \frac{(\sum_i w_i)^2}{M \sum_i w_i^2}

    Example:
        >>> import torch
        >>> metric = SequenceESS()
        >>> metric.update(trainer_logprobs=torch.zeros(2, 2),
        ...               rollout_logprobs=torch.tensor([[-1.0, 0.0], [0.0, 0.0]]))
        >>> metric.compute().round(decimals=4)
        tensor(0.8240, dtype=torch.float64)
    """

    keys = ("opbc/is/seq_ess",)
    from_kernel = staticmethod(_seq_ess_update)
    glossary = GlossaryEntry(
        name="seq_ess",
        what="ESS over whole-sequence importance weights w_i = exp(clamp(sum_t log_ratio_t)): how usable "
        "the rollout is when the correction is applied per sequence rather than per token.",
        unit=_SEQUENCES,
        cap="none by default; sequence-level correction presets compare it with min_ess",
        action="low values call for sequence-level truncation or masking of the outlier sequences",
    )


class _WeightMoment(_MismatchMetric):
    states = _WEIGHT_MOMENTS
    from_kernel = staticmethod(_weight_moments_update)


class ImportanceWeightSecondMoment(_WeightMoment):
    r"""Second moment of the importance weights, ``opbc/is/second_moment`` = :math:`E[w^2]`.

    Example:
        >>> import torch
        >>> metric = ImportanceWeightSecondMoment()
        >>> metric.update(trainer_logprobs=torch.zeros(1, 2), rollout_logprobs=torch.tensor([[0.0, -1.0]]))
        >>> metric.compute().round(decimals=4)
        tensor(4.1945, dtype=torch.float64)
    """

    keys = ("opbc/is/second_moment",)
    higher_is_better = False
    plot_lower_bound = 0.0
    formula = staticmethod(_second_moment_compute)
    glossary = GlossaryEntry(
        name="second_moment",
        what="E[w^2] of the importance weights w = exp(log_ratio); bounds the variance of the "
        "importance-corrected estimator. Closer to 1 = lower-variance correction.",
        unit=_TOKENS,
        cap=_DIAGNOSTIC,
        action="no direct OPBC action; it is 1 / ESS times E[w]^2, and ESS carries the cap",
    )


class ImportanceWeightMean(_WeightMoment):
    r"""Mean importance weight, ``opbc/is/weight_mean`` = :math:`E[w]`.

    Under exact on-policy sampling :math:`E_{rollout}[w] = 1`; departures show bias.

    Example:
        >>> import torch
        >>> metric = ImportanceWeightMean()
        >>> metric.update(trainer_logprobs=torch.zeros(1, 2), rollout_logprobs=torch.tensor([[0.0, -1.0]]))
        >>> metric.compute().round(decimals=4)
        tensor(1.8591, dtype=torch.float64)
    """

    keys = ("opbc/is/weight_mean",)
    formula = staticmethod(_weight_mean_compute)
    glossary = GlossaryEntry(
        name="weight_mean",
        what="Mean importance weight E[w]. Its expectation under the rollout policy is 1 when both "
        "engines share a support; a drift away from 1 shows a biased or truncated rollout distribution.",
        unit=_TOKENS,
        cap=_DIAGNOSTIC,
        action=_NO_ACTION,
    )


class ImportanceWeightStd(_WeightMoment):
    r"""Population standard deviation of the token importance weights, ``opbc/is/weight_std``.

    .. math:: \sigma_w = \sqrt{E[(w - 1)^2] - E[w - 1]^2}

    over the valid tokens of the window and all ranks (divisor N), from mergeable sums of ``w - 1`` and
    ``(w - 1)^2`` (of ``w`` and ``w^2`` when the mean weight is below 1/2, where those of ``w - 1`` hold no digits).

    Precision: these are sums of x and x^2 per window (x = w - 1 or w), in the inputs' precision, so the std loses
    digits when the spread is small next to the mean. With float32 inputs, once the spread is below ~1e-3 of the
    mean weight (e.g. every weight clamped at e^20), its relative error grows: two tokens both at w = e^20 give
    weight_std 95072 instead of 0. float64 inputs give it to ~1e-10 relative (0 in that case). Pass float64
    logprobs where such small spreads matter.

    Example:
        >>> import torch
        >>> metric = ImportanceWeightStd()
        >>> metric.update(trainer_logprobs=torch.zeros(1, 2), rollout_logprobs=torch.tensor([[0.0, -1.0]]))
        >>> metric.compute().round(decimals=4)  # weights 1 and e: (e - 1) / 2
        tensor(0.8591, dtype=torch.float64)
    """

    keys = ("opbc/is/weight_std",)
    higher_is_better = False
    plot_lower_bound = 0.0
    formula = staticmethod(_weight_std_compute)
    glossary = GlossaryEntry(
        name="weight_std",
        what="Population standard deviation (divisor N) of the token importance weights w = exp(clamp(log_ratio)), "
        "the spread the OPBC origin's budget report shows beside the weight mean: 0 on-policy; its square is "
        "chi2_token minus (weight_mean - 1)^2. Source: the OPBC origin's budget report.",
        unit=_TOKENS,
        cap=_DIAGNOSTIC,
        action=_NO_ACTION,
    )


class TopGradientMass(_Fraction):
    r"""Share of the total importance weight carried by the top 1% of tokens, ``opbc/is/top_1pct_gradient_mass``.

    .. math:: \frac{\sum_{j \le k} w_{(j)}}{\sum_t w_t}, \quad k = \max(1, \lfloor 0.01 N \rfloor)

    over a whole accumulation window and all ranks. By default it keeps a fixed-size histogram of the
    log-weights over ``[-C, C]`` (``bins`` bins of width ``h = 2C / bins``, token counts) plus the exact
    weight sum, and walks the histogram from the top, valuing each token at its bin centre: the bins
    taken are exactly those the true top k occupy, so the top-k sum is within a factor
    :math:`e^{\pm h/2}` of the truth, a relative error of at most :math:`e^{h/2} - 1` (0.2444% with
    C = 20 and 8192 bins). ``exact=True`` keeps every weight instead (state grows with the tokens:
    for small data and tests; not packed into the one-collective sync) and sorts in ``compute``.

    Args:
        clamp: C in nats (20).
        bins: histogram bins of the sketch (8192).
        fraction: the top share of tokens (0.01).
        exact: keep all weights and sort (unbounded state; not packed into the one-collective sync).

    Example:
        >>> import torch
        >>> metric = TopGradientMass()
        >>> metric.update(trainer_logprobs=torch.zeros(1, 4), rollout_logprobs=torch.tensor([[0.0, 0.0, 0.0, -1.0]]))
        >>> metric.compute().round(decimals=4)  # exact: e / (3 + e) = 0.47537; the sketch is within 0.245%
        tensor(0.4747, dtype=torch.float64)
    """

    keys = ("opbc/is/top_1pct_gradient_mass",)
    glossary = GlossaryEntry(
        name="top_1pct_gradient_mass",
        what="Fraction of total importance weight carried by the largest 1% of token weights. ~0.01 means "
        "the drift is uniform; > 0.05 means it is concentrated in a few outlier tokens, which is more "
        "dangerous.",
        unit=_TOKENS + " (k = max(1, floor(0.01 N)) largest weights)",
        cap="none by default (> 0.05 flags concentrated drift on dashboards)",
        action="concentrated drift calls for token-level truncation (train_with_correction) of the outliers",
    )

    def __init__(self, bins: int | None = None, fraction: float = DEFAULT_TOP_FRACTION, exact: bool = False,
                 **kwargs: Any) -> None:
        if bins is not None:
            kwargs["top_mass_bins"] = bins
        super().__init__(**kwargs)
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"`fraction` must be in (0, 1], got {fraction}")
        self.bins, self.fraction, self.exact = self.top_mass_bins, float(fraction), bool(exact)
        self.statistic_groups = frozenset() if self.exact else frozenset({"hist"})

    def own_state_table(self) -> Mapping[str, State]:
        # exact: every weight (grows with the tokens); sketch: token counts per log-weight bin and the weight sum.
        return table(weights=CAT, count=SUM) if self.exact else table(bin_count=SUM.of("bins"), sum_w=SUM)

    @property
    def error_bound(self) -> float:
        """Relative error bound of the sketch (0 in exact mode)."""
        return 0.0 if self.exact else sketch_relative_error_bound(self.clamp, self.bins)

    def own_statistics(self, view: BatchView) -> Stats:
        return _top_mass_sketch_update(self._stats(view))  # (the sketch; exact mode appends in _update_view)

    def folds_statistics(self) -> bool:
        return not self.exact and library_update(self)

    def _update_view(self, view: BatchView) -> None:
        if self.exact:
            # first: it refuses a batch on another device
            self.accumulate(count=view.num_valid, **self.input_check_statistics(view))
            self.weights.append(view.weights(self.clamp).reshape(-1).to(torch.float64))
        else:
            super()._update_view(view)

    def value(self) -> Tensor:
        if self.exact:
            weights = dim_zero_cat(self.weights) if len(self.weights) else torch.zeros(0, dtype=torch.float64)
            return _top_mass_exact_compute(weights, self.count, self.fraction)
        return _top_mass_sketch_compute(self.bin_count, self.sum_w, self.clamp, self.fraction)


class _ThresholdFraction(_Fraction):
    states = table("hits", "count")
    formula = staticmethod(_fraction_compute)


class ClippedFraction(_ThresholdFraction):
    r"""Share of valid tokens whose :math:`|r_t|` exceeded the clamp C, ``opbc/is/clipped_fraction``.

    Example:
        >>> import torch
        >>> metric = ClippedFraction(clamp=20.0)
        >>> t = torch.full((1, 4), -30.0)
        >>> metric.update(trainer_logprobs=t, rollout_logprobs=t - torch.tensor([[0.0, 25.0, 3.0, 21.0]]))
        >>> metric.compute()
        tensor(0.5000, dtype=torch.float64)
    """

    keys = ("opbc/is/clipped_fraction",)
    from_kernel = staticmethod(_clipped_update)
    glossary = GlossaryEntry(
        name="clipped_fraction",
        what="Fraction of tokens whose |log_ratio| exceeded the clamp threshold C (20 nats). Clamping stops "
        "one bad token from blowing up the gradient.",
        unit=_TOKENS,
        cap="clipped_fraction > max_clipped (0.10)",
        action="the group is marked train_with_correction: trained with truncated/masked importance weights",
    )


class VetoFraction(_ThresholdFraction):
    r"""Share of valid tokens whose :math:`|r_t|` exceeded the hard veto threshold, ``opbc/is/veto_fraction``.

    Args:
        veto: the veto threshold in nats (30).

    Example:
        >>> import torch
        >>> metric = VetoFraction()
        >>> t = torch.full((1, 4), -30.0)
        >>> metric.update(trainer_logprobs=t, rollout_logprobs=t - torch.tensor([[0.0, 25.0, 3.0, 9999.0]]))
        >>> metric.compute()
        tensor(0.2500, dtype=torch.float64)
    """

    keys = ("opbc/is/veto_fraction",)
    from_kernel = staticmethod(_vetoed_update)
    glossary = GlossaryEntry(
        name="veto_fraction",
        what="Fraction of tokens whose |log_ratio| exceeded the hard-veto threshold (30 nats): tokens so "
        "off-policy that even after clamping they would corrupt the gradient.",
        unit=_TOKENS,
        cap="veto_fraction > 0",
        action="the OPBC quarantines the whole group",
    )


class LogprobDiff(_MismatchMetric):
    r"""Per-token logprob disagreement ``opbc/logprob/{abs_diff_mean, abs_diff_max, diff_mean}``.

    Mean and max of :math:`|r_t|` and mean of :math:`r_t`, in nats.

    Example:
        >>> import torch
        >>> metric = LogprobDiff()
        >>> metric.update(trainer_logprobs=torch.tensor([[-1.0, -2.0]]), rollout_logprobs=torch.tensor([[-1.5, -1.0]]))
        >>> {k: round(v.item(), 3) for k, v in metric.compute().items()}
        {'opbc/logprob/abs_diff_mean': 0.75, 'opbc/logprob/abs_diff_max': 1.0, 'opbc/logprob/diff_mean': -0.25}
    """

    keys = LOGPROB_KEYS
    higher_is_better = False
    states = table("sum_abs", "sum_diff", max_abs=MAX, count=SUM)
    from_kernel, formula = staticmethod(_logprob_diff_update), staticmethod(_logprob_diff_compute)
    glossary = GlossaryEntry(
        name="|Δlogp|",
        what="Per-token disagreement size between rollout and trainer logprobs in nats: mean over the "
        "response of |trainer_logp - rollout_logp| (also its max and the signed mean). ~0.01 means the "
        "engines agree on most tokens; > 0.1 means meaningful single-token drift.",
        unit=_TOKENS,
        cap=_DIAGNOSTIC,
        action=_NO_ACTION,
        aliases=("abs_logprob_diff", "logprob_diff"),
    )


class LogRatioRange(_MismatchMetric):
    r"""Extremes of the raw log ratio ``opbc/log_ratio/{min, max, max_abs}``.

    :math:`r_t = \log(p_{train} / p_{roll})`, unclamped; :math:`e^{r_t}` is the token's importance weight.

    Example:
        >>> import torch
        >>> metric = LogRatioRange()
        >>> metric.update(trainer_logprobs=torch.tensor([[-1.0, -2.0]]), rollout_logprobs=torch.tensor([[-1.5, -1.0]]))
        >>> [round(v.item(), 2) for v in metric.compute().values()]
        [-1.0, 0.5, 1.0]
    """

    keys = LOG_RATIO_KEYS
    higher_is_better = False
    states = table(min=MIN, max=MAX, count=SUM)
    from_kernel, formula = staticmethod(_log_ratio_range_update), staticmethod(_log_ratio_range_compute)
    glossary = GlossaryEntry(
        name="log_ratio",
        what="log(trainer_prob / rollout_prob) per token in nats, the exponent of the importance weight; "
        "max|log_ratio| is the worst single-token disagreement (1 nat: the trainer is e≈2.7x more "
        "confident than the rollout was).",
        unit=_TOKENS + " (min/max, not averaged)",
        cap="|log_ratio| > clamp C (20) counts as clipped; > veto (30) as vetoed",
        action="see clipped_fraction and veto_fraction",
    )


class SequenceLogRatio(_MismatchMetric):
    r"""Sequence log ratios ``opbc/sequence/*`` of :math:`s_i = \sum_t r_t`.

    ``log_ratio_mean`` = mean :math:`s_i`, ``log_ratio_abs_mean`` = mean :math:`|s_i|`,
    ``log_ratio_max_abs`` = max :math:`|s_i|`, ``geo_log_ratio_mean`` = mean :math:`s_i / n_i`.

    Example:
        >>> import torch
        >>> metric = SequenceLogRatio()
        >>> metric.update(trainer_logprobs=torch.full((2, 2), -1.0),  # r: [1, 1] and [-0.5, 0]
        ...               rollout_logprobs=torch.tensor([[-2.0, -2.0], [-0.5, -1.0]]))
        >>> [round(v.item(), 3) for v in metric.compute().values()]
        [0.75, 1.25, 2.0, 0.375]
    """

    keys = SEQUENCE_KEYS
    higher_is_better = False
    states = table("sum_s", "sum_abs_s", max_abs_s=MAX, sum_geo=SUM, count=SUM)
    from_kernel, formula = staticmethod(_sequence_update), staticmethod(_sequence_compute)
    glossary = GlossaryEntry(
        name="sequence_log_ratio",
        what="Sum of per-token log ratios across the response in nats, the log of the full-sequence "
        "importance weight: how far the rollout drifted from the trainer's view over the whole sequence. "
        "±0.5 nats over 128 tokens is negligible; 5+ nats means the engines systematically disagree.",
        unit=_SEQUENCES,
        cap=_DIAGNOSTIC,
        action="large values call for sequence-level or geometric (length-normalised) correction",
    )


class KLEstimators(_MismatchMetric):
    r"""KL(rollout || trainer) estimators ``opbc/kl/{k1, k2, k3}`` on clamped log ratios.

    ``k1 = mean(-r~)``, ``k2 = mean(r~^2 / 2)``, ``k3 = mean(exp(r~) - 1 - r~)``, with
    :math:`\tilde r = \mathrm{clamp}(r, -C, C)` and tokens sampled from the rollout policy.

    Example:
        >>> import torch
        >>> metric = KLEstimators()
        >>> metric.update(trainer_logprobs=torch.tensor([[0.0, -1.0]]), rollout_logprobs=torch.tensor([[-1.0, 0.0]]))
        >>> [round(v.item(), 4) + 0.0 for v in metric.compute().values()]
        [0.0, 0.5, 0.5431]
    """

    keys = KL_KEYS
    higher_is_better = False
    states = table("sum_k1", "sum_k2", "sum_k3", "count")
    from_kernel, formula = staticmethod(_kl_update), staticmethod(_kl_compute)
    glossary = GlossaryEntry(
        name="kl",
        what="Monte-Carlo estimates of KL(rollout || trainer) from the sampled tokens: k1 (unbiased, "
        "high variance, can be negative), k2 (low variance, biased), k3 (unbiased and non-negative).",
        unit=_TOKENS,
        cap=_DIAGNOSTIC,
        action=_NO_ACTION,
        aliases=("k1", "k2", "k3", "kl_divergence_inference"),
    )


class ChiSquare(_MismatchMetric):
    r"""Chi-square divergence: ``opbc/kl/chi2_token`` and ``opbc/kl/chi2_seq``.

    ``chi2_token`` = :math:`E_t[w_t^2] - 1`; ``chi2_seq`` = :math:`E_i[w_i^2] - 1` with sequence weights.

    Example:
        >>> import torch
        >>> metric = ChiSquare()
        >>> metric.update(trainer_logprobs=torch.zeros(1, 2), rollout_logprobs=torch.tensor([[0.0, -1.0]]))
        >>> [round(v.item(), 4) for v in metric.compute().values()]
        [3.1945, 6.3891]
    """

    keys = CHI2_KEYS
    higher_is_better = False
    key_counts = ((CHI2_KEYS[1], "seq_count"),)  # chi2_seq needs a valid sequence, chi2_token a valid token
    # E[w^2] - 1 = E[(w - 1)^2] + 2 E[w - 1] (near -1 when every weight is small: the sums of u keep its digits)
    states = table("sum_u", "sum_u2", "count", "sum_seq_u", "sum_seq_u2", "seq_count")
    from_kernel, formula = staticmethod(_chi2_update), staticmethod(_chi2_compute)
    glossary = GlossaryEntry(
        name="chi2",
        what="Chi-square divergence of trainer from rollout, E[w^2] - 1, per token and per sequence: the "
        "variance of the importance weights, which scales the variance of the corrected gradient.",
        unit="valid tokens (chi2_token) and valid sequences (chi2_seq), over the window and all ranks",
        cap=_DIAGNOSTIC,
        action=_NO_ACTION,
    )


class PerplexityGap(_MismatchMetric):
    r"""Perplexity gap ``opbc/ppl/{log_ppl_diff, log_ppl_abs_diff, ratio}``.

    Per sequence :math:`d_i = \mathrm{mean}_t \log p_{roll} - \mathrm{mean}_t \log p_{train}`: mean
    :math:`d_i`, mean :math:`|d_i|` and mean :math:`e^{\min(d_i, 600)}` (trainer-over-rollout perplexity
    ratio; the cap only acts on gaps above 600 nats per token, i.e. a sentinel such as -9999, which would
    otherwise overflow the ratio to inf).

    Example:
        >>> import torch
        >>> metric = PerplexityGap()
        >>> metric.update(trainer_logprobs=torch.tensor([[-1.0, -1.0]]), rollout_logprobs=torch.tensor([[-0.5, -0.5]]))
        >>> [round(v.item(), 4) for v in metric.compute().values()]
        [0.5, 0.5, 1.6487]
    """

    keys = PPL_KEYS
    higher_is_better = False
    states = table("sum_d", "sum_abs_d", "sum_exp_d", "count")
    from_kernel, formula = staticmethod(_ppl_update), staticmethod(_ppl_compute)
    glossary = GlossaryEntry(
        name="ppl",
        what="Gap between the per-sequence perplexities the two engines assign to the same response: "
        "log-perplexity difference (signed and absolute) and the perplexity ratio.",
        unit=_SEQUENCES,
        cap=_DIAGNOSTIC,
        action=_NO_ACTION,
    )


class ProbabilityDiff(_MismatchMetric):
    r"""Probability-space disagreement ``opbc/prob/{abs_diff_mean, abs_diff_max, pearson, diff_std}``.

    On :math:`p = e^{\log p}`: mean and max :math:`|p_{train} - p_{roll}|`, Pearson's correlation
    (1 for identical constant probabilities, 0 for other zero-variance cases) and ``diff_std``, verl's
    ``probs_diff_std``: the standard deviation of :math:`|p_{train} - p_{roll}|` with divisor N - 1 as
    ``torch.std`` takes it. Pearson and ``diff_std`` need two valid tokens in the window: with one (a sample
    std of one value is undefined; ``torch.std`` gives NaN), their keys are left out. Logprobs above 0 (the
    rounding that :class:`InputHealth` lets through) are read as 0, probability 1; below -80 as -80.

    Precision: ``diff_std`` comes from the window's sums of x and x^2 (x = p - q; partial sums in the inputs'
    precision), so it loses digits when the spread is small next to the mean difference. With float32 inputs,
    once the spread is below ~1e-3 of the mean (probabilities shifted as a whole), its relative error grows:
    measured 4% to 40% at a spread of 1e-4 around a difference of 0.1. float64 inputs give it to ~1e-10 relative
    (measured 4e-11 there). Pass float64 logprobs where such small spreads matter.

    Example:
        >>> import torch
        >>> metric = ProbabilityDiff()
        >>> metric.update(trainer_logprobs=torch.tensor([[0.0, -1.0, -2.0]]),
        ...               rollout_logprobs=torch.tensor([[0.0, -1.1, -2.0]]))
        >>> [round(v.item(), 4) for v in metric.compute().values()]
        [0.0117, 0.035, 0.9991, 0.0202]
    """

    keys = PROB_KEYS
    higher_is_better = False
    # Moments of q and of the difference p - q (sum_dp: signed, sum_abs_pq: absolute).
    states = table("sum_q", "sum_dp", "sum_qq", "sum_qdp", "sum_dp2", "sum_abs_pq", "n", max_abs_pq=MAX)
    from_kernel, formula = staticmethod(_prob_update), staticmethod(_prob_compute)
    # A correlation and a sample std (n - 1) need two tokens: with one, no value (not 0, not rounding noise).
    key_counts = ((PROB_KEYS[2], "n", 2), (PROB_KEYS[3], "n", 2))
    glossary = GlossaryEntry(
        name="prob",
        what="Disagreement in probability space rather than log space: mean, max and standard deviation of "
        "|p_trainer - p_rollout| over tokens and the Pearson correlation of the two probability vectors "
        "(the 'training vs rollout probability' scatter of verl's dashboards). Source: verl's rollout-vs-actor "
        "debug metrics (verl/utils/debug/metrics.py): probs_diff_mean, probs_diff_max, probs_diff_std "
        "(diff_std: torch.std of |p_trainer - p_rollout|, divisor N - 1; absent with one token) and the Pearson "
        "correlation.",
        unit=_TOKENS,
        cap=_DIAGNOSTIC,
        action=_NO_ACTION,
        aliases=("training_rollout_probs_diff", "training_rollout_probs_pearson_corr", "probs_diff_std"),
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.statistic_groups = frozenset({"prob"})


def _token_id_pair(view: BatchView) -> tuple[Tensor, Tensor] | None:
    """The batch's ``(rollout_token_ids, trainer_token_ids)``, checked on host metadata (both or neither; integer
    tensors of the logprobs' shape, on their device), or ``None`` when neither is given."""
    pair = {name: view.data.get(name) for name in (ROLLOUT_TOKEN_IDS, TRAINER_TOKEN_IDS)}
    given = [name for name, ids in pair.items() if ids is not None]
    if not given:
        return None
    if len(given) == 1:
        (other,) = set(pair) - set(given)
        raise ValueError(f"batch field `{other}` is required when `{given[0]}` is given (both sides' token ids are "
                         "compared; pass both or neither)")
    trainer = view.tensor(TRAINER_LOGPROBS)
    for name, ids in pair.items():
        if not isinstance(ids, Tensor):
            raise ValueError(f"batch field `{name}` must be a torch.Tensor, got {type(ids).__name__}")
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise ValueError(f"batch field `{name}` must be an integer tensor of token ids, got {ids.dtype}")
        check_same_shape(name, ids, TRAINER_LOGPROBS, trainer)
    return pair[ROLLOUT_TOKEN_IDS], pair[TRAINER_TOKEN_IDS]


class InputHealth(_MismatchMetric):
    r"""Input accounting ``opbc/input/{nonfinite_count, num_tokens, num_sequences}``.

    Response tokens with a NaN or infinite logprob (rollout engines return -inf outside top-p) are
    excluded from every mismatch statistic and counted here instead; ``num_tokens`` and
    ``num_sequences`` are the valid tokens and sequences the other metrics averaged over. Its compute refuses
    (``ValueError`` naming the field) a window whose logprobs held positive values (probabilities, logits;
    :attr:`~opbc_metrics.batch.BatchView.logprob_range`) or whose ``response_mask`` held values other than 0
    and 1.

    With ``rollout_token_ids`` and ``trainer_token_ids`` (``[B, T]`` integer, as the logprobs) it compares them
    on the response tokens (:func:`token_ids_differ`, the controller's ``token_ids_mismatch`` comparison) and
    counts those that differ, over the window and all ranks (a state; no host read in ``update``): ``compute()``
    refuses a window with any, since the two logprobs are then of different tokens and their difference is no
    drift. One field without the other, a wrong shape or a non-integer dtype is refused at ``update``.

    Example:
        >>> import torch
        >>> metric = InputHealth()
        >>> metric.update(trainer_logprobs=torch.tensor([[-1.0, -2.0]]),
        ...               rollout_logprobs=torch.tensor([[float("-inf"), -1.0]]))
        >>> {k: v.item() for k, v in metric.compute().items()}
        {'opbc/input/nonfinite_count': 1.0, 'opbc/input/num_tokens': 1.0, 'opbc/input/num_sequences': 0.0}
    """

    keys = INPUT_KEYS
    higher_is_better = False
    data_counts = ()  # input accounting reports its zero counts too
    # and the input checks' states (LogprobInputChecks: always on here), refused at compute; token_ids_differ:
    # response tokens whose rollout and trainer token ids differ, refused at compute too
    states = table("nonfinite", "tokens", "sequences", "token_ids_differ")
    optional_fields = (RESPONSE_MASK, ROLLOUT_TOKEN_IDS, TRAINER_TOKEN_IDS)
    glossary = GlossaryEntry(
        name="input",
        what="Input accounting: response tokens with non-finite logprobs (excluded from every other "
        "statistic), and the number of valid tokens and sequences the statistics cover.",
        unit="response tokens and sequences, summed over the window and all ranks",
        cap="nonfinite_count > 0 inside a group is a contract failure",
        action="the OPBC rejects the group",
        aliases=("nonfinite_count",),
    )

    def own_statistics(self, view: BatchView) -> Stats:
        stats = _input_update(self._stats(view))
        pair = _token_id_pair(view)
        if pair is not None:
            stats["token_ids_differ"] = token_ids_differ(view.token_inputs[2], *pair).sum()
        return stats

    def raise_on_bad_inputs(self) -> None:
        # One host read for every deferred check of the window (synced: the counts of all ranks).
        *sides, other, differ = torch.cat([
            self.logprob_min, self.logprob_max, self.mask_other.reshape(1), self.token_ids_differ.reshape(1)
        ]).tolist()
        raise_if_not_logprobs(sides[:2], sides[2:])
        if other:  # (its error, worded once in batch.py: a second read, on the way to the error only)
            raise_if_bad_inputs(self.logprob_min, self.logprob_max, self.mask_other)
        if differ:
            raise ValueError(
                f"batch fields `{ROLLOUT_TOKEN_IDS}` and `{TRAINER_TOKEN_IDS}` differ on {int(differ)} response "
                "token(s) in this window (over all ranks): the trainer's and the rollout's logprobs are of different "
                "tokens, so their difference is not a drift; align the rollout's tokens to the trainer's (e.g. "
                "re-tokenisation drift: give the trainer the rollout engine's token ids rather than re-tokenised text)"
            )

    def value(self) -> dict[str, Tensor]:
        return _input_compute(self.nonfinite, self.tokens, self.sequences)


MISMATCH_METRICS: tuple[type[_MismatchMetric], ...] = (
    ImportanceSamplingESS,
    SequenceESS,
    ImportanceWeightSecondMoment,
    ImportanceWeightMean,
    ImportanceWeightStd,
    TopGradientMass,
    ClippedFraction,
    VetoFraction,
    LogprobDiff,
    LogRatioRange,
    SequenceLogRatio,
    KLEstimators,
    ChiSquare,
    PerplexityGap,
    ProbabilityDiff,
    InputHealth,
)
