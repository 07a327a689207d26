"""Length and turn metrics: ``response_length/*``, ``prompt_length/*``, ``response/aborted_ratio``,
``num_turns/*``."""

from __future__ import annotations

from typing import Any, ClassVar

from opbc_metrics.batch import check_count
from opbc_metrics.functional.training import (
    NUM_TURNS,
    PROMPT_LENGTHS,
    RESPONSE_LENGTHS,
    TURN_KEYS,
    _aborted_compute,
    _aborted_update,
    _length_compute,
    _length_update,
    _turns_compute,
    _turns_update,
    length_keys,
)
from opbc_metrics.metric import MAX, MIN, SUM, BySettings, table
from opbc_metrics.training._base import _TrainingMetric, _TurnCounts, diagnostic

_SEQUENCES = "sequences (samples) over the window and all ranks"


class _LengthStats(_TrainingMetric):
    """mean/max/min of one length field, and the clipped share given a maximum (``max_length``, set by the
    subclass's constructor). A subclass names the field and the key prefix as class keywords."""

    prefix: ClassVar[str]
    max_length: int | None
    states = table(sum=SUM, max=MAX, min=MIN, count=SUM, clipped=SUM, invalid=SUM)
    kernel = (_length_update, _length_compute)
    update_args = ("field", "max_length")
    compute_args = ("prefix", "max_length")

    def __init_subclass__(cls, field: str, prefix: str, **kwargs: Any) -> None:
        # clip_ratio only with a maximum length; a BySettings made here is named by hand (no class body)
        keys = BySettings(length_keys(prefix, 1), lambda m: length_keys(prefix, m.max_length))
        keys.__set_name__(cls, "keys")
        cls.keys, cls.prefix, cls.required_fields = keys, prefix, (field,)
        cls._deferred = (("invalid", field, "negative or non-finite lengths"),)
        super().__init_subclass__(**kwargs)


class ResponseLength(_LengthStats, field=RESPONSE_LENGTHS, prefix="response_length"):
    """``response_length/{mean,max,min,clip_ratio}`` from ``response_lengths`` [B] (tokens per response).

    ``clip_ratio`` = share of responses with ``length >= max_response_length`` (truncated by the limit);
    it is produced only when ``max_response_length`` is given (there is no way to tell truncation from the
    lengths alone). Zero-length (aborted) responses count in every statistic, as in verl.

    Args:
        max_response_length: the generation limit, in tokens.

    Example:
        >>> import torch
        >>> metric = ResponseLength(max_response_length=512)
        >>> metric.update(response_lengths=torch.tensor([10, 512, 0, 200]))
        >>> [(k, v.item()) for k, v in metric.compute().items()]  # doctest: +NORMALIZE_WHITESPACE
        [('response_length/mean', 180.5), ('response_length/max', 512.0), ('response_length/min', 0.0),
         ('response_length/clip_ratio', 0.25)]
    """

    glossary = diagnostic("response_length", unit=_SEQUENCES, aliases=("response_length/clip_ratio",),
        what="Completion length: mean, max, min, and the share clipped by max_response_length. A high clip ratio "
        "means frequent truncation; reward rising while length collapses can be reward hacking via a length bias.")

    def __init__(self, max_response_length: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_length = check_count("max_response_length", max_response_length)


class PromptLength(_LengthStats, field=PROMPT_LENGTHS, prefix="prompt_length"):
    """``prompt_length/{mean,max,min,clip_ratio}`` from ``prompt_lengths`` [B] (tokens per prompt).

    ``clip_ratio`` (share with ``length >= max_prompt_length``) only when ``max_prompt_length`` is given.

    Example:
        >>> metric = PromptLength(max_prompt_length=100)
        >>> metric.update(prompt_lengths=[40, 100])
        >>> [round(v.item(), 2) for v in metric.compute().values()]
        [70.0, 100.0, 40.0, 0.5]
    """

    glossary = diagnostic("prompt_length", unit=_SEQUENCES,
        what="Prompt length: mean, max, min, and the share clipped by max_prompt_length (inputs truncated).")

    def __init__(self, max_prompt_length: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_length = check_count("max_prompt_length", max_prompt_length)


class AbortedRatio(_TrainingMetric):
    """``response/aborted_ratio``: share of samples whose generation was aborted, i.e. whose response is
    empty (``response_lengths == 0``, verl's definition).

    Example:
        >>> import torch
        >>> metric = AbortedRatio()
        >>> metric.update(response_lengths=torch.tensor([0, 12, 7, 0]))
        >>> metric.compute()
        tensor(0.5000, dtype=torch.float64)
    """

    keys = ("response/aborted_ratio",)
    required_fields = (RESPONSE_LENGTHS,)
    higher_is_better = False
    plot_lower_bound = 0.0
    plot_upper_bound = 1.0
    _deferred = (("invalid", RESPONSE_LENGTHS, "negative or non-finite lengths"),)
    glossary = diagnostic("response/aborted_ratio", unit=_SEQUENCES,
        what="Fraction of generations that failed or were aborted (empty responses). High values point to sampling or "
        "runtime issues.")

    states = table("aborted", "count", "invalid")
    kernel = (_aborted_update, _aborted_compute)


class NumTurns(_TurnCounts, field=NUM_TURNS):
    """``num_turns/{min,max,mean}`` over samples, from ``num_turns`` [B] (multi-turn and agent rollouts).

    Example:
        >>> metric = NumTurns()
        >>> metric.update(num_turns=[1, 3])
        >>> metric.update(num_turns=[2, 6])
        >>> {k: v.item() for k, v in metric.compute().items()}
        {'num_turns/min': 1.0, 'num_turns/max': 6.0, 'num_turns/mean': 3.0}
    """

    keys = TURN_KEYS
    kernel = (_turns_update, _turns_compute)
    glossary = diagnostic("num_turns", unit=_SEQUENCES,
        what="Turns per trajectory: min, max, mean. A sudden jump of the max points to loops or tool failures causing "
        "repeated retries.")
