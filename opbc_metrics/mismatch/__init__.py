"""Train-vs-rollout mismatch metrics: importance weights, log ratios, KL, perplexity, probabilities."""

from opbc_metrics.mismatch.metrics import (
    MISMATCH_METRICS,
    ChiSquare,
    ClippedFraction,
    ImportanceSamplingESS,
    ImportanceWeightMean,
    ImportanceWeightSecondMoment,
    ImportanceWeightStd,
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

__all__ = [
    "MISMATCH_METRICS", "ChiSquare", "ClippedFraction", "ImportanceSamplingESS", "ImportanceWeightMean",
    "ImportanceWeightSecondMoment", "ImportanceWeightStd", "InputHealth", "KLEstimators", "LogRatioRange",
    "LogprobDiff", "PerplexityGap", "ProbabilityDiff", "SequenceESS", "SequenceLogRatio", "TopGradientMass",
    "VetoFraction",
]
