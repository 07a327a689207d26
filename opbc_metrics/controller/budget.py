"""Budget metrics of the controller (section ``opbc``, group ``decision``): how much data each action takes.

They accumulate the decisions of :meth:`OPBCController.step <opbc_metrics.controller.OPBCController.step>`
as float64 sums, so the values after a DDP sync are those of all ranks' groups together. A group is counted
on the rank (and batch) where it was decided. ``update`` takes the :class:`BatchDecisions` (or a batch
mapping holding it under ``opbc_decisions``, which lets these metrics sit in an ``OPBCCollection`` next to
the mismatch metrics: batches without decisions are skipped) and never synchronises host and device.

A window without a decided group has no keys; with decided groups, zero counts are reported.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from opbc_metrics.batch import BatchView
from opbc_metrics.functional.statistics import safe_div as _safe_div
from opbc_metrics.metric import SUM, GlossaryEntry, OPBCMetric, table
from opbc_metrics.policy import ACTIONS, REASON_NAMES

DECISIONS_FIELD = "opbc_decisions"
_GROUPS = "prompt groups decided by the OPBC, over the window and all ranks"
_TOKENS = "response tokens (response_mask = 1) of the decided groups, over the window and all ranks"
_DIAGNOSTIC = "none (diagnostic: the budget the OPBC policy spends)"


class _DecisionMetric(OPBCMetric):
    required_fields = (DECISIONS_FIELD,)
    optional_inputs = True
    data_counts = ("groups", "tokens", "trained_tokens")  # decided groups / their tokens
    plot_lower_bound = 0.0  # counts and shares

    def __init__(self, optional: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # In a shared collection the budget members skip batches without decisions (and leave their keys
        # out of a window that never had any); the controller's own budget always reports its keys.
        self.optional_inputs = bool(optional)  # type: ignore[misc]

    def update(self, decisions: Any = None, **fields: Any) -> None:
        """Accumulate one batch's :class:`BatchDecisions` (or a mapping with it under ``opbc_decisions``)."""
        if hasattr(decisions, "budget_stats"):
            fields = {DECISIONS_FIELD: decisions, **fields}
            decisions = None
        super().update(decisions, **fields)

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        out = view.field(DECISIONS_FIELD)
        if not hasattr(out, "budget_stats"):
            raise ValueError(
                f"batch field `{DECISIONS_FIELD}` must be the BatchDecisions returned by OPBCController.step, "
                f"got {type(out).__name__}"
            )
        stats = out.budget_stats()
        return {name: stats[name] for name in self.states}


class _ActionShare(_DecisionMetric):
    """A count per action over its total (the first and second states), then the total (the last key)."""

    def compute(self) -> dict[str, Tensor]:
        count, total = self.state_values().values()
        shares = _safe_div(count, total.expand_as(count), 0.0)
        return {**dict(zip(self.keys[:-1], shares, strict=True)), self.keys[-1]: total.clone()}


class DecisionGroupShare(_ActionShare):
    r"""Share of groups per action, ``opbc/decision/group_share/<action>``, and ``opbc/decision/num_groups``.

    .. math:: \mathrm{share}_a = \frac{\#\{g : \mathrm{action}(g) = a\}}{\#\{g\}}

    Example:
        >>> import torch
        >>> from opbc_metrics.controller import OPBCController
        >>> t = torch.full((3, 2), -1.0)
        >>> out = OPBCController(track_budget=False).step(
        ...     trainer_logprobs=t, rollout_logprobs=t - 0.01, group_ids=torch.tensor([0, 1, 2]),
        ...     policy_lag=torch.tensor([0, 5, 9]))
        >>> metric = DecisionGroupShare()
        >>> metric.update(out)
        >>> {k.split("/")[-1]: round(v.item(), 3) for k, v in metric.compute().items()}
        {'reject': 0.0, 'quarantine': 0.333, 'train_with_correction': 0.0, 'replay': 0.333, 'train': 0.333,
         'num_groups': 3.0}
    """

    keys = (*(f"opbc/decision/group_share/{a}" for a in ACTIONS), "opbc/decision/num_groups")
    states = table(group_count=SUM.of(len(ACTIONS)), groups=SUM)
    glossary = GlossaryEntry(
        name="decision_group_share",
        what="Share of prompt groups the Off-Policy Budget Controller assigned to each action (train, "
        "train_with_correction, replay, quarantine, reject), and the number of groups decided.",
        unit=_GROUPS,
        cap=_DIAGNOSTIC,
        action="a growing replay / quarantine / reject share means the rollout engine drifts from the trainer "
        "(or is stale): read the reason counts to see which rule fires",
        aliases=("OPBC",),
    )


class DecisionTokenShare(_ActionShare):
    r"""Share of response tokens per action, ``opbc/decision/token_share/<action>``, and ``opbc/decision/num_tokens``.

    .. math:: \mathrm{share}_a = \frac{\sum_{g : \mathrm{action}(g) = a} n_g}{\sum_g n_g}

    with :math:`n_g` the response tokens (``response_mask = 1``) of group g.

    Example:
        >>> import torch
        >>> from opbc_metrics.controller import OPBCController
        >>> t = torch.full((2, 4), -1.0)
        >>> out = OPBCController(track_budget=False).step(
        ...     trainer_logprobs=t, rollout_logprobs=t, group_ids=torch.tensor([0, 1]),
        ...     response_mask=torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]]), policy_lag=torch.tensor([0, 9]))
        >>> metric = DecisionTokenShare()
        >>> metric.update(out)
        >>> {k.split("/")[-1]: v.item() for k, v in metric.compute().items() if v > 0}
        {'quarantine': 0.25, 'train': 0.75, 'num_tokens': 4.0}
    """

    keys = (*(f"opbc/decision/token_share/{a}" for a in ACTIONS), "opbc/decision/num_tokens")
    states = table(token_count=SUM.of(len(ACTIONS)), tokens=SUM)
    glossary = GlossaryEntry(
        name="decision_token_share",
        what="Share of response tokens whose group the OPBC assigned to each action: the part of the "
        "generated data that trains now, trains with importance-weight correction, waits for replay, or is "
        "dropped. Long responses weigh more than in the group share.",
        unit=_TOKENS,
        cap=_DIAGNOSTIC,
        action="the share of tokens outside train / train_with_correction is generation spent without gradient "
        "this step",
    )


