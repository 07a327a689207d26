r"""Training dynamics (the training-metrics glossary): pure functions over one batch.

Actor (``actor/*``), critic and reward statistics (``critic/*``), lengths and turns
(``response_length/*``, ``prompt_length/*``, ``response/aborted_ratio``, ``num_turns/*``), DPO
(``loss/dpo``, ``rewards/*``) and reward-model training (``rm/*``). Validation lives in
:mod:`opbc_metrics.functional.validation`; load balance, timing and MFU in
:mod:`opbc_metrics.functional.perf`.

As in :mod:`opbc_metrics.functional.mismatch`, each metric is a pair ``_x_update(view, ...) -> dict of
sufficient statistics`` and ``_x_compute(**stats) -> value``; the stateful classes in
:mod:`opbc_metrics.training` sum (or max/min) the statistics over updates and ranks and call the same
``_x_compute``, so the functional value of one batch equals the class value after one update.

**Bad values inside tensors.** Shapes, dtypes and types are checked at once (host metadata). Values
cannot be checked inside ``update()`` without a host-device sync, so for tensor inputs the offending
entries (negative lengths, NaN/inf values on response tokens) are excluded from the statistics and
*counted*; ``compute()`` then raises a ``ValueError`` naming the batch field and the count. Inputs
given as Python lists or NumPy arrays live on the host already and are checked in ``update()``.

**No made-up values.** The ``_x_compute`` steps return 0 over an empty window (nothing valid seen) for every
mean, extreme, ratio and standard deviation, and ``critic/vf_explained_var`` 0 (1 with one token). Nothing reports
it: the stateful classes have no keys then, and the public functions below raise a ``ValueError`` on a batch
without a valid value (:func:`~opbc_metrics.functional.statistics.require_data`), :func:`explained_variance` on
one with fewer than two valid tokens (its sample variances need two).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from opbc_metrics.batch import (
    PROBABILITY_TOLERANCE,
    RESPONSE_MASK,
    BatchView,
    as_bool_mask,
    check_same_device,
    check_same_shape,
    from_host,
)
from opbc_metrics.functional.statistics import (
    SCALE,
    Stats,
    mean_std,
    moments,
    raise_if_invalid,
    require_data,
    safe_div,
    variance,
)

F64 = torch.float64

# Batch fields of this section (beyond the core schema of opbc_metrics.batch).
POLICY_LOGPROBS = "policy_logprobs"  # [B, T] log pi_theta(token) of the policy being updated
OLD_LOGPROBS = "old_logprobs"  # [B, T] log pi_old(token), the policy the PPO ratio is taken against
PPO_LOGPROB_FIELDS = (POLICY_LOGPROBS, OLD_LOGPROBS)
ADVANTAGES = "advantages"
VALUES = "values"
RETURNS = "returns"
REWARDS = "rewards"
SCORES = "scores"
ENTROPIES = "entropies"
LOGITS = "logits"
PROMPT_LENGTHS = "prompt_lengths"
RESPONSE_LENGTHS = "response_lengths"
NUM_TURNS = "num_turns"
LOSS_TOKENS = "loss_tokens"

DEFAULT_RATIO_CLAMP = 20.0  # verl clamps log(pi/pi_old) to [-20, 20] before exp
DEFAULT_CLIP_RATIO = 0.2
DEFAULT_CLIP_RATIO_C = 3.0
DEFAULT_DPO_BETA = 0.1


# input helpers (shared by the training, validation and perf modules)
def _f64(stats: Stats) -> Stats:
    return {k: v.to(F64) for k, v in stats.items()}


def _amax(x: Tensor) -> Tensor:
    """Max over all elements; -inf for an empty tensor."""
    return x.amax() if x.numel() else torch.full((), float("-inf"), dtype=x.dtype, device=x.device)


def _amin(x: Tensor) -> Tensor:
    """Min over all elements; +inf for an empty tensor."""
    return x.amin() if x.numel() else torch.full((), float("inf"), dtype=x.dtype, device=x.device)


def tensor_device(view: BatchView, *names: str) -> torch.device | None:
    """The device of the first of ``names`` that the batch gives as a tensor: where host values (lists,
    numbers) of a related field go, so that a mix of host values and device tensors works without a sync."""
    for name in names:
        value = view.data.get(name)
        if isinstance(value, Tensor):
            return value.device
    return None


def field_tensor(view: BatchView, name: str, *, ndims: Sequence[int] = (1,), dims: Sequence[str] = ("B", "T", "V"),
                 device: torch.device | None = None, check: str | None = None) -> tuple[Tensor, bool]:
    """Batch field ``name`` as a tensor of rank in ``ndims`` (a clear error if it is missing).

    Returns ``(tensor, on_host)``: ``on_host`` is True when the value arrived as a Python number, list or
    NumPy array; such values are checked at once (``check="finite"``: no NaN/inf; ``"nonnegative"``:
    also no negative value), since that needs no device sync. Tensors are returned as they are (booleans
    included); host values become float64 tensors on ``device``.
    """
    value = view.field(name)
    on_host = not isinstance(value, Tensor)
    if on_host:
        try:
            arr = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            kind = type(value).__name__
            raise ValueError(f"batch field `{name}` must be a tensor or numeric array, got {kind}") from exc
        if check is not None and not np.isfinite(arr).all():
            raise ValueError(f"batch field `{name}` contains NaN or infinite values")
        if check == "nonnegative" and (arr < 0).any():
            raise ValueError(f"batch field `{name}` contains negative values (min {arr.min():g})")
        t = from_host(arr, F64, device)
    else:
        t = value
        if t.is_complex():
            raise ValueError(f"batch field `{name}` must be real-valued, got {t.dtype}")
    if t.ndim not in ndims:
        shapes = " or ".join(f"[{', '.join(dims[:n])}]" if n else "a scalar" for n in ndims)
        raise ValueError(f"batch field `{name}` must have shape {shapes}, got {tuple(t.shape)}")
    return t, on_host


def response_mask_for(view: BatchView, shape: torch.Size, device: torch.device, *, like: str) -> Tensor:
    """``response_mask`` as bool of ``shape`` (all ones when absent); errors name both fields."""
    mask = view.data.get(RESPONSE_MASK)
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if not isinstance(mask, Tensor):
        raise ValueError(f"batch field `{RESPONSE_MASK}` must be a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != shape:
        raise ValueError(f"batch field `{RESPONSE_MASK}` has shape {tuple(mask.shape)} but `{like}` has shape "
                         f"{tuple(shape)}")
    if mask.is_complex():
        raise ValueError(f"batch field `{RESPONSE_MASK}` must be bool, integer or float, got {mask.dtype}")
    if mask.device != device:
        raise ValueError(f"batch field `{RESPONSE_MASK}` is on {mask.device} but `{like}` is on {device}")
    return as_bool_mask(mask)


def _zero(device: torch.device) -> Tensor:
    return torch.zeros((), dtype=F64, device=device)


def _masked_moments(x: Tensor, valid: Tensor, scaled: bool = False) -> Stats:
    """:func:`~opbc_metrics.functional.statistics.moments` of every element of ``x`` (float64) over ``valid``;
    the 2^-600-scaled sums only with ``scaled``."""
    out = moments(x.reshape(-1), valid.reshape(-1))
    if not scaled:
        del out["sum_hi"], out["sum_sq_hi"]
    return out


def _one_batch(compute: Callable[..., Any], stats: Stats, fields: str | Sequence[str], what: str, *args: Any,
               need: tuple[str, str, str], count: str = "count", at_least: int = 1) -> Any:
    """A public function's value: ``compute(*args, **stats)`` of one batch, after raising on the bad values the
    batch's ``nonfinite`` (or ``invalid``) count holds, on its ``positive`` logprob count where it has one (the
    metric classes raise at ``compute()`` instead), and when its ``count`` is below ``at_least``: ``need`` is
    ``(function, what the batch lacks, what to pass)`` of
    :func:`~opbc_metrics.functional.statistics.require_data` (the metric classes leave the keys out instead)."""
    raise_if_invalid(fields, stats["nonfinite" if "nonfinite" in stats else "invalid"], what)
    stats = dict(stats)
    positive = stats.pop("positive", None)
    if positive is not None:
        raise_if_invalid(PPO_LOGPROB_FIELDS, positive, POSITIVE_LOGPROBS)
    require_data(stats[count], *need, at_least=at_least)
    return compute(*args, **_f64(stats))


def _tokens_needed(function: str, fields: str, at_least: int = 1) -> tuple[str, str, str]:
    """``need`` of :func:`_one_batch` for a function over the response tokens of ``fields``."""
    tokens = "a response token" if at_least == 1 else f"{at_least} or more response tokens"
    return (function, f"valid token (response_mask = 1 and finite {fields})",
            f"a batch with {tokens} (`response_mask` 1, not all masked out) whose {fields} are finite")


# The deferred error of the PPO metrics for logprobs above 0 (PROBABILITY_TOLERANCE passes as rounding).
POSITIVE_LOGPROBS = ("logprobs above 0 on response tokens: log-probabilities are <= 0, these look like probabilities "
                     "or logits; pass the log-probability of each sampled token, e.g. torch.log(p)")


def _positive_count(new: Tensor, old: Tensor, valid: Tensor) -> Tensor:
    """Valid tokens where either side's logprob is above :data:`~opbc_metrics.batch.PROBABILITY_TOLERANCE`."""
    return (((new > PROBABILITY_TOLERANCE) | (old > PROBABILITY_TOLERANCE)) & valid).to(F64).sum()


