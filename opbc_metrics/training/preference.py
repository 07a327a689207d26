"""Preference optimisation (DPO: ``loss/dpo``, ``rewards/*``) and reward-model training (``rm/*``)."""

from __future__ import annotations

import math
from typing import Any

from opbc_metrics.batch import check_positive
from opbc_metrics.functional.training import (
    DEFAULT_DPO_BETA,
    DPO_FIELDS,
    DPO_KEYS,
    RM_FIELDS,
    RM_KEYS,
    _dpo_compute,
    _dpo_update,
    _rm_compute,
    _rm_update,
)
from opbc_metrics.metric import table
from opbc_metrics.training._base import Scalar, _TrainingMetric, diagnostic, trainer_scalars

_PAIRS = "preference pairs (chosen, rejected) over the window and all ranks"


class DPOMetrics(_TrainingMetric):
    r"""DPO's ``loss/dpo`` and implicit rewards ``rewards/{chosen,rejected,margins,accuracy}``.

    From sequence log-probabilities of the policy and the frozen reference on each pair:
    ``policy_chosen_logps``, ``policy_rejected_logps``, ``reference_chosen_logps``,
    ``reference_rejected_logps`` ([B] or [B, 1]). :math:`r_c = \beta(\log\pi(y_c) - \log\pi_{ref}(y_c))`,
    :math:`r_r` likewise; loss = :math:`-(1-\varepsilon)\log\sigma(r_c - r_r) - \varepsilon\log\sigma(r_r - r_c)`;
    accuracy = share of pairs with :math:`r_c > r_r`. All are means over pairs (see
    :func:`~opbc_metrics.functional.training.dpo_metrics`).

    Args:
        beta: DPO's temperature (0.1).
        label_smoothing: :math:`\varepsilon` in [0, 0.5) (conservative DPO); 0 = the standard sigmoid loss.

    Example:
        >>> import torch
        >>> metric = DPOMetrics(beta=0.5)
        >>> metric.update(policy_chosen_logps=torch.tensor([-10.0, -12.0]),
        ...               policy_rejected_logps=torch.tensor([-14.0, -11.0]),
        ...               reference_chosen_logps=torch.tensor([-11.0, -12.0]),
        ...               reference_rejected_logps=torch.tensor([-12.0, -12.0]))
        >>> [round(v.item(), 4) for v in metric.compute().values()]
        [0.5877, 0.25, -0.25, 0.5, 0.5]
    """

    keys = DPO_KEYS
    required_fields = DPO_FIELDS
    _deferred = (("nonfinite", DPO_FIELDS, "pairs with non-finite logps"),)
    states = table("sum_loss", "sum_chosen", "sum_rejected", "correct", "count", "nonfinite")
    kernel = (_dpo_update, _dpo_compute)
    update_args = ("beta", "label_smoothing")
    glossary = diagnostic("dpo", unit=_PAIRS, aliases=("loss/dpo", "rewards/margins", "rewards/accuracy"),
        what="DPO loss and implicit rewards: rewards/chosen and rewards/rejected are beta times the "
        "policy-vs-reference log-ratio of each response; margins = chosen - rejected (discrimination strength); "
        "accuracy = share of pairs where the chosen response gets the larger reward. Margins up without validation "
        "gains, or accuracy at 99%+, suggest overfitting the training pairs.")

    def __init__(self, beta: float = DEFAULT_DPO_BETA, label_smoothing: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.beta = check_positive("beta", beta)
        label_smoothing = float(label_smoothing)
        if not 0.0 <= label_smoothing < 0.5 or math.isnan(label_smoothing):
            raise ValueError(f"`label_smoothing` must be in [0, 0.5), got {label_smoothing}")
        self.label_smoothing = label_smoothing


class RewardModelMetrics(_TrainingMetric):
    r"""Pairwise reward-model training: ``rm/loss``, ``rm/accuracy``, ``rm/reward_margin``.

    From the model's scores of each pair, ``chosen_scores`` and ``rejected_scores`` ([B] or [B, 1]):
    loss = mean :math:`-\log\sigma(s_c - s_r)` (Bradley-Terry), accuracy = share with :math:`s_c > s_r`,
    margin = mean :math:`s_c - s_r`.

    Example:
        >>> import torch
        >>> metric = RewardModelMetrics()
        >>> metric.update(chosen_scores=torch.tensor([2.0, 0.0]), rejected_scores=torch.tensor([1.0, 0.5]))
        >>> {k: round(v.item(), 4) for k, v in metric.compute().items()}
        {'rm/loss': 0.6437, 'rm/accuracy': 0.5, 'rm/reward_margin': 0.25}
    """

    keys = RM_KEYS
    required_fields = RM_FIELDS
    _deferred = (("nonfinite", RM_FIELDS, "pairs with non-finite scores"),)
    glossary = diagnostic("rm", unit=_PAIRS, aliases=("rm/loss", "rm/accuracy", "rm/reward_margin"),
        what="Reward-model training: preference loss (cross-entropy of the Bradley-Terry model), accuracy (how often "
        "the RM ranks the better response first) and reward margin (how decisive it is). A margin near zero means a "
        "non-discriminative RM; high accuracy without downstream PPO gains points to an overfit or misaligned RM.")

    states = table("sum_loss", "correct", "sum_margin", "count", "nonfinite")
    kernel = (_rm_update, _rm_compute)


(RMGradNorm,) = trainer_scalars(__name__, Scalar(
    "RMGradNorm", "rm/grad_norm", "rm_grad_norm", "Reward-model gradient norm", ("rm_grad_norm=[2.0, 4.0]",),
    "tensor(3., dtype=torch.float64)", higher_is_better=False, what="L2 norm of the reward model's gradients.",
    unit="trainer observations (optimizer steps) over the window and all ranks"))
