"""Per-round (multi-turn) logprob mismatch: rounds are contiguous runs of 1s in ``response_mask``."""

from opbc_metrics.per_round.metrics import PER_ROUND_METRICS, PerRoundMismatch, per_round_section

__all__ = ["PER_ROUND_METRICS", "PerRoundMismatch", "per_round_section"]
