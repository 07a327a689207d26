"""opbc-metrics: distributed-exact metrics of train/rollout mismatch for RL post-training of LLMs."""

from opbc_metrics.batch import BatchView
from opbc_metrics.collection import OPBCCollection
from opbc_metrics.metric import GlossaryEntry, OPBCMetric
from opbc_metrics.mismatch import (
    ChiSquare,
    ClippedFraction,
    ImportanceSamplingESS,
    ImportanceWeightMean,
    ImportanceWeightSecondMoment,
    InputHealth,
    KLEstimators,
    LogprobDiff,
    LogRatioRange,
    PerplexityGap,
    ProbabilityDiff,
    SequenceESS,
    SequenceLogRatio,
    TopGradientMass,
    VetoFraction,
)
from opbc_metrics.naming import make_key, parse_key

__version__ = "0.1.0"

__all__ = [
    "BatchView",
    "ChiSquare",
    "ClippedFraction",
    "GlossaryEntry",
    "ImportanceSamplingESS",
    "ImportanceWeightMean",
    "ImportanceWeightSecondMoment",
    "InputHealth",
    "KLEstimators",
    "LogRatioRange",
    "LogprobDiff",
    "OPBCCollection",
    "OPBCMetric",
    "PerplexityGap",
    "ProbabilityDiff",
    "SequenceESS",
    "SequenceLogRatio",
    "TopGradientMass",
    "VetoFraction",
    "make_key",
    "parse_key",
]
