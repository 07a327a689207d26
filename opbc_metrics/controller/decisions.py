"""Host-side results of the controller: a per-group report and a decision with its reasons, as JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from opbc_metrics.policy import Action, Reason, decode_float, encode_float

_COUNTS = ("num_sequences", "num_response_tokens", "num_tokens", "nonfinite_count", "num_valid_sequences")


@dataclass(frozen=True)
class GroupReport:
    """The statistics of one group (definitions in :mod:`opbc_metrics.functional.controller`).

    Counts are ints. A statistic is ``None`` (``null`` in JSON) when the group has no data for it: the token
    statistics (``ess``, ``second_moment``, ``weight_mean``, the fractions, ``max_abs_log_ratio``,
    ``top_1pct_gradient_mass``) without a valid token, the sequence statistics without a valid sequence,
    ``router_flip_rate`` without expert ids or response tokens, ``policy_lag`` without lags.

    Example:
        >>> import torch
        >>> from opbc_metrics.controller import OPBCController
        >>> t = torch.full((2, 3), -1.0)
        >>> out = OPBCController(track_budget=False).step(trainer_logprobs=t, rollout_logprobs=t - 0.1,
        ...     group_ids=torch.tensor([0, 1]), response_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]))
        >>> [(d.action.value, d.report.ess) for d in out.decisions]    # group 1 has no token: no ESS
        [('train', 1.0), ('reject', None)]
    """

    group_id: int
    num_sequences: int
    num_response_tokens: int
    num_tokens: int
    nonfinite_count: int
    ess: float | None
    seq_ess: float | None
    second_moment: float | None
    weight_mean: float | None
    clipped_fraction: float | None
    veto_fraction: float | None
    max_abs_log_ratio: float | None
    seq_log_ratio_mean: float | None
    seq_log_ratio_abs_mean: float | None
    seq_log_ratio_max_abs: float | None
    geo_log_ratio_mean: float | None
    num_valid_sequences: int
    top_1pct_gradient_mass: float | None
    router_flip_rate: float | None = None
    policy_lag: float | None = None

    @classmethod
    def from_values(cls, group_id: int, values: dict[str, float]) -> GroupReport:
        """Build from raw floats (NaN for a statistic without data or not given: ``None``)."""
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name == "group_id":
                continue
            v = values[f.name]
            if f.name in _COUNTS:
                kwargs[f.name] = round(v)
            else:
                kwargs[f.name] = None if math.isnan(v) else v
        return cls(group_id=int(group_id), **kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {k: encode_float(v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GroupReport:
        return cls(**{k: decode_float(v) for k, v in data.items()})


@dataclass(frozen=True)
class GroupDecision:
    """The controller's decision for one group: the action, every reason that applied, and the report.

    ``reasons`` is in rule order; the first one (``primary_reason``) is the rule that set the action, or
    ``None`` for ``train`` with no reason.

    Example:
        >>> d = GroupDecision(3, Action.QUARANTINE, (Reason.VETO, Reason.ESS_BELOW_REPLAY))
        >>> d.primary_reason
        <Reason.VETO: 'veto'>
        >>> GroupDecision.from_json(d.to_json()) == d
        True
        >>> d.to_json()
        '{"action": "quarantine", "group_id": 3, "reasons": ["veto", "ess_below_replay"], "report": null}'
    """

    group_id: int
    action: Action
    reasons: tuple[Reason, ...] = ()
    report: GroupReport | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "action", Action(self.action))
        object.__setattr__(self, "reasons", tuple(Reason(r) for r in self.reasons))

    @property
    def primary_reason(self) -> Reason | None:
        return self.reasons[0] if self.reasons else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "action": self.action.value,
            "reasons": [r.value for r in self.reasons],
            "report": None if self.report is None else self.report.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GroupDecision:
        report = data.get("report")
        return cls(
            group_id=int(data["group_id"]),
            action=Action(data["action"]),
            reasons=tuple(Reason(r) for r in data.get("reasons", ())),
            report=None if report is None else GroupReport.from_dict(report),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> GroupDecision:
        return cls.from_dict(json.loads(text))


def dump_decisions(decisions: Iterable[GroupDecision], **extra: Any) -> str:
    """A list of decisions (and any extra JSON-able metadata, e.g. ``policy=policy.to_dict()``) as JSON.

    Example:
        >>> text = dump_decisions([GroupDecision(1, Action.TRAIN)], step=7)
        >>> load_decisions(text)
        [GroupDecision(group_id=1, action=<Action.TRAIN: 'train'>, reasons=(), report=None)]
    """
    return json.dumps({"decisions": [d.to_dict() for d in decisions], **extra}, sort_keys=True, allow_nan=False)


def load_decisions(text: str) -> list[GroupDecision]:
    """Inverse of :func:`dump_decisions` (extra metadata is ignored)."""
    return [GroupDecision.from_dict(d) for d in json.loads(text)["decisions"]]
