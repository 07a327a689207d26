"""Helpers every section's kernels share: the statistics type, safe division, deferred value errors, the
public functions' error for a batch without data.

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
    # (a Python scalar for ``empty``: one op fewer than a filled tensor, a kernel launch on a GPU; no clamp of
    # ``den``: where it is 0 the quotient's inf or NaN is not selected. compute() is ~45 of these, Python-bound.)
    return torch.where(den > 0, num / den, empty)


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


def require_data(count: Tensor | float, function: str, missing: str, what_to_pass: str, at_least: int = 1) -> None:
    """A public function's ``ValueError`` for a batch without the data its value needs: ``count`` below
    ``at_least`` (1, or 2 for a sample variance: one value has none).

    Every section's public functions raise it alike, naming themselves, what the batch lacks and what to pass:
    a number returned there (a rate 0, an ESS 1) would be made up. One host read of ``count``: a function may
    read one; a metric's ``update()`` never does (its ``compute()`` leaves the keys out instead).

    Example:
        >>> import torch
        >>> require_data(torch.tensor(2.0), "group_gini", "group", "at least one value")
        >>> require_data(torch.tensor(0.0), "group_gini", "group", "at least one value")
        Traceback (most recent call last):
        ...
        ValueError: group_gini(): no group in the batch, so there is no value to return (a number would be made up)...
        >>> require_data(1, "explained_variance", "valid token", "two or more", at_least=2)
        Traceback (most recent call last):
        ...
        ValueError: explained_variance(): 1 valid token in the batch, it needs at least 2, so there is no value...
    """
    n = float(count)
    if not n >= at_least:
        have = f"no {missing} in the batch" if n == 0 else f"{n:g} {missing} in the batch, it needs at least {at_least}"
        raise ValueError(
            f"{function}(): {have}, so there is no value to return (a number would be made up); pass {what_to_pass}"
        )


# ---------------------------------------------------------------------------------------------
# moments: count, mean, standard deviation, min, max from mergeable sums
# ---------------------------------------------------------------------------------------------
#: Scale of the second set of sums, used where the plain sums overflow (values beyond ~1e154): with
#: |x| up to the float64 limit, (x * 2^-600)^2 <= 1e255, so those sums stay finite for any realistic count.
SCALE = 2.0**-600
#: A variance below this fraction of E[x^2] is under the rounding resolution of the raw moments (a few ulps
#: of E[x^2]) and reads as 0, so a constant quantity has std exactly 0.
VARIANCE_RESOLUTION = 1e-13


def moments(x: Tensor, valid: Tensor) -> Stats:
    """Sufficient statistics of float64 ``x`` over ``valid``, reduced over the first dimension.

    ``count``, ``sum``, ``sum_sq``, the same sums of ``x * 2^-600`` (``sum_hi``, ``sum_sq_hi``, finite for
    values up to the float64 limit) and ``min``/``max`` (+inf/-inf without data). Each merges by sum,
    min or max, so the statistics of a window are exact whatever the split into batches and ranks.

    Example:
        >>> import torch
        >>> m = moments(torch.tensor([1.0, 2.0, 9.0], dtype=torch.float64), torch.tensor([True, True, False]))
        >>> [m[k].item() for k in ("count", "sum", "sum_sq", "min", "max")]
        [2.0, 3.0, 5.0, 1.0, 2.0]
    """
    inf = torch.full(x.shape[1:], float("inf"), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        lo, hi = inf, -inf
    else:
        lo = torch.where(valid, x, inf).amin(dim=0)
        hi = torch.where(valid, x, -inf).amax(dim=0)
    xv = torch.where(valid, x, 0.0)
    xs = xv * SCALE
    return {"count": valid.to(torch.float64).sum(dim=0), "sum": xv.sum(dim=0), "sum_sq": (xv * xv).sum(dim=0),
            "sum_hi": xs.sum(dim=0), "sum_sq_hi": (xs * xs).sum(dim=0), "min": lo, "max": hi}


def variance(total: Tensor, total_sq: Tensor, count: Tensor, ddof: int = 0) -> Tensor:
    """``(E[x^2] - E[x]^2) n / (n - ddof)`` from raw moments (0 under :data:`VARIANCE_RESOLUTION`, or empty)."""
    n = count.clamp_min(1.0)
    mean, second = total / n, total_sq / n
    var = second - mean * mean
    return torch.where(var > VARIANCE_RESOLUTION * second, var, 0.0) * (n / (n - ddof).clamp_min(1.0))


def mean_std(count: Tensor, total: Tensor, total_sq: Tensor, total_hi: Tensor, total_sq_hi: Tensor, lo: Tensor,
             hi: Tensor, ddof: int) -> tuple[Tensor, Tensor]:
    """``(mean, std)`` of :func:`moments` statistics; 0 each over an empty window.

    From the plain sums, or from the 2^-600-scaled ones (then rescaled) where a plain sum overflowed, so
    finite values give finite statistics. ``ddof`` 0 is the population std, 1 the sample std (NaN for fewer
    than two values). The mean is kept in ``[lo, hi]`` (the data's min and max) against rounding. From raw sums
    (mergeable by addition across batches and ranks) the std keeps about ``16 - 2 log10(|mean| / std)`` digits:
    values sharing an offset above ~1e7 times their spread (unix timestamps) read a std of 0 or noise.

    Example:
        >>> import torch
        >>> m = moments(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64), torch.ones(4, dtype=torch.bool))
        >>> [round(v.item(), 4) for d in (0, 1) for v in mean_std(m["count"], m["sum"], m["sum_sq"],
        ...     m["sum_hi"], m["sum_sq_hi"], m["min"], m["max"], ddof=d)]
        [2.5, 1.118, 2.5, 1.291]
    """
    big = ~(torch.isfinite(total) & torch.isfinite(total_sq))
    scale = torch.where(big, torch.full_like(total, 1.0 / SCALE), torch.ones_like(total))
    mean = torch.where(big, total_hi, total) / count.clamp_min(1.0) * scale
    mean = torch.where(count > 0, torch.minimum(torch.maximum(mean, lo), hi), torch.zeros_like(mean))
    var = torch.where(big, variance(total_hi, total_sq_hi, count, ddof), variance(total, total_sq, count, ddof))
    std = var.sqrt() * scale
    return mean, torch.where(count > ddof, std, torch.full_like(std, float("nan") if ddof else 0.0))


def bin_counts(values: Tensor, weights: Tensor, inner_edges: Tensor, right: bool = False) -> Tensor:
    """Weighted float64 counts of ``values`` in the fixed bins cut by the sorted ``inner_edges``.

    ``len(inner_edges) + 1`` bins, the outer two open-ended (nothing is dropped); a bin is ``(lo, hi]``, or
    ``[lo, hi)`` with ``right``. Fixed size and no host sync, so counts merge by sum. Give non-finite values
    weight 0.

    Example:
        >>> import torch
        >>> v, w = torch.tensor([-3.0, 0.0, 0.5, 9.0]), torch.ones(4)
        >>> edges = torch.tensor([-1.0, 0.0, 1.0])
        >>> bin_counts(v, w, edges).tolist(), bin_counts(v, w, edges, right=True).tolist()
        ([1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 2.0, 1.0])
    """
    idx = torch.bucketize(values.reshape(-1), inner_edges.to(values.device, values.dtype), right=right)
    counts = torch.zeros(inner_edges.numel() + 1, dtype=torch.float64, device=values.device)
    return counts.index_add_(0, idx, weights.reshape(-1).to(torch.float64))
