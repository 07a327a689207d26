"""Critic and reward statistics (``critic/*``): loss, value, returns, advantages, rewards, score,
explained variance."""

from __future__ import annotations

from typing import Any

from opbc_metrics.functional.training import (
    ADVANTAGES,
    CRITIC_STAT_KEYS,
    RETURNS,
    REWARDS,
    SCORES,
    VALUES,
    _critic_stats_compute,
    _explained_var_compute,
    _explained_var_update,
    _sequence_sum_update,
    _token_stats_update,
)
from opbc_metrics.metric import MAX, MIN, SUM, table
from opbc_metrics.training._base import Scalar, _TrainingMetric, diagnostic, trainer_scalars

_TOKENS = ("response tokens (response_mask = 1) over the window and all ranks; a [B] field with a response_mask counts "
           "once per response token of its sequence, without one once per sequence")
_STEPS = "trainer observations (optimizer steps) over the window and all ranks"
_SEQUENCES = "sequences over the window and all ranks (a [B, T] field is summed over T); aborted sequences " \
    "(no response token) are skipped when a response_mask is given"


CriticLoss, CriticLR = trainer_scalars(
    __name__,
    Scalar("CriticLoss", "critic/loss", "critic_loss", "Value-function regression loss", ("critic_loss=[0.4, 0.2]",),
           "tensor(0.3000, dtype=torch.float64)", weighted=True, higher_is_better=False,
           unit="trainer observations over the window and all ranks, weighted by `loss_tokens` when given",
           what="Value-function regression loss. Should generally decrease; if it never does, suspect reward "
           "scaling, wrong masks or too little critic capacity."),
    Scalar("CriticLR", "critic/lr", "critic_lr", "Critic learning rate", ("critic_lr=1e-5",),
           "tensor(1.0000e-05, dtype=torch.float64)", unit=_STEPS,
           what="Critic learning rate, if a critic is trained (PPO; not GRPO)."),
)


class _FieldStats(_TrainingMetric):
    """mean/max/min (and std) of one batch field over response tokens, or of its per-sequence sums.

    A subclass names the field, what a bad value of it is, and whether it is per sequence, as class
    keywords: ``class ValueStats(_FieldStats, field=VALUES, bad="values on response tokens")``.
    """

    states = table("sum", "sum_sq", "sum_hi", "sum_sq_hi", max=MAX, min=MIN, count=SUM, nonfinite=SUM)
    update_args = compute_args = ("field",)

    def __init_subclass__(cls, field: str, bad: str, per_sequence: bool = False, **kwargs: Any) -> None:
        cls.keys, cls.required_fields = CRITIC_STAT_KEYS[field], (field,)
        cls._deferred = (("nonfinite", field, f"non-finite {bad}"),)
        cls.kernel = (_sequence_sum_update if per_sequence else _token_stats_update, _critic_stats_compute)
        super().__init_subclass__(**kwargs)


class ValueStats(_FieldStats, field=VALUES, bad="values on response tokens"):
    """Critic value predictions ``critic/value/{mean,max,min}`` over response tokens (batch field ``values``).

    verl logs the same statistics as ``critic/values/*``; the glossary's name is ``critic/value/mean``.

    Example:
        >>> import torch
        >>> metric = ValueStats()
        >>> metric.update(values=torch.tensor([[0.5, 1.5, 9.0]]), response_mask=torch.tensor([[1, 1, 0]]))
        >>> {k: v.item() for k, v in metric.compute().items()}
        {'critic/value/mean': 1.0, 'critic/value/max': 1.5, 'critic/value/min': 0.5}
    """

    glossary = diagnostic("critic/value", unit=_TOKENS,
        what="Mean (and extremes) of the critic's predicted values; track for drift or saturation.",
        aliases=("critic/values/mean", "critic/values/max", "critic/values/min"))


class ReturnStats(_FieldStats, field=RETURNS, bad="returns on response tokens"):
    """Returns ``critic/returns/{mean,max,min}`` over response tokens (batch field ``returns``).

    Example:
        >>> import torch
        >>> metric = ReturnStats()
        >>> metric.update(returns=torch.tensor([1.0, 3.0]))
        >>> {k: v.item() for k, v in metric.compute().items()}
        {'critic/returns/mean': 2.0, 'critic/returns/max': 3.0, 'critic/returns/min': 1.0}
    """

    glossary = diagnostic("critic/returns", unit=_TOKENS,
        what="Returns (the critic's regression targets): mean and extremes.")


