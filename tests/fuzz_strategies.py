"""Hostile inputs for tests/test_fuzz.py: batch fields of every kind the public ``update()`` s read, with
random shapes (0-size, 1x1, mismatched), dtypes, non-finite and sentinel values, empty and fully masked
rows, huge log ratios, non-contiguous / strided / broadcast layouts and a field on another device.

Hypothesis draws a small *plan* (sizes, dtype, value pool, mask kind, layouts, at most one structural
mutation); the tensors are then built from the plan's seed with NumPy, so a case is cheap to build and
shrinks through its parameters. Nothing here reads the library: expectations (which fields are hostile,
how many non-finite tokens a batch holds) are derived from the built tensors alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

NAN, INF = float("nan"), float("inf")
F32_MIN = float(torch.finfo(torch.float32).min)  # what masked_fill(..., finfo.min) leaves in a logprob
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Specials: NaN and +-inf (vLLM returns -inf outside top-p), the -9999 sentinel, huge log ratios (+-1e4), the
# float32 minimum used as a mask fill, and exact zeros (a missing-logprob fill).
SPECIALS = (NAN, INF, -INF, -9999.0, 1e4, -1e4, F32_MIN, 0.0)
LAYOUTS = ("contiguous", "transposed", "strided", "expanded")
MASK_KINDS = ("absent", "ones", "zeros", "random", "empty_rows", "first_row_only", "float", "int8")
# Structural mutations of one field; the run must then raise a ValueError/TypeError naming that field or
# accept the input and return finite values. A field that is not a tensor gets the type mutations (mutate).
TENSOR_MUTATIONS: dict[str, Callable[[torch.Tensor], Any]] = {
    "extra_dim": lambda t: t[..., None],
    "drop_dim": lambda t: t.sum(-1) if t.ndim else t.reshape(1),
    "other_size": lambda t: torch.zeros([t.shape[0] + 1, *t.shape[1:]] if t.ndim else [2], dtype=t.dtype),
    "int_dtype": lambda t: torch.nan_to_num(t.double(), nan=0.0, posinf=0.0, neginf=0.0).to(torch.int64),
    "bool_dtype": lambda t: torch.nan_to_num(t.double(), nan=1.0) != 0,
    "float_dtype": lambda t: t.to(torch.float32),
    "complex_dtype": lambda t: t.to(torch.complex64),
    "meta_device": lambda t: t.to("meta"),
    "as_list": lambda t: t.tolist(),
    "as_string": lambda t: "not a tensor",
    "none": lambda t: None,
}
MUTATIONS = tuple(TENSOR_MUTATIONS)


@dataclass
class Plan:
    """The drawn parameters of one case."""

    seed: int
    b: int
    t: int
    dtype: torch.dtype
    specials: tuple[float, ...]
    rate: float
    mask_kind: str
    layouts: dict[str, str] = field(default_factory=dict)
    mutation: tuple[str, str] | None = None  # (field, kind)
    extra: dict[str, Any] = field(default_factory=dict)

    def rng(self, salt: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, *salt.encode()])


def plans(fields: tuple[str, ...], mutate: bool = True, max_b: int = 5, max_t: int = 7) -> st.SearchStrategy[Plan]:
    """Plans for a batch with ``fields``: sizes 0..max, one float dtype, a subset of specials, layouts."""

    @st.composite
    def make(draw: Any) -> Plan:
        b = draw(st.sampled_from((0, 1, 1, 2, 3, 4, max_b)))
        t = draw(st.sampled_from((0, 1, 1, 2, 3, 5, max_t)))
        specials = tuple(draw(st.lists(st.sampled_from(SPECIALS), max_size=4, unique_by=repr)))
        rate = draw(st.sampled_from((0.0, 0.15, 0.5, 1.0))) if specials else 0.0
        layouts = {f: draw(st.sampled_from(LAYOUTS)) for f in fields}
        mutation = None
        if mutate and draw(st.booleans()):
            mutation = (draw(st.sampled_from(fields)), draw(st.sampled_from(MUTATIONS)))
        return Plan(seed=draw(st.integers(0, 2**16)), b=b, t=t, dtype=draw(st.sampled_from(FLOAT_DTYPES)),
                    specials=specials, rate=rate, mask_kind=draw(st.sampled_from(MASK_KINDS)), layouts=layouts,
                    mutation=mutation)

    return make()


# -- values -----------------------------------------------------------------------------------------------
def with_specials(plan: Plan, name: str, values: np.ndarray) -> np.ndarray:
    """Replace a ``plan.rate`` share of ``values`` (float64) by specials drawn from ``plan.specials``."""
    if not plan.specials or plan.rate == 0.0 or values.size == 0:
        return values
    rng = plan.rng("specials/" + name)
    hit = rng.random(values.shape) < plan.rate
    pick = rng.integers(0, len(plan.specials), values.shape)
    return np.where(hit, np.asarray(plan.specials, dtype=np.float64)[pick], values)


def logprobs(plan: Plan, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Logprob-like values: mostly in [-8, 0], some near 0, plus specials."""
    rng = plan.rng(name)
    x = -rng.exponential(1.5, shape)
    if x.size:
        x = np.where(rng.random(shape) < 0.2, x * 0.01, x)
    return with_specials(plan, name, x)


