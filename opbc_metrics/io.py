"""Readers of rollout dumps for offline analysis: JSONL (one sample per line), JSON arrays and ``.pt`` tensor files.

Both readers turn a file into batches in the batch schema of :mod:`opbc_metrics.batch`
(``trainer_logprobs`` [B, T], ``rollout_logprobs`` [B, T], ``response_mask`` [B, T], ``group_ids`` [B], ...), ready for
:class:`~opbc_metrics.collection.OPBCCollection`. Bad input never raises out of a reader: every
problem becomes an :class:`InputIssue` with the line (JSONL) or record/row range (``.pt``) it came
from, and the caller decides whether to skip it or stop.

Text dumps are JSONL (``.jsonl``, ``.ndjson``, ``.jsonlines``: one JSON object per line, always read line by
line) or a JSON array of objects (a ``.json`` file or standard input whose first character is ``[``; a
``.json`` file of one object per line is read as JSONL), optionally gzip-compressed
(``.gz``, or recognised by its first bytes), read from a file or from standard input (``-`` or
``/dev/stdin``). Every sample is reported by the line it starts on.

Sample schema (one JSON object per sample; blank lines are ignored; other keys are ignored, see below):

==================  ==============================  =====================================================
key                 type                            meaning
==================  ==============================  =====================================================
trainer_logprobs    list[float], length T           log pi_trainer of each token (required)
rollout_logprobs    list[float], length T           log pi_rollout of each token (required)
response_mask       list[0/1 or bool], length T     1 on policy tokens, 0 on prompt/tool/env tokens;
                                                    default all 1. Runs of 1s are rounds (multi-turn).
group_id            int or str                      prompt group (GRPO group); ``3`` and ``"3"`` are the
                                                    same group. Default: each sample is its own group.
rollout_experts     list[T][L][K] of int >= 0       routed expert ids per token and layer, highest
trainer_experts     list[T][L][K] of int >= 0       routing weight first (both or neither)
policy_lag          number >= 0                     trainer steps between rollout and training
step                int >= 0                        training step the sample belongs to (the x axis of the
                                                    report's charts; default: the batch number)
reward              finite number                   scalar reward of the sample (batch field ``rewards``)
advantage           finite number                   scalar advantage (batch field ``advantages``)
prompt_length       int >= 0                        prompt tokens (batch field ``prompt_lengths``)
response_length     int >= 0                        response tokens (batch field ``response_lengths``)
stop_reason         str                             ``"stop"``, ``"length"``... (``stop_reasons``; one of
                                                    ``functional.rollout.STOP_REASON_STRINGS``)
discard_reason      ``"kept"``, ``"max_async"`` or  why the rollout was not trained on
                    ``"zero_advantage"``            (``discard_reasons``)
==================  ==============================  =====================================================

Logprobs may be ``NaN``, ``Infinity`` or ``-Infinity`` (Python's JSON extension, which rollout engines
emit for tokens outside top-p) and ``null`` (a missing logprob, read as NaN): such tokens are counted
in ``opbc/input/nonfinite_count`` and excluded from the other statistics, as everywhere in this
library. A sample whose logprob lists differ in length, whose fields have the wrong type or an invalid
value (a NaN reward, a negative length, an unknown ``stop_reason``, a finite logprob above
:data:`~opbc_metrics.batch.PROBABILITY_TOLERANCE` on a response token: probabilities or logits), that names a
key twice (JSON would keep the last value silently), or whose line is not a JSON object is an issue reported
with its line number. A last line cut mid-record (a file still being
written) is reported as truncated. A sample that carries verl's or TRL's field names instead of this schema's
gets a hint naming the adapter that converts them.

A key outside the schema that looks meant for one of its keys, which the sample lacks, is an issue of its
line, since ignoring it would change the result: ``mask`` (or another framework's name of the mask), a
misspelling (``respons_mask``, difflib ratio >= :data:`~opbc_metrics.batch.CLOSE_MATCH_CUTOFF`) or
the batch-field name of a sample key (``rewards``, ``group_ids``, ``response_lengths``). Any other key
(``prompt``, ``uid``) is ignored, and counted in :attr:`Batch.ignored_keys` (the CLI lists them).

``.pt`` files are read with ``torch.load(path, weights_only=True)`` only: a file that needs pickle to
load (arbitrary Python objects, hence arbitrary code) is refused. The file holds one dict of tensors in
the batch schema (``trainer_logprobs`` [B, T] float, ``rollout_logprobs`` [B, T], optional
``response_mask`` [B, T], ``group_ids`` [B] int (or a list of int/str), ``rollout_experts`` and
``trainer_experts`` [B, T, L, K] int, ``policy_lag``, ``rewards``, ``advantages``, ``prompt_lengths``,
``response_lengths`` [B], ``stop_reasons``, ``discard_reasons`` [B] int or list[str], and ``step`` an int),
or a list of such dicts (one per step: without ``step``, a record's step is its index). Other batch fields
that metrics read (``values``, ``rollout_router_logits``...) are passed on; other keys are treated as in text
dumps (``reward``, ``group_id``, ``mask``: an issue of the record; ``uid``: ignored and counted). A row with an
unknown stop reason (string or int code) or a positive logprob on a response token is an issue of that row (the
other rows are read). Rows are
streamed in slices of the batch size, extended to keep a run of one group's rows together (as for
JSONL).

Example:
    >>> import json, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "dump.jsonl")
    >>> with open(path, "w") as f:
    ...     _ = f.write(json.dumps({"trainer_logprobs": [-1.0, -0.5], "rollout_logprobs": [-1.1, -0.5],
    ...                             "group_id": "q1"}) + "\\n")
    ...     _ = f.write('{"trainer_logprobs": [-1.0], "rollout_logprobs": "oops"}\\n')
    >>> items = list(read_batches(path, batch_size=8))
    >>> [type(item).__name__ for item in items]
    ['InputIssue', 'Batch']
    >>> print(items[0])
    dump.jsonl line 2: `rollout_logprobs` must be a list of numbers, got str
    >>> items[1].tensors["trainer_logprobs"].shape, items[1].group_labels
    (torch.Size([1, 2]), ['q1'])
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import os
import pickle
import re
import sys
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch
from torch import Tensor

from opbc_metrics.batch import FRAMEWORK_FIELDS, PROBABILITY_TOLERANCE, close_name, known_field_names
from opbc_metrics.functional.rollout import STOP_REASON_CODES, STOP_REASON_STRINGS

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonlines")
JSON_SUFFIXES = (".json",)
GZIP_SUFFIX = ".gz"
PT_SUFFIXES = (".pt", ".pth")
STDIN_NAMES = ("-", "/dev/stdin")

# Per-sample JSONL key -> (batch field, kind). Kinds: "float" (any number), "count" (int >= 0),
# "lag" (number >= 0), "stop" (a str of STOP_REASON_STRINGS), "discard" (one of DISCARD_REASONS).
SCALAR_FIELDS: dict[str, tuple[str, str]] = {
    "policy_lag": ("policy_lag", "lag"),
    "reward": ("rewards", "float"),
    "advantage": ("advantages", "float"),
    "prompt_length": ("prompt_lengths", "count"),
    "response_length": ("response_lengths", "count"),
    "stop_reason": ("stop_reasons", "stop"),
    "discard_reason": ("discard_reasons", "discard"),
}
# Fields of the sample schema (the keys a JSONL sample may carry, besides unknown ones).
SAMPLE_KEYS = ("trainer_logprobs", "rollout_logprobs", "response_mask", "group_id", "step", *SCALAR_FIELDS)
# Sample key -> its batch-schema name where they differ (`rewards` in a sample means `reward`; `reward` in a .pt
# dict means `rewards`).
BATCH_NAMES = {"group_id": "group_ids", **{k: name for k, (name, _) in SCALAR_FIELDS.items() if name != k}}
DISCARD_REASONS = ("kept", "max_async", "zero_advantage")
PER_ROW_PT_FIELDS = (
    "group_ids",
    "policy_lag",
    "rewards",
    "advantages",
    "prompt_lengths",
    "response_lengths",
    "stop_reasons",
    "discard_reasons",
)
TOKEN_PT_FIELDS = ("trainer_logprobs", "rollout_logprobs", "response_mask")
EXPERT_FIELDS = ("rollout_experts", "trainer_experts")
_SAMPLE_SCHEMA = frozenset((*SAMPLE_KEYS, *EXPERT_FIELDS))
_SAMPLE_ALIASES = {batch: key for key, batch in BATCH_NAMES.items()}

# A batch grows up to this many times the batch size to keep a run of one group's samples together.
GROUP_SLACK = 4

# Messages quoted from a torch.load failure are cut to this many characters.
_MAX_QUOTE = 200
_INT64_MAX = 2**63 - 1
# The first bytes of what torch.save writes: a zip archive, or (legacy format) a pickle of protocol >= 2.
_TORCH_MAGIC = (b"PK\x03\x04", b"\x80")


class InputFormatError(Exception):
    """A file the readers cannot handle at all (unknown extension, unreadable, refused)."""


@dataclass(frozen=True)
class InputIssue:
    """One problem in the input: where it is and what is wrong.

    Attributes:
        source: the file name as given.
        where: ``"line 7"``, ``"record 2"``, ``"rows 64-127"``...
        message: what is wrong, naming the field.
        line: the 1-based line number for JSONL issues, else ``None``.
    """

    source: str
    where: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        return f"{os.path.basename(self.source)} {self.where}: {self.message}"

    def as_dict(self) -> dict[str, Any]:
        return {"where": self.where, "line": self.line, "message": self.message}


@dataclass
class Batch:
    """One batch in the batch schema plus what the analysis needs to report about it.

    Attributes:
        tensors: batch fields (tensors, or a list of str for ``stop_reasons``).
        group_labels: the group label of each row (``group_ids`` indexes :attr:`GroupLabels.labels`).
        where: the lines or rows it came from, for messages.
        num_bytes: bytes of the file consumed so far (text dumps) or rows done (``.pt``), for progress.
        step: the training step of every row (``step`` field), or ``None`` when the input has none.
        ignored_keys: keys outside the schema that the rows carried, ignored: key -> rows carrying it.
    """

    tensors: dict[str, Any]
    group_labels: list[str]
    where: str
    num_bytes: int = 0
    step: int | None = None
    ignored_keys: dict[str, int] = field(default_factory=dict)


@dataclass
class GroupLabels:
    """Maps group labels (int or str, compared as str) to contiguous int ids, in order of appearance."""

    ids: dict[str, int] = field(default_factory=dict)

    @property
    def labels(self) -> list[str]:
        return list(self.ids)

    def id_of(self, label: str) -> int:
        if label not in self.ids:
            self.ids[label] = len(self.ids)
        return self.ids[label]


def is_stdin(path: str) -> bool:
    """Whether ``path`` names standard input (``-`` or ``/dev/stdin``)."""
    return path in STDIN_NAMES


def detect_format(path: str) -> str:
    """``"jsonl"``, ``"json"`` or ``"pt"`` from the file name (``.gz`` allowed on text dumps; standard input
    is read as text); :class:`InputFormatError` otherwise.

    Example:
        >>> detect_format("runs/step_10.jsonl"), detect_format("dump.PT"), detect_format("a.json.gz")
        ('jsonl', 'pt', 'json')
        >>> detect_format("-")
        'jsonl'
    """
    if is_stdin(path):
        return "jsonl"
    lower = path.lower()
    text = lower[: -len(GZIP_SUFFIX)] if lower.endswith(GZIP_SUFFIX) else lower
    if text.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if text.endswith(JSON_SUFFIXES):
        return "json"
    if lower.endswith(PT_SUFFIXES):
        return "pt"
    ext = os.path.splitext(path)[1] or "(none)"
    known = [*JSONL_SUFFIXES, *JSON_SUFFIXES, *(x + GZIP_SUFFIX for x in JSONL_SUFFIXES + JSON_SUFFIXES), *PT_SUFFIXES]
    raise InputFormatError(f"{path}: unknown file extension {ext}; expected one of {', '.join(known)} or - (stdin)")


# ---------------------------------------------------------------------------------------------
# JSONL
# ---------------------------------------------------------------------------------------------
class SampleError(ValueError):
    """A per-sample validation failure (the message names the key)."""


@dataclass
class Sample:
    """One validated JSONL sample."""

    trainer: list[float]
    rollout: list[float]
    mask: list[int] | None
    group: str | None
    experts: tuple[Tensor, Tensor] | None
    scalars: dict[str, Any]
    step: int | None = None
    ignored: tuple[str, ...] = ()

    @property
    def signature(self) -> tuple[Any, ...]:
        """Samples batched together must carry the same optional fields (and expert shapes)."""
        shape = tuple(self.experts[0].shape[1:]) if self.experts is not None else None
        return (shape, tuple(sorted(self.scalars)))


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _logprob_list(obj: Mapping[str, Any], key: str) -> tuple[list[float], list[int]]:
    """``(values, above)``: the logprob list ``obj[key]`` as floats (None: NaN), and the indices of its finite
    values above PROBABILITY_TOLERANCE, found in the same pass (:func:`_positive_logprob` checks them against
    the mask, which is read later)."""
    if key not in obj:
        raise SampleError(f"`{key}` is required but missing (present: {', '.join(sorted(obj)) or 'none'})")
    values = obj[key]
    if not isinstance(values, list):
        raise SampleError(f"`{key}` must be a list of numbers, got {_type_name(values)}")
    out: list[float] = []
    above: list[int] = []
    tolerance, inf = PROBABILITY_TOLERANCE, math.inf
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
            continue
        if type(v) is float:
            pass
        elif type(v) is int:
            try:
                v = float(v)
            except OverflowError:
                raise SampleError(f"`{key}` holds an integer too large for a float at index {i}") from None
        else:
            raise SampleError(f"`{key}` must be a list of numbers, got {_type_name(v)} at index {i}")
        out.append(v)
        if v > tolerance and v < inf:  # (a logprob fails the first comparison: one per value; NaN fails both)
            above.append(i)
    return out, above


def _mask_list(obj: Mapping[str, Any], length: int) -> list[int] | None:
    values = obj.get("response_mask")
    if values is None:
        return None
    if not isinstance(values, list):
        raise SampleError(f"`response_mask` must be a list of 0/1, got {_type_name(values)}")
    if len(values) != length:
        raise SampleError(f"`response_mask` has length {len(values)} but `trainer_logprobs` has length {length}")
    out: list[int] = []
    for i, v in enumerate(values):
        if v is True or v is False or (type(v) is int and v in (0, 1)):
            out.append(int(v))
        else:
            raise SampleError(f"`response_mask` must contain only 0/1 or true/false, got {v!r} at index {i}")
    return out


def _group_label(obj: Mapping[str, Any]) -> str | None:
    if "group_id" not in obj or obj["group_id"] is None:
        return None
    value = obj["group_id"]
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SampleError(f"`group_id` must be an int or a str, got {_type_name(value)}")
    return str(value)


def _experts(obj: Mapping[str, Any], length: int) -> tuple[Tensor, Tensor] | None:
    present = [k for k in EXPERT_FIELDS if obj.get(k) is not None]
    if not present:
        return None
    if len(present) == 1:
        missing = next(k for k in EXPERT_FIELDS if k not in present)
        raise SampleError(f"`{present[0]}` is given but `{missing}` is missing (give both or neither)")
    out = []
    for key in EXPERT_FIELDS:
        raw = obj[key]
        if not isinstance(raw, list):
            raise SampleError(f"`{key}` must be a nested list [T][L][K] of ints, got {_type_name(raw)}")
        try:
            t = torch.tensor(raw) if raw else torch.zeros((0, 1, 1), dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise SampleError(f"`{key}` must be a nested list [T][L][K] of ints (ragged or non-numeric)") from None
        if t.dtype != torch.int64:
            raise SampleError(f"`{key}` must hold integer expert ids, got {str(t.dtype).replace('torch.', '')}")
        if t.ndim != 3:
            raise SampleError(f"`{key}` must be nested [T][L][K], got {t.ndim} levels of nesting")
        if t.shape[0] != length:
            raise SampleError(f"`{key}` has {t.shape[0]} tokens but `trainer_logprobs` has {length}")
        if t.numel() and int(t.min()) < 0:
            raise SampleError(f"`{key}` holds a negative expert id")
        out.append(t)
    if out[0].shape != out[1].shape:
        raise SampleError(
            f"`rollout_experts` has shape {list(out[0].shape)} but `trainer_experts` has {list(out[1].shape)}"
        )
    return out[0], out[1]


def _scalars(obj: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, (_, kind) in SCALAR_FIELDS.items():
        value = obj.get(key)
        if value is None:
            continue
        if kind == "stop":
            if not isinstance(value, str):
                raise SampleError(f"`{key}` must be a str, got {_type_name(value)}")
            if value not in STOP_REASON_STRINGS:  # the metric refuses it, which would drop the sample's whole batch
                raise SampleError(_unknown_stop_reason(key, value))
        elif kind == "discard":
            if value not in DISCARD_REASONS:
                raise SampleError(f"`{key}` must be one of {', '.join(map(repr, DISCARD_REASONS))}, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SampleError(f"`{key}` must be a number, got {_type_name(value)}")
        elif isinstance(value, int) and not -_INT64_MAX <= value <= _INT64_MAX:
            # JSON integers are unbounded; the batch tensors are int64 / float64
            raise SampleError(f"`{key}` is too large ({len(str(abs(value)))} digits): at most 2**63 - 1")
        elif kind == "float" and not math.isfinite(value):
            raise SampleError(f"`{key}` must be a finite number, got {value!r}")
        elif kind == "count" and (not isinstance(value, int) or value < 0):
            raise SampleError(f"`{key}` must be a non-negative int, got {value!r}")
        elif kind == "lag" and not (value >= 0 and math.isfinite(value)):
            raise SampleError(f"`{key}` must be a finite number >= 0, got {value!r}")
        out[key] = value
    return out


def _unknown_stop_reason(key: str, value: Any) -> str:
    return f"`{key}` must be one of {', '.join(map(repr, STOP_REASON_STRINGS))} or null, got {value!r}"


_NOT_LOGPROBS = ("logprobs must be <= 0 (log-probabilities); values in [0, 1] look like probabilities, larger ones "
                 "like logits")


def _positive_logprob(key: str, values: list[float], above: list[int], mask: list[int] | None) -> str | None:
    """The problem of a logprob list holding a finite value above PROBABILITY_TOLERANCE on a response token (the
    collection refuses it at compute, for the whole run), or ``None``. ``above``: the indices of such values
    (response token or not), ascending, as :func:`_logprob_list` found them."""
    for i in above:
        if mask is None or mask[i]:
            return f"`{key}` holds {values[i]:g} at index {i}: {_NOT_LOGPROBS}"
    return None


def _step(obj: Mapping[str, Any]) -> int | None:
    value = obj.get("step")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SampleError(f"`step` must be a non-negative int, got {value!r}")
    if value > _INT64_MAX:  # JSON integers are unbounded; steps are int64 (and chart coordinates)
        raise SampleError(f"`step` is too large ({len(str(value))} digits): at most 2**63 - 1")
    return value


def unknown_keys(
    obj: Mapping[Any, Any], accepted: Iterable[str], aliases: Mapping[str, str], alias_kind: str = "another name"
) -> list[str]:
    """The keys of ``obj`` (with a value) outside ``accepted``, which the readers ignore; :class:`SampleError` for one
    that looks meant for a schema key the record lacks, since ignoring it would silently change the result (a mask
    defaults to all ones, rewards to none, groups to one per sample).

    Such a key is a framework name (``mask``, ``completion_mask``) of an absent schema field, or a close misspelling
    (:func:`opbc_metrics.batch.close_name`) of an absent key of ``accepted`` or of ``aliases``
    (other names of a key, ``alias_kind``: the batch-field name ``rewards`` of the sample key ``reward``).

    Example:
        >>> unknown_keys({"trainer_logprobs": [], "prompt": "hi"}, SAMPLE_KEYS, {})
        ['prompt']
        >>> unknown_keys({"trainer_logprobs": [], "respons_mask": [1]}, SAMPLE_KEYS, {})
        Traceback (most recent call last):
        ...
        opbc_metrics.io.SampleError: unknown key `respons_mask`: did you mean `response_mask`? (rename it, ...)
    """
    accepted = frozenset(accepted)
    if all(k in accepted or v is None for k, v in obj.items()):  # the common case: nothing to look at
        return []
    present = {str(k) for k, v in obj.items() if v is not None}
    names = {**{k: k for k in accepted}, **aliases}  # a name -> the key it stands for
    meant = {name: key for name, key in names.items() if key not in present}
    ignored, misnamed = [], []
    for key in obj:
        name = str(key)
        if obj[key] is None or name in accepted:
            continue
        framework = FRAMEWORK_FIELDS.get(name)
        if framework is not None and framework[0] in accepted and framework[0] not in present:
            close = [framework[0]]
        else:
            match = close_name(name, meant)
            close = [] if match is None else [meant[match]]
        if close:
            other = f" (`{name}` is its {alias_kind})" if aliases.get(name) == close[0] else ""
            misnamed.append(f"unknown key `{name}`: did you mean `{close[0]}`?{other}")
        else:
            ignored.append(name)
    if misnamed:  # all of them at once, so that one pass over the file fixes them
        what = "it" if len(misnamed) == 1 else "them"
        raise SampleError(f"{'; '.join(misnamed)} (rename {what}, or remove {what} if meant otherwise: an unknown key "
                          "is ignored, which would change the result)")
    return ignored


def framework_hint(keys: Iterable[str]) -> str | None:
    """A hint naming the adapter when ``keys`` look like verl's or TRL's batch fields rather than this schema.

    Example:
        >>> framework_hint(["old_log_probs", "rollout_log_probs", "uid"])  # doctest: +ELLIPSIS
        "these look like verl's batch fields (old_log_probs, rollout_log_probs): ...verl_to_batch..."
        >>> framework_hint(["trainer_logprobs"]) is None
        True
    """
    from opbc_metrics.integrations import trl, verl

    frameworks = (
        ("verl", (verl.VERL_TRAINER_LOGPROBS, verl.VERL_ROLLOUT_LOGPROBS),
         "opbc_metrics.integrations.verl.verl_to_batch"),
        ("TRL", (trl.TRL_TRAINER_LOGPROBS, trl.TRL_ROLLOUT_LOGPROBS, trl.TRL_COMPLETION_MASK),
         "opbc_metrics.integrations.trl.trl_to_batch"),
    )
    present = set(keys)
    for name, fields, adapter in frameworks:
        found = [f for f in fields if f in present]
        if found:
            return (f"these look like {name}'s batch fields ({', '.join(found)}): convert each batch with "
                    f"`{adapter}` and write its fields in this schema (see --help)")
    return None


def parse_sample(obj: Any) -> Sample:
    """Validate one decoded JSONL record; :class:`SampleError` names the offending key.

    Example:
        >>> s = parse_sample({"trainer_logprobs": [-1, None], "rollout_logprobs": [-1.5, -2.0], "group_id": 7})
        >>> s.trainer, s.group
        ([-1.0, nan], '7')
        >>> parse_sample({"trainer_logprobs": [-1.0], "rollout_logprobs": [-1.0, -2.0]})
        Traceback (most recent call last):
        ...
        opbc_metrics.io.SampleError: `rollout_logprobs` has length 2 but `trainer_logprobs` has length 1
    """
    if not isinstance(obj, dict):
        raise SampleError(f"expected a JSON object, got {'array' if isinstance(obj, list) else _type_name(obj)}")
    if "trainer_logprobs" not in obj or "rollout_logprobs" not in obj:
        hint = framework_hint(obj)
        if hint is not None:
            missing = "`trainer_logprobs`" if "trainer_logprobs" not in obj else "`rollout_logprobs`"
            raise SampleError(f"{missing} is required but missing; {hint}")
    ignored = unknown_keys(obj, _SAMPLE_SCHEMA, _SAMPLE_ALIASES, "batch-field name")
    trainer, trainer_above = _logprob_list(obj, "trainer_logprobs")
    rollout, rollout_above = _logprob_list(obj, "rollout_logprobs")
    if len(rollout) != len(trainer):
        raise SampleError(
            f"`rollout_logprobs` has length {len(rollout)} but `trainer_logprobs` has length {len(trainer)}"
        )
    mask = _mask_list(obj, len(trainer))
    for key, values, above in (("trainer_logprobs", trainer, trainer_above),
                               ("rollout_logprobs", rollout, rollout_above)):
        problem = _positive_logprob(key, values, above, mask)
        if problem is not None:
            raise SampleError(problem)
    return Sample(
        trainer=trainer,
        rollout=rollout,
        mask=mask,
        group=_group_label(obj),
        experts=_experts(obj, len(trainer)),
        scalars=_scalars(obj),
        step=_step(obj),
        ignored=tuple(ignored),
    )


def collate(samples: list[Sample], groups: GroupLabels, first_index: int) -> tuple[dict[str, Any], list[str]]:
    """Pad samples to the batch's longest (at least 1 token) with mask 0; returns (fields, group labels).

    ``first_index`` numbers samples without a ``group_id`` (each is its own group, ``"#<index>"``).
    """
    length = max(1, max(len(s.trainer) for s in samples))
    b = len(samples)
    trainer = torch.zeros(b, length, dtype=torch.float64)
    rollout = torch.zeros(b, length, dtype=torch.float64)
    mask = torch.zeros(b, length, dtype=torch.int64)
    labels: list[str] = []
    for i, s in enumerate(samples):
        n = len(s.trainer)
        if n:
            trainer[i, :n] = torch.tensor(s.trainer, dtype=torch.float64)
            rollout[i, :n] = torch.tensor(s.rollout, dtype=torch.float64)
            mask[i, :n] = torch.tensor(s.mask, dtype=torch.int64) if s.mask is not None else 1
        labels.append(s.group if s.group is not None else f"#{first_index + i}")
    fields: dict[str, Any] = {
        "trainer_logprobs": trainer,
        "rollout_logprobs": rollout,
        "response_mask": mask,
        "group_ids": torch.tensor([groups.id_of(g) for g in labels], dtype=torch.int64),
    }
    if samples[0].experts is not None:
        layers, k = samples[0].experts[0].shape[1:]
        for j, name in enumerate(EXPERT_FIELDS):
            out = torch.zeros(b, length, layers, k, dtype=torch.int64)
            for i, s in enumerate(samples):
                assert s.experts is not None  # same signature as samples[0]
                out[i, : s.experts[j].shape[0]] = s.experts[j]
            fields[name] = out
    for key in samples[0].scalars:
        name, kind = SCALAR_FIELDS[key]
        values = [s.scalars[key] for s in samples]
        if kind in ("stop", "discard"):
            fields[name] = values
        else:
            fields[name] = torch.tensor(values, dtype=torch.int64 if kind == "count" else torch.float64)
    return fields, labels


class _Counted(io.RawIOBase):
    """A read-only binary stream that counts the bytes read from the one it wraps (progress of gzip input)."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.count = raw, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.raw.read(len(buffer))
        buffer[: len(data)] = data
        self.count += len(data)
        return len(data)


