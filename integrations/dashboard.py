"""Which computed keys a logger writes: one key per quantity, no chart that is always zero.

``OPBCCollection.compute()`` returns every key of the design (a contract). A dashboard needs less:

* **Aliases** (:data:`ALIASES`): keys that equal another key, or its negation, by definition or under a
  condition that usually holds. The loggers leave an alias out while it equals its canonical key on
  every step so far, and write it on every step from the first one where it differs, so a chart never
  shows the same line twice and nothing is lost (``opbc/kl/k1`` reaches the dashboard only once the
  clamp made it differ from ``-opbc/logprob/diff_mean``). :func:`resolve_alias` and the glossary table
  name the key to read instead.
* **Single-round runs** (:data:`PER_ROUND`): while no sequence has had more than one round
  (``per_round/total_rounds`` <= 1), the per-round keys repeat the whole-sequence ones (round 0 is the
  whole response); they are written from the first window with a multi-round sequence on.
* **Sparse keys** (:data:`SPARSE_PATTERNS`): overflow counters that are zero in any healthy run (expert
  ids beyond the configured layers, rounds beyond the per-round capacity). They are written from their
  first nonzero value on, then on every step.

Keys that are absent from the computed values are never written or filled in. ``KeyFilter(log_all=True)``
writes everything.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ALIASES", "PER_ROUND", "SPARSE_PATTERNS", "Alias", "KeyFilter", "resolve_alias"]


@dataclass(frozen=True)
class Alias:
    """``key`` equals ``sign * canonical`` whenever ``condition`` holds (always when it is empty)."""

    key: str
    canonical: str
    sign: float = 1.0
    condition: str = ""

    def describe(self) -> str:
        where = f" when {self.condition}" if self.condition else ""
        return f"{self.key} = {'-' if self.sign < 0 else ''}{self.canonical}{where}"


ALIASES: tuple[Alias, ...] = (
    # max |r| is one state read twice.
    Alias("opbc/log_ratio/max_abs", "opbc/logprob/abs_diff_max"),
    # d_i = mean rollout logp - mean trainer logp = -s_i / n_i, over the same sequences.
    Alias("opbc/ppl/log_ppl_diff", "opbc/sequence/geo_log_ratio_mean", -1.0),
    # k1 = mean(-clamp(r, -C, C)): the clamp changes it only when some |r| > C.
    Alias("opbc/kl/k1", "opbc/logprob/diff_mean", -1.0, "opbc/is/clipped_fraction is 0"),
    # The controller decides on the batch the collection measures (the usual pattern).
    Alias("opbc/decision/num_tokens", "opbc/input/num_tokens", 1.0, "the decisions cover the measured batch"),
    # total = prompt + completion per sample: with one prompt length, the spreads agree.
    Alias("rollout/tokens_total/std", "rollout/tokens_completion/std", 1.0, "every prompt has one length"),
    # total = max_async + zero_advantage.
    Alias("rollout/discarded/zero_advantage", "rollout/discarded/total", 1.0, "nothing was discarded for max_async"),
)

# The per-round section and the key that says whether any sequence had more than one round.
PER_ROUND = ("per_round/", "per_round/total_rounds")

# Overflow counters: zero unless the input outgrew the configured capacity.
SPARSE_PATTERNS: tuple[re.Pattern[str], ...] = (
    re.compile(r"(^|/)layer_overflow/"),
    re.compile(r"(^|/)per_round/overflow_"),
)


def resolve_alias(key: str) -> Alias | None:
    """The :class:`Alias` a key is, with or without a collection prefix/postfix; ``None`` for a canonical key.

    Example:
        >>> resolve_alias("opbc/log_ratio/max_abs").canonical
        'opbc/logprob/abs_diff_max'
        >>> resolve_alias("bf16/opbc/kl/k1").describe()
        'bf16/opbc/kl/k1 = -bf16/opbc/logprob/diff_mean when opbc/is/clipped_fraction is 0'
        >>> resolve_alias("opbc/is/ess") is None
        True
    """
    for alias in ALIASES:
        at = key.find(alias.key)
        if at >= 0:
            head, tail = key[:at], key[at + len(alias.key) :]
            return Alias(key, f"{head}{alias.canonical}{tail}", alias.sign, alias.condition)
    return None


def _float(value: Any) -> float | None:
    try:
        if hasattr(value, "numel") and value.numel() != 1:
            return None
        return float(value)
    except (TypeError, ValueError):
        return None


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15) or (math.isnan(a) and math.isnan(b))


class KeyFilter:
    """Selects the keys a logger writes from computed values (stateful: remembers sparse keys seen nonzero).

    Args:
        log_all: write every key (no alias or sparse filtering).

    Example:
        >>> f = KeyFilter()
        >>> sorted(f({"opbc/logprob/abs_diff_max": 0.5, "opbc/log_ratio/max_abs": 0.5,
        ...           "moe/router/layer_overflow/flip_rate": 0.0}))
        ['opbc/logprob/abs_diff_max']
        >>> sorted(f({"moe/router/layer_overflow/flip_rate": 0.25}))
        ['moe/router/layer_overflow/flip_rate']
        >>> sorted(f({"moe/router/layer_overflow/flip_rate": 0.0}))  # seen nonzero: written from then on
        ['moe/router/layer_overflow/flip_rate']
        >>> one_round = {"per_round/total_rounds": 1.0, "per_round/round_0_abs_diff_mean": 0.1,
        ...              "opbc/logprob/abs_diff_mean": 0.1}
        >>> sorted(f(one_round))  # round 0 is the whole response
        ['opbc/logprob/abs_diff_mean']
    """

    def __init__(self, log_all: bool = False) -> None:
        self.log_all = log_all
        self.written: set[str] = set()  # aliases and sparse keys written once: written from then on
        self.multi_round: set[str] = set()  # prefixes of per-round sections that saw a multi-round sequence

    def dropped(self, values: Mapping[str, Any]) -> set[str]:
        """The keys of ``values`` not to write on this step."""
        if self.log_all:
            return set()
        out: set[str] = set()
        for key, value in values.items():
            if key in self.written:
                continue
            alias = resolve_alias(key)
            if alias is not None:
                mine, theirs = _float(value), _float(values.get(alias.canonical))
                if mine is not None and theirs is not None and _same(mine, alias.sign * theirs):
                    out.add(key)
                else:
                    self.written.add(key)
            elif any(p.search(key) for p in SPARSE_PATTERNS):
                if _float(value) == 0.0:
                    out.add(key)
                else:
                    self.written.add(key)
            elif self._single_round(key, values):
                out.add(key)
        return out

    def _single_round(self, key: str, values: Mapping[str, Any]) -> bool:
        """Whether ``key`` is a per-round key of a run whose sequences all had one round so far, with the
        whole-sequence keys it repeats present."""
        section, total_key = PER_ROUND
        at = key.find(section)
        if at < 0:
            return False
        head = key[:at]
        if head in self.multi_round:
            return False
        total = _float(values.get(head + total_key))
        if total is None or f"{head}opbc/logprob/abs_diff_mean" not in values:
            return False
        if total > 1.0:
            self.multi_round.add(head)
            return False
        return True

    def __call__(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` without the keys not to write on this step (missing keys stay missing)."""
        drop = self.dropped(values)
        return {k: v for k, v in values.items() if k not in drop}
