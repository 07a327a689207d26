"""Read one OpenAI-compatible response and report which capabilities it exposes.

Formats read (non-streaming responses, parsed JSON or client objects with ``model_dump()``):

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
  are all non-empty ``{token: logprob}`` maps, with at least one such entry.
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

from opbc_metrics.functional.endpoint import CAPABILITY_FLAGS

CHAT_COMPLETION = "chat.completion"
TEXT_COMPLETION = "text_completion"

_TOKEN_ID_FORM = re.compile(r"token_id:-?\d+")


@dataclass(frozen=True)
class EndpointCapabilities:
    """What one response exposes; see :mod:`opbc_metrics.endpoint.probe` for each flag's rule.

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
    return EndpointCapabilities(
        api=api,
        token_ids_available=token_ids,
        prompt_token_ids_available=prompt_ids,
        sampled_logprobs_available=sampled,
        top_logprobs_available=top,
        seed_requested=seed_requested,
        seed_supported=seed_requested and bool(fingerprint),
    )


# ---------------------------------------------------------------------------------------------
def _describe(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if isinstance(value, Mapping):
        return value
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        out = dump()
        if isinstance(out, Mapping):
            return out
    raise ValueError(f"response field `{where}` must be a JSON object, got {_describe(value)}")


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
            if entry is None:
                continue
            entry = _mapping(entry, f"{where}.top_logprobs[{j}]")
            if any(not _is_number(v) for v in entry.values()):
                raise ValueError(f"response field `{where}.top_logprobs[{j}]` must map tokens to numbers")
            entries.append(entry)
        top = bool(entries) and all(entries)
    ids = bool(tokens) and all(_TOKEN_ID_FORM.fullmatch(t) for t in tokens)
    return sampled, top, ids
