"""Stateful per-round (multi-turn) logprob mismatch (section ``per_round``), a thin class over
:mod:`opbc_metrics.functional.per_round`."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from opbc_metrics.batch import ROLLOUT_LOGPROBS, TRAINER_LOGPROBS, BatchView, check_count
from opbc_metrics.functional.mismatch import _input_update
from opbc_metrics.functional.per_round import (
    DEFAULT_ROUND_CAPACITY,
    Stats,
    _occurred,
    _per_round_compute,
    _per_round_update,
    per_round_keys,
    request_rounds,
    round_kernel_statistics,
)
from opbc_metrics.metric import INPUT_CHECK_STATES, MAX, SUM, GlossaryEntry, LogprobInputChecks, OPBCMetric, table

_BUCKETS = SUM.of(lambda m: m.capacity + 1)  # rounds 0 .. capacity - 1, then the overflow bucket


class PerRoundMismatch(LogprobInputChecks, OPBCMetric):
    r"""Per-round logprob mismatch for multi-turn trajectories, ``per_round/*`` (verl PR #5229's keys).

    A round is a contiguous run of 1s in ``response_mask`` (one turn of generation between
    environment/tool tokens). Per round ``i``, pooled over sequences, the window and all ranks:

    .. math:: \mathrm{round}_i\_\mathrm{abs\_diff\_mean} = \frac{\sum_{t \in \mathrm{round}\ i} |r_t|}
              {\#\{t \in \mathrm{round}\ i\}}, \quad r_t = \log p_{train} - \log p_{roll}

    Keys: ``per_round/total_rounds`` (the most rounds of any one sequence), ``per_round/round_{i}_abs_diff_mean``
    and ``per_round/round_{i}_token_count`` for ``i < capacity``, ``per_round/overflow_abs_diff_mean`` and
    ``per_round/overflow_token_count`` pooling rounds ``>= capacity``, ``per_round/max_round_diff`` (the
    round with the largest mean, first on ties; ``capacity`` stands for the overflow bucket) and
    ``per_round/max_diff_value`` (its mean). Only rounds some sequence reached have keys (single-turn data:
    round 0 only), and the overflow keys appear only when a sequence had more than ``capacity`` rounds; a
    round without a finite token in the window has its ``token_count`` but no ``abs_diff_mean``.

    States: per-bucket sums of ``|r|``, valid-token counts and response-token counts
    (``capacity + 1`` each) and the running max of rounds per sequence; the max round is found in
    ``compute`` from the synced sums, so the values are exact over DDP. Non-finite tokens stay in their
    round's ``token_count`` but not in its mean (see :mod:`opbc_metrics.functional.per_round`).

    The sums come out of the mismatch kernel's sweep over the tokens (:mod:`opbc_metrics.functional.mismatch`):
    in a collection, the same call that computes the mismatch statistics.

    Args:
        capacity: rounds with their own keys (16).
        compiled: run the kernel under ``torch.compile`` (a collection's ``compiled`` option does it for all).
        input_checks: refuse at compute a window whose logprobs held positive values (probabilities, logits) or
            whose ``response_mask`` held values other than 0 and 1 (a collection with the mismatch section leaves
            that to its InputHealth).
        kwargs: torchmetrics ``Metric`` arguments.

    Example:
        >>> import torch
        >>> metric = PerRoundMismatch(capacity=2)
        >>> mask = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0]])  # rounds: [0, 1], [3] and [0]
        >>> trainer = torch.tensor([[-1.0, -1.0, -5.0, -2.0], [-1.0, 0.0, 0.0, 0.0]])
        >>> rollout = torch.tensor([[-1.5, -1.0, -1.0, -1.0], [-1.1, 0.0, 0.0, 0.0]])
        >>> metric.update(trainer_logprobs=trainer, rollout_logprobs=rollout, response_mask=mask)
        >>> out = metric.compute()
        >>> [round(out["per_round/" + k].item(), 4) for k in ("total_rounds", "round_0_abs_diff_mean",
        ...                                                     "round_1_token_count", "max_round_diff")]
        [2.0, 0.2, 1.0, 1.0]
    """

    keys = per_round_keys(DEFAULT_ROUND_CAPACITY)
    data_counts = ("valid_count",)
    states = table(sum_abs=_BUCKETS, valid_count=_BUCKETS, token_count=_BUCKETS, max_rounds=MAX)
    required_fields = (TRAINER_LOGPROBS, ROLLOUT_LOGPROBS)  # response_mask is optional (all ones)
    higher_is_better = False
    glossary = GlossaryEntry(
        name="per_round_abs_diff",
        what="Per-round logprob mismatch for multi-turn training: rounds are the contiguous runs of 1s in "
        "response_mask (one generation turn each, separated by environment/tool tokens); per round i the "
        "mean |trainer_logp - rollout_logp| and the token count, the most rounds of any sequence, and the "
        "round that diverges most with its mean. Shows which turn the engines disagree on (e.g. rounds "
        "after an image, where attention differs between engines).",
        unit="valid response tokens of round i, pooled over sequences, the window and all ranks "
        "(total_rounds: max over sequences)",
        cap="none (diagnostic)",
        action="no OPBC action; a round far above the others points at a per-turn cause (context length, "
        "multimodal attention, tool-token formatting) to fix in the rollout engine",
        aliases=("per-round mismatch", "per_round", "round_abs_diff_mean"),
    )

    def __init__(self, capacity: int = DEFAULT_ROUND_CAPACITY, compiled: bool = False, input_checks: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.input_checks = bool(input_checks)
        self.capacity = check_count("capacity", capacity, optional=False)
        self.compiled = bool(compiled)
        self.keys = per_round_keys(self.capacity)

    def update(self, batch: Any = None, **fields: Any) -> None:
        """Accumulate a batch with ``trainer_logprobs`` [B, T], ``rollout_logprobs`` [B, T] and an
        optional ``response_mask`` [B, T] (all ones when absent)."""
        super().update(batch, **fields)

    def request_shared(self, view: BatchView) -> None:
        """Ask the shared mismatch kernel for the per-round sums."""
        request_rounds(view, self.capacity)

    def statistics(self, view: BatchView) -> Stats:
        return {**_per_round_update(view, self.capacity, self.compiled), **self.input_check_statistics(view)}

    def nonfinite_tokens(self, view: BatchView) -> Tensor:
        # (the kernel call _per_round_update made, cached on the view)
        return _input_update(round_kernel_statistics(view, self.capacity, self.compiled))["nonfinite"]

    def compute(self) -> dict[str, Tensor]:
        self.raise_on_bad_inputs()
        out = _per_round_compute(**self.state_values(exclude=tuple(INPUT_CHECK_STATES)))
        return _occurred(out, self.capacity, self.valid_count)


PER_ROUND_METRICS: tuple[type[PerRoundMismatch], ...] = (PerRoundMismatch,)


def per_round_section(**kwargs: Any) -> list[OPBCMetric]:
    """The ``per_round`` section of :class:`~opbc_metrics.collection.OPBCCollection`: one
    :class:`PerRoundMismatch` (options: ``capacity``, default 16)."""
    return [PerRoundMismatch(**kwargs)]
