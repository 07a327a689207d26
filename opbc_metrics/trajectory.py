"""The trajectory data model: assistant steps with content and tool calls, a final answer, a reason to stop.

A :class:`Trajectory` is what an agent did on one task: the ordered assistant steps (each step is one
assistant message: its text ``content`` and the :class:`ToolCall` s it made), the final answer, and
the terminal reason (``"stop"``, ``"length"``, ``"max_turns"``, ... as the caller's harness names it).
Tool results, user and system messages are the environment, not the agent's actions, so they are
not steps.

:meth:`Trajectory.from_messages` builds one from an OpenAI-style chat message list (roles
``system``/``developer``/``user``/``assistant``/``tool``/``function``; assistant ``tool_calls`` with
``function.name`` and JSON-string ``function.arguments``; the legacy ``function_call`` field).

Tool-call arguments are kept in canonical form, so that two calls with the same arguments written
differently (key order, spacing) compare equal:

* valid JSON (a string, or an already parsed value such as a ``dict``) is canonicalised as
  ``json.dumps(value, sort_keys=True, separators=(",", ":"))`` (ASCII-escaped; numbers as Python's
  ``json`` parses them, so ``1`` and ``1.0`` differ);
* ``None`` and an empty or whitespace-only string mean "no arguments" and canonicalise to ``{}``;
* malformed JSON is not an error, since a model can emit it: the call keeps the raw text with the
  surrounding whitespace stripped and is marked ``malformed``. Two malformed calls are equal exactly
  when their stripped raw texts are equal, and a malformed call never equals a well-formed one
  (a canonical JSON text is valid JSON, a malformed text is not).

:attr:`ToolCall.arguments_hash` is the SHA-256 hex digest of that canonical text (UTF-8), stable
across processes and machines, unlike Python's salted ``hash()``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

# Roles that are the environment's turns, not the agent's steps.
ENVIRONMENT_ROLES = frozenset({"system", "developer", "user", "tool", "function", "ipython"})


def canonical_json(value: Any) -> str:
    """The canonical JSON text of a parsed value: sorted keys, compact separators, ASCII-escaped.

    Example:
        >>> canonical_json({"b": [1, 2], "a": "é"})
        '{"a":"\\\\u00e9","b":[1,2]}'
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def canonical_arguments(arguments: Any) -> tuple[str, bool]:
    """``(canonical text, malformed)`` for tool-call arguments (a JSON string or a parsed value).

    Example:
        >>> canonical_arguments('{"q": "x",  "k": 3}')
        ('{"k":3,"q":"x"}', False)
        >>> canonical_arguments('{"q": "x"')
        ('{"q": "x"', True)
        >>> canonical_arguments(None), canonical_arguments("  ")
        (('{}', False), ('{}', False))
    """
    if arguments is None:
        return "{}", False
    if isinstance(arguments, (bytes, bytearray)):
        arguments = bytes(arguments).decode("utf-8", errors="surrogateescape")
    if isinstance(arguments, str):
        text = arguments.strip()
        if not text:
            return "{}", False
        try:
            return canonical_json(json.loads(text)), False
        except (ValueError, RecursionError):
            return text, True
    try:
        return canonical_json(arguments), False
    except (TypeError, ValueError, RecursionError) as err:  # RecursionError: nested past the recursion limit
        raise ValueError(
            f"tool-call field `arguments` must be a JSON string or a JSON-serialisable value, got "
            f"{type(arguments).__name__}: {err}"
        ) from None


def arguments_digest(canonical: str) -> str:
    """SHA-256 hex digest of a canonical argument text (UTF-8; lone surrogates passed through).

    Example:
        >>> arguments_digest("{}")[:16]
        '44136fa355b3678a'
    """
    return hashlib.sha256(canonical.encode("utf-8", errors="surrogatepass")).hexdigest()


@dataclass(frozen=True)
class ToolCall:
    """One tool invocation: the tool's name and its arguments in canonical form.

    Args:
        name: the tool (function) name.
        arguments: a JSON string as in OpenAI messages, an already parsed JSON value, or ``None``
            (no arguments). Stored canonicalised; see the module docstring for malformed JSON.

    Attributes:
        malformed: whether ``arguments`` was not valid JSON (then it holds the stripped raw text).

    Example:
        >>> a = ToolCall("search", '{"q": "cats", "k": 3}')
        >>> b = ToolCall("search", {"k": 3, "q": "cats"})
        >>> a == b, a.arguments, a.malformed
        (True, '{"k":3,"q":"cats"}', False)
        >>> ToolCall("search", '{"q": ').malformed
        True
    """

    name: str
    arguments: Any = None
    malformed: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"tool-call field `name` must be a string, got {type(self.name).__name__}")
        text, malformed = canonical_arguments(self.arguments)
        object.__setattr__(self, "arguments", text)
        object.__setattr__(self, "malformed", malformed)

    # (cached in the frozen dataclass's instance dict: a trajectory compared again, or read by several collections,
    # hashes its arguments once)
    @cached_property
    def arguments_hash(self) -> str:
        """SHA-256 hex digest of the canonical arguments."""
        return arguments_digest(self.arguments)

    @cached_property
    def key(self) -> tuple[str, str]:
        """``(name, arguments_hash)``: the identity used by ``tool_call_jaccard``."""
        return (self.name, self.arguments_hash)


