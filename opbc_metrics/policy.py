r"""The OPBC policy: actions, reasons, and one frozen, validated object holding every threshold.

A data model: it imports no metric class, so that the controller's kernels
(:mod:`opbc_metrics.functional.controller`) and its classes (:mod:`opbc_metrics.controller`) both build on it.

Rules, per group, in order (DESIGN "OPBC"); the first that holds sets the action, and every condition that
holds is kept as a reason:

1. contract failure (:data:`Reason` ``shape_mismatch`` ... ``invalid_policy_lag``) -> ``reject``
2. ``veto_fraction > max_veto_fraction`` [0; veto V = 30 nats] -> ``quarantine``
3. ``policy_lag > max_lag`` [8], ``ess < min_ess`` [0.30], ``router_flip_rate > max_flip`` [0.15] ->
   ``quarantine``
4. ``clipped_fraction > max_clipped`` [0.10; clamp C = 20 nats] -> ``train_with_correction``
5. ``policy_lag > replay_lag`` [4] or ``ess < replay_ess`` [0.60] -> ``replay``
6. otherwise -> ``train``

**Strictness.** Actions are ordered by the precedence of their rules: ``reject`` > ``quarantine`` >
``train_with_correction`` > ``replay`` > ``train`` (:attr:`Action.strictness`). *Loosening* a threshold
(raising ``veto``, ``max_veto_fraction``, ``max_lag``, ``max_flip``, ``max_clipped``, ``replay_lag`` or
``alignment_gap``; lowering ``min_ess`` or ``replay_ess``) can only remove conditions, so the first match
moves to a later rule: it never makes a group's action stricter. ``clamp`` is not a threshold but the
definition of the weights (it changes ESS as well as the clipped fraction).

**Correction** (what ``train_with_correction`` groups, and ``train`` groups when ``correct_train``, are
trained with): ``correction_level`` token / sequence / geometric ratio, ``correction_mode`` truncate
(clamp the ratio into ``[weight_floor, weight_cap]``) or mask (drop tokens / sequences outside it).
``None`` bounds mean the core clamp ``e^{+-C}``: the default preset trains flagged groups with exactly the
weights ``w = exp(clamp(r, -C, C))`` that ESS and the second moment describe.

**Presets** (:meth:`OPBCPolicy.preset`):

* ``"default"``: the DESIGN thresholds; ``train_with_correction`` groups get ``w = exp(clamp(r, -C, C))``.
* ``"truncated_is"``: TIS as most RL frameworks run it (verl ``rollout_is_threshold=2``, truncate, token
  level): every trained token gets ``min(exp(r), 2)``. How the weight cap of 2 maps to the thresholds: it is a
  log ratio of ln 2 = 0.693 nats, so the log-ratio axis has four bands: ``r <= ln 2`` untouched,
  ``ln 2 < r`` truncated to 2 (counted in ``opbc/decision/truncated_token_share``), ``|r| > C = 20`` counted
  in ``clipped_fraction`` (``train_with_correction`` past 10% of the group), ``|r| > V = 30`` vetoed
  (quarantine). The cap is *not* used as the clamp C of the statistics: ESS of weights clamped to
  ``[e^-C, e^C]`` is at least ``1 / cosh(C)^2`` (Kantorovich), 0.64 for C = ln 2, so both ESS rules
  (0.30, 0.60) could never fire and ESS would stop measuring drift; C = 20 keeps the DESIGN meaning of
  ESS and of the clipped fraction, whose thresholds are calibrated on it.
* ``"masked_is"``: MIS: every trained token outside ``[0.5, 2]`` is dropped from the loss mask, the rest keep
  their true ratio.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass
from enum import Enum
from typing import Any

from opbc_metrics.batch import DEFAULT_CLAMP, DEFAULT_VETO

# Actions in the precedence order of the rules: a smaller code is a stricter action and wins.
ACTIONS: tuple[str, ...] = ("reject", "quarantine", "train_with_correction", "replay", "train")
REJECT, QUARANTINE, TRAIN_WITH_CORRECTION, REPLAY, TRAIN = range(5)

# Every rule condition, in rule order, with the action it triggers.
REASONS: tuple[tuple[str, int], ...] = (
    ("shape_mismatch", REJECT),
    ("logprobs_missing", REJECT),
    ("no_response_tokens", REJECT),
    ("logprobs_misaligned", REJECT),
    ("non_finite", REJECT),
    ("logprobs_positive", REJECT),
    ("mask_not_binary", REJECT),
    ("token_ids_mismatch", REJECT),
    ("expert_ids_negative", REJECT),
    ("invalid_policy_lag", REJECT),
    ("veto", QUARANTINE),
    ("lag_above_max", QUARANTINE),
    ("ess_below_min", QUARANTINE),
    ("router_flip_above_max", QUARANTINE),
    ("clipped_above_max", TRAIN_WITH_CORRECTION),
    ("lag_above_replay", REPLAY),
    ("ess_below_replay", REPLAY),
)
REASON_NAMES: tuple[str, ...] = tuple(name for name, _ in REASONS)
CONTRACT_REASONS: tuple[str, ...] = tuple(name for name, action in REASONS if action == REJECT)



class Action(str, Enum):
    """What happens to a group. Members are listed from the strictest to the most permissive."""

    REJECT = "reject"
    QUARANTINE = "quarantine"
    TRAIN_WITH_CORRECTION = "train_with_correction"
    REPLAY = "replay"
    TRAIN = "train"

    @property
    def code(self) -> int:
        """The code used on the device (index into :data:`ACTIONS`)."""
        return ACTIONS.index(self.value)

    @property
    def strictness(self) -> int:
        """0 for ``train`` up to 4 for ``reject``: the precedence order of the rules.

        Example:
            >>> sorted(Action, key=lambda a: a.strictness)[:2]
            [<Action.TRAIN: 'train'>, <Action.REPLAY: 'replay'>]
        """
        return len(ACTIONS) - 1 - self.code

    @property
    def trains(self) -> bool:
        """Whether the group's tokens enter this step's loss (``train`` and ``train_with_correction``)."""
        return self in (Action.TRAIN, Action.TRAIN_WITH_CORRECTION)

    @classmethod
    def from_code(cls, code: int) -> Action:
        return cls(ACTIONS[code])


class Reason(str, Enum):
    """Every rule condition, in rule order. :attr:`action` is the action its rule triggers."""

    SHAPE_MISMATCH = "shape_mismatch"
    LOGPROBS_MISSING = "logprobs_missing"
    NO_RESPONSE_TOKENS = "no_response_tokens"
    LOGPROBS_MISALIGNED = "logprobs_misaligned"
    NON_FINITE = "non_finite"
    LOGPROBS_POSITIVE = "logprobs_positive"
    MASK_NOT_BINARY = "mask_not_binary"
    TOKEN_IDS_MISMATCH = "token_ids_mismatch"
    EXPERT_IDS_NEGATIVE = "expert_ids_negative"
    INVALID_POLICY_LAG = "invalid_policy_lag"
    VETO = "veto"
    LAG_ABOVE_MAX = "lag_above_max"
    ESS_BELOW_MIN = "ess_below_min"
    ROUTER_FLIP_ABOVE_MAX = "router_flip_above_max"
    CLIPPED_ABOVE_MAX = "clipped_above_max"
    LAG_ABOVE_REPLAY = "lag_above_replay"
    ESS_BELOW_REPLAY = "ess_below_replay"

    @property
    def action(self) -> Action:
        """The action of this reason's rule.

        Example:
            >>> Reason.ESS_BELOW_REPLAY.action
            <Action.REPLAY: 'replay'>
        """
        return Action.from_code(dict(REASONS)[self.value])

    @property
    def is_contract(self) -> bool:
        return self.action is Action.REJECT


class CorrectionLevel(str, Enum):
    """The ratio the correction bounds: per token ``e^{r_t}``, per sequence ``e^{s_i}``, or the
    length-normalised (geometric) ``e^{s_i / n_i}``."""

    TOKEN = "token"
    SEQUENCE = "sequence"
    GEOMETRIC = "geometric"


class CorrectionMode(str, Enum):
    """``truncate``: clamp the ratio into ``[floor, cap]`` (TIS); ``mask``: drop tokens / sequences outside
    it from the loss mask (MIS)."""

    TRUNCATE = "truncate"
    MASK = "mask"


_CAPS = ("max_veto_fraction", "max_lag", "max_flip", "max_clipped", "replay_lag")
_FRACTIONS = ("max_veto_fraction", "max_flip", "max_clipped", "min_ess", "replay_ess")
# Thresholds whose increase loosens the policy, and those whose decrease does.
LOOSEN_UP: tuple[str, ...] = ("veto", "max_veto_fraction", "max_lag", "max_flip", "max_clipped", "replay_lag",
                              "alignment_gap")
LOOSEN_DOWN: tuple[str, ...] = ("min_ess", "replay_ess")


def ess_floor(clamp: float) -> float:
    """The smallest ESS weights clamped to ``[e^-C, e^C]`` can have: ``1 / cosh(C)^2`` (Kantorovich).

    Example:
        >>> round(ess_floor(math.log(2.0)), 4)
        0.64
    """
    if clamp > 350:  # cosh overflows; the floor is 0 to double precision
        return 0.0
    return 1.0 / math.cosh(clamp) ** 2


@dataclass(frozen=True)
class OPBCPolicy:
    """Every threshold of the controller in one frozen, validated object.

    Args:
        clamp: C, the log-ratio clamp in nats of ``w = exp(clamp(r, -C, C))`` and of the clipped fraction (20).
        veto: V, the veto threshold in nats (30); ``inf`` disables the veto. Must be ``>= clamp``.
        max_veto_fraction: quarantine when the veto fraction exceeds it (0: any vetoed token).
        max_lag: quarantine when the policy lag exceeds it, in trainer steps (8).
        min_ess: quarantine when ESS is below it (0.30).
        max_flip: quarantine when the router top-1 flip rate exceeds it (0.15).
        max_clipped: ``train_with_correction`` when the clipped fraction exceeds it (0.10).
        replay_lag: ``replay`` when the lag exceeds it (4); at most ``max_lag``.
        replay_ess: ``replay`` when ESS is below it (0.60); at least ``min_ess``.
        alignment_gap: nats; a response token whose logprob is exactly 0 on one side while the other side is
            below ``-alignment_gap`` is misaligned (ln 2: probability 1 against less than even odds).
        correction_level: ``"token"``, ``"sequence"`` or ``"geometric"``.
        correction_mode: ``"truncate"`` or ``"mask"``.
        weight_cap: upper bound of the correction ratio (> 1); ``None``: ``e^C``.
        weight_floor: lower bound (in ``[0, 1)``); ``None``: ``e^-C``.
        correct_train: also correct the groups decided ``train`` (TIS/MIS frameworks correct every token).

    Raises:
        ValueError: a threshold is NaN, negative or out of range, ``replay_ess < min_ess``,
            ``replay_lag > max_lag``, ``veto < clamp``, or an unknown correction level / mode.

    Example:
        >>> policy = OPBCPolicy()
        >>> policy.min_ess, policy.replay_ess, policy.max_lag
        (0.3, 0.6, 8.0)
        >>> OPBCPolicy.preset("truncated_is").weight_cap
        2.0
        >>> OPBCPolicy(min_ess=0.7)
        Traceback (most recent call last):
        ...
        ValueError: `replay_ess` (0.6) must be >= `min_ess` (0.7): ...
    """

    clamp: float = DEFAULT_CLAMP
    veto: float = DEFAULT_VETO
    max_veto_fraction: float = 0.0
    max_lag: float = 8.0
    min_ess: float = 0.30
    max_flip: float = 0.15
    max_clipped: float = 0.10
    replay_lag: float = 4.0
    replay_ess: float = 0.60
    alignment_gap: float = math.log(2.0)
    correction_level: CorrectionLevel = CorrectionLevel.TOKEN
    correction_mode: CorrectionMode = CorrectionMode.TRUNCATE
    weight_cap: float | None = None
    weight_floor: float | None = None
    correct_train: bool = False

    def __post_init__(self) -> None:
        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"`{name}` must be a number, got {value!r}")
            value = float(value)
            if math.isnan(value):
                raise ValueError(f"`{name}` must not be NaN")
            if value < 0:
                raise ValueError(f"`{name}` must be non-negative, got {value}")
            object.__setattr__(self, name, value)
            return value

        clamp = number("clamp")
        if not 0 < clamp < math.inf:
            raise ValueError(f"`clamp` must be a positive finite number of nats, got {clamp}")
        if number("veto") == 0:
            raise ValueError("`veto` must be positive (use inf to disable the veto)")
        for name in (*_CAPS, "min_ess", "replay_ess", "alignment_gap"):
            number(name)
        for name in _FRACTIONS:
            if getattr(self, name) > 1:
                raise ValueError(f"`{name}` is a fraction and must be in [0, 1], got {getattr(self, name)}")
        if self.veto < self.clamp:
            raise ValueError(
                f"`veto` ({self.veto}) must be >= `clamp` ({self.clamp}): every clipped token would also be "
                "vetoed, so the group would be quarantined before train_with_correction could apply"
            )
        if self.replay_ess < self.min_ess:
            raise ValueError(
                f"`replay_ess` ({self.replay_ess}) must be >= `min_ess` ({self.min_ess}): a group below min_ess "
                "is quarantined before it could be replayed"
            )
        if self.replay_lag > self.max_lag:
            raise ValueError(
                f"`replay_lag` ({self.replay_lag}) must be <= `max_lag` ({self.max_lag}): a group staler than "
                "max_lag is quarantined before it could be replayed"
            )
        for name, enum in (("correction_level", CorrectionLevel), ("correction_mode", CorrectionMode)):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, enum(value.value if isinstance(value, Enum) else value))
            except ValueError:
                known = [m.value for m in enum]
                raise ValueError(f"`{name}` must be one of {known}, got {value!r}") from None
        if self.weight_cap is not None:
            cap = number("weight_cap")
            if not cap > 1:
                raise ValueError(f"`weight_cap` must be > 1 (a ratio of 1 is on-policy), got {cap}")
        if self.weight_floor is not None:
            floor = number("weight_floor")
            if not floor < 1:
                raise ValueError(f"`weight_floor` must be in [0, 1), got {floor}")
        if not isinstance(self.correct_train, bool):
            raise ValueError(f"`correct_train` must be a bool, got {self.correct_train!r}")
        floor_ess = ess_floor(self.clamp)
        dead = [n for n in ("min_ess", "replay_ess") if 0 < getattr(self, n) <= floor_ess]
        if dead:
            warnings.warn(
                f"with clamp C = {self.clamp:g} nats the ESS of the clamped weights is at least "
                f"1/cosh(C)^2 = {floor_ess:.4g}, so the rule(s) {dead} can never fire",
                UserWarning,
                stacklevel=3,
            )

    # -- presets ----------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> OPBCPolicy:
        """A named preset (see the module docstring), optionally with some fields overridden.

        Example:
            >>> OPBCPolicy.preset("masked_is").correction_mode
            <CorrectionMode.MASK: 'mask'>
            >>> OPBCPolicy.preset("nope")
            Traceback (most recent call last):
            ...
            ValueError: unknown OPBC preset 'nope'; known: ['default', 'masked_is', 'truncated_is']
        """
        if name not in PRESETS:
            raise ValueError(f"unknown OPBC preset {name!r}; known: {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @staticmethod
    def preset_names() -> list[str]:
        return sorted(PRESETS)

    def replace(self, **changes: Any) -> OPBCPolicy:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    # -- derived ----------------------------------------------------------------------------------
    @property
    def weight_bounds(self) -> tuple[float, float]:
        """``(floor, cap)`` of the correction ratio, with the ``None`` defaults resolved to ``e^{-+C}``."""
        floor = math.exp(-self.clamp) if self.weight_floor is None else self.weight_floor
        cap = math.exp(self.clamp) if self.weight_cap is None else self.weight_cap
        return floor, cap

    # -- serialisation ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (enums as strings, infinities as ``"inf"``)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.value if isinstance(value, Enum) else encode_float(value)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OPBCPolicy:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown OPBC policy fields {unknown}")
        return cls(**{k: decode_float(v) for k, v in data.items()})

    def to_json(self) -> str:
        """Example:
        >>> OPBCPolicy.from_json(OPBCPolicy.preset("truncated_is").to_json()) == OPBCPolicy.preset("truncated_is")
        True
        """
        return json.dumps(self.to_dict(), sort_keys=True, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> OPBCPolicy:
        return cls.from_dict(json.loads(text))


def encode_float(value: Any) -> Any:
    """Floats that strict JSON cannot hold (inf, -inf, nan) as strings; everything else unchanged."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def decode_float(value: Any) -> Any:
    """Inverse of :func:`encode_float`."""
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return float(value)
    return value


PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "truncated_is": {
        "correction_level": "token",
        "correction_mode": "truncate",
        "weight_cap": 2.0,
        "weight_floor": 0.0,
        "correct_train": True,
    },
    "masked_is": {
        "correction_level": "token",
        "correction_mode": "mask",
        "weight_cap": 2.0,
        "weight_floor": 0.5,
        "correct_train": True,
    },
}
