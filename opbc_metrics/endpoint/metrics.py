"""Stateful endpoint-capability coverage (section ``endpoint``), thin classes over
:mod:`opbc_metrics.functional.endpoint`.

Each class reads the batch field ``endpoint_responses`` (and the optional ``endpoint_requests``); the
responses of one batch are probed once per :class:`~opbc_metrics.batch.BatchView` and shared by the
classes of a collection. The inputs are optional: inside an
:class:`~opbc_metrics.collection.OPBCCollection` the classes skip batches without responses.
No response in the window: no keys.
"""

from __future__ import annotations

from functools import partial
from typing import Any, ClassVar

from torch import Tensor

from opbc_metrics.batch import BatchView
from opbc_metrics.functional.endpoint import (
    ENDPOINT_REQUESTS,
    ENDPOINT_RESPONSES,
    NUM_RESPONSES_KEY,
    _coverage_compute,
    _endpoint_update,
    capability_key,
)
from opbc_metrics.metric import GlossaryEntry, OPBCMetric, table

__all__ = ["ENDPOINT_METRICS", "EndpointResponseCount", "SampledLogprobsCoverage", "SeedSupportCoverage",
           "TokenIdsCoverage", "TopLogprobsCoverage", "endpoint_section"]

_RESPONSES = (
    "OpenAI-compatible responses probed (one per request, all of its choices), summed over the window and "
    "all ranks"
)
#: ``_entry(name, what, action=...)``: a glossary entry of this section, a diagnostic over probed responses.
_entry = partial(GlossaryEntry, unit=_RESPONSES, cap="none (diagnostic)")


class _CoverageMetric(OPBCMetric):
    """Base: the fraction of probed responses with each of the capability ``flags`` (its keys, and its states
    after ``responses``)."""

    required_fields = (ENDPOINT_RESPONSES,)
    optional_inputs = True
    trigger_fields = (ENDPOINT_RESPONSES, ENDPOINT_REQUESTS)  # requests alone raise: their responses are missing
    data_counts = ("responses",)
    states = table("responses")
    flags: ClassVar[tuple[str, ...]] = ()
    higher_is_better = True
    plot_lower_bound, plot_upper_bound = 0.0, 1.0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        if cls.flags:
            cls.keys = tuple(map(capability_key, cls.flags))
            cls.states = table("responses", *cls.flags)
        super().__init_subclass__(**kwargs)

    def update(self, batch: Any = None, **fields: Any) -> None:
        """Accumulate ``endpoint_responses`` (a list of responses) and the optional ``endpoint_requests``
        (their request bodies: a parallel list, or one body for all)."""
        super().update(batch, **fields)

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        stats = _endpoint_update(view)  # the statistics of every endpoint metric, computed once per view
        return {name: stats[name] for name in self.states}

    def compute(self) -> Tensor | dict[str, Tensor]:
        flags = self.state_values(exclude=("responses",))
        out = {capability_key(f): _coverage_compute(v, self.responses) for f, v in flags.items()}
        return out if len(out) > 1 else next(iter(out.values()))


class TokenIdsCoverage(_CoverageMetric):
    """Share of responses exposing token ids, ``endpoint/capabilities/{token_ids_available,
    prompt_token_ids_available}``.

    Generated-token ids come from vLLM's ``token_ids`` per choice (request ``return_token_ids``) or
    from logprob tokens written ``token_id:<int>`` (``return_tokens_as_token_ids``); prompt ids from
    ``prompt_token_ids``.

    Example:
        >>> vllm = {"object": "chat.completion", "prompt_token_ids": [151644, 872],
        ...         "choices": [{"message": {"role": "assistant", "content": "Hi"}, "token_ids": [13048, 151645]}]}
        >>> openai = {"object": "chat.completion", "choices": [{"message": {"role": "assistant", "content": "Hi"}}]}
        >>> metric = TokenIdsCoverage()
        >>> metric.update(endpoint_responses=[vllm, openai, openai, openai])
        >>> metric.compute()["endpoint/capabilities/token_ids_available"]
        tensor(0.2500, dtype=torch.float64)
    """

    flags = ("token_ids_available", "prompt_token_ids_available")
    glossary = _entry(
        "token_ids_available",
        "Whether the API exposes the integer token IDs of the response (not just text), as the share "
        "of probed responses that do (vLLM: token_ids per choice with return_token_ids, or "
        "'token_id:<int>' logprob tokens with return_tokens_as_token_ids); prompt_token_ids_available "
        "is the same for the prompt. Without ids the trainer must re-tokenize text, which can split "
        "tokens differently from the rollout and misalign the logprobs.",
        action="no OPBC action; below 1.0, rollouts are re-tokenized from text and token-level logprob "
        "comparisons can misalign (a misaligned batch is a contract failure the OPBC rejects)",
        aliases=("prompt_token_ids_available",),
    )