def _mean(total: Tensor, count: Tensor) -> Tensor:
    return safe_div(total, count, 0.0)


def _extreme(value: Tensor, count: Tensor) -> Tensor:
    return torch.where(count > 0, value, torch.zeros_like(value))


# scalars the trainer passes in (losses, grad norms, learning rates)
def _scalar_update(view: BatchView, name: str, weight_field: str | None, device: torch.device | None) -> Stats:
    """Observations of a trainer scalar: a number, a 0-d tensor, or a list/1-D tensor (one per micro-batch).

    With ``weight_field`` present in the batch (e.g. ``loss_tokens``), each observation is weighted by it.
    """
    x, _ = field_tensor(view, name, ndims=(0, 1), dims=("N",), device=device, check="finite")
    x = x.reshape(-1).to(F64)
    if weight_field is not None and view.has(weight_field):
        w, _ = field_tensor(view, weight_field, ndims=(0, 1), dims=("N",), device=x.device, check="nonnegative")
        check_same_device(weight_field, w, name, x)
        w = w.reshape(-1).to(dtype=F64)
        if w.numel() != x.numel():
            raise ValueError(f"batch field `{weight_field}` has {w.numel()} values but `{name}` has {x.numel()}; "
                             "give one weight per observation")
    else:
        w = torch.ones_like(x)
    # Tensor observations cannot be checked without a sync: non-finite ones (or non-finite / negative
    # weights) are left out and counted; the metric raises at compute().
    ok = torch.isfinite(x) & torch.isfinite(w) & (w >= 0)
    x, w = torch.where(ok, x, _zero(x.device)), torch.where(ok, w, _zero(x.device))
    return {"sum_wx": (w * x).sum(), "sum_w": w.sum(), "count": torch.full((), float(x.numel()), dtype=F64),
            "nonfinite": (~ok).to(F64).sum()}


def _scalar_compute(sum_wx: Tensor, sum_w: Tensor, count: Tensor, nonfinite: Tensor | None = None) -> Tensor:
    return _mean(sum_wx, sum_w)


def scalar_mean(values: Any, weights: Any = None) -> Tensor:
    """The (optionally weighted) mean a trainer-scalar metric reports: ``sum(w x) / sum(w)``.

    Raises:
        ValueError: no observation, or all weights 0 (no mean to return), or non-finite values or weights.

    Example:
        >>> scalar_mean([1.0, 2.0, 4.0])
        tensor(2.3333, dtype=torch.float64)
        >>> scalar_mean([1.0, 3.0], weights=[300, 100])  # token-weighted loss
        tensor(1.5000, dtype=torch.float64)
        >>> scalar_mean([])
        Traceback (most recent call last):
        ...
        ValueError: scalar_mean(): no observation with a positive weight in the batch, so there is no value to ...
    """
    weight = "w" if weights is not None else None
    stats = _scalar_update(BatchView(x=values, w=weights), "x", weight, None)
    return _one_batch(_scalar_compute, stats, ("x", weight) if weight else "x", "non-finite values or weights",
                      need=("scalar_mean", "observation with a positive weight",
                            "at least one value in `values` (with a positive weight when `weights` are given)"),
                      count="sum_w")


