"""Helpers every section's kernels share: the statistics type, safe division, deferred value errors.

This module imports no metric class and no other section, so any functional module can use it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

#: The sufficient statistics of one batch (or of a window): state name -> tensor.
Stats = dict[str, Tensor]


def safe_div(num: Tensor, den: Tensor, empty: float) -> Tensor:
    """``num / den`` where ``den > 0``, else ``empty``, with no branch on the data.

    Example:
        >>> import torch
        >>> safe_div(torch.tensor([1.0, 2.0]), torch.tensor([4.0, 0.0]), -1.0)
        tensor([ 0.2500, -1.0000])
    """
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny), torch.full_like(num, empty))


def raise_if_invalid(fields: str | Sequence[str], count: Tensor, what: str) -> None:
    """Raise the deferred ``ValueError`` for the values ``update()`` counted as invalid.

    ``update()`` cannot look at tensor values without a host sync, so it counts bad values into a state;
    ``compute()`` calls this (it reads ``count``), naming the batch field, or every field the count is
    shared by.

    Example:
        >>> import torch
        >>> raise_if_invalid("response_lengths", torch.tensor(0.0), "negative or non-finite token counts")
        >>> raise_if_invalid(("values", "returns"), torch.tensor(2.0), "non-finite values")
        Traceback (most recent call last):
        ...
        ValueError: batch fields `values`, `returns` held 2 invalid value(s) (non-finite values); fix the input
    """
    n = float(count.sum())
    if n > 0:
        names = (fields,) if isinstance(fields, str) else tuple(fields)
        where = ("batch field " if len(names) == 1 else "batch fields ") + ", ".join(f"`{x}`" for x in names)
        raise ValueError(f"{where} held {n:g} invalid value(s) ({what}); fix the input")
