"""Helpers shared by the framework adapters (no framework imports)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from opbc_metrics.batch import (
    PER_SEQUENCE_FIELDS,
    RESPONSE_MASK,
    ROLLOUT_LOGPROBS,
    TRAINER_LOGPROBS,
    host_floats,
)
from opbc_metrics.functional.moe import ROLLOUT_EXPERTS, TRAINER_EXPERTS

# The batch schema's fields: adapters pass them through unchanged when a trainer's batch already uses them.
SCHEMA_FIELDS: tuple[str, ...] = (
    TRAINER_LOGPROBS, ROLLOUT_LOGPROBS, RESPONSE_MASK, ROLLOUT_EXPERTS, TRAINER_EXPERTS, *PER_SEQUENCE_FIELDS,
)


def lookup(container: Any, key: str) -> Any:
    """``container[key]`` for a dict, a TensorDict or any mapping-like object; ``None`` when absent."""
    if container is None:
        return None
    try:
        if key not in container:
            return None
        return container[key]
    except (KeyError, TypeError):
        return None


def ids_to_group_ids(ids: Any, *, offset: int = 0, device: torch.device | str | None = None) -> Tensor:
    """Map per-sequence group identifiers (strings, UUIDs, ints) to dense ``int64`` group ids.

    Ids are numbered in order of first appearance, from ``offset``: deterministic for a given batch,
    equal ids get equal numbers. Integer tensors are returned as ``int64`` unchanged (plus ``offset``).

    Example:
        >>> ids_to_group_ids(["b7", "b7", "a1", "b7", "a1", "c3"])
        tensor([0, 0, 1, 0, 1, 2])
        >>> ids_to_group_ids(["x", "y"], offset=10)
        tensor([10, 11])
    """
    if isinstance(ids, Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.ndim != 1:
            raise ValueError(f"group identifiers must be a 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}")
        out = ids.to(torch.int64) + offset
        return out if device is None else out.to(device)
    if hasattr(ids, "tolist"):  # numpy arrays (object dtype for verl's uid strings)
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError(f"group identifiers must be a sequence, got {type(ids).__name__}")
    numbering: dict[Any, int] = {}
    values = [numbering.setdefault(hashable_key(i), len(numbering)) + offset for i in ids]
    return torch.tensor(values, dtype=torch.int64, device=device)


def hashable_key(value: Any) -> Any:
    """``value`` itself when it is hashable, else its ``repr`` (a dict key for any group identifier)."""
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def passthrough(*containers: Any) -> dict[str, Any]:
    """The batch-schema fields already present (and not ``None``) in any of ``containers``."""
    out: dict[str, Any] = {}
    for container in containers:
        for name in SCHEMA_FIELDS:
            value = lookup(container, name)
            if value is not None and name not in out:
                out[name] = value
    return out


def logprob_fields(container: Any, keys: tuple[str, str], missing: tuple[str, str] | None) -> dict[str, Any]:
    """``trainer_logprobs`` and ``rollout_logprobs`` read from the framework's names ``keys`` (those present).

    With ``missing`` (one message per key) both are required: an absent one raises a ``ValueError`` with its
    message. A container holding the schema field too, as another tensor, raises: neither may be dropped silently.
    """
    out: dict[str, Any] = {}
    for schema, key, message, arg in zip((TRAINER_LOGPROBS, ROLLOUT_LOGPROBS), keys, missing or (None, None),
                                         ("trainer_key", "rollout_key"), strict=True):
        value = lookup(container, key)
        explicit = lookup(container, schema) if key != schema else None
        if value is not None and explicit is not None and explicit is not value:
            raise ValueError(
                f"the batch has both `{schema}` and `{key}`, which the adapter maps to `{schema}`; drop one, or "
                f"pass {arg}={schema!r} to read `{schema}`"
            )
        if value is None and message is not None:
            raise ValueError(message)
        if value is not None:
            out[schema] = value
    return out


def as_plain_mapping(obj: Any, what: str) -> Mapping[str, Any]:
    if isinstance(obj, Mapping) or (hasattr(obj, "keys") and hasattr(obj, "__getitem__")):
        return obj
    raise TypeError(f"{what} must be a mapping of tensors, got {type(obj).__name__}")


class OPBCIntegrationWarning(UserWarning):
    """A batch the integration could not read (reported once per distinct problem, then skipped)."""


class ReportOnce:
    """Warn once per distinct problem; integrations skip the batch and training goes on."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.seen: set[str] = set()

    def __call__(self, problem: str | BaseException) -> None:
        text = f"{type(problem).__name__}: {problem}" if isinstance(problem, BaseException) else str(problem)
        if text in self.seen:
            return
        self.seen.add(text)
        warnings.warn(f"{self.where}: {text} (reported once; such batches are skipped)", OPBCIntegrationWarning,
                      stacklevel=3)


def loggable(values: Mapping[str, Any], *, logprob_window: bool = False) -> dict[str, float]:
    """``compute()`` output -> ``{key: float}`` for a trainer's logger; ``{}`` when the window had no data.

    Only the keys present are converted (a metric without data has no key, and none is filled in).
    Multi-element values (per-layer vectors) are left to loggers that take tensors. A result that holds only
    the input-accounting keys, all zero, is a window without data: nothing is logged. With
    ``logprob_window`` (a collection fed only logprob batches), a window whose synced input accounting
    counts no token and no sequence logs nothing either.
    """
    from opbc_metrics.functional.mismatch import INPUT_KEYS

    out = host_floats(values)  # one device-to-host copy, not one sync per key
    if out and set(out) <= set(INPUT_KEYS) and not any(out.values()):
        return {}
    if logprob_window and not any(out.get(k, 0.0) for k in INPUT_KEYS[1:]):  # num_tokens, num_sequences
        return {}
    return out