def reals(plan: Plan, name: str, shape: tuple[int, ...], scale: float = 2.0) -> np.ndarray:
    """Real values (rewards, advantages, values, scores) plus specials."""
    return with_specials(plan, name, plan.rng(name).normal(0.0, scale, shape))


def counts(plan: Plan, name: str, shape: tuple[int, ...], high: int = 40) -> np.ndarray:
    """Non-negative integer counts (lengths, turns); with specials, some turn negative or non-finite."""
    x = plan.rng(name).integers(0, high, shape).astype(np.float64)
    return with_specials(plan, name, x)


def to_tensor(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """``values`` (float64) as ``dtype``; integer/bool targets get finite values (NaN -> 0, inf -> +-1e4)."""
    t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))
    if dtype.is_floating_point:
        return t.to(dtype)
    t = torch.nan_to_num(t, nan=0.0, posinf=1e4, neginf=-1e4)
    return t.round().to(dtype) if dtype != torch.bool else t != 0


def mask_values(plan: Plan, b: int, t: int) -> torch.Tensor | None:
    """A response mask of ``plan.mask_kind``: None (absent), all ones, all zeros, ragged, empty rows, ..."""
    rng = plan.rng("mask")
    kind = plan.mask_kind
    if kind == "absent":
        return None
    if kind == "ones":
        return torch.ones(b, t, dtype=torch.bool)
    if kind == "zeros":
        return torch.zeros(b, t, dtype=torch.int64)
    m = rng.random((b, t)) < 0.7
    if kind == "empty_rows" and b:
        m[rng.random(b) < 0.5] = False
    if kind == "first_row_only" and b:
        m[1:] = False
    if kind == "float":
        return torch.from_numpy(m.astype(np.float32))
    if kind == "int8":
        return torch.from_numpy(m.astype(np.int8))
    return torch.from_numpy(m)


# -- layouts: the same values, other memory layouts -------------------------------------------------------
def expanded_values(t: torch.Tensor) -> torch.Tensor:
    """The values an ``expanded`` layout holds: the first slice along dim 0, repeated (contiguous)."""
    if t.ndim == 0 or t.shape[0] == 0:
        return t
    return t[:1].expand_as(t).contiguous()