class DecisionReasonCount(_DecisionMetric):
    r"""Number of groups for which each rule condition held, ``opbc/decision/reason_count/<reason>``.

    A group counts once for every reason that applied to it, not only the one that set its action.

    Example:
        >>> import torch
        >>> from opbc_metrics.controller import OPBCController
        >>> t = torch.full((2, 2), -1.0)
        >>> out = OPBCController(track_budget=False).step(
        ...     trainer_logprobs=t, rollout_logprobs=t, group_ids=torch.tensor([0, 1]), policy_lag=torch.tensor([9, 6]))
        >>> metric = DecisionReasonCount()
        >>> metric.update(out)
        >>> {k.split("/")[-1]: v.item() for k, v in metric.compute().items() if v > 0}
        {'lag_above_max': 1.0, 'lag_above_replay': 2.0}
    """

    keys = tuple(f"opbc/decision/reason_count/{r}" for r in REASON_NAMES)
    states = table(reason_count=SUM.of(len(REASON_NAMES)), groups=SUM)  # a window with groups reports zero counts
    glossary = GlossaryEntry(
        name="decision_reason_count",
        what="For every OPBC rule condition (contract failures, veto, lag, ESS, router flips, clipped "
        "fraction), the number of groups for which it held. Every reason that applied is counted, so the "
        "counts add up to more than the number of groups when several rules fire.",
        unit=_GROUPS,
        cap=_DIAGNOSTIC,
        action="the reason tells what to fix: contract reasons point at the data pipeline, veto / ESS / clipped "
        "at the rollout engine's numerics, lag at asynchrony, router flips at MoE routing",
    )

    def compute(self) -> dict[str, Tensor]:
        return {key: count.clone() for key, count in zip(self.keys, self.reason_count, strict=True)}


class CorrectionTokenShare(_DecisionMetric):
    r"""Share of trained tokens whose importance weight the correction changed:
    ``opbc/decision/truncated_token_share`` and ``opbc/decision/masked_token_share``.

    .. math:: \frac{\#\{t \text{ truncated}\}}{\#\{t \text{ trained}\}}, \quad
              \frac{\#\{t \text{ masked}\}}{\#\{t \text{ trained}\}}

    over the valid tokens of groups decided ``train`` or ``train_with_correction``. A token is truncated when
    its ratio (at the policy's correction level) lay outside ``[weight_floor, weight_cap]`` and was clamped,
    masked when it was dropped from the loss mask for that reason (mask mode).

    Example:
        >>> import torch
        >>> from opbc_metrics.controller import OPBCController
        >>> t = torch.full((1, 4), -1.0)
        >>> out = OPBCController("truncated_is", track_budget=False).step(   # one ratio e > 2: truncated
        ...     trainer_logprobs=t, rollout_logprobs=torch.tensor([[-1.0, -2.0, -1.0, -1.0]]),
        ...     group_ids=torch.tensor([0]))
        >>> metric = CorrectionTokenShare()
        >>> metric.update(out)
        >>> {k.split("/")[-1]: v.item() for k, v in metric.compute().items()}
        {'truncated_token_share': 0.25, 'masked_token_share': 0.0}
    """

    keys = ("opbc/decision/truncated_token_share", "opbc/decision/masked_token_share")
    states = table("truncated_tokens", "masked_tokens", "trained_tokens")
    higher_is_better = False
    plot_upper_bound = 1.0
    glossary = GlossaryEntry(
        name="correction_token_share",
        what="Share of the trained tokens whose importance weight the rollout correction truncated (clamped to "
        "the weight cap / floor, TIS) or masked out of the loss (MIS), at the policy's correction level "
        "(token, sequence or geometric).",
        unit="valid tokens of groups decided train or train_with_correction, over the window and all ranks",
        cap=_DIAGNOSTIC,
        action="a large truncated share means the gradient is biased toward the cap; a large masked share "
        "means data is silently dropped: tighten the rollout engine or loosen the bounds",
        aliases=("truncated_token_share", "masked_token_share"),
    )

    def compute(self) -> dict[str, Tensor]:
        changed = (self.truncated_tokens, self.masked_tokens)
        return {key: _safe_div(n, self.trained_tokens, 0.0) for key, n in zip(self.keys, changed, strict=True)}


BUDGET_METRICS: tuple[type[_DecisionMetric], ...] = (
    DecisionGroupShare,
    DecisionTokenShare,
    DecisionReasonCount,
    CorrectionTokenShare,
)


def budget_metrics(optional: bool = True, **kwargs: Any) -> list[OPBCMetric]:
    """One instance of every budget metric (``kwargs``: torchmetrics ``Metric`` arguments).

    ``optional=True`` (for a shared collection): batches without ``opbc_decisions`` are skipped and a
    window without any leaves the budget keys out; ``False`` always updates (no decided group: no keys).

    Example:
        >>> [type(m).__name__ for m in budget_metrics()]
        ['DecisionGroupShare', 'DecisionTokenShare', 'DecisionReasonCount', 'CorrectionTokenShare']
    """
    return [cls(optional=optional, **kwargs) for cls in BUDGET_METRICS]
