"""Endpoint capabilities: coverage fractions of what OpenAI-compatible responses expose.

Each response is read by :func:`~opbc_metrics.endpoint.probe.probe_response` (chat and text
completions, OpenAI and vLLM formats; see that module for every flag's rule). Over a window of
responses, each flag is reported as the share of responses that have it:

=================================================  ===================================================
key                                                value (empty window: 0, "not observed")
=================================================  ===================================================
endpoint/capabilities/token_ids_available          responses exposing generated token ids / responses
endpoint/capabilities/prompt_token_ids_available   responses exposing prompt token ids / responses
endpoint/capabilities/sampled_logprobs_available   responses with each sampled token's logprob / responses
endpoint/capabilities/top_logprobs_available       responses with top-k alternatives / responses
endpoint/capabilities/seed_requested               requests that set a seed / responses
endpoint/capabilities/seed_supported               seed requested and system_fingerprint returned / responses
endpoint/capabilities/num_responses                responses probed
=================================================  ===================================================

Batch fields: ``endpoint_responses`` (a list of responses, parsed JSON or client objects) and the
optional ``endpoint_requests`` (a list of request bodies of the same length, ``None`` entries
allowed, or one request body applied to every response); without requests no seed counts as
requested.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from opbc_metrics.batch import BatchView
from opbc_metrics.functional.statistics import Stats, safe_div

if TYPE_CHECKING:
    from opbc_metrics.endpoint.probe import EndpointCapabilities

ENDPOINT_RESPONSES = "endpoint_responses"
ENDPOINT_REQUESTS = "endpoint_requests"

# The flags of opbc_metrics.endpoint.probe.EndpointCapabilities, in their reporting order.
CAPABILITY_FLAGS = (
    "token_ids_available",
    "prompt_token_ids_available",
    "sampled_logprobs_available",
    "top_logprobs_available",
    "seed_requested",
    "seed_supported",
)
CAPABILITY_PREFIX = "endpoint/capabilities/"
NUM_RESPONSES_KEY = CAPABILITY_PREFIX + "num_responses"
ENDPOINT_KEYS = (*(CAPABILITY_PREFIX + f for f in CAPABILITY_FLAGS), NUM_RESPONSES_KEY)



def capability_key(flag: str) -> str:
    """The window key of a flag.

    Example:
        >>> capability_key("seed_supported")
        'endpoint/capabilities/seed_supported'
    """
    if flag not in CAPABILITY_FLAGS:
        raise ValueError(f"unknown capability flag {flag!r}; known: {', '.join(CAPABILITY_FLAGS)}")
    return CAPABILITY_PREFIX + flag


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray, Mapping))


def probe_responses(responses: Any, requests: Any = None) -> list[EndpointCapabilities]:
    """Probe a list of responses, with their requests (a parallel list, one body for all, or ``None``).

    Raises:
        ValueError: naming ``endpoint_responses[i]`` / ``endpoint_requests`` and the bad field.
    """
    # lazy: opbc_metrics.endpoint imports this module
    from opbc_metrics.endpoint.probe import _seed_requested, probe_response

    if not _is_list(responses):
        raise ValueError(
            f"batch field `{ENDPOINT_RESPONSES}` must be a list of responses, got {type(responses).__name__}"
        )
    if requests is None or isinstance(requests, Mapping) or hasattr(requests, "model_dump"):
        per_response = [requests] * len(responses)
    elif _is_list(requests):
        if len(requests) != len(responses):
            raise ValueError(
                f"batch field `{ENDPOINT_REQUESTS}` has {len(requests)} entries but `{ENDPOINT_RESPONSES}` has "
                f"{len(responses)}"
            )
        per_response = list(requests)
    else:
        raise ValueError(
            f"batch field `{ENDPOINT_REQUESTS}` must be a list of request bodies or one request body, got "
            f"{type(requests).__name__}"
        )
    out = []
    for i, (response, request) in enumerate(zip(responses, per_response)):
        try:
            _seed_requested(request)  # a bad request body is the requests field's fault, not the response's
        except ValueError as err:
            where = f"{ENDPOINT_REQUESTS}[{i}]" if _is_list(requests) else ENDPOINT_REQUESTS
            raise ValueError(f"batch field `{where}`: {err}") from None
        try:
            out.append(probe_response(response, request))
        except ValueError as err:
            raise ValueError(f"batch field `{ENDPOINT_RESPONSES}[{i}]`: {err}") from None
    return out


def _probe_stats(caps: Sequence[EndpointCapabilities]) -> Stats:
    stats = {"responses": torch.tensor(float(len(caps)), dtype=torch.float64)}
    for flag in CAPABILITY_FLAGS:
        stats[flag] = torch.tensor(float(sum(getattr(c, flag) for c in caps)), dtype=torch.float64)
    return stats


def _endpoint_update(view: BatchView) -> Stats:
    """Counts of one batch's responses and of each flag, probed once per BatchView and shared."""

    def make() -> Stats:
        requests = view.data.get(ENDPOINT_REQUESTS)
        return _probe_stats(probe_responses(view.field(ENDPOINT_RESPONSES), requests))

    return view._cached("endpoint/probe_stats", make)


def _coverage_compute(hits: Tensor, responses: Tensor) -> Tensor:
    return safe_div(hits, responses, 0.0)


def endpoint_capabilities(responses: Sequence[Any], requests: Any = None) -> dict[str, Tensor]:
    """Every ``endpoint/capabilities/...`` key for one batch of responses (float64 tensors).

    Example:
        >>> chat = {"object": "chat.completion", "system_fingerprint": "fp_1",
        ...         "choices": [{"message": {"role": "assistant", "content": "Hi"}, "logprobs": None}]}
        >>> vllm = {"object": "text_completion", "choices": [{"text": "Hi", "token_ids": [13347],
        ...         "prompt_token_ids": [1, 2], "logprobs": {"tokens": ["Hi"], "token_logprobs": [-0.2],
        ...         "top_logprobs": [{"Hi": -0.2, "Hey": -1.9}]}}]}
        >>> out = endpoint_capabilities([chat, vllm], requests=[{"seed": 0}, {"seed": 0}])
        >>> {k.removeprefix("endpoint/capabilities/"): v.item() for k, v in out.items()}
        ... # doctest: +NORMALIZE_WHITESPACE
        {'token_ids_available': 0.5, 'prompt_token_ids_available': 0.5, 'sampled_logprobs_available': 0.5,
         'top_logprobs_available': 0.5, 'seed_requested': 1.0, 'seed_supported': 0.5, 'num_responses': 2.0}
    """
    stats = _probe_stats(probe_responses(responses, requests))
    out = {capability_key(f): _coverage_compute(stats[f], stats["responses"]) for f in CAPABILITY_FLAGS}
    out[NUM_RESPONSES_KEY] = stats["responses"]
    return out