def apply_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t``'s values (or, for ``expanded``, :func:`expanded_values`) in a non-contiguous layout.

    ``transposed``: a transposed view of a contiguous transposed copy; ``strided``: every other element of
    an interleaved buffer; ``expanded``: a stride-0 broadcast of the first slice.
    """
    if not isinstance(t, torch.Tensor) or t.ndim == 0 or t.numel() == 0 or t.device.type == "meta":
        return t
    if layout == "transposed" and t.ndim >= 2:
        return t.transpose(0, -1).contiguous().transpose(0, -1)
    if layout == "strided":
        junk = torch.zeros_like(t)
        return torch.stack([t, junk], dim=-1)[..., 0]
    if layout == "expanded":
        return t[:1].expand_as(t)
    return t


# -- structural mutations ---------------------------------------------------------------------------------
def mutate(value: Any, kind: str) -> Any:
    """One structural mutation of a field's value (:data:`TENSOR_MUTATIONS`; other values: the type ones)."""
    if isinstance(value, torch.Tensor) or kind in ("as_string", "none"):
        return TENSOR_MUTATIONS[kind](value)
    return {"as_list": [value], "int_dtype": object(), "bool_dtype": object()}.get(kind, value)


def _holds(value: Any, tensor: Callable[[torch.Tensor], bool], number: Callable[[float], bool]) -> bool:
    """Whether a field (a tensor, a number, nested lists or dict values of them) holds an entry that passes."""
    if isinstance(value, torch.Tensor):
        return value.device.type != "meta" and tensor(value)
    if isinstance(value, (int, float)):
        return number(value)
    if isinstance(value, dict):
        value = list(value.values())
    return isinstance(value, (list, tuple)) and any(_holds(v, tensor, number) for v in value)


def nonfinite_in(value: Any) -> bool:
    """Whether a field holds a NaN/inf."""
    return _holds(value, lambda t: t.is_floating_point() and not bool(torch.isfinite(t).all()),
                  lambda x: isinstance(x, float) and not math.isfinite(x))


def negative_in(value: Any) -> bool:
    """Whether a field holds a negative number (for count fields)."""
    return _holds(value, lambda t: t.dtype != torch.bool and bool((t < 0).any()), lambda x: x < 0)


# Per-token logprob fields (the schema's and the frameworks'): log-probabilities are <= 0.
TOKEN_LOGPROB_FIELDS = frozenset({"trainer_logprobs", "rollout_logprobs", "old_log_probs", "rollout_log_probs",
                                  "old_per_token_logps", "sampling_per_token_logps"})


def out_of_range(name: str, value: Any) -> bool:
    """Codes outside a field's declared range (``rank_ids`` for 2 ranks, ``discard_reasons`` 0..2), and positive
    values in a per-token logprob field (a special such as 1e4: no log-probability)."""
    if name in TOKEN_LOGPROB_FIELDS:
        return isinstance(value, torch.Tensor) and value.is_floating_point() and bool((value > 0.01).any())
    if name == "stop_reasons" and isinstance(value, torch.Tensor) and value.dtype != torch.bool:
        return bool(((value < 0) | (value > 2)).any())  # int codes: STOP_REASON_CODES 0..2
    limit = {"rank_ids": 2, "discard_reasons": 3}.get(name)
    return limit is not None and isinstance(value, torch.Tensor) and bool((value >= limit).any())


# -- field builders: name -> (plan, name, b, t) -> value --------------------------------------------------
Builder = Callable[[Plan, str, int, int], Any]
Values = Callable[[Plan, str, tuple[int, ...]], np.ndarray]


def floats(make: Values, dims: str) -> Builder:
    """A float field of ``make``'s values shaped ``dims``; ``b|bt`` is [B] or [B, T], one choice per batch
    (the [B] and [B, T] fields of one batch must agree: values with returns, ...)."""

    def build(plan: Plan, name: str, b: int, t: int) -> torch.Tensor:
        if dims == "b|bt":
            shape = (b, t) if plan.rng("ndim").random() < 0.5 else (b,)
        else:
            shape = {"bt": (b, t), "b": (b,), "b1": (b, 1), "b2": (b, 2), "bt3": (b, t, 3)}[dims]
        return to_tensor(make(plan, name, shape), plan.dtype)

    return build


def _counts(dtype: torch.dtype = torch.int64) -> Builder:
    def build(plan: Plan, name: str, b: int, t: int) -> torch.Tensor:
        x = counts(plan, name, (b,))
        return to_tensor(x, torch.float64 if nonfinite_or_fraction(x) else dtype)

    return build


