"""Critic and reward statistics (``critic/*``): loss, value, returns, advantages, rewards, score,
explained variance."""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from opbc_metrics.batch import BatchView
from opbc_metrics.functional import training as F
from opbc_metrics.metric import MAX, MIN, SUM, GlossaryEntry, table
from opbc_metrics.training._base import DIAGNOSTIC, NO_ACTION, _TrainerScalar, _TrainingMetric

_TOKENS = (
    "response tokens (response_mask = 1) over the window and all ranks; a [B] field with a response_mask "
    "counts once per response token of its sequence, without one once per sequence"
)
_SEQUENCES = "sequences over the window and all ranks (a [B, T] field is summed over T); aborted sequences " \
    "(no response token) are skipped when a response_mask is given"


class CriticLoss(_TrainerScalar):
    """Value-function regression loss ``critic/loss`` (batch field ``critic_loss``; token-weighted by
    ``loss_tokens`` when given).

    Example:
        >>> metric = CriticLoss()
        >>> metric.update(critic_loss=[0.4, 0.2])
        >>> metric.compute().round(decimals=4)
        tensor(0.3000, dtype=torch.float64)
    """

    keys = ("critic/loss",)
    weight_field = F.LOSS_TOKENS
    required_fields = ("critic_loss",)
    higher_is_better = False
    glossary = GlossaryEntry(
        name="critic/loss",
        what="Value-function regression loss. Should generally decrease; if it never does, suspect reward "
        "scaling, wrong masks or too little critic capacity.",
        unit="trainer observations over the window and all ranks, weighted by `loss_tokens` when given",
        cap=DIAGNOSTIC,
        action=NO_ACTION,
    )


class CriticLR(_TrainerScalar):
    """Critic learning rate ``critic/lr`` (batch field ``critic_lr``; mean over observations).

    Example:
        >>> metric = CriticLR()
        >>> metric.update(critic_lr=1e-5)
        >>> metric.compute()
        tensor(1.0000e-05, dtype=torch.float64)
    """

    keys = ("critic/lr",)
    required_fields = ("critic_lr",)
    glossary = GlossaryEntry(
        name="critic/lr",
        what="Critic learning rate, if a critic is trained (PPO; not GRPO).",
        unit="trainer observations (optimizer steps) over the window and all ranks",
        cap=DIAGNOSTIC,
        action=NO_ACTION,
    )


class _FieldStats(_TrainingMetric):
    """mean/max/min (and std) of one batch field (``required_fields[0]``), token-level or per-sequence sums."""

    per_sequence: ClassVar[bool] = False
    states = table("sum", "sum_sq", "sum_hi", "sum_sq_hi", max=MAX, min=MIN, count=SUM, nonfinite=SUM)

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        update = F._sequence_sum_update if self.per_sequence else F._token_stats_update
        return update(view, self.required_fields[0])

    def compute(self) -> dict[str, Tensor]:
        self.check_deferred()
        return F._critic_stats_compute(self.required_fields[0], **self.state_values(exclude=("nonfinite",)))


class ValueStats(_FieldStats):
    """Critic value predictions ``critic/value/{mean,max,min}`` over response tokens (batch field ``values``).

    verl logs the same statistics as ``critic/values/*``; the glossary's name is ``critic/value/mean``.

    Example:
        >>> import torch
        >>> metric = ValueStats()
        >>> metric.update(values=torch.tensor([[0.5, 1.5, 9.0]]), response_mask=torch.tensor([[1, 1, 0]]))
        >>> {k: v.item() for k, v in metric.compute().items()}
        {'critic/value/mean': 1.0, 'critic/value/max': 1.5, 'critic/value/min': 0.5}
    """

    keys = F.CRITIC_STAT_KEYS[F.VALUES]
    required_fields = (F.VALUES,)
    _deferred = (("nonfinite", F.VALUES, "non-finite values on response tokens"),)
    glossary = GlossaryEntry(
        name="critic/value",
        what="Mean (and extremes) of the critic's predicted values; track for drift or saturation.",
        unit=_TOKENS,
        cap=DIAGNOSTIC,
        action=NO_ACTION,
        aliases=("critic/values/mean", "critic/values/max", "critic/values/min"),
    )


class ReturnStats(_FieldStats):
    """Returns ``critic/returns/{mean,max,min}`` over response tokens (batch field ``returns``).

    Example:
        >>> import torch
        >>> metric = ReturnStats()
        >>> metric.update(returns=torch.tensor([1.0, 3.0]))
        >>> {k: v.item() for k, v in metric.compute().items()}
        {'critic/returns/mean': 2.0, 'critic/returns/max': 3.0, 'critic/returns/min': 1.0}
    """

    keys = F.CRITIC_STAT_KEYS[F.RETURNS]
    required_fields = (F.RETURNS,)
    _deferred = (("nonfinite", F.RETURNS, "non-finite returns on response tokens"),)
    glossary = GlossaryEntry(
        name="critic/returns",
        what="Returns (the critic's regression targets): mean and extremes.",
        unit=_TOKENS,
        cap=DIAGNOSTIC,
        action=NO_ACTION,
    )


