"""Length and turn metrics: ``response_length/*``, ``prompt_length/*``, ``response/aborted_ratio``,
``num_turns/*``."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from opbc_metrics.batch import BatchView
from opbc_metrics.functional import training as F
from opbc_metrics.metric import MAX, MIN, SUM, BySettings, GlossaryEntry, table
from opbc_metrics.training._base import DIAGNOSTIC, NO_ACTION, _TrainingMetric, _TurnCounts

_SEQUENCES = "sequences (samples) over the window and all ranks"


def _check_max_length(name: str, value: int | None) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer or None, got {value!r}")
    return value


def _length_keys(m: _LengthStats) -> tuple[str, ...]:
    return F.length_keys(m.prefix, m.max_length)  # clip_ratio only with a maximum length


class _LengthStats(_TrainingMetric):
    """mean/max/min of one length field (``required_fields[0]``), and the clipped share given a maximum."""

    prefix: ClassVar[str] = ""
    states = table(sum=SUM, max=MAX, min=MIN, count=SUM, clipped=SUM, zero=SUM, invalid=SUM)

    def __init__(self, max_length: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_length = _check_max_length("max_length", max_length)

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        return F._length_update(view, self.required_fields[0], self.max_length)

    def compute(self) -> dict[str, Tensor]:
        self.check_deferred()
        return F._length_compute(self.prefix, self.max_length, **self.state_values("sum", "max", "min", "count",
                                                                                  "clipped"))


class ResponseLength(_LengthStats):
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

    keys = BySettings(F.length_keys("response_length", 1), _length_keys)
    prefix = "response_length"
    required_fields = (F.RESPONSE_LENGTHS,)
    _deferred = (("invalid", F.RESPONSE_LENGTHS, "negative or non-finite lengths"),)
    glossary = GlossaryEntry(
        name="response_length",
        what="Completion length: mean, max, min, and the share clipped by max_response_length. A high clip "
        "ratio means frequent truncation; reward rising while length collapses can be reward hacking via a "
        "length bias.",
        unit=_SEQUENCES,
        cap=DIAGNOSTIC,
        action=NO_ACTION,
        aliases=("response_length/clip_ratio",),
    )

    def __init__(self, max_response_length: int | None = None, **kwargs: Any) -> None:
        super().__init__(_check_max_length("max_response_length", max_response_length), **kwargs)


class PromptLength(_LengthStats):
    """``prompt_length/{mean,max,min,clip_ratio}`` from ``prompt_lengths`` [B] (tokens per prompt).

    ``clip_ratio`` (share with ``length >= max_prompt_length``) only when ``max_prompt_length`` is given.

    Example:
        >>> metric = PromptLength(max_prompt_length=100)
        >>> metric.update(prompt_lengths=[40, 100])
        >>> [round(v.item(), 2) for v in metric.compute().values()]
        [70.0, 100.0, 40.0, 0.5]
    """

    keys = BySettings(F.length_keys("prompt_length", 1), _length_keys)
    prefix = "prompt_length"
    required_fields = (F.PROMPT_LENGTHS,)
    _deferred = (("invalid", F.PROMPT_LENGTHS, "negative or non-finite lengths"),)
    glossary = GlossaryEntry(
        name="prompt_length",
        what="Prompt length: mean, max, min, and the share clipped by max_prompt_length (inputs truncated).",
        unit=_SEQUENCES,
        cap=DIAGNOSTIC,
        action=NO_ACTION,
    )

    def __init__(self, max_prompt_length: int | None = None, **kwargs: Any) -> None:
        super().__init__(_check_max_length("max_prompt_length", max_prompt_length), **kwargs)


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
    required_fields = (F.RESPONSE_LENGTHS,)
    higher_is_better = False
    plot_lower_bound = 0.0
    plot_upper_bound = 1.0
    _deferred = (("invalid", F.RESPONSE_LENGTHS, "negative or non-finite lengths"),)
    glossary = GlossaryEntry(
        name="response/aborted_ratio",
        what="Fraction of generations that failed or were aborted (empty responses). High values point to "
        "sampling or runtime issues.",
        unit=_SEQUENCES,
        cap=DIAGNOSTIC,
        action=NO_ACTION,
    )

    states = table("aborted", "count", "invalid")

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        return F._aborted_update(view)

    def compute(self) -> Tensor:
        self.check_deferred()
        return F._aborted_compute(**self.state_values(exclude=("invalid",)))


class NumTurns(_TurnCounts):
    """``num_turns/{min,max,mean}`` over samples, from ``num_turns`` [B] (multi-turn and agent rollouts).

    Example:
        >>> metric = NumTurns()
        >>> metric.update(num_turns=[1, 3])
        >>> metric.update(num_turns=[2, 6])
        >>> {k: v.item() for k, v in metric.compute().items()}
        {'num_turns/min': 1.0, 'num_turns/max': 6.0, 'num_turns/mean': 3.0}
    """

    keys = F.TURN_KEYS
    required_fields = (F.NUM_TURNS,)
    _deferred = (("invalid", F.NUM_TURNS, "negative or non-finite turn counts"),)
    glossary = GlossaryEntry(
        name="num_turns",
        what="Turns per trajectory: min, max, mean. A sudden jump of the max points to loops or tool failures "
        "causing repeated retries.",
        unit=_SEQUENCES,
        cap=DIAGNOSTIC,
        action=NO_ACTION,
    )

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        return F._turns_update(view)

    def compute(self) -> dict[str, Tensor]:
        self.check_deferred()
        return F._turns_compute(**self.state_values(exclude=("invalid",)))