def nonfinite_or_fraction(x: np.ndarray) -> bool:
    return bool(x.size) and not bool(np.all(np.isfinite(x)) and np.all(x == np.round(x)))


def _group_ids(plan: Plan, name: str, b: int, t: int) -> Any:
    rng = plan.rng("group_ids")
    ids = rng.integers(0, max(1, b // 2 + 1), b)
    if rng.random() < 0.3:  # verl's uid strings
        return [f"uid-{i}" for i in ids]
    if rng.random() < 0.2:  # huge and negative ids
        return torch.from_numpy(ids * (2**40) - 7)
    return torch.from_numpy(ids)


def _experts(plan: Plan, name: str, b: int, t: int) -> torch.Tensor:
    base = plan.rng("experts").integers(0, 8, (b, t, 3, 2))  # both sides share a base so that some ids agree
    flip = plan.rng(name).random((b, t, 3, 2)) < 0.3
    return torch.from_numpy(np.where(flip, plan.rng(name + "/ids").integers(0, 8, (b, t, 3, 2)), base))


def _router_logits(plan: Plan, name: str, b: int, t: int) -> torch.Tensor:
    return to_tensor(reals(plan, name, (b, t, 3, 4)), plan.dtype)


def _token_ids(plan: Plan, name: str, b: int, t: int) -> torch.Tensor:
    base = plan.rng("token_ids").integers(0, 50, (b, t))
    other = plan.rng(name).integers(0, 50, (b, t))
    return torch.from_numpy(np.where(plan.rng(name + "/x").random((b, t)) < 0.1, other, base))


def _scalar(plan: Plan, name: str, b: int, t: int) -> Any:
    """A trainer scalar: a float, a 0-d tensor, a list, or a 1-D tensor (one per micro-batch)."""
    x = with_specials(plan, name, plan.rng(name).normal(0.5, 1.0, (max(b, 1),)))
    form = _scalar_form(plan)
    if form == 0:
        return float(x[0])
    if form == 1:
        return torch.tensor(float(x[0]), dtype=plan.dtype)
    return [float(v) for v in x] if form == 2 else to_tensor(x, plan.dtype)


def _scalar_form(plan: Plan) -> int:
    """0: a float, 1: a 0-d tensor, 2: a list, 3: a 1-D tensor (one form per batch, shared with loss_tokens)."""
    return int(plan.rng("scalar_form").integers(0, 4))


def _loss_tokens(plan: Plan, name: str, b: int, t: int) -> Any:
    """One weight per observation of the batch's trainer scalar."""
    w = [float(v) for v in counts(plan, "loss_tokens", (max(b, 1),))]
    return w if _scalar_form(plan) >= 2 else w[0]


def _timing(plan: Plan, name: str, b: int, t: int) -> dict[str, Any]:
    rng = plan.rng("timing")
    stages = ("gen", "step", "update_actor", "old_log_prob", "reward")
    out: dict[str, Any] = {s: float(rng.exponential(2.0)) for s in stages if rng.random() < 0.8}
    if plan.specials and rng.random() < plan.rate:
        out[stages[rng.integers(0, len(stages))]] = float(plan.specials[rng.integers(0, len(plan.specials))])
    return out


def _stop_reasons(plan: Plan, name: str, b: int, t: int) -> Any:
    rng = plan.rng("stop_reasons")
    form = rng.integers(0, 3)
    if form == 0:
        return [("stop", "length", "abort", None, "tool_calls")[i] for i in rng.integers(0, 5, b)]
    if form == 1:
        return torch.from_numpy(rng.integers(-1, 4, b))
    return torch.from_numpy(rng.random(b) < 0.5)


def _discard_reasons(plan: Plan, name: str, b: int, t: int) -> Any:
    rng = plan.rng("discard_reasons")
    if rng.random() < 0.5:
        return [("max_async", "zero_advantage", None, "")[i] for i in rng.integers(0, 4, b)]
    return torch.from_numpy(rng.integers(0, 4 if plan.specials else 3, b))


def _sample_metrics(plan: Plan, name: str, b: int, t: int) -> Any:
    rng = plan.rng("sample_metrics")
    cols = {n: to_tensor(reals(plan, "sample_metrics/" + n, (b,)), plan.dtype) for n in ("format", "tool_calls")}
    if rng.random() < 0.3:  # list of per-sample mappings (RewardResult.sample_metrics), some names missing
        return [{n: float(c[i]) for n, c in cols.items() if rng.random() < 0.8} for i in range(b)]
    return cols


def _data_sources(plan: Plan, name: str, b: int, t: int) -> Any:
    rng = plan.rng("data_sources")
    if rng.random() < 0.3:
        return "gsm8k"
    return [("gsm8k", "math")[i] for i in rng.integers(0, 2, b)]


def _val(plan: Plan, name: str, b: int, t: int) -> torch.Tensor:
    x = plan.rng(name).integers(0, 2, (b, 2)).astype(np.float64)
    if name == "val_rewards":
        x = plan.rng(name).normal(0.0, 1.0, (b, 2))
    return to_tensor(with_specials(plan, name, x), plan.dtype)


def _times(plan: Plan, name: str, b: int, t: int) -> Any:
    x = with_specials(plan, name, plan.rng(name).exponential(1.0, (b,)))
    return [float(v) for v in x] if plan.rng("form/" + name).random() < 0.5 else to_tensor(x, plan.dtype)


def _completion_mask(plan: Plan, name: str, b: int, t: int) -> torch.Tensor:
    lengths = plan.rng(name).integers(0, t + 1, (b, 1))
    return torch.from_numpy((np.arange(t)[None, :] < lengths).astype(np.int64))


def _prompt_mask(plan: Plan, name: str, b: int, t: int) -> torch.Tensor:
    return torch.from_numpy((np.arange(3)[None, :] >= plan.rng(name).integers(0, 4, (b, 1))).astype(np.int64))


def _attention_mask(plan: Plan, name: str, b: int, t: int) -> torch.Tensor:
    """verl's [B, P + T] attention mask: left-padded prompt (P = 3), right-padded response."""
    rng = plan.rng("attention_mask")
    prompt = np.arange(3)[None, :] >= rng.integers(0, 4, (b, 1))
    response = np.arange(t)[None, :] < rng.integers(0, t + 1, (b, 1))
    return torch.from_numpy(np.concatenate([prompt, response], axis=1).astype(np.int64))


def _uid(plan: Plan, name: str, b: int, t: int) -> Any:
    rng = plan.rng("uid")
    ids = [f"p-{i}" for i in rng.integers(0, max(1, b // 2 + 1), b)]
    form = rng.integers(0, 3)
    if form == 0:
        return np.array(ids, dtype=object)
    return ids if form == 1 else torch.from_numpy(rng.integers(0, 3, b))


def _fields(names: str, build: Builder) -> dict[str, Builder]:
    return dict.fromkeys(names.split(), build)


BUILDERS: dict[str, Builder] = {
    "response_mask": lambda plan, name, b, t: mask_values(plan, b, t),
    "group_ids": _group_ids,
    "policy_lag": lambda plan, name, b, t: to_tensor(counts(plan, name, (b,), high=10), torch.float64),
    "entropies": floats(lambda p, n, s: np.abs(reals(p, n, s)), "bt"),
    "logits": floats(reals, "bt3"),
    "num_turns": _counts(torch.int32),
    "rank_ids": lambda plan, name, b, t: torch.from_numpy(plan.rng(name).integers(0, 3 if plan.specials else 2, b)),
    "stop_reasons": _stop_reasons,
    "discard_reasons": _discard_reasons,
    "sample_metrics": _sample_metrics,
    "loss_tokens": _loss_tokens,
    "timing_s": _timing,
    "policy_rejected_logps": floats(logprobs, "b1"),
    "val_num_turns": floats(lambda p, n, s: counts(p, n, s, high=6), "b2"),
    "val_mask": lambda plan, name, b, t: torch.from_numpy(plan.rng(name).random((b, 2)) < 0.8),
    "data_sources": _data_sources,
    **_fields("trainer_logprobs rollout_logprobs policy_logprobs old_logprobs", floats(logprobs, "bt")),
    **_fields("policy_chosen_logps reference_chosen_logps reference_rejected_logps", floats(logprobs, "b")),
    **_fields("chosen_scores rejected_scores", floats(reals, "b")),
    **_fields("rewards advantages values returns scores", floats(reals, "b|bt")),
    **_fields("rollout_experts trainer_experts", _experts),
    **_fields("rollout_router_logits trainer_router_logits", _router_logits),
    **_fields("rollout_token_ids trainer_token_ids", _token_ids),
    **_fields("prompt_lengths response_lengths", _counts()),
    **_fields("agent_generate_s agent_tool_calls_s", _times),
    **_fields("val_acc val_rewards", _val),
    **_fields("actor_loss pg_loss entropy_loss kl_loss kl_coef actor_grad_norm actor_lr critic_loss critic_lr "
              "rm_grad_norm", _scalar),
    # framework adapters' own field names (verl DataProto, TRL GRPOTrainer inputs)
    "responses": _token_ids, "attention_mask": _attention_mask, "uid": _uid,
    "token_level_rewards": floats(reals, "bt"), "prompt_mask": _prompt_mask,
    **_fields("old_log_probs rollout_log_probs old_per_token_logps sampling_per_token_logps", floats(logprobs, "bt")),
    **_fields("completion_mask tool_mask", _completion_mask),
}


# Optional fields that come in pairs (both sides or neither).
PAIRED = {"rollout_experts": "experts", "trainer_experts": "experts", "rollout_token_ids": "token_ids",
          "trainer_token_ids": "token_ids"}


@dataclass
class Case:
    """A built batch: the fields as given to ``update`` and their contiguous, unmutated twins."""

    plan: Plan
    batch: dict[str, Any]  # with layouts and the mutation applied
    plain: dict[str, Any]  # contiguous, same values, no mutation
    mutated: str | None  # the field whose structure was mutated (None: structurally valid batch)
    hostile: set[str]  # fields holding non-finite (or, for counts, negative) values


def build_case(
    plan: Plan, fields: tuple[str, ...], optional: tuple[str, ...] = (), builders: dict[str, Builder] | None = None
) -> Case:
    """Build every field of ``fields`` (and of ``optional``, each present with probability 1/2); ``builders``
    override :data:`BUILDERS` for some names."""
    b, t = plan.b, plan.t
    make = {**BUILDERS, **(builders or {})}
    plain: dict[str, Any] = {}
    for name in (*fields, *optional):
        if name in optional and plan.rng("present/" + PAIRED.get(name, name)).random() < 0.5:
            continue
        value = make[name](plan, name, b, t)
        if value is None:
            continue
        if isinstance(value, torch.Tensor) and plan.layouts.get(name) == "expanded":
            value = expanded_values(value)
        plain[name] = value
    batch = {k: apply_layout(v, plan.layouts.get(k, "contiguous")) if isinstance(v, torch.Tensor) else v
             for k, v in plain.items()}
    mutated = None
    if plan.mutation is not None and plan.mutation[0] in batch:
        name, kind = plan.mutation
        new = mutate(plain[name], kind)
        if new is None:
            del batch[name]
        else:
            batch[name] = new
        mutated = name
    hostile = {k for k, v in plain.items()
               if nonfinite_in(v) or (k in COUNT_FIELDS and negative_in(v)) or out_of_range(k, v)}
    return Case(plan, batch, plain, mutated, hostile)


COUNT_FIELDS = frozenset({"prompt_lengths", "response_lengths", "num_turns", "val_num_turns", "loss_tokens",
                          "agent_generate_s", "agent_tool_calls_s", "timing_s", "policy_lag", "rank_ids",
                          "discard_reasons"})


def int_group_ids(plan: Plan, name: str, b: int, t: int) -> torch.Tensor:
    """Integer group ids (the controller's contract: a [B] integer tensor), some huge or negative."""
    ids = _group_ids(plan, name, b, t)
    if isinstance(ids, list):
        return torch.tensor([int(x.split("-")[1]) for x in ids], dtype=torch.int64)
    return ids


def lag_or_number(plan: Plan, name: str, b: int, t: int) -> Any:
    """``policy_lag``: a [B] tensor (with specials) or one number for the batch."""
    x = counts(plan, "policy_lag", (b,), high=10)
    if plan.rng("lag_form").random() < 0.3:
        return float(x[0]) if b else 3.0
    return to_tensor(x, torch.float64)


# -- host data: agent trajectories and OpenAI-compatible endpoint responses -------------------------------
class Opaque:
    """A value no JSON encoder, number check or mapping check accepts."""

    def __repr__(self) -> str:
        return "Opaque()"


class Nested(list):
    """A list nested ``depth`` deep (deep enough to exhaust a recursive JSON encoder), with a short repr."""

    def __init__(self, depth: int) -> None:
        inner: Any = []
        for _ in range(depth - 1):
            inner = [inner]
        super().__init__([inner] if depth else [])
        self.depth = depth

    def __repr__(self) -> str:
        return f"Nested({self.depth})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))


JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4),
    st.binary(max_size=3), st.builds(Opaque), st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(0, 3), max_size=2),
)
def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """Draw from one of ``choices`` with the given integer weights (``st.one_of`` flattens nested one_ofs
    and weighs every leaf branch alike, which would bury the valid structures under the junk)."""
    table = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.integers(0, len(table) - 1).flatmap(lambda i: table[i])


def mostly(valid: st.SearchStrategy[Any], junk: st.SearchStrategy[Any] = JUNK) -> st.SearchStrategy[Any]:
    """``valid`` seven times in eight, else ``junk``: deep structures stay reachable, and a fair share of
    the batches is valid all the way down."""
    return weighted((7, valid), (1, junk))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)
ARGUMENTS = weighted(
    (3, JSON.map(json.dumps)),  # a JSON string, as OpenAI sends it
    (2, JSON),  # an already parsed value
    (1, st.text(max_size=8)),  # often malformed JSON
    (1, st.sampled_from((None, "  ", b"{}", b"\xff"))),
    (1, st.builds(Opaque)),
    (1, st.sampled_from((50, 5000)).map(Nested)),  # deeply nested parsed arguments
    (1, st.sampled_from((50, 5000)).map(lambda d: "[" * d + "]" * d)),  # deeply nested JSON text
)
TEXT_PART = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=4)})
CONTENT = weighted((2, st.none()), (3, st.text(max_size=8)), (1, st.lists(mostly(TEXT_PART), max_size=2)), (1, JUNK))

