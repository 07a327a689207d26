"""Training-dynamics metrics (the training-metrics glossary): validation, actor, critic and rewards,
lengths and turns, DPO and reward models, load balance, timing and performance.

Every class is an :class:`~opbc_metrics.metric.OPBCMetric` with fixed-size sum/max/min states, so it
syncs exactly across ranks, and declares ``optional_inputs``: in a collection it only updates on batches
that carry its fields. Trainer scalars (losses, grad norms, learning rates) are passed in as batch fields
(``actor_loss``, ``pg_loss``, ``entropy_loss``, ``kl_loss``, ``kl_coef``, ``actor_grad_norm``,
``actor_lr``, ``critic_loss``, ``critic_lr``, ``rm_grad_norm``; ``loss_tokens`` weights the losses).

Use :func:`training_metrics` to build the set (some members need construction-time settings: the
validation data sources, the length limits, the model's FLOPs), and pass it to
``OPBCCollection(metrics=...)``, alone or next to other sections' members. The collection section
``"training"`` builds the same set (settings via ``section_options={"training": {...}}``); it is not in the
default sections, since its members read fields that a mismatch-only user
never feeds.

Example:
    >>> import torch
    >>> from opbc_metrics import OPBCCollection
    >>> metrics = OPBCCollection(metrics=training_metrics(max_response_length=4))
    >>> metrics.update(response_lengths=torch.tensor([4, 2]), prompt_lengths=torch.tensor([3, 3]),
    ...                actor_loss=0.5, actor_grad_norm=1.5)
    >>> out = metrics.compute()
    >>> out["response_length/clip_ratio"].item(), out["actor/grad_norm"].item(), out["global_seqlen/max"].item()
    (0.5, 1.5, 12.0)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from opbc_metrics.functional import perf as P
from opbc_metrics.functional.training import DEFAULT_CLIP_RATIO, DEFAULT_CLIP_RATIO_C, DEFAULT_DPO_BETA
from opbc_metrics.metric import OPBCMetric
from opbc_metrics.training.actor import (
    PPOKL,
    ActorGradNorm,
    ActorLoss,
    ActorLR,
    ApproxKL,
    EntropyLoss,
    KLCoef,
    KLLoss,
    LRSchedulerState,
    PolicyClipFraction,
    PolicyEntropy,
    PolicyGradientLoss,
)
from opbc_metrics.training.critic import (
    AdvantageStats,
    CriticLoss,
    CriticLR,
    ExplainedVariance,
    ReturnStats,
    RewardStats,
    ScoreStats,
    ValueStats,
)
from opbc_metrics.training.lengths import AbortedRatio, NumTurns, PromptLength, ResponseLength
from opbc_metrics.training.perf import (
    DEFAULT_MFU_STAGES,
    AgentLoopSlowest,
    AgentLoopTiming,
    GlobalSeqlen,
    ModelFlopsUtilization,
    StageTimer,
    StageTiming,
    Throughput,
)
from opbc_metrics.training.preference import DPOMetrics, RewardModelMetrics, RMGradNorm
from opbc_metrics.training.validation import ValidationAccuracy, ValidationReward, ValidationTurns

# Members that need no construction-time setting (in this order in the "training" section).
_SIMPLE = (ActorLoss, PolicyGradientLoss, EntropyLoss, KLLoss, KLCoef, ActorGradNorm, ActorLR, PPOKL, ApproxKL,
           CriticLoss, CriticLR, ValueStats, ReturnStats, AdvantageStats, RewardStats, ScoreStats, ExplainedVariance,
           AbortedRatio, NumTurns, RewardModelMetrics, RMGradNorm, ValidationTurns, AgentLoopTiming)

TRAINING_METRICS: tuple[type[OPBCMetric], ...] = (*_SIMPLE, PolicyEntropy, PolicyClipFraction, ResponseLength,
                                                  PromptLength, DPOMetrics, ValidationAccuracy, ValidationReward,
                                                  GlobalSeqlen, StageTiming, Throughput, AgentLoopSlowest,
                                                  LRSchedulerState, ModelFlopsUtilization)


def training_metrics(*, max_response_length: int | None = None, max_prompt_length: int | None = None,
                     data_sources: Sequence[str] | None = None, n_samples: int = 1, ks: Sequence[int] | None = None,
                     allow_other: bool = False, entropy_from_logits: bool = False,
                     clip_ratio: float = DEFAULT_CLIP_RATIO, clip_ratio_low: float | None = None,
                     clip_ratio_high: float | None = None, clip_ratio_c: float = DEFAULT_CLIP_RATIO_C,
                     dpo_beta: float = DEFAULT_DPO_BETA, timing_stages: Sequence[str] = P.DEFAULT_STAGES,
                     strict_stages: bool = True, flops: P.TransformerFlops | None = None,
                     mfu_stages: Mapping[str, tuple[str, str | float]] | None = None, accelerator: str | None = None,
                     peak_flops: float | None = None, num_gpus: int | None = None, world_size: int | None = None,
                     lr_scheduler_names: Sequence[str] = ("last_lr",), **metric_kwargs: Any) -> list[OPBCMetric]:
    """Every training metric, configured: pass the list to ``OPBCCollection(metrics=...)``.

    The validation members (``val-core/*``, per-source ``val-aux/*``) are included when ``data_sources``
    is given, MFU (``perf/mfu/*``) when ``flops`` is given; ``clip_ratio`` keys need the max lengths.
    ``metric_kwargs`` are torchmetrics ``Metric`` arguments for every member.

    Example:
        >>> keys = [k for m in training_metrics(data_sources=["gsm8k"]) for k in m.keys]
        >>> "val-core/gsm8k/acc/mean@1" in keys, "actor/pg_clipfrac" in keys, "response_length/clip_ratio" in keys
        (True, True, False)
    """
    kw = metric_kwargs
    out: list[OPBCMetric] = [cls(**kw) for cls in _SIMPLE]
    out += [PolicyEntropy(from_logits=entropy_from_logits, **kw),
            PolicyClipFraction(clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c, **kw),
            ResponseLength(max_response_length, **kw), PromptLength(max_prompt_length, **kw),
            DPOMetrics(beta=dpo_beta, **kw), GlobalSeqlen(world_size=world_size, **kw),
            StageTiming(timing_stages, strict=strict_stages, world_size=world_size, **kw),
            Throughput(num_gpus=num_gpus, world_size=world_size, **kw), AgentLoopSlowest(world_size=world_size, **kw),
            LRSchedulerState(names=tuple(lr_scheduler_names), **kw)]
    if data_sources is not None:
        out += [ValidationAccuracy(data_sources, n_samples, ks, allow_other, **kw),
                ValidationReward(data_sources, n_samples, ks, allow_other, **kw)]
    if flops is not None:
        out.append(ModelFlopsUtilization(flops, mfu_stages, accelerator, peak_flops, num_gpus, world_size=world_size,
                                         **kw))
    return out


def training_section(**kwargs: Any) -> list[OPBCMetric]:
    """The ``training`` section of :class:`~opbc_metrics.collection.OPBCCollection`: :func:`training_metrics`
    with ``kwargs``. Give its settings through ``section_options``, e.g.
    ``OPBCCollection(sections=["mismatch", "training"], section_options={"training": {"max_response_length":
    4096}})``, or build the list yourself and pass ``metrics=``."""
    return training_metrics(**kwargs)


__all__ = ["DEFAULT_MFU_STAGES", "PPOKL", "TRAINING_METRICS", "AbortedRatio", "ActorGradNorm", "ActorLR", "ActorLoss",
           "AdvantageStats", "AgentLoopSlowest", "AgentLoopTiming", "ApproxKL", "CriticLR", "CriticLoss", "DPOMetrics",
           "EntropyLoss", "ExplainedVariance", "GlobalSeqlen", "KLCoef", "KLLoss", "LRSchedulerState",
           "ModelFlopsUtilization", "NumTurns", "PolicyClipFraction", "PolicyEntropy", "PolicyGradientLoss",
           "PromptLength", "RMGradNorm", "ResponseLength", "ReturnStats", "RewardModelMetrics", "RewardStats",
           "ScoreStats", "StageTimer", "StageTiming", "Throughput", "ValidationAccuracy", "ValidationReward",
           "ValidationTurns", "ValueStats", "training_metrics", "training_section"]
