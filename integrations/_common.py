"""Helpers shared by the framework adapters (no framework imports)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

# The batch schema of DESIGN.md: adapters pass these names through unchanged when a trainer's batch
# already uses them.
SCHEMA_FIELDS: tuple[str, ...] = (
    "trainer_logprobs",
    "rollout_logprobs",
    "response_mask",
    "group_ids",
    "rollout_experts",
    "trainer_experts",
    "rewards",
    "advantages",
    "values",
    "returns",
    "prompt_lengths",
    "response_lengths",
    "stop_reasons",
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
    values = [numbering.setdefault(_hashable(i), len(numbering)) + offset for i in ids]
    return torch.tensor(values, dtype=torch.int64, device=device)


def _hashable(value: Any) -> Any:
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


def as_plain_mapping(obj: Any, what: str) -> Mapping[str, Any]:
    if isinstance(obj, Mapping) or (hasattr(obj, "keys") and hasattr(obj, "__getitem__")):
        return obj
    raise TypeError(f"{what} must be a mapping of tensors, got {type(obj).__name__}")