# actor/entropy
def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    r"""Per-position entropy :math:`H = -\sum_v p_v \log p_v` of ``softmax(logits / temperature)``.

    Uses ``log_softmax`` (no overflow for large logits) and treats ``0 log 0`` as 0, so vocabulary
    entries masked with ``-inf`` are fine. bf16/fp16 logits are computed in float32.

    Example:
        >>> import torch
        >>> entropy_from_logits(torch.tensor([[0.0, 0.0], [0.0, float("-inf")]]))
        tensor([0.6931, 0.0000])
    """
    x = logits if logits.dtype in (torch.float32, F64) else logits.float()
    if temperature != 1.0:
        x = x / temperature
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    plogp = torch.where(p > 0, p * logp, torch.zeros((), dtype=x.dtype, device=x.device))
    return 0.0 - plogp.sum(-1)  # 0 - x, not -x: a certain token has entropy +0.0


def _entropy_update(view: BatchView, from_logits: bool, temperature: float) -> Stats:
    if from_logits:
        logits, _ = field_tensor(view, LOGITS, ndims=(3,))
        if not logits.is_floating_point():
            raise ValueError(f"batch field `{LOGITS}` must be a floating-point tensor, got {logits.dtype}")
        if logits.shape[-1] == 0:  # (a softmax over no entry: no distribution, no entropy)
            raise ValueError(f"batch field `{LOGITS}` has shape {tuple(logits.shape)}: an empty vocabulary (V = 0); "
                             "pass the [B, T, V] logits over the whole vocabulary")
        h, name = entropy_from_logits(logits, temperature), LOGITS
    else:
        h, _ = field_tensor(view, ENTROPIES, ndims=(2,), check="finite", device=tensor_device(view, RESPONSE_MASK))
        name = ENTROPIES
    mask = response_mask_for(view, h.shape, h.device, like=name)
    h = h.to(F64)
    finite = torch.isfinite(h)
    valid = mask & finite
    return {"sum": torch.where(valid, h, _zero(h.device)).sum(), "count": valid.to(F64).sum(),
            "nonfinite": (mask & ~finite).to(F64).sum()}


def _token_mean_compute(sum: Tensor, count: Tensor, nonfinite: Tensor | None = None) -> Tensor:
    """The mean over valid tokens (``actor/entropy``, ``actor/ppo_kl``, ``actor/approx_kl``)."""
    return _mean(sum, count)


def policy_entropy(entropies: Tensor | None = None, response_mask: Tensor | None = None, logits: Tensor | None = None,
                   temperature: float = 1.0) -> Tensor:
    r"""``actor/entropy``: token-mean policy entropy over response tokens (nats).

    Give per-token ``entropies`` [B, T] or ``logits`` [B, T, V]. The mean is over all valid tokens of
    the batch (verl's ``token-mean``), not a mean of per-sequence means.

    Example:
        >>> import torch
        >>> policy_entropy(torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[1, 1, 0]]))
        tensor(1.5000, dtype=torch.float64)
        >>> policy_entropy(logits=torch.zeros(1, 2, 4)).round(decimals=4)  # uniform over 4: log 4
        tensor(1.3863, dtype=torch.float64)
        >>> policy_entropy(torch.tensor([[1.0, 2.0]]), torch.tensor([[0, 0]]))  # every token masked out
        Traceback (most recent call last):
        ...
        ValueError: policy_entropy(): no valid token (response_mask = 1 and finite `entropies`) in the batch, ...
    """
    view = BatchView(entropies=entropies, logits=logits, response_mask=response_mask)
    stats = _entropy_update(view, logits is not None, temperature)
    name = LOGITS if logits is not None else ENTROPIES
    return _one_batch(_token_mean_compute, stats, name, "non-finite entropies",
                      need=_tokens_needed("policy_entropy", f"`{name}`"))


# actor/ppo_kl, actor/approx_kl, actor/pg_clipfrac(_lower)
KL_ESTIMATORS = ("k1", "k2", "k3")


def _ppo_inputs(view: BatchView) -> tuple[Tensor, Tensor, Tensor]:
    new, _ = field_tensor(view, POLICY_LOGPROBS, ndims=(2,), device=tensor_device(view, OLD_LOGPROBS, RESPONSE_MASK))
    old, _ = field_tensor(view, OLD_LOGPROBS, ndims=(2,), device=new.device)
    for name, t in ((POLICY_LOGPROBS, new), (OLD_LOGPROBS, old)):
        if not t.is_floating_point():
            raise ValueError(f"batch field `{name}` must be a floating-point tensor, got {t.dtype}")
    check_same_shape(OLD_LOGPROBS, old, POLICY_LOGPROBS, new)
    mask = response_mask_for(view, new.shape, new.device, like=POLICY_LOGPROBS)
    dtype = F64 if F64 in (new.dtype, old.dtype) else torch.float32
    return new.to(dtype), old.to(dtype), mask


def _policy_kl_update(view: BatchView, estimator: str, clamp: float) -> Stats:
    new, old, mask = _ppo_inputs(view)
    finite = torch.isfinite(new) & torch.isfinite(old)
    valid = mask & finite
    zero = torch.zeros((), dtype=new.dtype, device=new.device)
    r = torch.where(valid, new - old, zero).clamp(-clamp, clamp)  # log(pi / pi_old)
    if estimator == "k1":
        k = -r
    elif estimator == "k2":
        k = 0.5 * r * r
    else:
        k = torch.expm1(r) - r
    return {"sum": k.to(F64).sum(), "count": valid.to(F64).sum(), "nonfinite": (mask & ~finite).to(F64).sum(),
            "positive": _positive_count(new, old, valid)}


