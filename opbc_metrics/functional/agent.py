r"""Agent trajectories: rollout vs reference behaviour, pure functions over (rollout, reference) pairs.

A pair is one task run twice: by the rollout engine and by a reference engine (e.g. bf16 vs fp8, or
vLLM vs the trainer's own sampler). Each side is a :class:`~opbc_metrics.trajectory.Trajectory`
or an OpenAI-style chat message list (converted with ``Trajectory.from_messages``). Per pair:

* ``tool_call_jaccard`` = :math:`|A \cap B| / |A \cup B|` over the *sets* of
  ``(tool name, sha256 of canonical JSON arguments)`` of all the tool calls of each side; 1.0 when
  neither side calls a tool.
* ``first_divergence``: walking the assistant steps in order, the first step ``i`` (0-based) where
  the two sides took a different action: the ordered tool-name lists differ (kind ``tool_choice``),
  else the ordered canonical argument lists differ (``tool_arguments``), else, on a step where
  neither side calls a tool (its text is the action, e.g. the final answer), the normalised contents
  differ (``content``). On a step with tool calls the action is the calls: the same tools with the same
  arguments are the same action whatever text accompanies them. If one side runs out of steps first,
  it diverges at its end, step ``min(len_a, len_b)`` (``length``); ``None`` when no step differs. The
  final answer is not part of it (see ``answer_match``).
* ``answer_match``: both sides reached a final answer and the answers are equal after
  :func:`normalize_text` (whitespace runs folded to one space, ends stripped, lower-cased). A missing
  final answer counts as ``""``, and two empty answers (neither side answered, e.g. both stopped at
  the step limit) did not reach the same answer: no match.
* ``answer_soft_match``: the token-overlap F1 of the two normalised answers (SQuAD's F1): with ``c``
  the size of the multiset intersection of their whitespace tokens, precision ``c / len(a)``, recall
  ``c / len(b)``, F1 ``2 p r / (p + r)``; 0 when either side is empty or nothing overlaps, 1 for equal
  non-empty answers. Partial credit for answers that differ in a few words.
* step counts: the number of assistant steps of the rollout and of the reference trajectory.
* ``tool_choice_disagreement``: over step indices ``0 .. max(len_a, len_b) - 1`` (a side without
  that step has an empty tool list), ``(steps whose tool-name lists differ, steps where either side
  calls a tool)``.

The window values (keys ``agent/...``) are ratios of sums over all pairs and ranks. A key whose
denominator is zero in the window has no value and is left out (no made-up -1 or 0): the stateful
classes decide it on the synced counts, :func:`agent_metrics` on its batch, which raises a ``ValueError``
without a pair (:func:`~opbc_metrics.functional.statistics.require_data`; the classes report nothing then).

================================================  ==================================================
key                                               value (left out when)
================================================  ==================================================
agent/trajectory/tool_call_jaccard                mean per-pair Jaccard (no pair)
agent/trajectory/first_divergence_step_mean       mean first-divergence step of diverged pairs (no
                                                  pair diverged)
agent/trajectory/first_divergence_step_min        earliest first-divergence step (no pair diverged)
agent/trajectory/diverged_fraction                diverged pairs / pairs (no pair)
agent/trajectory/divergence_kind/<kind>           pairs diverging by <kind> / pairs (no pair); the four
                                                  kinds sum to diverged_fraction
agent/trajectory/num_pairs                        pairs compared (no pair)
agent/answer/match_rate                           pairs whose answers match / pairs (no pair)
agent/answer/soft_match_mean                      mean per-pair token-overlap F1 of the answers (no pair)
agent/steps/rollout_mean                          mean assistant steps of the rollout sides (no pair)
agent/steps/reference_mean                        mean assistant steps of the reference sides (no pair)
agent/steps/tool_choice_disagreement_rate         sum of disagreeing steps / sum of steps where either
                                                  side calls a tool (no step calls a tool)
================================================  ==================================================

The per-pair work is plain Python over small host structures; the sufficient statistics are float64
tensors (sums, and a min for the earliest step), so the stateful classes in
:mod:`opbc_metrics.agent` sync over DDP exactly like the tensor metrics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from opbc_metrics.batch import BatchView
from opbc_metrics.functional.statistics import Stats, require_data, safe_div
from opbc_metrics.trajectory import Trajectory, as_trajectory

TRAJECTORY_PAIRS = "trajectory_pairs"

DIVERGENCE_KINDS = ("tool_choice", "tool_arguments", "content", "length")

JACCARD_KEY = "agent/trajectory/tool_call_jaccard"
DIVERGENCE_KEYS = (
    "agent/trajectory/first_divergence_step_mean",
    "agent/trajectory/first_divergence_step_min",
    "agent/trajectory/diverged_fraction",
    *(f"agent/trajectory/divergence_kind/{kind}" for kind in DIVERGENCE_KINDS),
    "agent/trajectory/num_pairs",
)
ANSWER_KEY = "agent/answer/match_rate"
SOFT_ANSWER_KEY = "agent/answer/soft_match_mean"
STEP_COUNT_KEYS = ("agent/steps/rollout_mean", "agent/steps/reference_mean")
TOOL_CHOICE_KEY = "agent/steps/tool_choice_disagreement_rate"
AGENT_KEYS = (JACCARD_KEY, *DIVERGENCE_KEYS, ANSWER_KEY, SOFT_ANSWER_KEY, TOOL_CHOICE_KEY, *STEP_COUNT_KEYS)

# The divergence step's placeholder inside _divergence_compute when no pair diverged; never reported: the keys
# are left out then (FirstDivergenceStep.key_counts, agent_metrics).
NO_DIVERGENCE = -1.0

AnyTrajectory = Any  # a Trajectory or a list of chat messages


class Divergence(NamedTuple):
    """Where and how a pair first diverged: the 0-based assistant ``step`` and its ``kind``."""

    step: int
    kind: str


def normalize_text(text: str | None) -> str:
    """Fold whitespace runs to one space, strip the ends, lower-case; ``None`` gives ``""``.

    Example:
        >>> normalize_text("  The answer\\n is   42. ")
        'the answer is 42.'
    """
    return " ".join((text or "").split()).lower()


def _pair(rollout: AnyTrajectory, reference: AnyTrajectory) -> tuple[Trajectory, Trajectory]:
    return as_trajectory(rollout, "rollout"), as_trajectory(reference, "reference")


# ---------------------------------------------------------------------------------------------
# per pair
# ---------------------------------------------------------------------------------------------
def _jaccard(a: Trajectory, b: Trajectory) -> float:
    set_a = {call.key for step in a.steps for call in step.tool_calls}
    set_b = {call.key for step in b.steps for call in step.tool_calls}
    union = set_a | set_b
    return len(set_a & set_b) / len(union) if union else 1.0


def _divergence(a: Trajectory, b: Trajectory) -> Divergence | None:
    for i, (sa, sb) in enumerate(zip(a.steps, b.steps)):
        if sa.tool_names != sb.tool_names:
            return Divergence(i, "tool_choice")
        if tuple(c.arguments for c in sa.tool_calls) != tuple(c.arguments for c in sb.tool_calls):
            return Divergence(i, "tool_arguments")
        # Equal tool names: both sides call tools (the calls are the action) or neither does (the text is).
        if not sa.tool_calls and normalize_text(sa.content) != normalize_text(sb.content):
            return Divergence(i, "content")
    if len(a.steps) != len(b.steps):
        return Divergence(min(len(a.steps), len(b.steps)), "length")
    return None


def _answer_match(a: Trajectory, b: Trajectory) -> bool:
    answer = normalize_text(a.final_answer)
    return answer != "" and answer == normalize_text(b.final_answer)


def _soft_answer_match(a: Trajectory, b: Trajectory) -> float:
    return _token_f1(normalize_text(a.final_answer).split(), normalize_text(b.final_answer).split())


def _token_f1(tokens_a: list[str], tokens_b: list[str]) -> float:
    if tokens_a == tokens_b:  # (the common case, without two Counters)
        return 1.0 if tokens_a else 0.0
    common = sum((Counter(tokens_a) & Counter(tokens_b)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(tokens_a), common / len(tokens_b)
    return 2.0 * precision * recall / (precision + recall)


def _tool_choice(a: Trajectory, b: Trajectory) -> tuple[int, int]:
    disagree = either = 0
    for i in range(max(len(a.steps), len(b.steps))):
        names_a = a.steps[i].tool_names if i < len(a.steps) else ()
        names_b = b.steps[i].tool_names if i < len(b.steps) else ()
        if names_a or names_b:
            either += 1
            disagree += names_a != names_b
    return disagree, either


def tool_call_jaccard(rollout: AnyTrajectory, reference: AnyTrajectory) -> float:
    r"""Jaccard similarity of the ``(tool name, arguments hash)`` sets of two trajectories.

    .. math:: J = \frac{|A \cap B|}{|A \cup B|}, \quad J = 1 \text{ when } A = B = \emptyset

    Example:
        >>> from opbc_metrics.agent import Step, ToolCall, Trajectory
        >>> a = Trajectory([Step(tool_calls=[ToolCall("search", {"q": "x"}), ToolCall("calc", "{}")])])
        >>> b = Trajectory([Step(tool_calls=[ToolCall("search", '{"q":"x"}')])])
        >>> tool_call_jaccard(a, b)
        0.5
    """
    return _jaccard(*_pair(rollout, reference))


def first_divergence(rollout: AnyTrajectory, reference: AnyTrajectory) -> Divergence | None:
    """The first assistant step (0-based) where the two trajectories act differently, and how.

    Tool choice is compared first, then tool arguments, then normalised content; a trajectory that
    ends early diverges at its end (kind ``length``). ``None`` when the steps are identical.

    Example:
        >>> from opbc_metrics.agent import Step, Trajectory
        >>> a = Trajectory([Step("Thinking"), Step(tool_calls=[("search", '{"q": "x"}')])])
        >>> b = Trajectory([Step("thinking "), Step(tool_calls=[("search", '{"q": "y"}')])])
        >>> first_divergence(a, b)
        Divergence(step=1, kind='tool_arguments')
        >>> first_divergence(a, Trajectory([Step("thinking")]))
        Divergence(step=1, kind='length')
        >>> first_divergence(a, a) is None
        True
    """
    return _divergence(*_pair(rollout, reference))


def answer_match(rollout: AnyTrajectory, reference: AnyTrajectory) -> bool:
    """Whether both sides gave a final answer and the answers agree after whitespace folding and lower-casing.

    Example:
        >>> answer_match([{"role": "assistant", "content": "Paris "}],
        ...              [{"role": "assistant", "content": " paris"}])
        True
        >>> answer_match([{"role": "assistant", "content": ""}], [{"role": "assistant", "content": " "}])
        False
    """
    return _answer_match(*_pair(rollout, reference))


def answer_soft_match(rollout: AnyTrajectory, reference: AnyTrajectory) -> float:
    r"""Token-overlap F1 of the normalised final answers (SQuAD's F1; 0 when either is empty).

    .. math:: c = |\mathrm{tok}(a) \cap \mathrm{tok}(b)|_{\text{multiset}}, \quad
              F_1 = \frac{2 c}{|\mathrm{tok}(a)| + |\mathrm{tok}(b)|}

    Example:
        >>> answer_soft_match([{"role": "assistant", "content": "The capital is Paris"}],
        ...                   [{"role": "assistant", "content": "paris"}])
        0.4
    """
    return _soft_answer_match(*_pair(rollout, reference))


def tool_choice_disagreement(rollout: AnyTrajectory, reference: AnyTrajectory) -> tuple[int, int]:
    """``(steps whose tool-name lists differ, steps where either side calls a tool)``.

    Steps are aligned by index; a side without step ``i`` has an empty tool list there.

    Example:
        >>> from opbc_metrics.agent import Step, Trajectory
        >>> a = Trajectory([Step(tool_calls=[("search", "{}")]), Step("done")])
        >>> b = Trajectory([Step(tool_calls=[("search", "{}")]), Step(tool_calls=[("calc", "{}")])])
        >>> tool_choice_disagreement(a, b)
        (1, 2)
    """
    return _tool_choice(*_pair(rollout, reference))


# ---------------------------------------------------------------------------------------------
# batches of pairs
# ---------------------------------------------------------------------------------------------
def trajectory_pairs(value: Any) -> list[tuple[Trajectory, Trajectory]]:
    """Validate a ``trajectory_pairs`` batch field: a sequence of (rollout, reference) pairs.

    Raises:
        ValueError: naming ``trajectory_pairs`` (and the index) for a wrong container, a pair that
            is not two items, or a side that is neither a Trajectory nor a valid message list.
    """
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise ValueError(
            f"batch field `{TRAJECTORY_PAIRS}` must be a list of (rollout, reference) pairs, "
            f"got {type(value).__name__}"
        )
    pairs = []
    for i, pair in enumerate(value):
        if isinstance(pair, (str, bytes, Mapping)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise ValueError(
                f"batch field `{TRAJECTORY_PAIRS}[{i}]` must be a (rollout, reference) pair, got "
                f"{type(pair).__name__}{f' of length {len(pair)}' if isinstance(pair, Sequence) else ''}"
            )
        pairs.append((as_trajectory(pair[0], f"{TRAJECTORY_PAIRS}[{i}][0]"),
                      as_trajectory(pair[1], f"{TRAJECTORY_PAIRS}[{i}][1]")))
    return pairs


def _pair_stats(pairs: Sequence[tuple[Trajectory, Trajectory]]) -> Stats:
    s = dict.fromkeys(("pairs", "jaccard_sum", "diverged", "step_sum", *(f"kind_{k}" for k in DIVERGENCE_KINDS),
                       "matches", "soft_sum", "rollout_steps", "reference_steps", "disagree", "tool_steps"), 0.0)
    step_min = float("inf")
    # (per pair: each final answer normalised once, for the exact and the soft match)
    jaccard = matches = soft = rollout_steps = reference_steps = disagree = tool_steps = 0.0
    for a, b in pairs:
        pair_disagree, either = _tool_choice(a, b)
        disagree += pair_disagree
        tool_steps += either
        jaccard += _jaccard(a, b)
        answer_a, answer_b = normalize_text(a.final_answer), normalize_text(b.final_answer)
        matches += answer_a != "" and answer_a == answer_b
        soft += _token_f1(answer_a.split(), answer_b.split())
        rollout_steps += len(a.steps)
        reference_steps += len(b.steps)
        div = _divergence(a, b)
        if div is not None:
            s["diverged"] += 1
            s["step_sum"] += div.step
            s[f"kind_{div.kind}"] += 1
            step_min = min(step_min, float(div.step))
    s.update(pairs=float(len(pairs)), jaccard_sum=jaccard, matches=matches, soft_sum=soft, rollout_steps=rollout_steps,
             reference_steps=reference_steps, disagree=disagree, tool_steps=tool_steps, step_min=step_min)
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in s.items()}


def _agent_update(view: BatchView) -> Stats:
    """The statistics of one batch's ``trajectory_pairs``, computed once per BatchView and shared."""
    return view.shared("agent/pair_stats", lambda: _pair_stats(trajectory_pairs(view.field(TRAJECTORY_PAIRS))))


#: The window values that are ratios of sums: key -> (numerator state, denominator state, empty-window value).
RATIOS = {
    JACCARD_KEY: ("jaccard_sum", "pairs", 1.0),
    ANSWER_KEY: ("matches", "pairs", 1.0),
    SOFT_ANSWER_KEY: ("soft_sum", "pairs", 1.0),
    TOOL_CHOICE_KEY: ("disagree", "tool_steps", 0.0),
    STEP_COUNT_KEYS[0]: ("rollout_steps", "pairs", 0.0),
    STEP_COUNT_KEYS[1]: ("reference_steps", "pairs", 0.0),
}


def _ratio_compute(keys: Sequence[str], stats: Stats) -> dict[str, Tensor]:
    return {key: safe_div(stats[num], stats[den], empty) for key in keys for num, den, empty in [RATIOS[key]]}


def _divergence_compute(pairs: Tensor, diverged: Tensor, step_sum: Tensor, step_min: Tensor, **kinds: Tensor
                        ) -> dict[str, Tensor]:
    """``kinds``: the ``kind_<kind>`` counts, in :data:`DIVERGENCE_KINDS` order."""
    return {
        DIVERGENCE_KEYS[0]: safe_div(step_sum, diverged, NO_DIVERGENCE),
        DIVERGENCE_KEYS[1]: torch.where(diverged > 0, step_min, torch.full_like(step_min, NO_DIVERGENCE)),
        DIVERGENCE_KEYS[2]: safe_div(diverged, pairs, 0.0),
        **{key: safe_div(kinds[f"kind_{k}"], pairs, 0.0) for key, k in zip(DIVERGENCE_KEYS[3:7], DIVERGENCE_KINDS)},
        DIVERGENCE_KEYS[7]: pairs.clone(),
    }


#: Keys counted by another state than ``pairs``: left out while it is zero (``OPBCMetric.key_counts``).
COUNTED_KEYS = {DIVERGENCE_KEYS[0]: "diverged", DIVERGENCE_KEYS[1]: "diverged", TOOL_CHOICE_KEY: "tool_steps"}


def _all_compute(s: Stats) -> dict[str, Tensor]:
    """Every key with a value: keys over pairs when there was a pair, :data:`COUNTED_KEYS` when their count is
    non-zero, ``num_pairs`` always (host reads: the statistics are host tensors)."""
    kinds = {f"kind_{k}": s[f"kind_{k}"] for k in DIVERGENCE_KINDS}
    out = {**_ratio_compute(RATIOS, s), **_divergence_compute(s["pairs"], s["diverged"], s["step_sum"], s["step_min"],
                                                              **kinds)}
    counts = {key: COUNTED_KEYS.get(key, "pairs") for key in AGENT_KEYS if key != DIVERGENCE_KEYS[7]}
    return {key: out[key] for key in AGENT_KEYS if key not in counts or bool(s[counts[key]] > 0)}


def agent_metrics(pairs: Sequence[tuple[AnyTrajectory, AnyTrajectory]]) -> dict[str, Tensor]:
    """Every ``agent/...`` key for one batch of (rollout, reference) pairs (float64 tensors); a key whose count is
    zero is left out, and no pair raises a ``ValueError``.

    Example:
        >>> roll = [{"role": "assistant", "content": None, "tool_calls": [
        ...     {"type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}]},
        ...     {"role": "tool", "content": "..."}, {"role": "assistant", "content": "42"}]
        >>> ref = [{"role": "assistant", "content": "42"}]
        >>> out = agent_metrics([(roll, ref), (ref, ref)])
        >>> {k.removeprefix("agent/"): v.item() for k, v in out.items()}  # doctest: +NORMALIZE_WHITESPACE
        {'trajectory/tool_call_jaccard': 0.5,
         'trajectory/first_divergence_step_mean': 0.0, 'trajectory/first_divergence_step_min': 0.0,
         'trajectory/diverged_fraction': 0.5,
         'trajectory/divergence_kind/tool_choice': 0.5, 'trajectory/divergence_kind/tool_arguments': 0.0,
         'trajectory/divergence_kind/content': 0.0, 'trajectory/divergence_kind/length': 0.0,
         'trajectory/num_pairs': 2.0, 'answer/match_rate': 1.0, 'answer/soft_match_mean': 1.0,
         'steps/tool_choice_disagreement_rate': 1.0, 'steps/rollout_mean': 1.5, 'steps/reference_mean': 1.0}
        >>> agent_metrics([])
        Traceback (most recent call last):
        ...
        ValueError: agent_metrics(): no trajectory pair in the batch, so there is no value to return (a number ...
    """
    stats = _pair_stats(trajectory_pairs(pairs))
    require_data(stats["pairs"], "agent_metrics", "trajectory pair", "at least one (rollout, reference) pair")
    return _all_compute(stats)