class SampledLogprobsCoverage(_CoverageMetric):
    """Share of responses with the logprob of each sampled token,
    ``endpoint/capabilities/sampled_logprobs_available``.

    Example:
        >>> with_lp = {"object": "text_completion", "choices": [{"text": " a", "logprobs": {
        ...     "tokens": [" a"], "token_logprobs": [-0.5], "top_logprobs": None, "text_offset": [0]}}]}
        >>> without = {"object": "text_completion", "choices": [{"text": " a", "logprobs": None}]}
        >>> metric = SampledLogprobsCoverage()
        >>> metric.update(endpoint_responses=[with_lp, without])
        >>> metric.compute()
        tensor(0.5000, dtype=torch.float64)
    """

    flags = ("sampled_logprobs_available",)
    glossary = _entry(
        "sampled_logprobs_available",
        "Whether the API returns the logprob of each sampled token (chat: logprobs.content[].logprob; "
        "completions: logprobs.token_logprobs), as the share of probed responses that do. These are the "
        "rollout_logprobs every mismatch metric and the OPBC need.",
        action="no OPBC action by itself; a rollout without sampled logprobs fails the OPBC input contract "
        "(missing rollout_logprobs), and its group is rejected",
    )


class TopLogprobsCoverage(_CoverageMetric):
    """Share of responses with the top-k alternatives at each sampled position,
    ``endpoint/capabilities/top_logprobs_available``.

    Example:
        >>> item = {"token": "Hi", "logprob": -0.1, "top_logprobs": [{"token": "Hi", "logprob": -0.1}]}
        >>> resp = {"object": "chat.completion",
        ...         "choices": [{"message": {"role": "assistant", "content": "Hi"}, "logprobs": {"content": [item]}}]}
        >>> metric = TopLogprobsCoverage()
        >>> metric.update(endpoint_responses=[resp])
        >>> metric.compute()
        tensor(1., dtype=torch.float64)
    """

    flags = ("top_logprobs_available",)
    glossary = _entry(
        "top_logprobs_available",
        "Whether the API returns the top-k alternatives at each sampled position (chat: non-empty "
        "logprobs.content[].top_logprobs; completions: logprobs.top_logprobs maps), as the share of "
        "probed responses that do. Needed for distribution-level comparisons (top-k KL, probability "
        "scatter) beyond the sampled token.",
        action="no OPBC action; without top-k only sampled-token statistics can be computed",
    )


class SeedSupportCoverage(_CoverageMetric):
    """Share of responses that honour a requested seed, ``endpoint/capabilities/{seed_supported,
    seed_requested}``.

    A response counts as ``seed_supported`` when its request set a ``seed`` and the response returned
    a ``system_fingerprint``; ``seed_requested`` is the share of requests that set one (without
    ``endpoint_requests`` none did).

    Example:
        >>> resp = {"object": "chat.completion", "system_fingerprint": "fp_44709d6fcb",
        ...         "choices": [{"message": {"role": "assistant", "content": "Hi"}}]}
        >>> metric = SeedSupportCoverage()
        >>> metric.update(endpoint_responses=[resp, resp], endpoint_requests=[{"seed": 1}, {"seed": None}])
        >>> {k: v.item() for k, v in metric.compute().items()}
        {'endpoint/capabilities/seed_supported': 0.5, 'endpoint/capabilities/seed_requested': 0.5}
    """

    flags = ("seed_supported", "seed_requested")
    glossary = _entry(
        "seed_supported",
        "Whether the API honours a generation seed and signals it back via system_fingerprint: the "
        "share of probed responses whose request set a seed and whose response returned a "
        "system_fingerprint (seed_requested: the share whose request set a seed).",
        action="no OPBC action; below seed_requested, reruns of the same request may not reproduce the "
        "rollout, so replayed groups cannot be regenerated bit-for-bit",
        aliases=("seed_requested",),
    )


class EndpointResponseCount(_CoverageMetric):
    """Number of responses probed, ``endpoint/capabilities/num_responses``: the denominator of the
    coverage fractions.

    Example:
        >>> resp = {"object": "chat.completion", "choices": [{"message": {"role": "assistant", "content": ""}}]}
        >>> metric = EndpointResponseCount()
        >>> metric.update(endpoint_responses=[resp, resp, resp])
        >>> metric.compute()
        tensor(3., dtype=torch.float64)
    """

    keys = (NUM_RESPONSES_KEY,)
    higher_is_better = plot_lower_bound = plot_upper_bound = None
    glossary = _entry("endpoint_num_responses", "Number of OpenAI-compatible responses the endpoint-capability "
                      "fractions were computed over.", action="no OPBC action; a window without a probed response has "
                      "no endpoint keys at all")

    def compute(self) -> Tensor:
        return self.responses.clone()


ENDPOINT_METRICS: tuple[type[_CoverageMetric], ...] = (
    TokenIdsCoverage, SampledLogprobsCoverage, TopLogprobsCoverage, SeedSupportCoverage, EndpointResponseCount,
)


def endpoint_section(**kwargs: Any) -> list[OPBCMetric]:
    """The ``endpoint`` section of :class:`~opbc_metrics.collection.OPBCCollection`: the coverage of each
    capability and the response count."""
    return [cls(**kwargs) for cls in ENDPOINT_METRICS]