def policy_kl(policy_logprobs: Tensor, old_logprobs: Tensor, response_mask: Tensor | None = None, estimator: str = "k1",
              clamp: float = DEFAULT_RATIO_CLAMP) -> Tensor:
    r"""Token-mean KL(pi_old || pi) from the sampled tokens' logprobs (``actor/ppo_kl``, ``actor/approx_kl``).

    With :math:`r = \mathrm{clamp}(\log\pi - \log\pi_{old}, -C, C)` (tokens sampled from
    :math:`\pi_{old}`; C = 20 as in verl): ``k1 = -r`` (verl's ``ppo_kl``), ``k2 = r^2 / 2`` (TRL's
    ``approx_kl``), ``k3 = e^r - 1 - r`` (Schulman's low-variance unbiased estimator, CleanRL's
    ``approx_kl``). All are means over valid response tokens of the batch.

    Example:
        >>> import torch
        >>> new, old = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
        >>> [round(policy_kl(new, old, estimator=e).item(), 4) for e in ("k1", "k2", "k3")]
        [0.25, 0.3125, 0.2583]
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"`estimator` must be one of {KL_ESTIMATORS}, got {estimator!r}")
    view = BatchView(policy_logprobs=policy_logprobs, old_logprobs=old_logprobs, response_mask=response_mask)
    return _one_batch(_token_mean_compute, _policy_kl_update(view, estimator, clamp), (POLICY_LOGPROBS, OLD_LOGPROBS),
                      "non-finite logprobs on response tokens",
                      need=_tokens_needed("policy_kl", "`policy_logprobs` and `old_logprobs`"))


CLIPFRAC_KEYS = ("actor/pg_clipfrac", "actor/pg_clipfrac_lower")


def check_clip_range(clip_ratio: float, clip_ratio_low: float | None, clip_ratio_high: float | None,
                     clip_ratio_c: float) -> tuple[float, float, float]:
    """Validate PPO clip arguments; returns ``(eps_low, eps_high, c)``."""
    low = float(clip_ratio if clip_ratio_low is None else clip_ratio_low)
    high = float(clip_ratio if clip_ratio_high is None else clip_ratio_high)
    c = float(clip_ratio_c)
    if not 0.0 <= low < 1.0:
        raise ValueError(f"`clip_ratio_low` must be in [0, 1), got {low}")
    if not 0.0 <= high < math.inf:
        raise ValueError(f"`clip_ratio_high` must be a non-negative finite number, got {high}")
    if not 1.0 < c < math.inf:
        raise ValueError(f"`clip_ratio_c` (dual-clip bound) must be a finite number > 1, got {c}")
    return low, high, c


def _advantages_like(view: BatchView, like: Tensor) -> tuple[Tensor, bool]:
    adv, on_host = field_tensor(view, ADVANTAGES, ndims=(1, 2), device=like.device, check="finite")
    check_same_device(ADVANTAGES, adv, POLICY_LOGPROBS, like)
    if adv.ndim == 1:
        if adv.shape[0] != like.shape[0]:
            raise ValueError(f"batch field `{ADVANTAGES}` has shape {tuple(adv.shape)} but `{POLICY_LOGPROBS}` has "
                             f"shape {tuple(like.shape)}; give [B] or [B, T]")
        adv = adv[:, None].expand(like.shape)
    else:
        check_same_shape(ADVANTAGES, adv, POLICY_LOGPROBS, like)
    return adv, on_host


def _clipfrac_update(view: BatchView, low: float, high: float, c: float, clamp: float) -> Stats:
    new, old, mask = _ppo_inputs(view)
    adv, _ = _advantages_like(view, new)
    adv = adv.to(new.dtype)
    finite = torch.isfinite(new) & torch.isfinite(old) & torch.isfinite(adv)
    valid = mask & finite
    zero = torch.zeros((), dtype=new.dtype, device=new.device)
    ratio = torch.where(valid, new - old, zero).clamp(-clamp, clamp).exp()
    a = torch.where(valid, adv, zero)
    pg1 = -a * ratio
    pg2 = -a * ratio.clamp(1.0 - low, 1.0 + high)
    clipped = pg2 > pg1
    pg3 = -a * c
    lower = (torch.maximum(pg1, pg2) > pg3) & (a < 0)
    return {"clipped": (clipped & valid).to(F64).sum(), "clipped_lower": (lower & valid).to(F64).sum(),
            "count": valid.to(F64).sum(), "nonfinite": (mask & ~finite).to(F64).sum(),
            "positive": _positive_count(new, old, valid)}


def _clipfrac_compute(clipped: Tensor, clipped_lower: Tensor, count: Tensor, nonfinite: Tensor | None = None
                      ) -> dict[str, Tensor]:
    return {CLIPFRAC_KEYS[0]: _mean(clipped, count), CLIPFRAC_KEYS[1]: _mean(clipped_lower, count)}


def pg_clipfrac(policy_logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor | None = None,
                clip_ratio: float = DEFAULT_CLIP_RATIO, clip_ratio_low: float | None = None,
                clip_ratio_high: float | None = None, clip_ratio_c: float = DEFAULT_CLIP_RATIO_C,
                clamp: float = DEFAULT_RATIO_CLAMP) -> dict[str, Tensor]:
    r"""``actor/pg_clipfrac`` and ``actor/pg_clipfrac_lower``: how often PPO's clipping is active.

    Follows PPO (Schulman et al. 2017, eq. 7) with dual clip (Ye et al. 2020, arXiv:1912.09729) as verl's
    ``compute_policy_loss`` does, per valid token with
    :math:`\rho = e^{\mathrm{clamp}(\log\pi - \log\pi_{old}, -20, 20)}`:

    * ``pg_clipfrac``: share of tokens where the clipped surrogate is the active one,
      :math:`-A\,\mathrm{clip}(\rho, 1-\epsilon_{low}, 1+\epsilon_{high}) > -A\rho`;
    * ``pg_clipfrac_lower``: share of tokens where the dual-clip bound binds,
      :math:`A < 0` and :math:`\max(-A\rho, -A\,\mathrm{clip}(\rho)) > -A c` (``c = clip_ratio_c``, 3).

    ``advantages`` may be [B] (one per sequence, broadcast over tokens) or [B, T].

    Example:
        >>> import torch, math
        >>> new = torch.log(torch.tensor([[0.3, 0.1, 0.2, 0.8]]))   # ratios 1.5, 0.5, 1, 4
        >>> old = torch.log(torch.full((1, 4), 0.2))
        >>> out = pg_clipfrac(new, old, torch.tensor([[1.0, -1.0, 1.0, -1.0]]))
        >>> [round(v.item(), 4) for v in out.values()]
        [0.5, 0.25]
    """
    low, high, c = check_clip_range(clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c)
    view = BatchView(policy_logprobs=policy_logprobs, old_logprobs=old_logprobs, advantages=advantages,
                     response_mask=response_mask)
    stats = _clipfrac_update(view, low, high, c, clamp)
    return _one_batch(_clipfrac_compute, stats, (POLICY_LOGPROBS, OLD_LOGPROBS, ADVANTAGES),
                      "non-finite logprobs/advantages on response tokens",
                      need=_tokens_needed("pg_clipfrac", "`policy_logprobs`, `old_logprobs` and `advantages`"))


# critic/*: value, returns, advantages, rewards, score, explained variance
def _sequence_mask(view: BatchView, name: str, x: Tensor) -> Tensor:
    """The ``[B, T]`` ``response_mask`` beside the ``[B]`` values ``x`` of field ``name`` (same B and device)."""
    mask = view.tensor(RESPONSE_MASK)
    if mask.ndim != 2 or mask.shape[0] != x.shape[0]:
        raise ValueError(f"batch field `{RESPONSE_MASK}` has shape {tuple(mask.shape)} but `{name}` has "
                         f"{x.shape[0]} sequences; a per-sequence field needs a [B, T] mask")
    check_same_device(RESPONSE_MASK, mask, name, x)
    return mask


def _token_values(view: BatchView, name: str, device: torch.device | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """A [B, T] or [B] field as float64 with its valid mask and the mask of non-finite entries.

    [B, T]: the tokens under ``response_mask`` (all when absent). [B] with a ``response_mask``:
    broadcast over each sequence's response tokens (as verl broadcasts GRPO advantages). [B] without a
    mask: one value per sequence. Host values go to ``device`` (default: the mask's).
    """
    device = device or tensor_device(view, RESPONSE_MASK)
    x, _ = field_tensor(view, name, ndims=(1, 2), check="finite", device=device)
    x = x.to(F64)
    if x.ndim == 1 and view.has(RESPONSE_MASK):
        x = x[:, None].expand(_sequence_mask(view, name, x).shape)
    mask = response_mask_for(view, x.shape, x.device, like=name)
    finite = torch.isfinite(x)
    return x, mask & finite, mask & ~finite


CRITIC_STAT_KEYS = {
    VALUES: ("critic/value/mean", "critic/value/max", "critic/value/min"),
    RETURNS: ("critic/returns/mean", "critic/returns/max", "critic/returns/min"),
    ADVANTAGES: ("critic/advantages/mean", "critic/advantages/std", "critic/advantages/max", "critic/advantages/min"),
    REWARDS: ("critic/rewards/mean", "critic/rewards/max", "critic/rewards/min"),
    SCORES: ("critic/score/mean", "critic/score/max", "critic/score/min"),
}


def _token_stats_update(view: BatchView, name: str) -> Stats:
    x, valid, bad = _token_values(view, name)
    return {**_masked_moments(x, valid, scaled=True), "nonfinite": bad.to(F64).sum()}


def _sequence_sum_update(view: BatchView, name: str) -> Stats:
    """Per-sequence totals (a [B, T] field summed over T, as verl sums token-level rewards), skipping
    aborted sequences (no response token) when a ``response_mask`` is given."""
    x, _ = field_tensor(view, name, ndims=(1, 2), check="finite", device=tensor_device(view, RESPONSE_MASK))
    x = x.to(F64)
    if x.ndim == 2:
        x = x.sum(dim=1)
    keep = ((_sequence_mask(view, name, x) != 0).any(dim=1) if view.has(RESPONSE_MASK)
            else torch.ones(x.shape, dtype=torch.bool, device=x.device))
    finite = torch.isfinite(x)
    return {**_masked_moments(x, keep & finite, scaled=True), "nonfinite": (keep & ~finite).to(F64).sum()}


def _critic_stats_compute(name: str, sum: Tensor, sum_sq: Tensor, max: Tensor, min: Tensor, count: Tensor,
                          sum_hi: Tensor, sum_sq_hi: Tensor, nonfinite: Tensor | None = None) -> dict[str, Tensor]:
    mean, std = mean_std(count, sum, sum_sq, sum_hi, sum_sq_hi, min, max, ddof=0)
    values = {"mean": mean, "std": std, "max": _extreme(max, count), "min": _extreme(min, count)}
    return {key: values[key.rsplit("/", 1)[1]] for key in CRITIC_STAT_KEYS[name]}


def critic_stats(name: str, values: Tensor, response_mask: Tensor | None = None) -> dict[str, Tensor]:
    """The ``critic/*`` statistics of one field: ``values``, ``returns``, ``advantages`` (token level,
    under the mask), ``rewards`` or ``scores`` (per sequence: a [B, T] field is summed over T).

    Means are over tokens (values, returns, advantages) or sequences (rewards, score); ``std`` is the
    population standard deviation (ddof = 0: 0 for one token). A batch without a valid token (or sequence)
    raises a ``ValueError``.

    Example:
        >>> import torch
        >>> out = critic_stats("advantages", torch.tensor([[1.0, -1.0, 5.0]]), torch.tensor([[1, 1, 0]]))
        >>> {k.split('/')[-1]: v.item() for k, v in out.items()}
        {'mean': 0.0, 'std': 1.0, 'max': 1.0, 'min': -1.0}
        >>> out = critic_stats("rewards", torch.tensor([[0.0, 1.0], [0.0, 0.5]]))
        >>> {k: v.item() for k, v in out.items()}
        {'critic/rewards/mean': 0.75, 'critic/rewards/max': 1.0, 'critic/rewards/min': 0.5}
    """
    if name not in CRITIC_STAT_KEYS:
        raise ValueError(f"`name` must be one of {sorted(CRITIC_STAT_KEYS)}, got {name!r}")
    view = BatchView({name: values, RESPONSE_MASK: response_mask})
    per_sequence = name in (REWARDS, SCORES)
    stats = (_sequence_sum_update if per_sequence else _token_stats_update)(view, name)
    need = (("critic_stats", f"sequence with `{name}` (one with a response token when a `response_mask` is given)",
             f"`{name}` with at least one sequence that has a response token")
            if per_sequence else _tokens_needed("critic_stats", f"`{name}`"))
    return _one_batch(_critic_stats_compute, stats, name, "non-finite values", name, need=need)


#: The epsilon verl adds to ``Var(R)`` in ``critic/vf_explained_var`` (``compute_data_metrics``:
#: ``1 - Var(R - V) / (Var(R) + 1e-5)``, with ``torch.var``'s sample variances); kept so the key agrees with verl's.
EXPLAINED_VAR_EPS = 1e-5


def _explained_var_update(view: BatchView) -> Stats:
    device = tensor_device(view, RESPONSE_MASK, RETURNS, VALUES)
    r, valid_r, bad_r = _token_values(view, RETURNS, device)
    v, valid_v, bad_v = _token_values(view, VALUES, device)
    check_same_shape(VALUES, v, RETURNS, r)
    valid = valid_r & valid_v
    zero = _zero(r.device)
    rv = torch.where(valid, r, zero)
    d = torch.where(valid, r - v, zero)  # r - v may overflow for finite r, v near the limit: scale first
    d_hi = torch.where(valid, r * SCALE - v * SCALE, zero)
    r_hi = rv * SCALE
    return {"sum_r": rv.sum(), "sum_r2": (rv * rv).sum(), "sum_d": d.sum(), "sum_d2": (d * d).sum(),
            "sum_r_hi": r_hi.sum(), "sum_r2_hi": (r_hi * r_hi).sum(), "sum_d_hi": d_hi.sum(),
            "sum_d2_hi": (d_hi * d_hi).sum(), "count": valid.to(F64).sum(), "nonfinite": (bad_r | bad_v).to(F64).sum()}


def _explained_var_compute(sum_r: Tensor, sum_r2: Tensor, sum_d: Tensor, sum_d2: Tensor, count: Tensor,
                           sum_r_hi: Tensor, sum_r2_hi: Tensor, sum_d_hi: Tensor, sum_d2_hi: Tensor,
                           nonfinite: Tensor | None = None) -> Tensor:
    # Both variances on one scale: the scaled sums when any plain sum overflowed (the ratio is scale-free).
    # Sample variances (n - 1) and verl's epsilon, as verl's compute_data_metrics computes the key.
    big = ~torch.isfinite(torch.stack([sum_r, sum_r2, sum_d, sum_d2])).all()
    var_r = torch.where(big, variance(sum_r_hi, sum_r2_hi, count, 1), variance(sum_r, sum_r2, count, 1))
    var_d = torch.where(big, variance(sum_d_hi, sum_d2_hi, count, 1), variance(sum_d, sum_d2, count, 1))
    # On the 2^-1200-scaled variances (returns past ~1e154) the epsilon is far below their rounding: left out.
    denominator = var_r + torch.where(big, torch.zeros_like(var_r), torch.full_like(var_r, EXPLAINED_VAR_EPS))
    ev = 1.0 - var_d / denominator.clamp_min(torch.finfo(F64).tiny)
    # Only there can the denominator be 0 (constant huge returns): 1 if the values are exact too, else 0
    # (scikit-learn's force_finite convention).
    degenerate = torch.where(var_d > 0, torch.zeros_like(ev), torch.ones_like(ev))
    ev = torch.where(denominator > 0, ev, degenerate)
    return torch.where(count > 0, ev, torch.zeros_like(ev))


def explained_variance(values: Tensor, returns: Tensor, response_mask: Tensor | None = None) -> Tensor:
    r"""``critic/vf_explained_var`` = :math:`1 - \mathrm{Var}(R - V) / (\mathrm{Var}(R) + 10^{-5})` over valid tokens.

    verl's formula (``compute_data_metrics``): sample variances (``n - 1``, as ``torch.var``) and its
    epsilon :data:`EXPLAINED_VAR_EPS` in the denominator, so for returns of small variance the value is
    pulled toward 1 as verl's is (``Var(R) = 0`` gives ``1 - Var(R - V) / 1e-5``). From mergeable raw moments
    in float64 (relative rounding about ``1e-16 * mean^2 / variance``). The sample variances need two valid
    tokens: with fewer it raises a ``ValueError`` (verl's ``torch.var`` gives NaN there; the metric has no key).

    Example:
        >>> import torch
        >>> returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
        >>> explained_variance(returns, returns)
        tensor(1., dtype=torch.float64)
        >>> explained_variance(torch.tensor([[1.0, 2.0, 3.0, 3.0]]), returns)
        tensor(0.8500, dtype=torch.float64)
        >>> explained_variance(returns, returns, torch.tensor([[1, 0, 0, 0]]))
        Traceback (most recent call last):
        ...
        ValueError: explained_variance(): 1 valid token (...) in the batch, it needs at least 2, so there is no ...
    """
    stats = _explained_var_update(BatchView(values=values, returns=returns, response_mask=response_mask))
    return _one_batch(_explained_var_compute, stats, (VALUES, RETURNS), "non-finite values/returns",
                      need=_tokens_needed("explained_variance", "`values` and `returns`", 2), at_least=2)


# response_length/*, prompt_length/*, response/aborted_ratio, num_turns/*
def nonnegative_field(view: BatchView, name: str, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """A [B] count field (lengths, turns) as float64, and the number of invalid entries (negative or
    non-finite) that were zeroed. Host inputs are checked at once instead."""
    x, _ = field_tensor(view, name, ndims=(1,), dims=("B",), device=device, check="nonnegative")
    if x.dtype == torch.bool:
        raise ValueError(f"batch field `{name}` must hold counts (integers), got {x.dtype}")
    x = x.to(F64)
    ok = torch.isfinite(x) & (x >= 0)
    return torch.where(ok, x, _zero(x.device)), (~ok).to(F64).sum()


def length_keys(prefix: str, max_length: int | None) -> tuple[str, ...]:
    keys = (f"{prefix}/mean", f"{prefix}/max", f"{prefix}/min")
    return (*keys, f"{prefix}/clip_ratio") if max_length is not None else keys


def _count_stats(view: BatchView, name: str, device: torch.device | None = None) -> tuple[Tensor, Stats]:
    """A [B] count field (:func:`nonnegative_field`) and its sum, max, min, count and invalid entries."""
    x, invalid = nonnegative_field(view, name, device)
    stats = _masked_moments(x, torch.ones_like(x, dtype=torch.bool))
    del stats["sum_sq"]
    return x, {**stats, "invalid": invalid}


def _length_update(view: BatchView, name: str, max_length: int | None) -> Stats:
    x, stats = _count_stats(view, name)
    limit = math.inf if max_length is None else float(max_length)
    return {**stats, "clipped": (x >= limit).to(F64).sum()}


def _length_compute(prefix: str, max_length: int | None, sum: Tensor, max: Tensor, min: Tensor, count: Tensor,
                    clipped: Tensor, invalid: Tensor | None = None) -> dict[str, Tensor]:
    keys = length_keys(prefix, max_length)
    out = {keys[0]: _mean(sum, count), keys[1]: _extreme(max, count), keys[2]: _extreme(min, count)}
    if max_length is not None:
        out[keys[3]] = _mean(clipped, count)
    return out


def length_stats(lengths: Any, max_length: int | None = None, prefix: str = "response_length") -> dict[str, Tensor]:
    """``<prefix>/{mean,max,min,clip_ratio}`` of per-sequence token counts.

    ``clip_ratio`` = share of sequences with ``length >= max_length`` (verl tests ``==``; a length above
    the limit cannot occur there, and counts as clipped here). It is produced only when ``max_length``
    is given. Means are over sequences, zero-length (aborted) ones included, as verl does. No sequence, or a
    negative or non-finite length: a ``ValueError``.

    Example:
        >>> out = length_stats([10, 512, 0, 200], max_length=512)
        >>> [(k.split("/")[1], v.item()) for k, v in out.items()]
        [('mean', 180.5), ('max', 512.0), ('min', 0.0), ('clip_ratio', 0.25)]
    """
    stats = _length_update(BatchView(lengths=lengths), "lengths", max_length)
    return _one_batch(_length_compute, stats, "lengths", BAD_LENGTHS, prefix, max_length,
                      need=("length_stats", "sequence", "at least one length in `lengths`"))


BAD_LENGTHS = "negative or non-finite lengths"


def _aborted_update(view: BatchView) -> Stats:
    x, invalid = nonnegative_field(view, RESPONSE_LENGTHS)
    return {"aborted": (x == 0).to(F64).sum(), "count": torch.full((), float(x.numel()), dtype=F64, device=x.device),
            "invalid": invalid}


def _aborted_compute(aborted: Tensor, count: Tensor, invalid: Tensor | None = None) -> Tensor:
    return _mean(aborted, count)


def aborted_ratio(response_lengths: Any) -> Tensor:
    """``response/aborted_ratio``: share of samples whose response is empty (``response_length == 0``),
    verl's definition of an aborted generation.

    Example:
        >>> aborted_ratio([0, 12, 7, 0])
        tensor(0.5000, dtype=torch.float64)
        >>> aborted_ratio([])
        Traceback (most recent call last):
        ...
        ValueError: aborted_ratio(): no sample in the batch, so there is no value to return (a number would be ...
    """
    return _one_batch(_aborted_compute, _aborted_update(BatchView(response_lengths=response_lengths)),
                      RESPONSE_LENGTHS, BAD_LENGTHS,
                      need=("aborted_ratio", "sample", "at least one length in `response_lengths`"))


TURN_KEYS = ("num_turns/min", "num_turns/max", "num_turns/mean")


def _turns_update(view: BatchView, name: str = NUM_TURNS) -> Stats:
    return _count_stats(view, name)[1]


def _turns_compute(sum: Tensor, max: Tensor, min: Tensor, count: Tensor, invalid: Tensor | None = None,
                   keys: tuple[str, str, str] = TURN_KEYS) -> dict[str, Tensor]:
    return {keys[0]: _extreme(min, count), keys[1]: _extreme(max, count), keys[2]: _mean(sum, count)}


def turn_stats(num_turns: Any) -> dict[str, Tensor]:
    """``num_turns/{min,max,mean}`` over samples (multi-turn / agent rollouts).

    Example:
        >>> {k: v.item() for k, v in turn_stats([1, 3, 2, 6]).items()}
        {'num_turns/min': 1.0, 'num_turns/max': 6.0, 'num_turns/mean': 3.0}
    """
    return _one_batch(_turns_compute, _turns_update(BatchView(num_turns=num_turns)), NUM_TURNS,
                      "negative or non-finite turn counts",
                      need=("turn_stats", "sample", "at least one count in `num_turns`"))


# DPO: loss/dpo, rewards/*; reward models: rm/*
DPO_FIELDS = ("policy_chosen_logps", "policy_rejected_logps", "reference_chosen_logps", "reference_rejected_logps")
DPO_KEYS = ("loss/dpo", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy")


def _paired_fields(view: BatchView, names: Sequence[str]) -> list[Tensor]:
    out: list[Tensor] = []
    for name in names:
        device = out[0].device if out else tensor_device(view, *names)
        t, _ = field_tensor(view, name, ndims=(1, 2), dims=("B", "1"), check="finite", device=device)
        if t.ndim == 2:
            if t.shape[1] != 1:
                raise ValueError(f"batch field `{name}` must have shape [B] or [B, 1], got {tuple(t.shape)}")
            t = t[:, 0]
        if out:
            check_same_shape(name, t, names[0], out[0])
        out.append(t.to(dtype=F64))
    return out


def _dpo_update(view: BatchView, beta: float, label_smoothing: float) -> Stats:
    pc, pr, rc, rr = _paired_fields(view, DPO_FIELDS)
    chosen = beta * (pc - rc)
    rejected = beta * (pr - rr)
    logits = chosen - rejected
    finite = torch.isfinite(logits)
    zero = _zero(logits.device)
    logits = torch.where(finite, logits, zero)
    chosen, rejected = torch.where(finite, chosen, zero), torch.where(finite, rejected, zero)
    loss = -torch.nn.functional.logsigmoid(logits) * (1.0 - label_smoothing)
    if label_smoothing:
        loss = loss - torch.nn.functional.logsigmoid(-logits) * label_smoothing
    return {"sum_loss": torch.where(finite, loss, zero).sum(), "sum_chosen": chosen.sum(),
            "sum_rejected": rejected.sum(), "correct": ((chosen > rejected) & finite).to(F64).sum(),
            "count": finite.to(F64).sum(), "nonfinite": (~finite).to(F64).sum()}


def _dpo_compute(sum_loss: Tensor, sum_chosen: Tensor, sum_rejected: Tensor, correct: Tensor, count: Tensor,
                 nonfinite: Tensor | None = None) -> dict[str, Tensor]:
    chosen, rejected = _mean(sum_chosen, count), _mean(sum_rejected, count)
    return {DPO_KEYS[0]: _mean(sum_loss, count), DPO_KEYS[1]: chosen, DPO_KEYS[2]: rejected,
            DPO_KEYS[3]: chosen - rejected, DPO_KEYS[4]: _mean(correct, count)}


def dpo_metrics(policy_chosen_logps: Tensor, policy_rejected_logps: Tensor, reference_chosen_logps: Tensor,
                reference_rejected_logps: Tensor, beta: float = DEFAULT_DPO_BETA,
                label_smoothing: float = 0.0) -> dict[str, Tensor]:
    r"""DPO's loss and implicit rewards (Rafailov et al. 2023), means over preference pairs.

    Per pair, from sequence log-probabilities: :math:`r_c = \beta(\log\pi(y_c) - \log\pi_{ref}(y_c))`,
    :math:`r_r = \beta(\log\pi(y_r) - \log\pi_{ref}(y_r))`; ``loss/dpo`` =
    :math:`-(1-\varepsilon)\log\sigma(r_c - r_r) - \varepsilon\log\sigma(r_r - r_c)` (the sigmoid loss;
    :math:`\varepsilon` = label smoothing, cDPO); ``rewards/chosen``, ``rewards/rejected``: mean
    :math:`r_c`, :math:`r_r`; ``rewards/margins`` = mean :math:`(r_c - r_r)`; ``rewards/accuracy`` =
    share of pairs with :math:`r_c > r_r` (ties count as wrong), as TRL logs them.

    Example:
        >>> import torch
        >>> out = dpo_metrics(torch.tensor([-10.0, -12.0]), torch.tensor([-14.0, -11.0]),
        ...                   torch.tensor([-11.0, -12.0]), torch.tensor([-12.0, -12.0]), beta=0.5)
        >>> {k: round(v.item(), 4) for k, v in out.items()}
        {'loss/dpo': 0.5877, 'rewards/chosen': 0.25, 'rewards/rejected': -0.25,
         'rewards/margins': 0.5, 'rewards/accuracy': 0.5}
    """
    stats = _dpo_update(BatchView(dict(zip(DPO_FIELDS, (policy_chosen_logps, policy_rejected_logps,
                                                           reference_chosen_logps, reference_rejected_logps)))),
                        beta, label_smoothing)
    return _one_batch(_dpo_compute, stats, DPO_FIELDS, "pairs with non-finite logps",
                      need=("dpo_metrics", "preference pair", "at least one (chosen, rejected) pair of logps"))


RM_FIELDS = ("chosen_scores", "rejected_scores")
RM_KEYS = ("rm/loss", "rm/accuracy", "rm/reward_margin")


def _rm_update(view: BatchView) -> Stats:
    chosen, rejected = _paired_fields(view, RM_FIELDS)
    margin = chosen - rejected
    finite = torch.isfinite(margin)
    zero = _zero(margin.device)
    margin = torch.where(finite, margin, zero)
    return {"sum_loss": torch.where(finite, -torch.nn.functional.logsigmoid(margin), zero).sum(),
            "correct": ((margin > 0) & finite).to(F64).sum(), "sum_margin": margin.sum(), "count": finite.to(F64).sum(),
            "nonfinite": (~finite).to(F64).sum()}


def _rm_compute(sum_loss: Tensor, correct: Tensor, sum_margin: Tensor, count: Tensor,
                nonfinite: Tensor | None = None) -> dict[str, Tensor]:
    return {RM_KEYS[0]: _mean(sum_loss, count), RM_KEYS[1]: _mean(correct, count), RM_KEYS[2]: _mean(sum_margin, count)}


def reward_model_metrics(chosen_scores: Tensor, rejected_scores: Tensor) -> dict[str, Tensor]:
    r"""``rm/{loss,accuracy,reward_margin}`` of a pairwise (Bradley-Terry) reward model, means over pairs.

    ``rm/loss`` = mean :math:`-\log\sigma(s_c - s_r)`; ``rm/accuracy`` = share of pairs with
    :math:`s_c > s_r` (ties count as wrong); ``rm/reward_margin`` = mean :math:`s_c - s_r`.

    Example:
        >>> import torch
        >>> out = reward_model_metrics(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.5]))
        >>> {k: round(v.item(), 4) for k, v in out.items()}
        {'rm/loss': 0.6437, 'rm/accuracy': 0.5, 'rm/reward_margin': 0.25}
    """
    stats = _rm_update(BatchView(chosen_scores=chosen_scores, rejected_scores=rejected_scores))
    return _one_batch(_rm_compute, stats, RM_FIELDS, "pairs with non-finite scores",
                      need=("reward_model_metrics", "preference pair",
                            "at least one (chosen, rejected) pair of scores"))
