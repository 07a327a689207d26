"""Validation metrics (``val-core/*``, ``val-aux/*``), per data source, with unbiased pass@k and best@k.

Data sources are strings, and states must have a fixed size, so the list of data sources (and the
``k`` values) is given at construction. A batch naming an undeclared source raises a ``ValueError``;
with ``allow_other=True`` it is counted under the extra source ``other`` instead. See
:mod:`opbc_metrics.functional.validation` for the batch layout (``[P, n]`` per prompt) and formulas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from torch import Tensor

from opbc_metrics.functional import validation as V
from opbc_metrics.metric import SUM, BySettings, table
from opbc_metrics.training._base import _TrainingMetric, _TurnCounts, diagnostic

_PROMPTS = ("validation prompts of each data source (each prompt's n samples averaged first; every prompt weighs the "
            "same), over the window and all ranks")


def _validation_keys(m: _PerSource) -> tuple[str, ...]:
    return V.validation_keys(m.data_sources, m.n_samples, m.ks, m.mode)


class _PerSource(_TrainingMetric):
    """Per data source statistics of a value field, ``[S]`` and ``[S, K]`` sums. A subclass names the field
    and the ``mode`` of the at-k statistic (``"pass"`` or ``"best"``) as class keywords."""

    mode: ClassVar[str]
    higher_is_better = True
    kernel = (V._validation_update, V._validation_compute)
    update_args = ("field", "data_sources", "allow_other", "n_samples", "ks", "mode")
    data_counts = ("prompts", "nonfinite")  # a source without prompts in the window has no keys (see compute)
    states = table(prompts=SUM.of("data_sources"), sum_mean=SUM.of("data_sources"),
                   sum_at_k=SUM.of("data_sources", "ks"), prompts_at_k=SUM.of("data_sources", "ks"), nonfinite=SUM)

    def __init__(self, data_sources: Sequence[str], n_samples: int = 1, ks: Sequence[int] | None = None,
                 allow_other: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.allow_other = bool(allow_other)
        self.data_sources = V.check_sources(data_sources, self.allow_other)
        self.n_samples = n_samples
        self.ks = V.check_ks(ks, n_samples)

    def __init_subclass__(cls, field: str, mode: str, **kwargs: Any) -> None:
        cls.mode, cls.required_fields = mode, (field, V.DATA_SOURCES)
        cls._deferred = (("nonfinite", field, V.NONFINITE_SAMPLES),)
        super().__init_subclass__(**kwargs)

    def compute(self) -> dict[str, Tensor]:
        return V._validation_compute(**self.state_values(exclude=("nonfinite",)), sources=self.data_sources,
                                     n_samples=self.n_samples, ks=self.ks, mode=self.mode)


class ValidationAccuracy(_PerSource, field=V.VAL_ACC, mode="pass"):
    r"""``val-core/<source>/acc/mean@<n>`` and ``val-aux/<source>/acc/pass@<k>`` per data source.

    Batch fields: ``val_acc`` [P, n] (or [P] for n = 1), ``data_sources`` (one string per prompt, or
    one string for the batch), optional ``val_mask`` [P, n] for ragged sample counts. ``mean@n`` averages
    the accuracy of each prompt's samples, then over prompts; ``pass@k`` is the unbiased estimator
    :math:`1 - \binom{n-c}{k}/\binom{n}{k}` (Chen et al. 2021) with ``c`` the samples with ``acc >= 0.5``.
    A declared source that no prompt of the window came from has no keys (not 0% accuracy).

    Args:
        data_sources: every data source the batches may name (fixed: states have one slot per source).
        n_samples: samples per prompt, the ``n`` of ``mean@n`` (1).
        ks: the ``k`` values of pass@k (default ``1, 2, 4, ..., n``).
        allow_other: count undeclared sources under ``other`` instead of raising.

    Example:
        >>> import torch
        >>> metric = ValidationAccuracy(["gsm8k", "math"], n_samples=4, ks=[1, 2])
        >>> metric.update(val_acc=torch.tensor([[1.0, 0.0, 0.0, 0.0]]), data_sources=["gsm8k"])
        >>> metric.update(val_acc=torch.tensor([[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]), data_sources="math")
        >>> {k: round(v.item(), 4) for k, v in metric.compute().items()}  # doctest: +NORMALIZE_WHITESPACE
        {'val-core/gsm8k/acc/mean@4': 0.25, 'val-aux/gsm8k/acc/pass@1': 0.25, 'val-aux/gsm8k/acc/pass@2': 0.5,
         'val-core/math/acc/mean@4': 0.375, 'val-aux/math/acc/pass@1': 0.375, 'val-aux/math/acc/pass@2': 0.5}
    """

    keys = BySettings(("val-core/<source>/acc/mean@<n>", "val-aux/<source>/acc/pass@<k>"), _validation_keys)
    glossary = diagnostic("val-core/acc", unit=_PROMPTS, aliases=("val-core/*/acc/mean@1", "pass@k"),
        what="Validation accuracy per data source on held-out tasks: mean@n (how often the model is correct; the "
        "number to watch first) and the unbiased pass@k (chance that at least one of k samples is correct). When it "
        "drops, first ask whether training is unstable or the data/reward mis-specified.")


class ValidationReward(_PerSource, field=V.VAL_REWARDS, mode="best"):
    r"""``val-aux/<source>/reward/mean@<n>`` and ``val-aux/<source>/reward/best@<k>`` per data source.

    Batch fields: ``val_rewards`` [P, n] (or [P]), ``data_sources``, optional ``val_mask``. ``best@k`` is
    the exact expected maximum reward of ``k`` of the ``n`` samples drawn without replacement.

    Example:
        >>> import torch
        >>> metric = ValidationReward(["gsm8k"], n_samples=4, ks=[2])
        >>> metric.update(val_rewards=torch.tensor([[3.0, 1.0, 2.0, 0.0]]), data_sources="gsm8k")
        >>> {k: round(v.item(), 4) for k, v in metric.compute().items()}
        {'val-aux/gsm8k/reward/mean@4': 1.5, 'val-aux/gsm8k/reward/best@2': 2.3333}
    """

    keys = BySettings(("val-aux/<source>/reward/mean@<n>", "val-aux/<source>/reward/best@<k>"), _validation_keys)
    glossary = diagnostic("val-aux/reward", unit=_PROMPTS, aliases=("val-aux/*/reward/mean@1", "best@k"),
        what="Mean validation reward per data source (mean@n; for rule-based rewards it tracks accuracy) and the "
        "expected best reward of k samples (best@k). Read it to interpret why val-core moved.")


class ValidationTurns(_TurnCounts, field=V.VAL_NUM_TURNS):
    """``val-aux/num_turns/{min,max,mean}`` over validation samples (batch field ``val_num_turns`` [P, n] or
    [P], optional ``val_mask``).

    Example:
        >>> metric = ValidationTurns()
        >>> metric.update(val_num_turns=[[2, 4], [1, 9]])
        >>> {k: v.item() for k, v in metric.compute().items()}
        {'val-aux/num_turns/min': 1.0, 'val-aux/num_turns/max': 9.0, 'val-aux/num_turns/mean': 4.0}
    """

    keys = V.VAL_TURN_KEYS
    kernel = (V._val_turns_update, V._val_turns_compute)
    glossary = diagnostic("val-aux/num_turns", unit="validation samples over the window and all ranks",
        what="Turn counts of multi-turn validation rollouts: min, max, mean.")
