"""Pure tensor functions: no state, no sync. One module per glossary section."""

from opbc_metrics.functional.mismatch import (
    chi_square,
    clipped_fraction,
    importance_ess,
    importance_weight_mean,
    importance_weight_second_moment,
    kl_estimators,
    log_ratio_range,
    logprob_diff,
    perplexity_gap,
    probability_diff,
    sequence_ess,
    sequence_log_ratio,
    sketch_relative_error_bound,
    top_gradient_mass,
    veto_fraction,
)

__all__ = [
    "chi_square",
    "clipped_fraction",
    "importance_ess",
    "importance_weight_mean",
    "importance_weight_second_moment",
    "kl_estimators",
    "log_ratio_range",
    "logprob_diff",
    "perplexity_gap",
    "probability_diff",
    "sequence_ess",
    "sequence_log_ratio",
    "sketch_relative_error_bound",
    "top_gradient_mass",
    "veto_fraction",
]