class AdvantageStats(_FieldStats, field=ADVANTAGES, bad="advantages on response tokens"):
    """Advantages ``critic/advantages/{mean,std,max,min}`` over response tokens (batch field ``advantages``).

    ``std`` is the population standard deviation (ddof = 0) from mergeable raw moments.

    Example:
        >>> import torch
        >>> metric = AdvantageStats()
        >>> metric.update(advantages=torch.tensor([[1.0, -1.0, 5.0]]), response_mask=torch.tensor([[1, 1, 0]]))
        >>> {k: v.item() for k, v in metric.compute().items()}
        {'critic/advantages/mean': 0.0, 'critic/advantages/std': 1.0, 'critic/advantages/max': 1.0, 'critic/advantages/min': -1.0}
    """  # noqa: E501

    glossary = diagnostic("critic/advantages", unit=_TOKENS,
        what="Mean and spread of the advantages: track the mean for sign flips or collapse; an extreme std often "
        "means instability.")


class RewardStats(_FieldStats, field=REWARDS, bad="rewards", per_sequence=True):
    """Sequence rewards ``critic/rewards/{mean,max,min}`` (batch field ``rewards``: [B], or [B, T] token-level
    rewards summed per sequence, as verl sums ``token_level_rewards``; after any KL-in-reward penalty).

    Example:
        >>> import torch
        >>> metric = RewardStats()
        >>> metric.update(rewards=torch.tensor([[0.0, 1.0], [0.0, 0.5]]))
        >>> {k: v.item() for k, v in metric.compute().items()}
        {'critic/rewards/mean': 0.75, 'critic/rewards/max': 1.0, 'critic/rewards/min': 0.5}
    """

    higher_is_better = True
    glossary = diagnostic("critic/rewards", unit=_SEQUENCES, aliases=("rewards",),
        what="Sequence reward (after any KL penalty in the reward): the training reward trend, the first thing to "
        "watch next to validation accuracy.")


class ScoreStats(_FieldStats, field=SCORES, bad="scores", per_sequence=True):
    """Sequence scores ``critic/score/{mean,max,min}`` (batch field ``scores``: the reward function's raw score,
    verl's ``token_level_scores``, before any KL penalty; [B] or [B, T] summed per sequence).

    Example:
        >>> import torch
        >>> metric = ScoreStats()
        >>> metric.update(scores=torch.tensor([1.0, 0.0, 1.0, 1.0]))
        >>> {k: v.item() for k, v in metric.compute().items()}
        {'critic/score/mean': 0.75, 'critic/score/max': 1.0, 'critic/score/min': 0.0}
    """

    higher_is_better = True
    glossary = diagnostic("critic/score", unit=_SEQUENCES,
        what="Sequence score from the reward function, before any KL penalty.")


class ExplainedVariance(_TrainingMetric):
    r"""``critic/vf_explained_var`` = :math:`1 - \mathrm{Var}(R - V) / (\mathrm{Var}(R) + 10^{-5})` on response tokens.

    From mergeable sums of :math:`R`, :math:`R^2`, :math:`R - V`, :math:`(R - V)^2`; 1 = the critic explains
    the returns, 0 = no better than their mean, negative = worse. verl's formula exactly (its key): sample
    variances (``n - 1``) and verl's epsilon (:data:`~opbc_metrics.functional.training.EXPLAINED_VAR_EPS`),
    which dominates when ``Var(R)`` is below about 1e-5. Fewer than two response tokens in the window: no key.

    Example:
        >>> import torch
        >>> metric = ExplainedVariance()
        >>> metric.update(values=torch.tensor([[1.0, 2.0, 3.0, 3.0]]), returns=torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
        >>> metric.compute()
        tensor(0.8500, dtype=torch.float64)
    """

    keys = ("critic/vf_explained_var",)
    key_counts = ((keys[0], "count", 2),)  # sample variances need two tokens (verl's formula gives NaN with one)
    required_fields = (VALUES, RETURNS)
    higher_is_better = True
    plot_upper_bound = 1.0
    _deferred = (("nonfinite", (VALUES, RETURNS), "non-finite values or returns on response tokens"),)
    glossary = diagnostic("critic/vf_explained_var", unit=_TOKENS, aliases=("vf_explained_var",),
        what="Explained variance of the returns by the value function: 1 = perfect critic, 0 = no better than a "
        "constant, negative = worse. A critic that stays low gives the actor noisy advantages.")

    states = table("sum_r", "sum_r2", "sum_d", "sum_d2", "sum_r_hi", "sum_r2_hi", "sum_d_hi", "sum_d2_hi", "count",
                   "nonfinite")
    kernel = (_explained_var_update, _explained_var_compute)