@contextlib.contextmanager
def open_text_dump(path: str) -> Iterator[tuple[BinaryIO, Callable[[], int]]]:
    """The decompressed bytes of a text dump (a file or standard input, gzip recognised by its magic bytes),
    and a function giving the bytes of the source consumed so far (for a progress bar)."""
    with contextlib.ExitStack() as stack:
        if is_stdin(path):
            source: BinaryIO = sys.stdin.buffer
        else:
            source = stack.enter_context(open(path, "rb"))
        counted = _Counted(source)
        buffered = io.BufferedReader(counted, buffer_size=1 << 16)
        if buffered.peek(2)[:2] == b"\x1f\x8b":
            stream: BinaryIO = stack.enter_context(gzip.GzipFile(fileobj=buffered, mode="rb"))
        else:
            stream = buffered
        yield stream, lambda: counted.count


def _json_records(stream: BinaryIO) -> Iterator[tuple[int, bool, bytes]]:
    """``(line number, ends with a newline, stripped bytes)`` of each non-blank line."""
    for lineno, raw in enumerate(stream, 1):
        if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        stripped = raw.strip()
        if stripped:
            yield lineno, raw.endswith(b"\n"), stripped


class _DuplicateKey(ValueError):
    """A JSON object that names a key twice (``json`` keeps the last value and drops the other silently)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` that refuses a key given twice in one object."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _DuplicateKey(f"the key `{twice}` appears twice in one object (JSON would keep the last value and "
                            "drop the other silently); remove one")
    return out


def _decode_line(source: str, lineno: int, complete: bool, raw: bytes) -> Any:
    """The decoded JSON value of one line, or the :class:`InputIssue` saying why it cannot be decoded."""
    where = f"line {lineno}"
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        return InputIssue(source, where, str(e), lineno)
    except UnicodeDecodeError as e:
        return InputIssue(source, where, f"not valid UTF-8 (byte {e.start})", lineno)
    except json.JSONDecodeError as e:
        detail = f"{e.msg}, column {e.colno}"
        if not complete:
            msg = f"truncated record at end of file (the last line is cut: {detail})"
            return InputIssue(source, where, msg, lineno)
        return InputIssue(source, where, f"invalid JSON ({detail})", lineno)
    except RecursionError:
        return InputIssue(source, where, "invalid JSON (nested too deeply)", lineno)


_WHITESPACE = re.compile(r"[ \t\n\r]*")


def _array_items(source: str, text: str) -> Iterator[tuple[int, Any]]:
    """``(line number, value or InputIssue)`` of each element of a JSON array, in order.

    Elements are decoded one at a time (so a bad element is reported with its line and the others are
    kept); a syntax error outside an element ends the array with an issue.
    """
    decoder, plain = json.JSONDecoder(object_pairs_hook=_unique_keys), json.JSONDecoder()
    pos = _WHITESPACE.match(text, 1).end()  # after "["
    line, counted_to = 1, 0

    def line_of(p: int) -> int:
        nonlocal line, counted_to
        line += text.count("\n", counted_to, p)
        counted_to = p
        return line

    if text.startswith("]", pos):
        return
    while True:
        try:
            try:
                value, end = decoder.raw_decode(text, pos)
            except _DuplicateKey as e:  # an issue of this element only: its end from a plain decode, and go on
                where = line_of(pos)
                value, end = InputIssue(source, f"line {where}", str(e), where), plain.raw_decode(text, pos)[1]
        except json.JSONDecodeError as e:
            where = line_of(e.pos)
            if not text.rstrip().endswith("]"):  # the array never closes: the file was cut
                msg = f"truncated JSON array (the file ends inside it: {e.msg})"
            else:
                msg = f"invalid JSON ({e.msg}, column {e.colno})"
            yield where, InputIssue(source, f"line {where}", msg, where)
            return
        except RecursionError:
            where = line_of(pos)
            yield where, InputIssue(source, f"line {where}", "invalid JSON (nested too deeply)", where)
            return
        yield line_of(pos), value
        pos = _WHITESPACE.match(text, end).end()
        if text.startswith("]", pos):
            rest = _WHITESPACE.match(text, pos + 1).end()
            if rest != len(text):
                where = line_of(rest)
                yield where, InputIssue(source, f"line {where}", "extra data after the JSON array", where)
            return
        if not text.startswith(",", pos):
            where = line_of(pos)
            cut = pos >= len(text)
            msg = "truncated JSON array (the file ends inside it)" if cut else "invalid JSON (expected ',' or ']')"
            yield where, InputIssue(source, f"line {where}", msg, where)
            return
        pos = _WHITESPACE.match(text, pos + 1).end()


def _is_jsonl_name(path: str) -> bool:
    """A file named as JSONL (``.jsonl``, ``.ndjson``, ``.jsonlines``, plain or ``.gz``): one value per line."""
    lower = path.lower()
    return not is_stdin(path) and lower.removesuffix(GZIP_SUFFIX).endswith(JSONL_SUFFIXES)


def read_jsonl(
    path: str, batch_size: int, groups: GroupLabels | None = None, limit: int | None = None
) -> Iterator[Batch | InputIssue]:
    """Stream a text dump (JSONL or a JSON array, plain or gzip, a file or ``-``) as :class:`Batch` es of about
    ``batch_size`` samples, and :class:`InputIssue` s.

    A file named as JSONL is read line by line whatever its first character (a line holding an array is an
    issue of that line); a ``.json`` file or standard input starting with ``[`` is read as one JSON array.

    A batch is extended past ``batch_size`` (up to ``GROUP_SLACK`` times it) rather than split a run of
    consecutive samples of one group, so that the controller sees whole groups. Consecutive samples
    carrying different optional fields (or expert shapes) or different steps go to different batches, so
    a field is never padded with made-up values and every batch belongs to one step. ``limit`` stops
    after that many samples.
    """
    groups = groups if groups is not None else GroupLabels()
    max_rows = GROUP_SLACK * batch_size
    pending: list[Sample] = []
    first_line = last_line = taken = 0

    def flush(consumed: int) -> Batch:
        nonlocal pending
        fields, labels = collate(pending, groups, taken - len(pending))
        where = f"line {first_line}" if first_line == last_line else f"lines {first_line}-{last_line}"
        ignored = Counter(key for s in pending for key in s.ignored)
        step, pending = pending[0].step, []
        return Batch(fields, labels, where, consumed, step, dict(ignored))

    try:
        with open_text_dump(path) as (stream, consumed):
            records: Iterator[tuple[int, Any]]
            first = stream.peek(64).lstrip()[:1] if hasattr(stream, "peek") else b""
            if first == b"[" and not _is_jsonl_name(path):
                try:
                    text = stream.read().decode("utf-8-sig")
                except UnicodeDecodeError as e:
                    yield InputIssue(path, "file", f"not valid UTF-8 (byte {e.start})")
                    return
                records = _array_items(path, text.lstrip())
            else:
                records = ((n, _decode_line(path, n, complete, raw)) for n, complete, raw in _json_records(stream))
            for lineno, obj in records:
                if isinstance(obj, InputIssue):
                    yield obj
                    continue
                try:
                    sample = parse_sample(obj)
                except SampleError as e:
                    yield InputIssue(path, f"line {lineno}", str(e), lineno)
                    continue
                if pending and (
                    sample.signature != pending[0].signature
                    or sample.step != pending[0].step
                    or len(pending) >= max_rows
                    or (len(pending) >= batch_size and (sample.group is None or sample.group != pending[-1].group))
                ):
                    yield flush(consumed())
                if not pending:
                    first_line = lineno
                pending.append(sample)
                last_line = lineno
                taken += 1
                if limit is not None and taken >= limit:
                    break
            if pending:
                yield flush(consumed())
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        if pending:
            yield flush(0)
        yield InputIssue(path, f"after line {last_line}", f"corrupt or cut gzip stream ({e})", None)


# ---------------------------------------------------------------------------------------------
# .pt
# ---------------------------------------------------------------------------------------------
def load_pt(path: str) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)`` with clear errors.

    A file that needs pickle (an object outside torch's weights-only allowlist) is refused with
    :class:`InputFormatError`, and so is a file that is not a readable torch archive.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
        what = f" (it references `{found.group(1)}`)" if found else ""
        if not _looks_like_torch_file(path):
            # torch's weights-only unpickler reads any bytes as a pickle: its "needs pickle" text would mislead
            raise InputFormatError(
                f"{path}: not a readable torch file (it does not start like a file written by torch.save)"
            ) from None
        if "Weights only load failed" in text or found:
            raise InputFormatError(
                f"{path}: refused: this .pt file needs pickle to load{what}, which can run arbitrary code. "
                "Only tensors, lists and dicts are read (torch.load with weights_only=True); re-save the "
                "batch as a dict of tensors."
            ) from None
        raise InputFormatError(f"{path}: not a readable torch file ({_short(e)})") from None
    except Exception as e:  # torch raises RuntimeError, KeyError, EOFError... for corrupt archives
        raise InputFormatError(f"{path}: not a readable torch file ({_short(e)})") from None


def _looks_like_torch_file(path: str) -> bool:
    """Whether the file starts as ``torch.save`` output does (so a weights-only failure means it needs pickle,
    not that it is some other file)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head.startswith(_TORCH_MAGIC)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = text if len(text) <= _MAX_QUOTE else text[:_MAX_QUOTE] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _rows(value: Any) -> int | None:
    if isinstance(value, Tensor):
        return int(value.shape[0]) if value.ndim >= 1 else None
    if isinstance(value, (list, tuple)):
        return len(value)
    return None


def pt_keys() -> frozenset[str]:
    """The keys a ``.pt`` record may carry: the documented ones and any other batch field a metric reads."""
    return frozenset({*TOKEN_PT_FIELDS, *EXPERT_FIELDS, *PER_ROW_PT_FIELDS, "step"} | known_field_names())


def _check_pt_record(record: Any) -> tuple[dict[str, Any], int, list[str]]:
    """Validate the structure of one ``.pt`` record (values are validated by the batch view); returns its fields,
    its rows and the keys outside the schema, ignored (dropped from the fields)."""
    if not isinstance(record, Mapping):
        raise SampleError(f"expected a dict of tensors in the batch schema, got {type(record).__name__}")
    out = {k: v for k, v in record.items() if isinstance(k, str) and v is not None}
    present = ", ".join(sorted(out)) or "none"
    for key in ("trainer_logprobs", "rollout_logprobs"):
        hint = framework_hint(out) if key not in out else None
        if hint is not None:
            raise SampleError(f"`{key}` is required but missing; {hint}")
    ignored = unknown_keys(record, pt_keys(), BATCH_NAMES, "JSONL sample key")
    out = {k: v for k, v in out.items() if k not in ignored}
    for key in ("trainer_logprobs", "rollout_logprobs"):
        if key not in out:
            raise SampleError(f"`{key}` is required but missing (present: {present})")
    for key in (*TOKEN_PT_FIELDS, *EXPERT_FIELDS):
        if key in out and not isinstance(out[key], Tensor):
            raise SampleError(f"`{key}` must be a tensor, got {type(out[key]).__name__}")
    trainer = out["trainer_logprobs"]
    if trainer.ndim != 2:
        raise SampleError(f"`trainer_logprobs` must have shape [B, T], got {list(trainer.shape)}")
    rows = int(trainer.shape[0])
    for key in (*TOKEN_PT_FIELDS, *EXPERT_FIELDS, *PER_ROW_PT_FIELDS):
        if key not in out:
            continue
        value = out[key]
        if not isinstance(value, (Tensor, list, tuple)):
            raise SampleError(f"`{key}` must be a tensor or a list, got {type(value).__name__}")
        n = _rows(value)
        if n != rows:
            got = "a 0-dim tensor" if n is None else f"{n} rows"
            raise SampleError(f"`{key}` has {got} but `trainer_logprobs` has {rows} rows")
    if "group_ids" in out and not isinstance(out["group_ids"], Tensor):
        bad = [g for g in out["group_ids"] if isinstance(g, bool) or not isinstance(g, (int, str))]
        if bad:
            raise SampleError(f"`group_ids` must hold ints or strs, got {type(bad[0]).__name__}")
    elif "group_ids" in out and (out["group_ids"].ndim != 1 or out["group_ids"].is_floating_point()):
        raise SampleError(f"`group_ids` must be an int tensor [B], got {out['group_ids'].dtype} "
                          f"with shape {list(out['group_ids'].shape)}")
    for key in ("stop_reasons", "discard_reasons"):
        if key in out and not isinstance(out[key], Tensor):
            if any(not isinstance(s, str) and s is not None for s in out[key]):
                raise SampleError(f"`{key}` must be an int tensor [B] or a list of str")
    return out, rows, ignored


def _bad_pt_rows(fields: Mapping[str, Any], rows: int) -> dict[int, str]:
    """Row -> problem, for the rows of a checked ``.pt`` record that the collection would refuse for the whole batch or
    run although the reader sees them on the host: an unknown stop reason, or a positive logprob on a response token
    (what :func:`parse_sample` makes an issue of a JSONL line). Shapes and dtypes are left to the batch view."""
    bad: dict[int, str] = {}
    mask = fields.get("response_mask")
    for key in ("trainer_logprobs", "rollout_logprobs"):
        values = fields[key]
        if not values.is_floating_point() or values.shape != fields["trainer_logprobs"].shape:
            continue
        above = torch.isfinite(values) & (values > PROBABILITY_TOLERANCE)
        if isinstance(mask, Tensor) and mask.shape == values.shape:
            above &= mask != 0
        first = above.to(torch.uint8).argmax(dim=1)  # the first such token of each row
        for row in torch.nonzero(above.any(dim=1)).flatten().tolist():
            col = int(first[row])
            bad.setdefault(row, f"`{key}` holds {float(values[row, col]):g} at token {col}: {_NOT_LOGPROBS}")
    stops = fields.get("stop_reasons")
    if isinstance(stops, Tensor):
        if stops.ndim == 1 and not stops.is_floating_point() and stops.dtype != torch.bool:
            codes = sorted(STOP_REASON_CODES.values())
            for row in torch.nonzero(~torch.isin(stops, torch.tensor(codes))).flatten().tolist():
                bad.setdefault(row, f"`stop_reasons` holds int code {int(stops[row])}; accepted: {codes} "
                                    f"(STOP_REASON_CODES {STOP_REASON_CODES}) or the strings "
                                    f"{list(STOP_REASON_STRINGS)}")
    elif stops is not None:
        for row, value in enumerate(stops):
            if value is not None and value not in STOP_REASON_STRINGS:
                bad.setdefault(row, _unknown_stop_reason("stop_reasons", value))
    return dict(sorted(bad.items()))


def _take_rows(value: Any, keep: list[int]) -> Any:
    if isinstance(value, Tensor):
        return value[torch.tensor(keep, dtype=torch.int64)]
    return [value[i] for i in keep]


def read_pt(
    path: str, batch_size: int, groups: GroupLabels | None = None, limit: int | None = None
) -> Iterator[Batch | InputIssue]:
    """Stream a ``.pt`` dump (a dict of tensors, or a list of them) as row slices of ``batch_size``.

    Raises :class:`InputFormatError` when the file cannot be loaded safely (see :func:`load_pt`).
    """
    groups = groups if groups is not None else GroupLabels()
    data = load_pt(path)
    records = data if isinstance(data, (list, tuple)) else [data]
    multi = isinstance(data, (list, tuple))
    taken = 0
    for r, record in enumerate(records):
        name = f"record {r}" if multi else "file"
        try:
            fields, rows, ignored = _check_pt_record(record)
        except SampleError as e:
            yield InputIssue(path, name, str(e))
            continue
        step = fields.pop("step", r if multi else None)
        if isinstance(step, Tensor) and step.numel() == 1 and not step.is_floating_point():
            step = int(step)
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            yield InputIssue(path, name, f"`step` must be a non-negative int, got {step!r}")
            continue
        if step is not None and step > _INT64_MAX:  # a Python int in the file is unbounded
            yield InputIssue(path, name, f"`step` is too large ({len(str(step))} digits): at most 2**63 - 1")
            continue
        gids = fields.get("group_ids")
        if gids is None:
            all_labels = [f"#{taken + i}" for i in range(rows)]
        else:
            all_labels = [str(g) for g in (gids.tolist() if isinstance(gids, Tensor) else gids)]
        original = list(range(rows))  # row in the file of each row kept
        bad = _bad_pt_rows(fields, rows)
        if bad:  # an issue per bad row; the other rows are analysed
            for row, message in bad.items():
                yield InputIssue(path, f"{name} row {row}" if multi else f"row {row}", message)
            original = [i for i in original if i not in bad]
            fields = {k: _take_rows(v, original) if _rows(v) == rows else v for k, v in fields.items()}
            all_labels = [all_labels[i] for i in original]
            rows = len(original)
        start = 0
        while start < rows:
            stop = min(rows, start + batch_size)
            while stop < rows and stop - start < GROUP_SLACK * batch_size and all_labels[stop] == all_labels[stop - 1]:
                stop += 1  # keep a run of one group's rows in one batch
            if limit is not None:
                stop = min(stop, start + (limit - taken))
            sliced = {k: v[start:stop] if _rows(v) is not None else v for k, v in fields.items()}
            labels = all_labels[start:stop]
            sliced["group_ids"] = torch.tensor([groups.id_of(g) for g in labels], dtype=torch.int64)
            for key in ("stop_reasons", "discard_reasons"):
                if isinstance(sliced.get(key), tuple):
                    sliced[key] = list(sliced[key])
            span = f"rows {original[start]}-{original[stop - 1]}"
            where = f"{name} {span}" if multi else span
            taken += stop - start
            ignored_rows = dict.fromkeys(ignored, stop - start)
            start = stop
            yield Batch(sliced, labels, where, taken, step, ignored_rows)
            if limit is not None and taken >= limit:
                return


def read_batches(
    path: str, batch_size: int = 64, groups: GroupLabels | None = None, limit: int | None = None
) -> Iterator[Batch | InputIssue]:
    """Batches and issues from a text (JSONL, JSON array; ``-`` for standard input) or ``.pt`` dump, chosen by
    extension.

    Raises :class:`InputFormatError` for an unknown extension or a missing file at once, and while
    iterating for a ``.pt`` file that is unreadable or needs pickle (``OSError`` for an unreadable
    JSONL file).
    """
    fmt = detect_format(path)
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    if not is_stdin(path) and not os.path.exists(path):
        raise InputFormatError(f"{path}: no such file")
    if os.path.isdir(path):
        raise InputFormatError(f"{path}: is a directory, expected a file")
    reader: Callable[..., Iterator[Batch | InputIssue]] = read_pt if fmt == "pt" else read_jsonl
    return reader(path, batch_size, groups, limit)
