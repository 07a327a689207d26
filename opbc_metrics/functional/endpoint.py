"""Endpoint capabilities: coverage fractions of what OpenAI-compatible responses expose.

Each response is read by :func:`probe_response` (chat and text completions, OpenAI and vLLM formats;
every flag's rule is below). Over a window of responses, each flag is reported as the share of
responses that have it. A window without a response has no keys (no made-up 0), and
:func:`endpoint_capabilities` raises a ``ValueError`` for a batch without one
(:func:`~opbc_metrics.functional.statistics.require_data`).

=================================================  ===================================================
key                                                value
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

**Reading one response.** Formats read (non-streaming responses, parsed JSON or client objects with
``model_dump()``):

* OpenAI chat completions (``"object": "chat.completion"``): per choice ``message`` and ``logprobs``
  ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``;
  ``system_fingerprint`` at the top level. Specified in the OpenAI API reference, "The chat
  completion object".
* OpenAI legacy completions (``"object": "text_completion"``): per choice ``text`` and ``logprobs``
  ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``. Specified in
  the OpenAI API reference, "The completion object".
* vLLM's OpenAI-compatible server extensions (vLLM docs, "OpenAI-Compatible Server"; response models
  in ``vllm/entrypoints/openai/{chat_completion,completion}/protocol.py``): with the request's
  ``return_token_ids`` the chat response carries ``prompt_token_ids`` at the top level and each
  choice ``token_ids``; a completions choice carries both ``prompt_token_ids`` and ``token_ids``.
  With ``return_tokens_as_token_ids`` the logprob tokens are strings ``"token_id:<int>"``.

Flags, each true only when every choice of the response has it (a zero-token generation shows no
evidence, so its flags are false):

* ``token_ids_available``: the generated tokens' integer ids: a non-empty ``token_ids`` list of ints,
  or logprob tokens all of the form ``token_id:<int>``.
* ``prompt_token_ids_available``: a non-empty ``prompt_token_ids`` list of ints (top level for chat,
  per choice or top level for completions).
* ``sampled_logprobs_available``: the logprob of each sampled token: a non-empty
  ``logprobs.content`` (chat) or a ``logprobs.token_logprobs`` with at least one number (completions;
  ``null`` entries, e.g. the first echoed prompt token, are allowed).
* ``top_logprobs_available``: the top-k alternatives: every chat content item has a non-empty
  ``top_logprobs`` list; for completions ``top_logprobs`` is a non-empty list whose non-null entries
  are all non-empty ``{token: logprob}`` maps, with at least one such entry, and null only where
  ``token_logprobs`` is null (nothing sampled there: an echoed prompt token).
* ``seed_requested``: the request (when given) has a non-null integer ``seed``.
* ``seed_supported``: ``seed_requested`` and the response returned a non-empty ``system_fingerprint``.

The probe reports what a response carries, so a capability shows only when the request asked for it
(``logprobs``, ``top_logprobs``, ``return_token_ids``, ``seed``). Malformed responses (missing
``choices``, a choice without ``message``/``text``, a logprob item without ``logprob``, wrong types)
raise a ``ValueError`` naming the field's path.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from opbc_metrics.batch import BatchView
from opbc_metrics.functional.statistics import Stats, require_data, safe_div
from opbc_metrics.trajectory import as_json_object

ENDPOINT_RESPONSES = "endpoint_responses"
ENDPOINT_REQUESTS = "endpoint_requests"

# The flags of EndpointCapabilities, in their reporting order.
CAPABILITY_FLAGS = ("token_ids_available", "prompt_token_ids_available", "sampled_logprobs_available",
                    "top_logprobs_available", "seed_requested", "seed_supported")
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


CHAT_COMPLETION = "chat.completion"
TEXT_COMPLETION = "text_completion"

_TOKEN_ID_FORM = re.compile(r"token_id:-?\d+")


@dataclass(frozen=True)
class EndpointCapabilities:
    """What one response exposes; see :mod:`opbc_metrics.functional.endpoint` for each flag's rule.

    Attributes:
        api: ``"chat.completion"`` or ``"text_completion"``.
    """

    api: str
    token_ids_available: bool
    prompt_token_ids_available: bool
    sampled_logprobs_available: bool
    top_logprobs_available: bool
    seed_requested: bool
    seed_supported: bool

    def flags(self) -> dict[str, bool]:
        """The boolean flags by name, in a fixed order."""
        return {name: getattr(self, name) for name in CAPABILITY_FLAGS}


def probe_response(response: Any, request: Mapping[str, Any] | None = None) -> EndpointCapabilities:
    """Probe one OpenAI-compatible response (chat or text completion).

    Args:
        response: the parsed JSON body (a mapping) or a client object with ``model_dump()``.
        request: the request body that produced it, if known; only its ``seed`` is read.

    Raises:
        ValueError: naming the field path of a missing or wrongly typed field.

    Example:
        >>> response = {
        ...     "object": "chat.completion", "system_fingerprint": "fp_1",
        ...     "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"},
        ...                  "logprobs": {"content": [{"token": "Hi", "logprob": -0.1, "top_logprobs": []}]}}],
        ... }
        >>> caps = probe_response(response, request={"seed": 7})
        >>> caps.sampled_logprobs_available, caps.top_logprobs_available, caps.token_ids_available
        (True, False, False)
        >>> caps.seed_supported
        True
    """
    resp = _mapping(response, "response")
    choices = resp.get("choices")
    if choices is None:
        raise ValueError("response field `choices` is required but missing")
    if not _is_list(choices) or not choices:
        raise ValueError(f"response field `choices` must be a non-empty list, got {_describe(choices)}")
    api = _api(resp, choices)
    seed_requested = _seed_requested(request)
    fingerprint = resp.get("system_fingerprint")
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise ValueError(
            f"response field `system_fingerprint` must be a string or null, got {type(fingerprint).__name__}"
        )
    top_prompt_ids = _int_list(resp.get("prompt_token_ids"), "prompt_token_ids")

    token_ids = prompt_ids = sampled = top = True
    for i, raw in enumerate(choices):
        where = f"choices[{i}]"
        choice = _mapping(raw, where)
        if api == CHAT_COMPLETION:
            if choice.get("message") is None:
                raise ValueError(f"response field `{where}.message` is required but missing")
            _mapping(choice["message"], f"{where}.message")
            s, t, logprob_ids = _chat_logprobs(choice.get("logprobs"), f"{where}.logprobs")
            choice_prompt_ids = bool(top_prompt_ids)
        else:
            if not isinstance(choice.get("text"), str):
                raise ValueError(f"response field `{where}.text` must be a string, got {_describe(choice.get('text'))}")
            s, t, logprob_ids = _completion_logprobs(choice.get("logprobs"), f"{where}.logprobs")
            choice_prompt_ids = bool(_int_list(choice.get("prompt_token_ids"), f"{where}.prompt_token_ids")) or bool(
                top_prompt_ids
            )
        ids = _int_list(choice.get("token_ids"), f"{where}.token_ids")
        token_ids &= bool(ids) or logprob_ids
        prompt_ids &= choice_prompt_ids
        sampled &= s
        top &= t
    return EndpointCapabilities(api, token_ids_available=token_ids, prompt_token_ids_available=prompt_ids,
                                sampled_logprobs_available=sampled, top_logprobs_available=top,
                                seed_requested=seed_requested, seed_supported=seed_requested and bool(fingerprint))


# ---------------------------------------------------------------------------------------------
def _describe(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# (plain lists and floats first: the ABC checks are ~0.3 us each, a few per token of every response)
def _is_list(value: Any) -> bool:
    return type(value) is list or (isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)))


def _is_number(value: Any) -> bool:
    return type(value) is float or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    out = as_json_object(value)
    if out is None:
        raise ValueError(f"response field `{where}` must be a JSON object, got {_describe(value)}")
    return out


def _int_list(value: Any, where: str) -> list[int]:
    """A token-id list (``[]`` when absent); ``ValueError`` when present but not a list of ints."""
    if value is None:
        return []
    if not _is_list(value) or any(not isinstance(v, int) or isinstance(v, bool) for v in value):
        raise ValueError(f"response field `{where}` must be a list of integer token ids, got {_describe(value)}")
    return list(value)


def _api(resp: Mapping[str, Any], choices: Sequence[Any]) -> str:
    obj = resp.get("object")
    if obj in (CHAT_COMPLETION, TEXT_COMPLETION):
        return obj
    if obj is not None:
        raise ValueError(
            f"response field `object` must be {CHAT_COMPLETION!r} or {TEXT_COMPLETION!r} (a complete, "
            f"non-streaming response), got {obj!r}"
        )
    first = _mapping(choices[0], "choices[0]")
    if "message" in first:
        return CHAT_COMPLETION
    if "text" in first:
        return TEXT_COMPLETION
    raise ValueError("response field `choices[0].message` (chat) or `choices[0].text` (completions) is required")


def _seed_requested(request: Mapping[str, Any] | None) -> bool:
    if request is None:
        return False
    try:
        req = _mapping(request, "request")
    except ValueError:
        raise ValueError(f"`request` must be the request body (a JSON object), got {_describe(request)}") from None
    seed = req.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ValueError(f"request field `seed` must be an integer or null, got {type(seed).__name__}")
    return seed is not None


def _chat_logprobs(logprobs: Any, where: str) -> tuple[bool, bool, bool]:
    """``(sampled, top, token ids in the tokens)`` of a chat choice's ``logprobs``."""
    if logprobs is None:
        return False, False, False
    content = _mapping(logprobs, where).get("content")
    if content is None:
        return False, False, False
    if not _is_list(content):
        raise ValueError(f"response field `{where}.content` must be a list or null, got {_describe(content)}")
    top_all = True
    ids_all = True
    for j, raw in enumerate(content):
        item = _mapping(raw, f"{where}.content[{j}]")
        token = item.get("token")
        if not isinstance(token, str):
            raise ValueError(f"response field `{where}.content[{j}].token` must be a string, got {_describe(token)}")
        if not _is_number(item.get("logprob")):
            raise ValueError(
                f"response field `{where}.content[{j}].logprob` must be a number, got {_describe(item.get('logprob'))}"
            )
        alternatives = item.get("top_logprobs")
        if alternatives is None:
            alternatives = []
        if not _is_list(alternatives):
            raise ValueError(
                f"response field `{where}.content[{j}].top_logprobs` must be a list, got {_describe(alternatives)}"
            )
        for k, alt in enumerate(alternatives):
            alt = _mapping(alt, f"{where}.content[{j}].top_logprobs[{k}]")
            if not _is_number(alt.get("logprob")):
                raise ValueError(f"response field `{where}.content[{j}].top_logprobs[{k}].logprob` must be a number")
        top_all &= bool(alternatives)
        ids_all &= bool(_TOKEN_ID_FORM.fullmatch(token))
    present = bool(content)
    return present, present and top_all, present and ids_all


