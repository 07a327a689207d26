"""The Off-Policy Budget Controller (OPBC): per-group reports, decisions with reasons, correction weights
and budget metrics. See :mod:`opbc_metrics.policy` for the rules and presets."""

from opbc_metrics.controller.budget import (
    BUDGET_METRICS,
    DECISIONS_FIELD,
    CorrectionTokenShare,
    DecisionGroupShare,
    DecisionReasonCount,
    DecisionTokenShare,
    budget_metrics,
)
from opbc_metrics.controller.controller import BatchDecisions, OPBCController
from opbc_metrics.controller.decisions import GroupDecision, GroupReport, dump_decisions, load_decisions
from opbc_metrics.policy import (
    PRESETS,
    Action,
    CorrectionLevel,
    CorrectionMode,
    OPBCPolicy,
    Reason,
    ess_floor,
)

__all__ = [
    "BUDGET_METRICS",
    "DECISIONS_FIELD",
    "PRESETS",
    "Action",
    "BatchDecisions",
    "CorrectionLevel",
    "CorrectionMode",
    "CorrectionTokenShare",
    "DecisionGroupShare",
    "DecisionReasonCount",
    "DecisionTokenShare",
    "GroupDecision",
    "GroupReport",
    "OPBCController",
    "OPBCPolicy",
    "Reason",
    "budget_metrics",
    "dump_decisions",
    "ess_floor",
    "load_decisions",
]
