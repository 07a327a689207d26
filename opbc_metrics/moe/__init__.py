"""MoE router drift between the rollout engine and the trainer: top-1 flips and top-K set disagreement."""

from opbc_metrics.moe.metrics import MOE_METRICS, RouterFlipRate, RouterSetDisagreement, moe_section

__all__ = ["MOE_METRICS", "RouterFlipRate", "RouterSetDisagreement", "moe_section"]