def _completion_logprobs(logprobs: Any, where: str) -> tuple[bool, bool, bool]:
    """``(sampled, top, token ids in the tokens)`` of a completions choice's ``logprobs``."""
    if logprobs is None:
        return False, False, False
    lp = _mapping(logprobs, where)
    for name in ("tokens", "token_logprobs"):
        if lp.get(name) is None:
            raise ValueError(f"response field `{where}.{name}` is required but missing")
        if not _is_list(lp[name]):
            raise ValueError(f"response field `{where}.{name}` must be a list, got {_describe(lp[name])}")
    tokens, token_logprobs = lp["tokens"], lp["token_logprobs"]
    if len(tokens) != len(token_logprobs):
        raise ValueError(
            f"response field `{where}.token_logprobs` has {len(token_logprobs)} entries but `{where}.tokens` "
            f"has {len(tokens)}"
        )
    for j, token in enumerate(tokens):
        if not isinstance(token, str):
            raise ValueError(f"response field `{where}.tokens[{j}]` must be a string, got {_describe(token)}")
    for j, value in enumerate(token_logprobs):
        if value is not None and not _is_number(value):
            raise ValueError(f"response field `{where}.token_logprobs[{j}]` must be a number or null")
    sampled = any(v is not None for v in token_logprobs)
    alternatives = lp.get("top_logprobs")
    top = False
    if alternatives is not None:
        if not _is_list(alternatives):
            raise ValueError(
                f"response field `{where}.top_logprobs` must be a list or null, got {_describe(alternatives)}"
            )
        entries = []
        for j, entry in enumerate(alternatives):
            if entry is None:  # allowed where nothing was sampled (an echoed prompt token), not at a sampled one
                if j < len(token_logprobs) and token_logprobs[j] is not None:
                    entries.append({})
                continue
            entry = _mapping(entry, f"{where}.top_logprobs[{j}]")
            if any(not _is_number(v) for v in entry.values()):
                raise ValueError(f"response field `{where}.top_logprobs[{j}]` must map tokens to numbers")
            entries.append(entry)
        top = bool(entries) and all(entries)
    ids = bool(tokens) and all(_TOKEN_ID_FORM.fullmatch(t) for t in tokens)
    return sampled, top, ids