NAME = st.sampled_from(("search", "calc"))
FUNCTION = mostly(st.fixed_dictionaries({"name": mostly(NAME), "arguments": ARGUMENTS}))
TOOL_CALL = mostly(st.fixed_dictionaries({"type": st.just("function"), "function": FUNCTION}))
ASSISTANT = st.fixed_dictionaries(
    {"role": st.just("assistant"), "content": CONTENT},
    optional={"tool_calls": mostly(st.lists(TOOL_CALL, min_size=1, max_size=2)), "function_call": FUNCTION},
)
MESSAGE = weighted(
    (2, ASSISTANT),
    (1, st.fixed_dictionaries({"role": st.sampled_from(("user", "tool", "system", "bogus", None)),
                               "content": CONTENT})),
    (1, JUNK),
)


@st.composite
def trajectory_objects(draw: Any) -> Any:
    from opbc_metrics.agent import Step, Trajectory

    steps = draw(st.lists(st.tuples(st.text(max_size=6), st.lists(st.tuples(
        st.sampled_from(("search", "calc", "")), st.one_of(JSON, st.text(max_size=6)),
    ), max_size=2)), min_size=1, max_size=3))
    answer = draw(st.one_of(st.none(), st.text(max_size=6)))
    return Trajectory([Step(c, tuple(calls)) for c, calls in steps], final_answer=answer)