class AdvantageStats(_FieldStats):
    """Advantages ``critic/advantages/{mean,std,max,min}`` over response tokens (batch field ``advantages``).

    ``std`` is the population standard deviation (ddof = 0) from mergeable raw moments.

    Example:
        >>> import torch
        >>> metric = AdvantageStats()
        >>> metric.update(advantages=torch.tensor([[1.0, -1.0, 5.0]]), response_mask=torch.tensor([[1, 1, 0]]))
        >>> {k: v.item() for k, v in metric.compute().items()}
        {'critic/advantages/mean': 0.0, 'critic/advantages/std': 1.0, 'critic/advantages/max': 1.0, 'critic/advantages/min': -1.0}
    """  # noqa: E501

    keys = F.CRITIC_STAT_KEYS[F.ADVANTAGES]
    required_fields = (F.ADVANTAGES,)
    _deferred = (("nonfinite", F.ADVANTAGES, "non-finite advantages on response tokens"),)
    glossary = GlossaryEntry(
        name="critic/advantages",
        what="Mean and spread of the advantages: track the mean for sign flips or collapse; an extreme std "
        "often means instability.",
        unit=_TOKENS,
        cap=DIAGNOSTIC,
        action=NO_ACTION,
    )


class RewardStats(_FieldStats):
    """Sequence rewards ``critic/rewards/{mean,max,min}`` (batch field ``rewards``: [B], or [B, T] token-level
    rewards summed per sequence, as verl sums ``token_level_rewards``; after any KL-in-reward penalty).

    Example:
        >>> import torch
        >>> metric = RewardStats()
        >>> metric.update(rewards=torch.tensor([[0.0, 1.0], [0.0, 0.5]]))
        >>> {k: v.item() for k, v in metric.compute().items()}
        {'critic/rewards/mean': 0.75, 'critic/rewards/max': 1.0, 'critic/rewards/min': 0.5}
    """

    keys = F.CRITIC_STAT_KEYS[F.REWARDS]
    per_sequence = True
    required_fields = (F.REWARDS,)
    higher_is_better = True
    _deferred = (("nonfinite", F.REWARDS, "non-finite rewards"),)
    glossary = GlossaryEntry(
        name="critic/rewards",
        what="Sequence reward (after any KL penalty in the reward): the training reward trend, the first thing "
        "to watch next to validation accuracy.",
        unit=_SEQUENCES,
        cap=DIAGNOSTIC,
        action=NO_ACTION,
        aliases=("rewards",),
    )


class ScoreStats(_FieldStats):
    """Sequence scores ``critic/score/{mean,max,min}`` (batch field ``scores``: the reward function's raw score,
    verl's ``token_level_scores``, before any KL penalty; [B] or [B, T] summed per sequence).

    Example:
        >>> import torch
        >>> metric = ScoreStats()
        >>> metric.update(scores=torch.tensor([1.0, 0.0, 1.0, 1.0]))
        >>> {k: v.item() for k, v in metric.compute().items()}
        {'critic/score/mean': 0.75, 'critic/score/max': 1.0, 'critic/score/min': 0.0}
    """

    keys = F.CRITIC_STAT_KEYS[F.SCORES]
    per_sequence = True
    required_fields = (F.SCORES,)
    higher_is_better = True
    _deferred = (("nonfinite", F.SCORES, "non-finite scores"),)
    glossary = GlossaryEntry(
        name="critic/score",
        what="Sequence score from the reward function, before any KL penalty.",
        unit=_SEQUENCES,
        cap=DIAGNOSTIC,
        action=NO_ACTION,
    )


class ExplainedVariance(_TrainingMetric):
    r"""``critic/vf_explained_var`` = :math:`1 - \mathrm{Var}(R - V) / \mathrm{Var}(R)` over response tokens.

    From mergeable sums of :math:`R`, :math:`R^2`, :math:`R - V`, :math:`(R - V)^2` (population
    variances); 1 = the critic explains the returns, 0 = no better than their mean, negative = worse.
    When ``Var(R) = 0`` it is 1 if the values are exact, else 0; no data in the window: no key.

    Example:
        >>> import torch
        >>> metric = ExplainedVariance()
        >>> metric.update(values=torch.tensor([[1.0, 2.0, 3.0, 3.0]]), returns=torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
        >>> metric.compute()
        tensor(0.8500, dtype=torch.float64)
    """

    keys = ("critic/vf_explained_var",)
    required_fields = (F.VALUES, F.RETURNS)
    higher_is_better = True
    plot_upper_bound = 1.0
    _deferred = (("nonfinite", (F.VALUES, F.RETURNS), "non-finite values or returns on response tokens"),)
    glossary = GlossaryEntry(
        name="critic/vf_explained_var",
        what="Explained variance of the returns by the value function: 1 = perfect critic, 0 = no better "
        "than a constant, negative = worse. A critic that stays low gives the actor noisy advantages.",
        unit=_TOKENS,
        cap=DIAGNOSTIC,
        action=NO_ACTION,
        aliases=("vf_explained_var",),
    )

    states = table("sum_r", "sum_r2", "sum_d", "sum_d2", "sum_r_hi", "sum_r2_hi", "sum_d_hi", "sum_d2_hi", "count",
                   "nonfinite")

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        return F._explained_var_update(view)

    def compute(self) -> Tensor:
        self.check_deferred()
        return F._explained_var_compute(**self.state_values(exclude=("nonfinite",)))
