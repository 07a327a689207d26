"""Which computed keys a logger writes: one key per quantity, no chart that is always zero.

``OPBCCollection.compute()`` returns every key of the glossary (:mod:`opbc_metrics.glossary`; a contract).
A dashboard needs less:

* **Aliases** (:data:`ALIASES`): keys that are a fixed linear function of other keys (equal, negated,
  offset by a constant, or a sum), by definition or under a condition that usually holds. The loggers
  leave an alias out while it equals its value from the other keys on every step so far, and write it
  on every step from the first one where it differs, so a chart never shows the same line twice and
  nothing is lost (``opbc/kl/k1`` reaches the dashboard only once the clamp made it differ from
  ``-opbc/logprob/diff_mean``). :func:`resolve_alias` and the glossary table name the keys to read instead.
* **Single-round runs** (:data:`PER_ROUND`): while no sequence has had more than one round
  (``per_round/total_rounds`` <= 1), the per-round keys repeat the whole-sequence ones (round 0 is the
  whole response, :func:`single_round_value`); they are written from the first window with a multi-round
  sequence on, and a key that differs from its value by that rule (round 0's token count counts
  non-finite tokens, ``opbc/input/num_tokens`` does not) from the first window it differs.
* **Quiet keys** (:data:`SPARSE_PATTERNS`): counts and shares of events that are zero in a healthy run
  (overflows beyond the configured capacity, controller decisions other than ``train`` and their
  reasons, clipped, vetoed or non-finite tokens, rollouts discarded as too stale, the smallest policy lag).
  They are written from their first nonzero value on, then on every step; until then
  :attr:`KeyFilter.zero_so_far` lists them
  (the W&B logger puts them in the run summary as 0, so "was anything vetoed?" has an answer).

Keys that are absent from the computed values are never written or filled in. ``KeyFilter(log_all=True)``
writes everything.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from opbc_metrics.batch import host_floats

__all__ = ["ALIASES", "PER_ROUND", "SPARSE_PATTERNS", "Alias", "KeyFilter", "resolve_alias", "single_round_value"]


@dataclass(frozen=True)
class Alias:
    """``key`` equals ``sign * canonical + sum(c * k for c, k in plus) + offset`` whenever ``condition``
    holds (always when it is empty)."""

    key: str
    canonical: str
    sign: float = 1.0
    condition: str = ""
    offset: float = 0.0
    plus: tuple[tuple[float, str], ...] = ()

    @property
    def sources(self) -> tuple[str, ...]:
        """The keys the alias is computed from."""
        return (self.canonical, *(k for _, k in self.plus))

    def value(self, get: Callable[[str], float]) -> float:
        """The alias's value from its sources' values (``get(key)``)."""
        return self.sign * get(self.canonical) + sum(c * get(k) for c, k in self.plus) + self.offset

    def describe(self) -> str:
        text = f"{'-' if self.sign < 0 else ''}{self.canonical}"
        for c, k in self.plus:
            text += f" {'-' if c < 0 else '+'} {'' if abs(c) == 1 else f'{abs(c):g} * '}{k}"
        if self.offset:
            text += f" {'-' if self.offset < 0 else '+'} {abs(self.offset):g}"
        where = f" when {self.condition}" if self.condition else ""
        return f"{self.key} = {text}{where}"


_ONE_PROMPT_LENGTH = "every prompt has one length"
ALIASES: tuple[Alias, ...] = (
    # max |r| is one state read twice; it is max(max r, -min r), so one extreme repeats it.
    Alias("opbc/log_ratio/max_abs", "opbc/logprob/abs_diff_max"),
    Alias("opbc/log_ratio/min", "opbc/logprob/abs_diff_max", -1.0, "the largest |r| is negative"),
    Alias("opbc/log_ratio/max", "opbc/logprob/abs_diff_max", 1.0, "the largest |r| is positive"),
    # d_i = mean rollout logp - mean trainer logp = -s_i / n_i, over the same sequences.
    Alias("opbc/ppl/log_ppl_diff", "opbc/sequence/geo_log_ratio_mean", -1.0),
    # k1 = mean(-clamp(r, -C, C)): the clamp changes it only when some |r| > C.
    Alias("opbc/kl/k1", "opbc/logprob/diff_mean", -1.0, "opbc/is/clipped_fraction is 0"),
    # chi2 = E[w^2] - 1 over the same tokens and weights.
    Alias("opbc/kl/chi2_token", "opbc/is/second_moment", offset=-1.0),
    # The controller decides on the batch the collection measures (the usual pattern).
    Alias("opbc/decision/num_tokens", "opbc/input/num_tokens", 1.0, "the decisions cover the measured batch"),
    # One prompt length: its extremes are its mean, and total = completion + that length.
    Alias("rollout/tokens_prompt/max", "rollout/tokens_prompt/mean", condition=_ONE_PROMPT_LENGTH),
    Alias("rollout/tokens_prompt/min", "rollout/tokens_prompt/mean", condition=_ONE_PROMPT_LENGTH),
    Alias("rollout/tokens_total/mean", "rollout/tokens_completion/mean", plus=((1.0, "rollout/tokens_prompt/mean"),)),
    *(
        Alias(f"rollout/tokens_total/{s}", f"rollout/tokens_completion/{s}", condition=_ONE_PROMPT_LENGTH,
              plus=((1.0, "rollout/tokens_prompt/mean"),))
        for s in ("max", "min")
    ),
    Alias("rollout/tokens_total/std", "rollout/tokens_completion/std", 1.0, _ONE_PROMPT_LENGTH),
    # total = max_async + zero_advantage; the two reasons' shares of it add up to 100.
    Alias("rollout/discarded/zero_advantage", "rollout/discarded/total", 1.0, "nothing was discarded for max_async"),
    Alias("rollout/discarded/zero_advantage_pct", "rollout/discarded/max_async_pct", -1.0, offset=100.0),
    # A zero-advantage group's rewards are all equal: all zero or all positive unless rewards go negative.
    Alias("rollout/discarded/zero_advantage_all_zero", "rollout/discarded/zero_advantage", 1.0,
          "no reward is negative", plus=((-1.0, "rollout/discarded/zero_advantage_all_positive"),)),
)
# Longest first: a key is matched by the most specific alias (``zero_advantage_pct`` before ``zero_advantage``).
_BY_LENGTH = sorted(ALIASES, key=lambda a: -len(a.key))

# The per-round section and the key that says whether any sequence had more than one round.
PER_ROUND = ("per_round/", "per_round/total_rounds")

# Counts and shares of events that are zero in a healthy run.
SPARSE_PATTERNS: tuple[re.Pattern[str], ...] = tuple(re.compile(p) for p in (
    r"(^|/)layer_overflow/",  # expert ids beyond the configured layers
    r"(^|/)per_round/overflow_",  # rounds beyond the per-round capacity
    r"(^|/)opbc/decision/reason_count/",
    r"(^|/)opbc/decision/(group|token)_share/(train_with_correction|replay|quarantine|reject)",
    r"(^|/)opbc/decision/(masked|truncated)_token_share",
    r"(^|/)opbc/input/nonfinite_count",
    r"(^|/)opbc/is/(clipped|veto)_fraction",
    r"(^|/)rollout/discarded/max_async",
    r"(^|/)rollout/tokens_prompt/std",  # every prompt has one length
    r"(^|/)rollout/off_policy_steps/min",  # the freshest sample's lag: 0 while any sample is on-policy
))


def resolve_alias(key: str) -> Alias | None:
    """The :class:`Alias` a key is (its sources renamed alike), with or without a collection prefix/postfix;
    ``None`` for a canonical key.

    Example:
        >>> resolve_alias("opbc/log_ratio/max_abs").canonical
        'opbc/logprob/abs_diff_max'
        >>> resolve_alias("bf16/opbc/kl/k1").describe()
        'bf16/opbc/kl/k1 = -bf16/opbc/logprob/diff_mean when opbc/is/clipped_fraction is 0'
        >>> resolve_alias("opbc/is/ess") is None
        True
    """
    for alias in _BY_LENGTH:
        at = key.find(alias.key)
        if at >= 0:
            head, tail = key[:at], key[at + len(alias.key) :]
            return Alias(key, f"{head}{alias.canonical}{tail}", alias.sign, alias.condition, alias.offset,
                         tuple((c, f"{head}{k}{tail}") for c, k in alias.plus))
    return None


# Round 0's mean and the whole response's mean accumulate in different orders (and float32 partial sums): their
# rounding differs by ~1e-9 relative at 100K tokens; a real difference (a non-finite token) is far above 1e-6.
ROUND_REL_TOL = 1e-6
# Per-round keys of a single-round window and the whole-sequence key each repeats (round 0 is the whole response).
_ROUND_SOURCES = {
    "round_0_abs_diff_mean": "opbc/logprob/abs_diff_mean",
    "max_diff_value": "opbc/logprob/abs_diff_mean",
    "round_0_token_count": "opbc/input/num_tokens",
}


def single_round_value(key: str, get: Callable[[str], float | None]) -> float | None:
    """The value a per-round key has when every sequence had one round, from the whole-sequence keys
    (``get(key)``, ``None`` when missing; a collection prefix carries over): ``total_rounds`` 1, round 0's
    mean and the worst round's value the whole response's mean, round 0's token count the valid tokens,
    the worst round's index 0. ``None`` for a key that is not per-round or a missing source.

    Example:
        >>> whole = {"opbc/logprob/abs_diff_mean": 0.1, "opbc/input/num_tokens": 37.0}
        >>> [single_round_value(f"per_round/{k}", whole.get) for k in ("total_rounds", "max_diff_value",
        ...                                                            "round_0_token_count", "max_round_diff")]
        [1.0, 0.1, 37.0, 0.0]
    """
    at = key.find(PER_ROUND[0])
    if at < 0:
        return None
    head, name = key[:at], key[at + len(PER_ROUND[0]) :]
    if name == "total_rounds":
        return 1.0
    source = _ROUND_SOURCES.get(name)
    return 0.0 if source is None else get(head + source)


def _float(value: Any) -> float | None:
    try:
        if hasattr(value, "numel") and value.numel() != 1:
            return None
        return float(value)
    except (TypeError, ValueError):
        return None


def _alias_value(alias: Alias, values: Mapping[str, Any]) -> float | None:
    """The alias's value from its sources in ``values``; ``None`` when one is missing or not a scalar."""
    sources = {k: _float(values.get(k)) for k in alias.sources}
    if any(v is None for v in sources.values()):
        return None
    return alias.value(sources.__getitem__)


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15) or (math.isnan(a) and math.isnan(b))