SIDE = weighted((2, st.lists(ASSISTANT, min_size=1, max_size=2)), (2, st.lists(MESSAGE, min_size=1, max_size=4)),
                (1, st.lists(MESSAGE, max_size=2)), (2, trajectory_objects()), (1, JUNK))
PAIR = weighted((6, st.tuples(SIDE, SIDE)), (1, st.lists(SIDE, max_size=3)), (1, JUNK))
TRAJECTORY_PAIRS = weighted((6, st.lists(PAIR, min_size=1, max_size=3)), (1, st.lists(PAIR, max_size=3)), (1, JUNK))

LOGPROB = mostly(st.floats(allow_nan=True, allow_infinity=True))
CHAT_ITEM = st.fixed_dictionaries(
    {"token": mostly(st.one_of(st.text(max_size=4), st.just("token_id:17"))), "logprob": LOGPROB},
    optional={"top_logprobs": mostly(st.lists(mostly(st.fixed_dictionaries(
        {"token": st.text(max_size=3), "logprob": LOGPROB})), max_size=2))},
)
TOKEN_IDS = mostly(st.lists(st.integers(0, 10**6), max_size=3))
CHAT_LOGPROBS = st.fixed_dictionaries({"content": weighted((1, st.none()), (6, st.lists(mostly(CHAT_ITEM), max_size=3)),
                                                          (1, JUNK))})