@dataclass(frozen=True)
class Step:
    """One assistant step: its text content and the tool calls it made, in order.

    Args:
        content: the assistant text (``None`` is stored as ``""``).
        tool_calls: :class:`ToolCall` s, or ``(name, arguments)`` pairs.

    Example:
        >>> Step("let me look", [("search", '{"q": "x"}')]).tool_names
        ('search',)
    """

    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()

    def __post_init__(self) -> None:
        content = "" if self.content is None else self.content
        if not isinstance(content, str):
            raise ValueError(f"step field `content` must be a string or None, got {type(content).__name__}")
        if isinstance(self.tool_calls, (str, bytes)) or not isinstance(self.tool_calls, Sequence):
            raise ValueError(
                f"step field `tool_calls` must be a sequence of ToolCall, got {type(self.tool_calls).__name__}"
            )
        calls = []
        for i, call in enumerate(self.tool_calls):
            if isinstance(call, ToolCall):
                calls.append(call)
            elif isinstance(call, (tuple, list)) and len(call) == 2:
                calls.append(ToolCall(call[0], call[1]))
            else:
                raise ValueError(
                    f"step field `tool_calls[{i}]` must be a ToolCall or a (name, arguments) pair, "
                    f"got {type(call).__name__}"
                )
        object.__setattr__(self, "content", content)
        object.__setattr__(self, "tool_calls", tuple(calls))

    @cached_property
    def tool_names(self) -> tuple[str, ...]:
        """The names of the tools called, in order."""
        return tuple(c.name for c in self.tool_calls)


@dataclass(frozen=True)
class Trajectory:
    """An agent's trajectory on one task: assistant steps, final answer, terminal reason.

    Args:
        steps: the assistant steps, in order (at least one; a ``ValueError`` otherwise).
        final_answer: the final assistant answer; ``None`` when the agent gave none (it is compared
            as the empty string by ``answer_match``).
        terminal_reason: why the trajectory ended, as the harness reports it (kept as metadata).

    Example:
        >>> traj = Trajectory.from_messages([
        ...     {"role": "user", "content": "2+2?"},
        ...     {"role": "assistant", "content": None, "tool_calls": [
        ...         {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"x": "2+2"}'}}]},
        ...     {"role": "tool", "tool_call_id": "c1", "content": "4"},
        ...     {"role": "assistant", "content": "It is 4."},
        ... ], terminal_reason="stop")
        >>> len(traj.steps), traj.steps[0].tool_names, traj.final_answer
        (2, ('calc',), 'It is 4.')
    """

    steps: tuple[Step, ...]
    final_answer: str | None = None
    terminal_reason: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.steps, (str, bytes)) or not isinstance(self.steps, Sequence):
            raise ValueError(f"trajectory field `steps` must be a sequence of Step, got {type(self.steps).__name__}")
        steps = tuple(self.steps)
        if not steps:
            raise ValueError("trajectory field `steps` is empty: a trajectory needs at least one assistant step")
        for i, step in enumerate(steps):
            if not isinstance(step, Step):
                raise ValueError(f"trajectory field `steps[{i}]` must be a Step, got {type(step).__name__}")
        for name in ("final_answer", "terminal_reason"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"trajectory field `{name}` must be a string or None, got {type(value).__name__}")
        object.__setattr__(self, "steps", steps)

    @classmethod
    def from_messages(cls, messages: Sequence[Any], *, final_answer: str | None = None,
                      terminal_reason: str | None = None) -> Trajectory:
        """Build a trajectory from an OpenAI-style chat message list.

        Every ``assistant`` message is one step. Its ``content`` may be a string, ``None`` or a list of
        content parts (their ``text``/``refusal`` strings are concatenated); ``tool_calls`` entries
        need ``function.name`` and ``function.arguments`` (a JSON string; malformed JSON is kept as
        described in the module docstring); a legacy ``function_call`` counts as one tool call after
        them. Other assistant fields (``reasoning_content``, ``refusal``, ``audio``) are ignored.
        Messages of other roles are skipped. Messages may be mappings or objects with
        ``model_dump()`` (OpenAI / pydantic client objects).

        Args:
            messages: the chat messages, prompt included or not.
            final_answer: overrides the default final answer, which is the content of the last
                assistant message when that message calls no tool, else ``None``.
            terminal_reason: stored as is.

        Raises:
            ValueError: naming the offending field, for a message without a known ``role``, a tool
                call without ``function.name``, wrong types, or no assistant message at all.
        """
        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
            raise ValueError(f"`messages` must be a list of chat messages, got {type(messages).__name__}")
        steps: list[Step] = []
        for i, raw in enumerate(messages):
            msg = _as_mapping(raw, f"messages[{i}]")
            role = msg.get("role")
            if role == "assistant":
                steps.append(_assistant_step(msg, f"messages[{i}]"))
            elif role not in ENVIRONMENT_ROLES:
                raise ValueError(
                    f"field `messages[{i}].role` must be one of assistant, {', '.join(sorted(ENVIRONMENT_ROLES))}; "
                    f"got {role!r}"
                )
        if not steps:
            raise ValueError("`messages` holds no assistant message, so the trajectory has no steps")
        if final_answer is None and not steps[-1].tool_calls:
            final_answer = steps[-1].content
        return cls(tuple(steps), final_answer=final_answer, terminal_reason=terminal_reason)