class KeyFilter:
    """Selects the keys a logger writes from computed values (stateful: remembers the aliases and quiet
    keys already written, which are then written on every step).

    Args:
        log_all: write every key (no alias, quiet-key or per-round filtering).

    Example:
        >>> f = KeyFilter()
        >>> sorted(f({"opbc/logprob/abs_diff_max": 0.5, "opbc/log_ratio/max_abs": 0.5,
        ...           "moe/router/layer_overflow/flip_rate": 0.0}))
        ['opbc/logprob/abs_diff_max']
        >>> sorted(f.zero_so_far)
        ['moe/router/layer_overflow/flip_rate']
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
        self.written: set[str] = set()  # aliases and quiet keys written once: written from then on
        self.zero_so_far: set[str] = set()  # quiet keys computed so far, always 0, not written yet
        self.multi_round: set[str] = set()  # prefixes of per-round sections that saw a multi-round sequence

    def dropped(self, values: Mapping[str, Any]) -> set[str]:
        """The keys of ``values`` not to write on this step."""
        if self.log_all:
            return set()
        values = {**values, **host_floats(values)}  # tensors read in one device-to-host copy, not one sync each
        out: set[str] = set()
        for key, value in values.items():
            if key in self.written:
                continue
            alias = resolve_alias(key)
            if alias is not None:
                mine, theirs = _float(value), _alias_value(alias, values)
                if mine is not None and theirs is not None and _same(mine, theirs):
                    out.add(key)
                else:
                    self.written.add(key)
            elif any(p.search(key) for p in SPARSE_PATTERNS):
                if _float(value) == 0.0:
                    out.add(key)
                    self.zero_so_far.add(key)
                else:
                    self.written.add(key)
                    self.zero_so_far.discard(key)
            elif self._single_round(key, values):
                out.add(key)
        return out

    def _single_round(self, key: str, values: Mapping[str, Any]) -> bool:
        """Whether ``key`` is a per-round key of a run whose sequences all had one round so far, equal to
        its value from the whole-sequence keys (:func:`single_round_value`)."""
        section, total_key = PER_ROUND
        at = key.find(section)
        if at < 0:
            return False
        head = key[:at]
        if head in self.multi_round:
            return False
        total = _float(values.get(head + total_key))
        if total is None or f"{head}opbc/logprob/abs_diff_mean" not in values:  # nothing it repeats
            return False
        if total > 1.0:
            self.multi_round.add(head)
            return False
        derived = single_round_value(key, lambda k: _float(values.get(k)))
        mine = _float(values[key])
        if derived is None or mine is None or not math.isclose(mine, derived, rel_tol=ROUND_REL_TOL, abs_tol=1e-15):
            # not what the rule gives (a source key missing, or e.g. non-finite tokens, which count in a
            # round's tokens but not in opbc/input/num_tokens): written, from now on, like an alias
            self.written.add(key)
            return False
        return True

    def __call__(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` without the keys not to write on this step (missing keys stay missing)."""
        drop = self.dropped(values)
        return {k: v for k, v in values.items() if k not in drop}