def probe_responses(responses: Any, requests: Any = None) -> list[EndpointCapabilities]:
    """Probe a list of responses, with their requests (a parallel list, one body for all, or ``None``).

    Raises:
        ValueError: naming ``endpoint_responses[i]`` / ``endpoint_requests`` and the bad field.
    """
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
    counts = {"responses": len(caps), **{flag: sum(getattr(c, flag) for c in caps) for flag in CAPABILITY_FLAGS}}
    return {name: torch.tensor(float(n), dtype=torch.float64) for name, n in counts.items()}


def _endpoint_update(view: BatchView) -> Stats:
    """Counts of one batch's responses and of each flag, probed once per BatchView and shared."""

    def make() -> Stats:
        requests = view.data.get(ENDPOINT_REQUESTS)
        return _probe_stats(probe_responses(view.field(ENDPOINT_RESPONSES), requests))

    return view.shared("endpoint/probe_stats", make)


def _coverage_compute(hits: Tensor, responses: Tensor) -> Tensor:
    return safe_div(hits, responses, 0.0)


def endpoint_capabilities(responses: Sequence[Any], requests: Any = None) -> dict[str, Tensor]:
    """Every ``endpoint/capabilities/...`` key for one batch of responses (float64 tensors); a ``ValueError``
    for no response.

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
        >>> endpoint_capabilities([])
        Traceback (most recent call last):
        ...
        ValueError: endpoint_capabilities(): no response in the batch, so there is no value to return (a number ...
    """
    stats = _probe_stats(probe_responses(responses, requests))
    require_data(stats["responses"], "endpoint_capabilities", "response",
                 f"at least one response in `{ENDPOINT_RESPONSES}`")
    out = {capability_key(f): _coverage_compute(stats[f], stats["responses"]) for f in CAPABILITY_FLAGS}
    out[NUM_RESPONSES_KEY] = stats["responses"]
    return out