def as_trajectory(value: Any, where: str = "trajectory") -> Trajectory:
    """A :class:`Trajectory` from a trajectory or a chat message list; ``ValueError`` naming ``where``.

    Example:
        >>> as_trajectory([{"role": "assistant", "content": "hi"}], "pair[0]").final_answer
        'hi'
    """
    if isinstance(value, Trajectory):
        return value
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise ValueError(
            f"field `{where}` must be a Trajectory or a list of chat messages, got {type(value).__name__}"
        )
    try:
        return Trajectory.from_messages(value)
    except ValueError as err:
        raise ValueError(f"field `{where}`: {err}") from None


def as_json_object(value: Any) -> Mapping[str, Any] | None:
    """A parsed JSON object: a mapping, or a client object's ``model_dump()`` (OpenAI / pydantic); else None.

    Example:
        >>> as_json_object({"role": "user"}), as_json_object("text")
        ({'role': 'user'}, None)
    """
    if type(value) is dict or isinstance(value, Mapping):  # (plain dicts first: an ABC check is ~0.3 us)
        return value
    dump = getattr(value, "model_dump", None)
    out = dump() if callable(dump) else None
    return out if isinstance(out, Mapping) else None


def _as_mapping(raw: Any, where: str) -> Mapping[str, Any]:
    out = as_json_object(raw)
    if out is None:
        raise ValueError(f"field `{where}` must be a mapping (a chat message), got {type(raw).__name__}")
    return out


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        parts = []
        for j, part in enumerate(content):
            part = _as_mapping(part, f"{where}[{j}]")
            text = part.get("text", part.get("refusal"))
            if not isinstance(text, str):
                raise ValueError(f"field `{where}[{j}]` is a content part without a `text` or `refusal` string")
            parts.append(text)
        return "".join(parts)
    raise ValueError(f"field `{where}` must be a string, None or a list of content parts, got {type(content).__name__}")


def _function_call(fn: Any, where: str) -> ToolCall:
    fn = _as_mapping(fn, where)
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"field `{where}.name` must be a non-empty string, got {name!r}")
    try:
        return ToolCall(name, fn.get("arguments"))
    except ValueError as err:
        raise ValueError(f"field `{where}.arguments`: {err}") from None


def _assistant_step(msg: Mapping[str, Any], where: str) -> Step:
    content = _content_text(msg.get("content"), f"{where}.content")
    raw_calls = msg.get("tool_calls")
    calls: list[ToolCall] = []
    if raw_calls is not None:
        if isinstance(raw_calls, (str, bytes, Mapping)) or not isinstance(raw_calls, Sequence):
            raise ValueError(f"field `{where}.tool_calls` must be a list, got {type(raw_calls).__name__}")
        for j, raw in enumerate(raw_calls):
            call = _as_mapping(raw, f"{where}.tool_calls[{j}]")
            if call.get("function") is None:
                raise ValueError(f"field `{where}.tool_calls[{j}].function` is required but missing")
            calls.append(_function_call(call["function"], f"{where}.tool_calls[{j}].function"))
    if msg.get("function_call") is not None:
        calls.append(_function_call(msg["function_call"], f"{where}.function_call"))
    return Step(content, tuple(calls))
