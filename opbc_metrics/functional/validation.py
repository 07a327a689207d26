r"""Validation ("the final exam"): per-data-source accuracy, reward, unbiased pass@k and best@k.

Validation batches are per prompt: a field ``[P, n]`` holds the ``n`` sampled responses of each of the
``P`` prompts (a ``[P]`` field means ``n = 1``), and ``data_sources`` names each prompt's source. The
fields have their own names (``val_acc``, ``val_rewards``, ``val_num_turns``, optional ``val_mask``), so
validation and training batches can share one collection without feeding each other's metrics.

Per data source ``s`` (averaged over that source's prompts, each prompt weighing the same, as verl's
``process_validation_metrics`` averages its per-prompt values):

* ``val-core/<s>/acc/mean@<n>``: mean accuracy of the ``n`` samples;
* ``val-aux/<s>/reward/mean@<n>``: mean reward of the ``n`` samples;
* ``val-aux/<s>/acc/pass@<k>``: the unbiased pass@k estimator of Chen et al. 2021 (Codex, eq. 1),
  :math:`1 - \binom{n-c}{k} / \binom{n}{k}` with ``c`` correct samples, in the numerically stable product
  form :math:`1 - \prod_{i=n-c+1}^{n} (1 - k/i)`;
* ``val-aux/<s>/reward/best@<k>``: the expected best reward of ``k`` samples drawn without replacement
  from the ``n``, exactly: with the rewards sorted :math:`v_{(1)} \ge \dots \ge v_{(n)}`,
  :math:`\sum_j v_{(j)} \binom{n-j}{k-1} / \binom{n}{k}` (verl estimates the same quantity by
  bootstrap; for 0/1 rewards it equals pass@k).

Prompts with fewer than ``k`` valid samples (a ragged ``val_mask``) are left out of the ``@k`` averages;
prompts without any valid sample are left out of everything. A source without a valid prompt in the window
has no keys, and a ``@k`` key no prompt had ``k`` valid samples for is left out (no made-up 0); the public
functions raise a ``ValueError`` on a batch without a valid sample
(:func:`~opbc_metrics.functional.statistics.require_data`), where the metrics report nothing. Non-finite values
on unmasked samples are refused: at once for host inputs, and for tensors (which cannot be read in
``update()`` without a sync) left out, counted, and raised as a ``ValueError`` naming the field at
``compute()``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from opbc_metrics.batch import BatchView, as_bool_mask, check_count, check_same_device, from_host
from opbc_metrics.functional.statistics import Stats, raise_if_invalid, require_data, safe_div
from opbc_metrics.functional.training import (
    F64,
    _amax,
    _amin,
    _f64,
    _turns_compute,
    field_tensor,
    tensor_device,
)

DATA_SOURCES = "data_sources"
VAL_ACC = "val_acc"
VAL_REWARDS = "val_rewards"
VAL_NUM_TURNS = "val_num_turns"
VAL_MASK = "val_mask"
OTHER_SOURCE = "other"
NONFINITE_SAMPLES = "non-finite values on unmasked samples"
VAL_TURN_KEYS = ("val-aux/num_turns/min", "val-aux/num_turns/max", "val-aux/num_turns/mean")


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------
def check_sources(data_sources: Sequence[str], allow_other: bool) -> tuple[str, ...]:
    """Validate the data-source names given at construction; ``other`` is appended when allowed."""
    if isinstance(data_sources, str):
        data_sources = (data_sources,)
    sources = tuple(data_sources)
    if not sources:
        raise ValueError("`data_sources` must name at least one data source")
    for s in sources:
        if not isinstance(s, str) or not s or any(not part for part in s.split("/")):
            raise ValueError(f"`data_sources` entries must be non-empty strings without empty '/' parts, got {s!r}")
    if len(set(sources)) != len(sources):
        raise ValueError(f"`data_sources` has duplicates: {sources}")
    if allow_other and OTHER_SOURCE not in sources:
        sources = (*sources, OTHER_SOURCE)
    return sources


def default_ks(n_samples: int) -> tuple[int, ...]:
    """``1, 2, 4, ...`` below ``n`` and ``n`` itself (verl's ladder of ``@k`` sizes, plus ``k = 1``).

    Example:
        >>> default_ks(1), default_ks(5), default_ks(8)
        ((1,), (1, 2, 4, 5), (1, 2, 4, 8))
    """
    ks, k = [], 1
    while k < n_samples:
        ks.append(k)
        k *= 2
    return (*ks, n_samples)


def check_ks(ks: Sequence[int] | None, n_samples: int) -> tuple[int, ...]:
    check_count("n_samples", n_samples, optional=False)
    ks = default_ks(n_samples) if ks is None else tuple(ks)
    for k in ks:
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= n_samples:
            raise ValueError(f"every k in `ks` must be an integer in [1, n_samples={n_samples}], got {k!r}")
    if len(set(ks)) != len(ks):
        raise ValueError(f"`ks` has duplicates: {ks}")
    return ks


def source_index(value: Any, sources: tuple[str, ...], allow_other: bool, num_prompts: int,
                 device: torch.device, like: str | None = None) -> Tensor:
    """Map the batch's ``data_sources`` (one string per prompt, or one string for all) to indices."""
    if isinstance(value, str):
        value = [value] * num_prompts
    if isinstance(value, Tensor) or not isinstance(value, Sequence):
        raise ValueError(
            f"batch field `{DATA_SOURCES}` must be a list of strings (one per prompt) or one string, "
            f"got {type(value).__name__}"
        )
    if len(value) != num_prompts:
        prompts = f"`{like}` has" if like else "the batch has"
        raise ValueError(f"batch field `{DATA_SOURCES}` has {len(value)} entries but {prompts} {num_prompts} prompts")
    lookup = {s: i for i, s in enumerate(sources)}
    other = lookup.get(OTHER_SOURCE) if allow_other else None
    idx = []
    for s in value:
        i = lookup.get(s, other) if isinstance(s, str) else None
        if i is None:
            raise ValueError(
                f"batch field `{DATA_SOURCES}` has unknown data source {s!r}; declared: {list(sources)} "
                "(declare it at construction, or pass allow_other=True to count it under 'other')"
            )
        idx.append(i)
    return from_host(idx, torch.long, device)


def _val_mask(view: BatchView, name: str, x: Tensor, per_prompt: bool) -> Tensor:
    """The bool ``val_mask`` for the field ``name`` of values ``x`` (all true without one); ``per_prompt``: a
    ``[P]`` mask applies to ``[P, 1]`` values."""
    if not view.has(VAL_MASK):
        return torch.ones(x.shape, dtype=torch.bool, device=x.device)
    m, _ = field_tensor(view, VAL_MASK, ndims=(1, 2), dims=("P", "n"), device=x.device)
    m = m[:, None] if per_prompt and m.ndim == 1 else m
    if m.shape != x.shape:
        raise ValueError(f"batch field `{VAL_MASK}` has shape {tuple(m.shape)} but `{name}` has {tuple(x.shape)}")
    check_same_device(VAL_MASK, m, name, x)
    return as_bool_mask(m)


def _samples(view: BatchView, name: str, n_samples: int) -> tuple[Tensor, Tensor, Tensor]:
    """A ``[P, n]`` (or ``[P]``) field as float64 ``[P, n]``, its valid mask (finite, under ``val_mask``) and
    the number of non-finite values under the mask (left out, counted for the deferred error)."""
    x, _ = field_tensor(view, name, ndims=(1, 2), dims=("P", "n"), check="finite", device=tensor_device(view, VAL_MASK))
    if x.ndim == 1:
        x = x[:, None]
    if x.shape[1] != n_samples:
        raise ValueError(
            f"batch field `{name}` has {x.shape[1]} samples per prompt (shape {tuple(x.shape)}) but the metric "
            f"was built with n_samples={n_samples}"
        )
    valid = _val_mask(view, name, x, per_prompt=True)
    x = x.to(F64)
    finite = torch.isfinite(x)
    nonfinite = (valid & ~finite).to(F64).sum()
    return torch.where(valid & finite, x, torch.zeros((), dtype=F64, device=x.device)), valid & finite, nonfinite


# ---------------------------------------------------------------------------------------------
# pass@k and best@k, per prompt
# ---------------------------------------------------------------------------------------------
def pass_at_k(n: Tensor, c: Tensor, k: int, n_max: int | None = None) -> Tensor:
    r"""Unbiased pass@k per prompt: :math:`1 - \binom{n-c}{k}/\binom{n}{k}`, product form.

    ``n``: samples per prompt, ``c``: correct ones (integer-valued tensors of the same shape). Uses
    :math:`\binom{n-c}{k}/\binom{n}{k} = \prod_{i=n-c+1}^{n} (1 - k/i)` (every factor in (0, 1) when
    ``n - c >= k``; the value is 1 when ``n - c < k``), so no factorial overflows. Prompts with ``n < k``
    get NaN: pass@k is undefined there (the metrics leave them out). ``n_max`` bounds ``n`` (the
    product's length); by default it is read from ``n`` (a host sync; the metrics pass ``n_samples``).

    Example:
        >>> import torch
        >>> pass_at_k(torch.tensor([5.0, 5.0, 5.0, 2.0]), torch.tensor([0.0, 1.0, 4.0, 1.0]), k=2)
        tensor([0.0000, 0.4000, 1.0000, 1.0000], dtype=torch.float64)
    """
    return _pass_at_k_rows(n.to(F64), c.to(F64), k, n_max)


def _pass_at_k_rows(n: Tensor, c: Tensor, k: int, n_max: int | None) -> Tensor:
    if n_max is None:
        # Functional use on host data: the largest n bounds the product's length.
        n_max = int(n.max().item()) if n.numel() else 0
    i = torch.arange(1, n_max + 1, dtype=F64, device=n.device)
    in_product = (i > (n - c)[..., None]) & (i <= n[..., None])
    factors = torch.where(in_product, 1.0 - k / i, torch.ones((), dtype=F64, device=n.device))
    fail = torch.where(n - c < k, torch.zeros_like(n), factors.prod(dim=-1))
    return torch.where(n >= k, 1.0 - fail, torch.full_like(n, float("nan")))


def best_at_k(values: Tensor, valid: Tensor, k: int) -> Tensor:
    r"""Expected max of ``k`` samples drawn without replacement, per row of ``values`` ``[P, n]``.

    With the row's ``m`` valid values sorted in decreasing order, the j-th largest (1-based) is the
    maximum of the drawn subset with probability :math:`\binom{m-j}{k-1} / \binom{m}{k}`. Rows with
    fewer than ``k`` valid values get NaN.

    Example:
        >>> import torch
        >>> v = torch.tensor([[3.0, 1.0, 2.0, 0.0]], dtype=torch.float64)
        >>> best_at_k(v, torch.ones_like(v, dtype=torch.bool), 2)  # (3*3 + 2*2 + 1*1) / 6
        tensor([2.3333], dtype=torch.float64)
    """
    values = values.to(F64)
    neg_inf = torch.full((), float("-inf"), dtype=F64, device=values.device)
    ordered = torch.sort(torch.where(valid, values, neg_inf), dim=-1, descending=True).values
    m = valid.to(F64).sum(dim=-1, keepdim=True)  # [P, 1]
    j = torch.arange(1, values.shape[-1] + 1, dtype=F64, device=values.device)  # [n]
    a = m - j  # choose k-1 out of a
    ok = (a >= k - 1) & (m >= k)
    a_safe = torch.where(ok, a, torch.full_like(a, float(k - 1)))
    m_safe = torch.where(m >= k, m, torch.full_like(m, float(k)))
    log_w = (
        torch.lgamma(a_safe + 1) - math.lgamma(k) - torch.lgamma(a_safe - k + 2)
        - (torch.lgamma(m_safe + 1) - math.lgamma(k + 1) - torch.lgamma(m_safe - k + 1))
    )
    w = torch.where(ok, log_w.exp(), torch.zeros((), dtype=F64, device=values.device))
    total = torch.where(w > 0, w * ordered, torch.zeros((), dtype=F64, device=values.device)).sum(dim=-1)
    return torch.where(m[..., 0] >= k, total, torch.full_like(total, float("nan")))


# ---------------------------------------------------------------------------------------------
# per-source accumulation
# ---------------------------------------------------------------------------------------------
def _per_source(idx: Tensor, x: Tensor, num_sources: int) -> Tensor:
    """Sum ``x`` ([P] or [P, K]) into ``[S]`` / ``[S, K]`` buckets by source index (index_add: no sync)."""
    out = torch.zeros((num_sources, *x.shape[1:]), dtype=F64, device=x.device)
    return out.index_add_(0, idx.to(x.device), x.to(F64))


def _validation_update(view: BatchView, name: str, sources: tuple[str, ...], allow_other: bool, n_samples: int,
                       ks: tuple[int, ...], mode: str) -> Stats:
    """Per-source sums for ``mean@n`` and pass@k (``mode="pass"``, correctness ``x >= 0.5``) or best@k."""
    x, valid, nonfinite = _samples(view, name, n_samples)
    num_prompts = x.shape[0]
    idx = source_index(view.field(DATA_SOURCES), sources, allow_other, num_prompts, x.device, like=name)
    n = valid.to(F64).sum(dim=1)
    has = n > 0
    prompt_mean = safe_div(x.sum(dim=1), n, 0.0)
    at_k, at_k_ok = [], []
    for k in ks:
        if mode == "pass":
            c = ((x >= 0.5) & valid).to(F64).sum(dim=1)
            v = _pass_at_k_rows(n, c, k, n_max=n_samples)
        else:
            v = best_at_k(x, valid, k)
        ok = n >= k
        at_k.append(torch.where(ok, v, torch.zeros_like(v)))
        at_k_ok.append(ok.to(F64))
    S = len(sources)
    return {
        "prompts": _per_source(idx, has.to(F64), S),
        "sum_mean": _per_source(idx, prompt_mean, S),
        "sum_at_k": _per_source(idx, torch.stack(at_k, dim=1), S),
        "prompts_at_k": _per_source(idx, torch.stack(at_k_ok, dim=1), S),
        "nonfinite": nonfinite,
    }


def validation_keys(sources: tuple[str, ...], n_samples: int, ks: tuple[int, ...], mode: str) -> tuple[str, ...]:
    keys: list[str] = []
    for s in sources:
        if mode == "pass":
            keys.append(f"val-core/{s}/acc/mean@{n_samples}")
            keys += [f"val-aux/{s}/acc/pass@{k}" for k in ks]
        else:
            keys.append(f"val-aux/{s}/reward/mean@{n_samples}")
            keys += [f"val-aux/{s}/reward/best@{k}" for k in ks]
    return tuple(keys)


def _validation_compute(prompts: Tensor, sum_mean: Tensor, sum_at_k: Tensor, prompts_at_k: Tensor,
                        sources: tuple[str, ...], n_samples: int, ks: tuple[int, ...], mode: str) -> dict[str, Tensor]:
    keys = iter(validation_keys(sources, n_samples, ks, mode))
    means = safe_div(sum_mean, prompts, 0.0)
    at_k = safe_div(sum_at_k, prompts_at_k, 0.0)
    # No made-up values: a source no prompt of the window came from (or an @k no prompt had k samples for) has
    # no key, rather than 0% accuracy. One host read of the (synced) counts, at compute time.
    seen = (torch.cat([prompts[:, None], prompts_at_k], dim=1) > 0).tolist()
    out: dict[str, Tensor] = {}
    for i in range(len(sources)):
        key = next(keys)
        if seen[i][0]:
            out[key] = means[i]
        for j in range(len(ks)):
            key = next(keys)
            if seen[i][j + 1]:
                out[key] = at_k[i, j]
    return out


def validation_accuracy(val_acc: Any, data_sources: Sequence[str] | str, ks: Sequence[int] | None = None,
                        val_mask: Tensor | None = None) -> dict[str, Tensor]:
    """``val-core/<s>/acc/mean@n`` and ``val-aux/<s>/acc/pass@k`` of one validation batch.

    ``val_acc`` is ``[P, n]`` (or ``[P]``); a sample is correct when ``acc >= 0.5``, which is the
    correctness pass@k counts (``mean@n`` averages the raw values, so fractional scores are kept there).
    A source without a valid prompt has no keys; a batch without a valid sample (none, or all masked out by
    ``val_mask``) raises a ``ValueError``.

    Example:
        >>> import torch
        >>> acc = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0]])
        >>> out = validation_accuracy(acc, ["gsm8k", "math"], ks=[1, 2])
        >>> {k: round(v.item(), 4) for k, v in out.items()}  # doctest: +NORMALIZE_WHITESPACE
        {'val-core/gsm8k/acc/mean@4': 0.25, 'val-aux/gsm8k/acc/pass@1': 0.25, 'val-aux/gsm8k/acc/pass@2': 0.5,
         'val-core/math/acc/mean@4': 0.75, 'val-aux/math/acc/pass@1': 0.75, 'val-aux/math/acc/pass@2': 1.0}
        >>> validation_accuracy(acc, ["gsm8k", "math"], val_mask=torch.zeros(2, 4))
        Traceback (most recent call last):
        ...
        ValueError: validation_accuracy(): no valid sample (not masked out by `val_mask`) in the batch, so there ...
    """
    return _validation_functional(val_acc, data_sources, ks, val_mask, VAL_ACC, "pass", "validation_accuracy")


def validation_reward(val_rewards: Any, data_sources: Sequence[str] | str, ks: Sequence[int] | None = None,
                      val_mask: Tensor | None = None) -> dict[str, Tensor]:
    """``val-aux/<s>/reward/mean@n`` and ``val-aux/<s>/reward/best@k`` of one validation batch.

    As :func:`validation_accuracy`: no keys for a source without a valid prompt, a ``ValueError`` for a batch
    without a valid sample.

    Example:
        >>> import torch
        >>> out = validation_reward(torch.tensor([[3.0, 1.0, 2.0, 0.0]]), "gsm8k", ks=[2])
        >>> {k: round(v.item(), 4) for k, v in out.items()}
        {'val-aux/gsm8k/reward/mean@4': 1.5, 'val-aux/gsm8k/reward/best@2': 2.3333}
    """
    return _validation_functional(val_rewards, data_sources, ks, val_mask, VAL_REWARDS, "best", "validation_reward")


def _validation_functional(values: Any, data_sources: Sequence[str] | str, ks: Sequence[int] | None,
                           val_mask: Tensor | None, name: str, mode: str, function: str) -> dict[str, Tensor]:
    t, _ = field_tensor(BatchView({name: values}), name, ndims=(1, 2), dims=("P", "n"))
    n_samples = 1 if t.ndim == 1 else t.shape[1]
    sources = check_sources([data_sources] if isinstance(data_sources, str) else list(dict.fromkeys(data_sources)),
                            False)
    kk = check_ks(ks, n_samples)
    view = BatchView({name: t, DATA_SOURCES: data_sources, VAL_MASK: val_mask})
    stats = _validation_update(view, name, sources, False, n_samples, kk, mode)
    raise_if_invalid(name, stats.pop("nonfinite"), NONFINITE_SAMPLES)
    require_data(stats["prompts"].sum(), function, f"valid sample (not masked out by `{VAL_MASK}`)",
                 f"`{name}` with at least one prompt and one sample of it that `{VAL_MASK}` keeps")
    return _validation_compute(**_f64(stats), sources=sources, n_samples=n_samples, ks=kk, mode=mode)


# ---------------------------------------------------------------------------------------------
# val-aux/num_turns/*
# ---------------------------------------------------------------------------------------------
def _val_turns_update(view: BatchView) -> Stats:
    x, _ = field_tensor(view, VAL_NUM_TURNS, ndims=(1, 2), dims=("P", "n"), check="nonnegative",
                        device=tensor_device(view, VAL_MASK))
    x = x.to(F64)
    valid = _val_mask(view, VAL_NUM_TURNS, x, per_prompt=False)
    ok = torch.isfinite(x) & (x >= 0)
    zero = torch.zeros((), dtype=F64, device=x.device)
    inf = torch.full((), float("inf"), dtype=F64, device=x.device)
    use = valid & ok
    return {
        "sum": torch.where(use, x, zero).sum(),
        "max": _amax(torch.where(use, x, -inf)),
        "min": _amin(torch.where(use, x, inf)),
        "count": use.to(F64).sum(),
        "invalid": (valid & ~ok).to(F64).sum(),
    }


def _val_turns_compute(sum: Tensor, max: Tensor, min: Tensor, count: Tensor, invalid: Tensor | None = None
                       ) -> dict[str, Tensor]:
    return _turns_compute(sum, max, min, count, keys=VAL_TURN_KEYS)


def validation_turns(val_num_turns: Any, val_mask: Tensor | None = None) -> dict[str, Tensor]:
    """``val-aux/num_turns/{min,max,mean}`` over validation samples; a ``ValueError`` without a valid sample.

    Example:
        >>> {k: v.item() for k, v in validation_turns([[2, 4], [1, 9]]).items()}
        {'val-aux/num_turns/min': 1.0, 'val-aux/num_turns/max': 9.0, 'val-aux/num_turns/mean': 4.0}
    """
    stats = _val_turns_update(BatchView(val_num_turns=val_num_turns, val_mask=val_mask))
    raise_if_invalid(VAL_NUM_TURNS, stats["invalid"], "negative or non-finite turn counts")
    require_data(stats["count"], "validation_turns", f"valid sample (not masked out by `{VAL_MASK}`)",
                 f"`{VAL_NUM_TURNS}` with at least one sample that `{VAL_MASK}` keeps")
    return _val_turns_compute(**_f64(stats))