CHAT_CHOICE = mostly(st.fixed_dictionaries(
    {"message": mostly(st.fixed_dictionaries({"role": st.just("assistant"), "content": CONTENT}))},
    optional={"logprobs": weighted((1, st.none()), (6, CHAT_LOGPROBS), (1, JUNK)),
              "token_ids": TOKEN_IDS, "index": st.integers(0, 3)},
))
TEXT_LOGPROBS = st.fixed_dictionaries(
    {"tokens": mostly(st.lists(mostly(st.one_of(st.text(max_size=3), st.just("token_id:5"))), max_size=3)),
     "token_logprobs": mostly(st.lists(st.one_of(st.none(), LOGPROB), max_size=3))},
    optional={"top_logprobs": mostly(st.lists(st.one_of(st.none(), st.dictionaries(
        st.text(max_size=3), LOGPROB, max_size=2)), max_size=3))},
)
TEXT_CHOICE = mostly(st.fixed_dictionaries(
    {"text": mostly(st.text(max_size=4))},
    optional={"logprobs": weighted((1, st.none()), (6, TEXT_LOGPROBS), (1, JUNK)),
              "token_ids": TOKEN_IDS, "prompt_token_ids": TOKEN_IDS},
))
RESPONSE = weighted(
    (3, st.fixed_dictionaries(
        {"choices": mostly(st.lists(CHAT_CHOICE, min_size=1, max_size=2), st.one_of(st.just([]), JUNK))},
        optional={"object": weighted((6, st.just("chat.completion")), (1, st.just("chat.completion.chunk"))),
                  "system_fingerprint": mostly(st.text(max_size=4)), "prompt_token_ids": TOKEN_IDS},
    )),
    (3, st.fixed_dictionaries(
        {"choices": mostly(st.lists(TEXT_CHOICE, min_size=1, max_size=2), st.one_of(st.just([]), JUNK))},
        optional={"object": st.just("text_completion"), "system_fingerprint": mostly(st.text(max_size=4))},
    )),
    (1, JUNK),
)
REQUEST = weighted((1, st.none()), (3, st.fixed_dictionaries({}, optional={"seed": mostly(st.integers())})),
                   (1, JUNK))
ENDPOINT_RESPONSES = mostly(st.lists(RESPONSE, min_size=1, max_size=3), st.one_of(st.just([]), JUNK))


def endpoint_requests(responses: Any) -> st.SearchStrategy[Any]:
    """Request bodies: none, one for all, a parallel list (usually as long as ``responses``), or junk."""
    n = len(responses) if isinstance(responses, list) else 2
    return weighted((1, st.none()), (1, REQUEST), (4, st.lists(REQUEST, min_size=n, max_size=n)),
                    (1, st.lists(REQUEST, max_size=3)))
