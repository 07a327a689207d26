"""The batch schema, its validation, and the per-token quantities every metric shares.

A batch is a mapping (or a dataclass) of tensors named as in the design's batch schema
(``trainer_logprobs``, ``rollout_logprobs``, ``response_mask``, ``group_ids``, ...). A :class:`BatchView`
wraps one batch for one ``update``: it validates each field the first time a metric asks for it (shape,
dtype, device: host metadata only, never the values) and caches derived per-token tensors, so a
collection of twenty metrics computes the log ratio, the mask and the weights once.

Metrics check field names before reading a batch (:meth:`BatchView.check_fields`; host metadata, no
sync): a known framework name whose meaning here has a schema name (``completion_mask``,
``old_log_probs``, ...) without that schema field raises a ``ValueError`` pointing at the adapter, and
per-sequence fields (``rewards``, ``group_ids``, ...) must have one entry per sequence. Inputs that
require grad are detached when the view is built: metrics never keep a graph.

Non-finite logprobs cannot be rejected in ``update()`` without a host sync, so they are handled by
value: a response token whose trainer or rollout logprob is NaN or infinite (or whose log ratio
overflows the compute dtype) is excluded from every mismatch statistic and counted instead
(``opbc/input/nonfinite_count``); a sequence holding such a token is excluded from the sequence-level
statistics. Finite sentinels such as -9999 or float32's minimum are real values and show up as huge
log ratios (clipped and vetoed); sequence sums of log ratios accumulate in float64.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import warnings
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

TRAINER_LOGPROBS = "trainer_logprobs"
ROLLOUT_LOGPROBS = "rollout_logprobs"
RESPONSE_MASK = "response_mask"
GROUP_IDS = "group_ids"
ROLLOUT_TOKEN_IDS = "rollout_token_ids"
TRAINER_TOKEN_IDS = "trainer_token_ids"

DEFAULT_CLAMP = 20.0
DEFAULT_VETO = 30.0

# How alike (difflib's ratio) an unread field's name and a schema name must be for the field to be taken as a
# misspelling (refused) rather than a field of the user's own (ignored with a warning): `respons_mask` 0.96,
# `reward` 0.92 pass; verl's `responses` (0.82 to `response_mask`), `turns` (0.83 to `returns`) and `grad_norm`
# (0.857 to `rm_grad_norm`) do not.
CLOSE_MATCH_CUTOFF = 0.86

def close_name(name: Any, candidates: Iterable[str]) -> str | None:
    """The candidate ``name`` looks like a misspelling of (:data:`CLOSE_MATCH_CUTOFF`), or ``None``: the one rule of
    the batch check (:meth:`BatchView.check_unread`) and the dump readers (:func:`opbc_metrics.io.unknown_keys`).

    Example:
        >>> close_name("respons_mask", ["response_mask", "rewards"]), close_name("responses", ["response_mask"])
        ('response_mask', None)
    """
    match = difflib.get_close_matches(str(name), list(candidates), n=1, cutoff=CLOSE_MATCH_CUTOFF)
    return match[0] if match else None


# A logprob side whose valid values reach above this holds probabilities, logits or the like, not logprobs.
PROBABILITY_TOLERANCE = 0.01
# The view's cache key of BatchView.logprob_high (the mismatch kernel fills it from its own sweep).
LOGPROB_HIGH = "logprob_high"

_TRL = "opbc_metrics.integrations.trl.trl_to_batch"
_VERL = "opbc_metrics.integrations.verl.verl_to_batch"
# Framework field name -> (the schema field it stands for, the adapter that maps it).
FRAMEWORK_FIELDS: dict[str, tuple[str, str]] = {
    "completion_mask": (RESPONSE_MASK, _TRL),
    "old_per_token_logps": (TRAINER_LOGPROBS, _TRL),
    "per_token_logps": (TRAINER_LOGPROBS, _TRL),
    "sampling_per_token_logps": (ROLLOUT_LOGPROBS, _TRL),
    "attention_mask": (RESPONSE_MASK, _VERL),
    "loss_mask": (RESPONSE_MASK, _VERL),
    "old_log_probs": (TRAINER_LOGPROBS, _VERL),
    "old_log_prob": (TRAINER_LOGPROBS, _VERL),
    "rollout_log_probs": (ROLLOUT_LOGPROBS, _VERL),
    "action_mask": (RESPONSE_MASK, "a mapping onto the schema names"),
    "mask": (RESPONSE_MASK, "a mapping onto the schema names"),
    "logprobs": (TRAINER_LOGPROBS, "a mapping onto the schema names"),
}

# Fields with one entry per sequence (first dimension B).
PER_SEQUENCE_FIELDS: tuple[str, ...] = (
    GROUP_IDS,
    "rewards",
    "advantages",
    "values",
    "returns",
    "prompt_lengths",
    "response_lengths",
    "stop_reasons",
    "discard_reasons",
    "policy_lag",
)


class _TrackedFields(dict):
    """A batch's fields that remember every name looked up (``get``, ``[]``, ``in``), so that the owner of a view
    can tell which fields no metric read (:meth:`BatchView.check_unread`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.looked_up: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.looked_up.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.looked_up.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self.looked_up.add(key)
        return super().__contains__(key)


# Fields metrics read when present, which no metric requires (the required ones come from the metric classes).
OPTIONAL_FIELDS: tuple[str, ...] = (
    "rollout_router_logits", "trainer_router_logits", "rollout_token_ids", "trainer_token_ids", "endpoint_requests",
    "timing_s", "rank_ids", "logits", "loss_tokens", "agent_tool_calls_s", "val_mask",
)
# Every concrete metric class, in definition order (opbc_metrics.metric registers them; read here for their fields).
METRIC_CLASSES: list[type] = []


def known_field_names() -> frozenset[str]:
    """The batch fields some metric of the library reads: the core schema, the per-sequence fields and every
    metric class's ``required_fields`` (the frameworks' own names are not among them)."""
    names = {TRAINER_LOGPROBS, ROLLOUT_LOGPROBS, RESPONSE_MASK, *PER_SEQUENCE_FIELDS, *OPTIONAL_FIELDS}
    for cls in METRIC_CLASSES:
        names.update(f for f in cls.required_fields if isinstance(f, str))
    return frozenset(names - FRAMEWORK_FIELDS.keys())


class UnreadFieldWarning(UserWarning):
    """A batch field that no metric read: ignored (:meth:`BatchView.check_unread`). To silence it after reading it:
    ``warnings.filterwarnings("ignore", category=UnreadFieldWarning)``."""


def _detached(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach() if value.requires_grad else value
    if isinstance(value, Mapping):
        return {k: _detached(v) for k, v in value.items()} if any(
            isinstance(v, Tensor) and v.requires_grad for v in value.values()
        ) else value
    return value


_SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _check_layout(name: str, value: Any) -> None:
    """Refuse a sparse (COO, CSR, ...), nested or other non-strided tensor field, naming it: the metrics read dense
    tensors, and such a field would fail inside torch with an error naming an operator (host metadata only)."""
    if not isinstance(value, Tensor):
        if isinstance(value, Mapping):
            for key, v in value.items():
                _check_layout(f"{name}[{key!r}]", v)
        return
    if value.is_nested:
        raise ValueError(
            f"batch field `{name}` is a nested tensor: metrics read dense [B, T] tensors; pass "
            f"`{name}.to_padded_tensor(0.0)` (with a `{RESPONSE_MASK}` that is 0 on the padding)"
        )
    if value.layout != torch.strided:
        kind = "sparse" if value.layout in _SPARSE_LAYOUTS else "non-strided"
        raise ValueError(
            f"batch field `{name}` is a {kind} tensor (layout {value.layout}): metrics read dense tensors; pass "
            f"`{name}.to_dense()`"
        )


def _length(value: Any) -> int | None:
    """The first-dimension length of a tensor or list/tuple field, ``None`` for anything else."""
    if isinstance(value, Tensor):
        return int(value.shape[0]) if value.ndim >= 1 else None
    if isinstance(value, list | tuple):
        return len(value)
    return None


def check_field_names(data: Mapping[str, Any]) -> None:
    """Refuse framework field names whose schema counterpart is missing, and misaligned per-sequence fields.

    Example:
        >>> check_field_names({"trainer_logprobs": torch.zeros(2, 3), "rewards": torch.zeros(2)})
        >>> check_field_names({"trainer_logprobs": torch.zeros(2, 3), "completion_mask": torch.ones(2, 3)})
        Traceback (most recent call last):
        ...
        ValueError: batch field `completion_mask` is not read by opbc-metrics: the schema name is `response_mask`; ...
    """
    for name, (schema, adapter) in FRAMEWORK_FIELDS.items():
        if data.get(name) is not None and data.get(schema) is None:
            raise ValueError(
                f"batch field `{name}` is not read by opbc-metrics: the schema name is `{schema}`; map the batch "
                f"with {adapter} (or rename the field)"
            )
    reference, size = None, None
    trainer = data.get(TRAINER_LOGPROBS)
    if isinstance(trainer, Tensor) and trainer.ndim == 2:
        reference, size = f"`{TRAINER_LOGPROBS}` is {list(trainer.shape)}", int(trainer.shape[0])
    for name in PER_SEQUENCE_FIELDS:
        n = _length(data.get(name))
        if n is None:
            continue
        if size is None:
            reference, size = f"`{name}` has {n}", n
        elif n != size:
            raise ValueError(
                f"batch field `{name}` has {n} entries but the batch has {size} sequences ({reference}); "
                "per-sequence fields need exactly one entry per sequence"
            )


def as_mapping(batch: Any) -> dict[str, Any]:
    """Turn a mapping, a dataclass or an object with attributes into a plain ``dict`` (shallow)."""
    if batch is None:
        return {}
    if isinstance(batch, Tensor):
        raise TypeError(
            "a batch must be a mapping or a dataclass of tensors, got a Tensor: pass the fields by name, e.g. "
            "update(trainer_logprobs=..., rollout_logprobs=..., response_mask=...)"
        )
    if isinstance(batch, Mapping):
        return dict(batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    if hasattr(batch, "__dict__"):
        return {k: v for k, v in vars(batch).items() if not k.startswith("_")}
    raise TypeError(f"a batch must be a mapping or a dataclass of tensors, got {type(batch).__name__}")


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (bf16/fp16 inputs are computed in float32)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


# The largest log-ratio clamp C float32 computation takes. The weight moments sum w^2 = exp(2 rc), rc in [-C, C]:
# float32 holds exp(+-80) with room for the sums (its normal range ends near exp(+-87)). Beyond it, a batch whose
# every weight is below exp(-44) sums w^2 to 0 (and would read ESS 1, the on-policy value), one above exp(44)
# to inf. float64 holds C up to ~350.
FLOAT32_MAX_CLAMP = 40.0


def check_clamp_dtype(clamp: float, dtype: torch.dtype) -> None:
    """``ValueError`` for a log-ratio clamp above :data:`FLOAT32_MAX_CLAMP` with logprobs computed in float32
    (float32, bfloat16 or float16 inputs): its weight moments would leave float32's range.

    Example:
        >>> check_clamp_dtype(20.0, torch.float32); check_clamp_dtype(60.0, torch.float64)
        >>> check_clamp_dtype(60.0, torch.float32)
        Traceback (most recent call last):
        ...
        ValueError: clamp C = 60 nats needs float64 logprobs: ...
    """
    if dtype != torch.float64 and float(clamp) > FLOAT32_MAX_CLAMP:
        raise ValueError(
            f"clamp C = {float(clamp):g} nats needs float64 logprobs: with float32 ones (bfloat16 and float16 are "
            f"computed in float32) the squared importance weights exp(2 clamp(r, -C, C)) leave float32's range for "
            f"C above {FLOAT32_MAX_CLAMP:g}, and far off-policy the ESS would read 1. Pass `{TRAINER_LOGPROBS}` and "
            f"`{ROLLOUT_LOGPROBS}` as float64, or a clamp of at most {FLOAT32_MAX_CLAMP:g}."
        )


def from_host(data: Any, dtype: torch.dtype, device: torch.device | str | None = None) -> Tensor:
    """Host data (a list, a NumPy array) as a ``dtype`` tensor on ``device``, without a host-device sync.

    ``torch.tensor(data, device="cuda")`` copies with a stream sync, which waits for every kernel queued
    before it; a non-blocking copy of the host tensor does not (pageable host memory is staged at once).

    Example:
        >>> from_host([1, 2], torch.float64)
        tensor([1., 2.], dtype=torch.float64)
    """
    t = torch.as_tensor(data, dtype=dtype)
    return t if device is None or t.device == torch.device(device) else t.to(device, non_blocking=True)


def host_floats(values: Mapping[str, Any]) -> dict[str, float]:
    """The single-element tensors and the numbers of ``values`` (a ``compute()`` result) as Python floats, in
    ``values``' order; other values are left out.

    The tensors come to the host in one copy per device and dtype: on a GPU each ``.item()`` waits for the device
    (a sync per key, ~100 for the default collection), this waits once.

    Example:
        >>> host_floats({"a": torch.tensor(0.5), "n": torch.tensor([3]), "x": 2, "v": torch.ones(2), "s": "no"})
        {'a': 0.5, 'n': 3.0, 'x': 2.0}
    """
    found = {key: float(v) for key, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    for keys, stacked in stacked_scalars(values):
        found.update(zip(keys, map(float, stacked.tolist()), strict=True))
    return {key: found[key] for key in values if key in found}


def stacked_scalars(values: Mapping[str, Any]) -> list[tuple[list[str], Tensor]]:
    """The single-element tensors of ``values``, detached and stacked into one 1-D tensor per device and dtype:
    ``[(keys, stacked)]``, ``stacked[i]`` the value of ``keys[i]`` (one op per group, not one per value).

    Example:
        >>> stacked_scalars({"a": torch.tensor(1.0), "v": torch.ones(2), "b": torch.tensor([2.0])})
        [(['a', 'b'], tensor([1., 2.]))]
    """
    groups: dict[tuple[torch.device, torch.dtype], list[str]] = {}
    for key, value in values.items():
        if isinstance(value, Tensor) and value.numel() == 1:
            groups.setdefault((value.device, value.dtype), []).append(key)
    return [(keys, torch.stack([_scalar(values[k]) for k in keys])) for keys in groups.values()]


def _scalar(value: Tensor) -> Tensor:
    """A single-element tensor as a 0-dim one without autograd history; most are already (views cost ~1 us each,
    ~100 values per read of a collection's result)."""
    return value if value.ndim == 0 and not value.requires_grad else value.detach().reshape(())


def as_bool_mask(mask: Tensor) -> Tensor:
    """``mask != 0`` as a bool tensor; a bool mask is returned as is (``!=`` on bools costs a full pass).

    Example:
        >>> m = torch.tensor([[True, False]])
        >>> as_bool_mask(m) is m, as_bool_mask(torch.tensor([[1.0, 0.0]])).tolist()
        (True, [[True, False]])
    """
    return mask if mask.dtype == torch.bool else mask != 0


def valid_tokens(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """The tokens every mismatch statistic uses: response tokens (``mask`` set) whose log ratio
    ``r = trainer - rollout`` is finite, so both logprobs are and ``r`` does not overflow the compute dtype.

    ``r - r`` is 0 exactly where ``r`` is finite (NaN elsewhere): a pointwise test that inductor fuses. The
    eager mismatch kernel applies the same rule in float arithmetic (see its comment).

    Example:
        >>> valid_tokens(torch.tensor([0.5, float("nan"), float("inf"), 1.0]), torch.tensor([True, True, True, False]))
        tensor([ True, False, False, False])
    """
    return mask & ((log_ratio - log_ratio) == 0)


def raise_if_not_logprobs(low: Tensor | list[float], high: Tensor | list[float]) -> None:
    """The deferred error for a logprob field that holds positive values: probabilities (all values in ``[0, 1]``)
    or logits, rewards and the like (``low``/``high``: the ``[2]`` min/max of the valid trainer and rollout values
    seen in the window; read at compute only; a ``high`` of +inf: positive values counted, their size unknown).
    Log-probabilities are <= 0; up to :data:`PROBABILITY_TOLERANCE` above 0 passes as rounding.

    Example:
        >>> raise_if_not_logprobs(torch.tensor([-3.0, -2.5]), torch.tensor([0.0, -0.1]))
        >>> raise_if_not_logprobs(torch.tensor([0.0, -2.5]), torch.tensor([0.9, -0.1]))
        Traceback (most recent call last):
        ...
        ValueError: batch field `trainer_logprobs` holds values in [0, 1] only (0 to 0.9): probabilities, ...
        >>> raise_if_not_logprobs(torch.tensor([-3.0, -2.5]), torch.tensor([0.0, 4.5]))
        Traceback (most recent call last):
        ...
        ValueError: batch field `rollout_logprobs` holds positive values (up to 4.5): log-probabilities are <= 0 ...
        >>> raise_if_not_logprobs(torch.tensor([-3.0, -2.5]), torch.tensor([float("inf"), -0.1]))
        Traceback (most recent call last):
        ...
        ValueError: batch field `trainer_logprobs` holds positive values on response tokens: log-probabilities ...
    """
    adapters = (
        "map a framework batch with its adapter (opbc_metrics.integrations.trl.trl_to_batch, "
        "opbc_metrics.integrations.verl.verl_to_batch)"
    )
    low, high = (x.tolist() if isinstance(x, Tensor) else x for x in (low, high))
    for name, lo, hi in zip((TRAINER_LOGPROBS, ROLLOUT_LOGPROBS), low, high, strict=True):
        if hi <= PROBABILITY_TOLERANCE:
            continue
        if hi == math.inf:  # counted above the tolerance, size unknown (the compiled kernel; valid tokens are finite)
            raise ValueError(
                f"batch field `{name}` holds positive values on response tokens: log-probabilities are <= 0; for "
                f"probabilities pass torch.log(p), for logits the log-probability of each sampled token, or {adapters}"
            )
        if lo >= 0.0 and hi <= 1.0:
            lo += 0.0  # a -0.0 minimum (masking) reads as 0
            raise ValueError(
                f"batch field `{name}` holds values in [0, 1] only ({lo:g} to {hi:g}): probabilities, not logprobs "
                f"(log-probabilities are <= 0); pass torch.log(p), or {adapters}"
            )
        raise ValueError(
            f"batch field `{name}` holds positive values (up to {hi:g}): log-probabilities are <= 0 (logits, "
            f"rewards or scores are not logprobs); pass the log-probability of each sampled token, or {adapters}"
        )


def raise_if_bad_inputs(logprob_min: Tensor, logprob_max: Tensor, mask_other: Tensor) -> None:
    """The input refusals of the mismatch metrics, on their window's states (one host read for both): positive
    logprobs (:func:`raise_if_not_logprobs`, on ``[2]`` min/max) and ``mask_other`` response_mask entries other
    than 0 and 1 (:attr:`BatchView.mask_other_values`)."""
    *sides, other = torch.cat([logprob_min, logprob_max, mask_other.reshape(1).to(logprob_min.dtype)]).tolist()
    raise_if_not_logprobs(sides[:2], sides[2:])
    if other:
        raise ValueError(
            f"batch field `{RESPONSE_MASK}` held {int(other)} value(s) other than 0 and 1 in this "
            "window: a response mask is 1 on policy tokens and 0 elsewhere (pass e.g. `labels != -100`)"
        )


def check_same_device(name: str, t: Tensor, ref_name: str, ref: Tensor) -> None:
    """A ``ValueError`` naming both batch fields when they are on different devices (moving one would be a
    hidden copy)."""
    if t.device != ref.device:
        raise ValueError(f"batch field `{name}` is on {t.device} but `{ref_name}` is on {ref.device}")


def check_same_shape(name: str, t: Tensor, ref_name: str, ref: Tensor) -> None:
    """A ``ValueError`` naming both batch fields, and what to do, unless ``t`` has the shape and device of ``ref``.

    Example:
        >>> check_same_shape("response_mask", torch.ones(4, 9), "trainer_logprobs", torch.zeros(4, 6))
        Traceback (most recent call last):
        ...
        ValueError: batch field `response_mask` has shape (4, 9) but `trainer_logprobs` has shape (4, 6): ...
    """
    if t.shape != ref.shape:
        shapes = f"has shape {tuple(t.shape)} but `{ref_name}` has shape {tuple(ref.shape)}"
        raise ValueError(f"batch field `{name}` {shapes}: {_shape_hint(name, t, ref_name, ref)}")
    check_same_device(name, t, ref_name, ref)


def _shape_hint(name: str, t: Tensor, ref_name: str, ref: Tensor) -> str:
    """What to do about a shape mismatch: a field over the prompt and the response (verl's ``attention_mask`` is
    [B, P+T]) against per-response-token logprobs [B, T] gets its response part cut; otherwise equal shapes."""
    if t.dim() == ref.dim() == 2 and t.shape[0] == ref.shape[0] and t.shape[1] > ref.shape[1]:
        width = ref.shape[1]
        if "mask" in name:
            return (f"a mask over the prompt and the response (such as verl's attention_mask, [B, P+T]) is wider than "
                    f"the logprobs of the response tokens: pass its response part only, `{name}[:, -{width}:]` "
                    "(verl's own `response_mask` is that), or map the verl batch with "
                    f"{_VERL}")
        return (f"if `{name}` covers the prompt and the response, pass its response part only, "
                f"`{name}[:, -{width}:]`; otherwise give it the shape of `{ref_name}`")
    return f"make the shapes equal: give `{name}` the shape of `{ref_name}`, {tuple(ref.shape)}"


def check_positive(name: str, value: float) -> float:
    """Validate a positive, finite threshold given to a constructor."""
    value = float(value)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"`{name}` must be a positive finite number, got {value}")
    return value


def check_count(name: str, value: int | None, optional: bool = True) -> int | None:
    """Validate a count argument (``top_k``, ``num_experts``, ``num_layers``): an integer >= 1, or ``None``
    where ``optional``.

    Example:
        >>> check_count("top_k", None), check_count("num_layers", 48, optional=False)
        (None, 48)
        >>> check_count("top_k", 0)
        Traceback (most recent call last):
        ...
        ValueError: `top_k` must be None or an integer >= 1, got 0
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        what = "None or an integer" if optional else "an integer"
        raise ValueError(f"`{name}` must be {what} >= 1, got {value!r}")
    return value


class BatchView:
    """One batch, validated on access, with per-token quantities computed once and shared.

    Args:
        batch: a mapping or dataclass of tensors with the batch-schema names.
        **fields: extra or overriding fields, e.g. ``trainer_logprobs=...``.

    Example:
        >>> import torch
        >>> view = BatchView(trainer_logprobs=torch.tensor([[-1.0, -2.0]]),
        ...                  rollout_logprobs=torch.tensor([[-1.5, -2.0]]),
        ...                  response_mask=torch.tensor([[1, 0]]))
        >>> view.log_ratio
        tensor([[0.5000, 0.0000]])
        >>> view.num_valid
        tensor(1.)
    """

    def __init__(self, batch: Any = None, **fields: Any) -> None:
        data = as_mapping(batch)
        data.update(fields)
        for k, v in data.items():
            _check_layout(k, v)  # every field, once, where it enters: no metric reads a sparse tensor
        self.data = _TrackedFields((k, _detached(v)) for k, v in data.items())
        self._cache: dict[Any, Any] = {}
        self._requests: dict[str, set[Hashable]] = {}
        # Shared pre-computations run under torch.compile (an OPBCCollection sets it from its `compiled` option).
        self.compiled = False

    def check_fields(self) -> BatchView:
        """:func:`check_field_names` on this batch, once (metrics and the controller call it)."""
        if "fields_checked" not in self._cache:
            check_field_names(dict(self.data))  # (a copy: these lookups are not reads by a metric)
            self._cache["fields_checked"] = True
        return self

    def check_unread(self, reported: set[str] | None = None) -> list[str]:
        """Refuse or report the fields that no metric read, once every metric has read the view (its owner calls it:
        the collection, the metric or the controller that made the view from the user's batch).

        A field that no metric of the library reads and that is named like a field these metrics looked up and did
        not find (``respons_mask``, ``reward``) is a misspelling that would silently change the result (a mask
        defaults to all ones): ``ValueError``. Any other such field (``input_ids``) is ignored with a
        warning naming it.

        Returns the known fields (schema names: ``rewards``, ``group_ids``, ...) that no metric of the owner read
        and that are not in ``reported`` (the owner's memory, a collection's), adding them to it: the owner reports
        them once (:func:`opbc_metrics.collection.unread_fields_message`; adapters map every field they find: one
        warning, not one per step). Without ``reported`` (a metric alone, the controller): none.

        Example:
            >>> view = BatchView(trainer_logprobs=torch.zeros(1, 2), rollout_logprobs=torch.zeros(1, 2),
            ...                  respons_mask=torch.ones(1, 2))
            >>> _ = view.token_inputs  # what a mismatch metric reads
            >>> view.check_unread()
            Traceback (most recent call last):
            ...
            ValueError: batch field `respons_mask` is not read by opbc-metrics: did you mean `response_mask`? ...
        """
        looked_up = self.data.looked_up
        unread = [k for k, v in self.data.items() if v is not None and k not in looked_up]
        if not unread:
            return []
        known = known_field_names()
        present = {k for k, v in self.data.items() if v is not None}
        # Only the names these metrics looked for matter: a misspelling of a field no metric here reads changes
        # nothing (and `grad_norm` is not a misspelt `rm_grad_norm` of a section that is not here).
        meant = sorted(k for k in looked_up if isinstance(k, str) and k not in present)
        unknown = [k for k in unread if k not in known]
        for name in unknown:
            close = close_name(name, meant)
            if close:
                raise ValueError(
                    f"batch field `{name}` is not read by opbc-metrics: did you mean `{close}`? "
                    "(rename it; a misspelt field would be ignored and change the result)"
                )
        if unknown:
            names = ", ".join(f"`{k}`" for k in unknown)
            warnings.warn(
                f"batch field(s) {names} not read by opbc-metrics: ignored (the batch-schema names are in the README)",
                UnreadFieldWarning,
                stacklevel=3,
            )
        fresh = [k for k in unread if k in known and k not in reported] if reported is not None else []
        if reported is not None:
            reported.update(fresh)
        return fresh

    # -- access and validation ---------------------------------------------------------------
    def has(self, *names: str) -> bool:
        """Whether every named field is present (and not ``None``)."""
        return all(self.data.get(n) is not None for n in names)

    def field(self, name: str) -> Any:
        """A raw field; a clear ``ValueError`` if it is missing."""
        value = self.data.get(name)
        if value is None:
            present = ", ".join(sorted(k for k, v in self.data.items() if v is not None)) or "none"
            hint = ""
            close = close_name(name, [k for k in self.data if isinstance(k, str)])
            if close:
                hint = f"; is it the field given as `{close}`?"
            elif {"batch", "non_tensor_batch"} <= self.data.keys():  # a verl DataProto passed as it is
                hint = f"; a verl DataProto maps onto the schema with {_VERL}"
            raise ValueError(f"batch field `{name}` is required but missing (present: {present}){hint}")
        return value

    def tensor(self, name: str) -> Tensor:
        """A field that must be a tensor."""
        value = self.field(name)
        if not isinstance(value, Tensor):
            raise ValueError(f"batch field `{name}` must be a torch.Tensor, got {type(value).__name__}")
        return value

    # -- shared pre-computations -------------------------------------------------------------
    def request(self, computation: str, *needs: Hashable) -> None:
        """Ask for ``needs`` of the shared pre-computation named ``computation`` (e.g. the mismatch kernel's
        statistic groups, :data:`opbc_metrics.functional.mismatch.TOKEN_STATISTICS`).

        Users of one view ask before any of them computes: an
        :class:`~opbc_metrics.collection.OPBCCollection` calls every member's ``request_shared(view)``
        first, so the computation runs once with the union of the needs (:meth:`requested`).
        """
        self._requests.setdefault(computation, set()).update(needs)

    def requested(self, computation: str) -> frozenset[Hashable]:
        """Everything asked for of ``computation`` so far (empty for a view no collection prepared)."""
        return frozenset(self._requests.get(computation, ()))

    def cached(self, key: Hashable) -> Any:
        """What :meth:`shared` holds under ``key``, or ``None`` (a reader that can use another's result but does not
        need it computed)."""
        return self._cache.get(key)

    def shared(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per view and ``key`` and shared by every metric reading this view."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    @property
    def token_inputs(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(trainer, rollout, mask)``: validated, in the compute dtype, mask as bool ``[B, T]``."""
        return self.shared("token_inputs", self._validate_token_inputs)

    def _validate_token_inputs(self) -> tuple[Tensor, Tensor, Tensor]:
        trainer = self.tensor(TRAINER_LOGPROBS)
        rollout = self.tensor(ROLLOUT_LOGPROBS)
        for name, t in ((TRAINER_LOGPROBS, trainer), (ROLLOUT_LOGPROBS, rollout)):
            if not t.is_floating_point():
                raise ValueError(f"batch field `{name}` must be a floating-point tensor, got {t.dtype}")
            if t.ndim != 2:
                raise ValueError(f"batch field `{name}` must have shape [B, T], got {tuple(t.shape)}")
        check_same_shape(ROLLOUT_LOGPROBS, rollout, TRAINER_LOGPROBS, trainer)
        mask = self.data.get(RESPONSE_MASK)
        if mask is None:
            mask = torch.ones(trainer.shape, dtype=torch.bool, device=trainer.device)
        else:
            mask = self.tensor(RESPONSE_MASK)
            check_same_shape(RESPONSE_MASK, mask, TRAINER_LOGPROBS, trainer)
            if mask.is_complex():
                raise ValueError(f"batch field `{RESPONSE_MASK}` must be bool, integer or float, got {mask.dtype}")
            mask = as_bool_mask(mask)
        dtype = compute_dtype(trainer, rollout)
        return trainer.to(dtype), rollout.to(dtype), mask

    # -- shared per-token quantities --------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.token_inputs[0].dtype

    @property
    def device(self) -> torch.device:
        return self.token_inputs[0].device

    @property
    def numel(self) -> int:
        return self.token_inputs[0].numel()

    @property
    def finite(self) -> Tensor:
        """Both logprobs finite and their difference too (``r`` does not overflow the compute dtype)."""
        trainer, rollout, _ = self.token_inputs
        return self.shared("finite", lambda: valid_tokens(trainer - rollout, torch.ones((), dtype=torch.bool)))

    @property
    def valid(self) -> Tensor:
        """``[B, T]`` bool: response tokens with finite logprobs, the tokens every statistic uses."""
        trainer, rollout, mask = self.token_inputs
        return self.shared("valid", lambda: valid_tokens(trainer - rollout, mask))

    @property
    def valid_f(self) -> Tensor:
        """:attr:`valid` in the compute dtype, for masked sums."""
        return self.shared("valid_f", lambda: self.valid.to(self.dtype))

    @property
    def num_valid(self) -> Tensor:
        """Number of valid tokens (0-dim tensor)."""
        return self.shared("num_valid", lambda: self.valid_f.sum())

    @property
    def mask_other_entries(self) -> Tensor | None:
        """``[B, T]`` bool: the ``response_mask`` entries that are neither 0 nor 1 (NaN included); ``None`` for a
        bool or absent mask, which has none. Such a mask (a label tensor with -100, weights) would count every
        non-zero entry as a response token: :class:`~opbc_metrics.mismatch.metrics.InputHealth` refuses it at
        compute (:attr:`mask_other_values`), the controller rejects the groups of its rows (:attr:`mask_other_rows`).
        """

        def make() -> Tensor | None:
            _, _, mask = self.token_inputs
            raw = self.data.get(RESPONSE_MASK)
            return None if raw is None or raw.dtype == torch.bool else mask & (raw != 1)  # mask: raw != 0

        return self.shared("mask_other_entries", make)

    @property
    def mask_other_values(self) -> Tensor:
        """How many ``response_mask`` entries are neither 0 nor 1 (0-dim, compute dtype; 0 for a bool or absent
        mask)."""
        entries = self.mask_other_entries
        if entries is None:
            return torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.count_nonzero(entries).to(self.dtype)

    @property
    def mask_other_rows(self) -> Tensor | None:
        """``[B]`` bool: the rows holding a ``response_mask`` entry other than 0 and 1 (``None``: a bool or absent
        mask)."""
        entries = self.mask_other_entries
        return None if entries is None else entries.any(dim=1)

    @property
    def logprob_range(self) -> tuple[Tensor, Tensor]:
        """``([2] min, [2] max)`` of the valid trainer and rollout logprobs (0 stands in for invalid tokens): a side
        above 0 holds probabilities or logits, refused by :func:`raise_if_not_logprobs`. The max is over every
        token where a mismatch kernel ran (:attr:`logprob_high`); the min, which only words that refusal
        (probabilities, all in [0, 1], or logits), on a sample of the columns (:attr:`logprob_sample`).
        """
        return self.logprob_sample[0], self.logprob_high

    @property
    def logprob_high(self) -> Tensor:
        """``[2]``: the largest valid trainer and rollout logprob (0 stands in for invalid tokens), over every token.

        The eager mismatch kernel takes it in its own sweep over the tokens
        (:func:`~opbc_metrics.functional.mismatch.batch_statistics` stores it here); the compiled one stores the
        column sample's (:attr:`logprob_sample`), +inf on a side where it counted a positive logprob the sample
        missed; a view that no kernel ran on first makes a pass of its own (:meth:`logprob_high_pass`).
        """
        return self.shared(LOGPROB_HIGH, self.logprob_high_pass)

    def logprob_high_pass(self) -> Tensor:
        """:attr:`logprob_high` in a pass of its own over the tokens."""
        trainer, rollout, mask = self.token_inputs
        valid = valid_tokens(trainer - rollout, mask)
        sides = torch.where(valid, torch.stack((trainer, rollout)), 0.0).flatten(1)
        return sides.amax(dim=1) if sides.shape[1] else sides.new_zeros(2)

    @property
    def logprob_sample(self) -> tuple[Tensor, Tensor]:
        """``([2] min, [2] max)`` of the valid trainer and rollout logprobs on a fixed sample of at most ~64 tokens
        per row, plus its first and last 16 (0 stands in for invalid tokens): ~1/64 of a pass. A response of a few
        tokens in the middle of a long row can fall between the sampled columns.

        Each row reads every ``T // 64``-th column from an offset of its own (37 x row, modulo the stride), so that
        responses confined to a few columns of a long padded batch still fall in the sample of some rows. Rows
        shorter than 128 tokens are read whole.
        """

        def make() -> tuple[Tensor, Tensor]:
            trainer, rollout, mask = self.token_inputs
            zero = torch.zeros((), dtype=self.dtype, device=self.device)
            if self.numel == 0:
                return zero.expand(2), zero.expand(2)
            rows, columns = trainer.shape
            stride = max(1, columns // 64)
            if stride > 1:
                offsets = torch.arange(rows, device=self.device) * 37 % stride
                index = offsets[:, None] + torch.arange(columns // stride, device=self.device) * stride
                # and the first and last 16 columns of every row (short right- or left-padded responses)
                ends = torch.cat([torch.arange(16, device=self.device), torch.arange(columns - 16, columns,
                                                                                     device=self.device)])
                index = torch.cat([index, ends.expand(rows, -1)], dim=1)
                trainer, rollout, mask = (x.gather(1, index) for x in (trainer, rollout, mask))
            valid = valid_tokens(trainer - rollout, mask)  # on the sample
            ranges = [torch.aminmax(torch.where(valid, x, zero)) for x in (trainer, rollout)]
            return torch.stack([r.min for r in ranges]), torch.stack([r.max for r in ranges])

        return self.shared("logprob_sample", make)

    @property
    def log_ratio(self) -> Tensor:
        """``r = trainer - rollout`` on valid tokens, 0 elsewhere (raw, unclamped)."""

        def make() -> Tensor:
            trainer, rollout, _ = self.token_inputs
            return torch.where(self.valid, trainer - rollout, torch.zeros((), dtype=self.dtype, device=self.device))

        return self.shared("log_ratio", make)

    @property
    def abs_log_ratio(self) -> Tensor:
        """``|r|`` on valid tokens, 0 elsewhere."""
        return self.shared("abs_log_ratio", lambda: self.log_ratio.abs())

    def clamped_log_ratio(self, clamp: float) -> Tensor:
        """``clamp(r, -C, C)``, 0 on invalid tokens."""
        return self.shared(("clamped", clamp), lambda: self.log_ratio.clamp(-clamp, clamp))

    def weights(self, clamp: float) -> Tensor:
        """``w = exp(clamp(r, -C, C))`` on valid tokens, 0 elsewhere."""
        return self.shared(("weights", clamp), lambda: self.clamped_log_ratio(clamp).exp() * self.valid_f)

    # -- sequences --------------------------------------------------------------------------
    @property
    def seq_lengths(self) -> Tensor:
        """``[B]`` valid tokens per sequence."""
        return self.shared("seq_lengths", lambda: self.valid_f.sum(dim=1))

    @property
    def seq_valid(self) -> Tensor:
        """``[B]`` bool: sequences with at least one valid token and no non-finite response token."""

        def make() -> Tensor:
            has_bad = (self.token_inputs[2] & ~self.finite).any(dim=1)
            return (self.seq_lengths > 0) & ~has_bad

        return self.shared("seq_valid", make)

    @property
    def seq_valid_f(self) -> Tensor:
        return self.shared("seq_valid_f", lambda: self.seq_valid.to(self.dtype))

    @property
    def seq_log_ratio(self) -> Tensor:
        """``[B]`` float64 ``s_i = sum_t r_t``; 0 for sequences outside :attr:`seq_valid`."""
        return self.shared(
            "seq_log_ratio", lambda: self.log_ratio.sum(dim=1, dtype=torch.float64) * self.seq_valid_f
        )

    @property
    def seq_mean_log_ratio(self) -> Tensor:
        """``[B]`` ``s_i / n_i`` (length-normalised); 0 for sequences outside :attr:`seq_valid`."""
        return self.shared(
            "seq_mean_log_ratio", lambda: self.seq_log_ratio / self.seq_lengths.clamp_min(1.0)
        )

    def seq_weights(self, clamp: float) -> Tensor:
        """``[B]`` ``w_i = exp(clamp(s_i, -C, C))``; 0 for sequences outside :attr:`seq_valid`."""
        return self.shared(
            ("seq_weights", clamp), lambda: self.seq_log_ratio.clamp(-clamp, clamp).exp() * self.seq_valid_f
        )


def as_view(batch: Any = None, **fields: Any) -> BatchView:
    """Reuse a :class:`BatchView` (so a collection shares its cache) or wrap a new batch."""
    if isinstance(batch, BatchView) and not fields:
        return batch
    if isinstance(batch, BatchView):
        batch = batch.data
    return BatchView(batch, **fields)
