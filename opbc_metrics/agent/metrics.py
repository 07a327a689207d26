"""Stateful agent-trajectory metrics (section ``agent``), thin classes over
:mod:`opbc_metrics.functional.agent`.

Each class reads the batch field ``trajectory_pairs`` (a list of ``(rollout, reference)`` pairs, each
side a :class:`~opbc_metrics.trajectory.Trajectory` or an OpenAI-style chat message list). The
pairs of one batch are compared once per :class:`~opbc_metrics.batch.BatchView`, so a collection of
the four classes does the host work once. The inputs are optional: inside an
:class:`~opbc_metrics.collection.OPBCCollection` the classes skip batches without ``trajectory_pairs``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import Tensor

from opbc_metrics.batch import BatchView
from opbc_metrics.functional.agent import (
    ANSWER_KEY,
    DIVERGENCE_KEYS,
    DIVERGENCE_KINDS,
    JACCARD_KEY,
    SOFT_ANSWER_KEY,
    STEP_COUNT_KEYS,
    TOOL_CHOICE_KEY,
    TRAJECTORY_PAIRS,
    _agent_update,
    _divergence_compute,
    _ratio_compute,
)
from opbc_metrics.metric import MIN, GlossaryEntry, OPBCMetric, table

__all__ = ["AGENT_METRICS", "AnswerMatchRate", "FirstDivergenceStep", "SoftAnswerMatch", "ToolCallJaccard",
           "ToolChoiceDisagreementRate", "TrajectoryStepCounts", "agent_section"]

_PAIRS = "(rollout, reference) trajectory pairs, summed over the window and all ranks"
_NO_ACTION = (
    "no OPBC action; a drop flags behavioural drift between the rollout and reference engines, to be read "
    "with the token-level mismatch metrics (ESS, |Δlogp|) of the same run"
)
#: ``_entry(name, what, ...)``: a glossary entry of this section, a diagnostic over pairs unless it says otherwise.
_entry = partial(GlossaryEntry, unit=_PAIRS, cap="none (diagnostic)", action=_NO_ACTION)


class _AgentMetric(OPBCMetric):
    """Base of the trajectory metrics: one batch field, per-pair host work shared through the view.

    ``compute()`` gives the ratios of sums of :data:`~opbc_metrics.functional.agent.RATIOS` for ``keys``.
    """

    required_fields = (TRAJECTORY_PAIRS,)
    optional_inputs = True
    data_counts = ("pairs",)

    def update(self, batch: Any = None, **fields: Any) -> None:
        """Accumulate a batch with ``trajectory_pairs``: a list of ``(rollout, reference)`` pairs."""
        super().update(batch, **fields)

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        stats = _agent_update(view)  # the statistics of every agent metric, computed once per view
        return {name: stats[name] for name in self.states}

    def compute(self) -> Tensor | dict[str, Tensor]:
        out = _ratio_compute(self.keys, self.state_values())
        return out if len(out) > 1 else out[self.keys[0]]


class ToolCallJaccard(_AgentMetric):
    r"""Mean per-pair Jaccard similarity of tool invocations, ``agent/trajectory/tool_call_jaccard``.

    Per pair, :math:`J = |A \cap B| / |A \cup B|` over the sets of ``(tool name, sha256 of canonical
    JSON arguments)`` of each side (1.0 when neither calls a tool); the metric is the mean of
    :math:`J` over pairs. No data in the window: no keys.

    Example:
        >>> from opbc_metrics.agent import Step, Trajectory
        >>> a = Trajectory([Step(tool_calls=[("search", {"q": "x"}), ("calc", "{}")])])
        >>> b = Trajectory([Step(tool_calls=[("search", '{"q": "x"}')])])
        >>> metric = ToolCallJaccard()
        >>> metric.update(trajectory_pairs=[(a, b), (a, a)])
        >>> metric.compute()
        tensor(0.7500, dtype=torch.float64)
    """

    keys, higher_is_better, states = (JACCARD_KEY,), True, table("jaccard_sum", "pairs")
    plot_lower_bound, plot_upper_bound = 0.0, 1.0
    glossary = _entry(
        "tool_call_jaccard",
        "Jaccard similarity of the (tool_name, arguments_hash) sets of the rollout and reference "
        "trajectories (arguments hashed as sha256 of canonical JSON: sorted keys, compact separators), "
        "averaged over pairs. 1.0 = identical tool invocations across the run; < 1.0 = the rollout "
        "engine picked at least one tool call the reference engine did not (or vice versa). Lower = "
        "more behavioural drift.",
    )


class FirstDivergenceStep(_AgentMetric):
    """Where trajectories first act differently, ``agent/trajectory/{first_divergence_step_mean,
    first_divergence_step_min, diverged_fraction, divergence_kind/<kind>, num_pairs}``.

    Per pair, the first assistant step (0-based) where the tool choice, then the tool arguments,
    then the normalised content differ; a trajectory that ends early diverges at its end (kind
    ``length``). The step mean and min are over the diverged pairs (left out while no pair in the
    window diverged: no value, not -1); the fractions are over all pairs, and the four
    ``divergence_kind`` fractions sum to ``diverged_fraction``. No data in the window: no keys.

    Example:
        >>> from opbc_metrics.agent import Step, Trajectory
        >>> a = Trajectory([Step("look"), Step(tool_calls=[("search", '{"q": "x"}')])])
        >>> b = Trajectory([Step("Look"), Step(tool_calls=[("search", '{"q": "y"}')])])
        >>> c = Trajectory([Step("look")])
        >>> metric = FirstDivergenceStep()
        >>> metric.update(trajectory_pairs=[(a, b), (a, a), (c, a)])
        >>> out = metric.compute()
        >>> out["agent/trajectory/first_divergence_step_mean"].item(), out["agent/trajectory/diverged_fraction"]
        (1.0, tensor(0.6667, dtype=torch.float64))
        >>> out["agent/trajectory/divergence_kind/length"].item() == 1 / 3
        True
    """

    keys, higher_is_better = DIVERGENCE_KEYS, None
    states = table("pairs", "diverged", "step_sum", *(f"kind_{k}" for k in DIVERGENCE_KINDS), step_min=MIN)
    key_counts = ((DIVERGENCE_KEYS[0], "diverged"), (DIVERGENCE_KEYS[1], "diverged"))
    glossary = _entry(
        "first_divergence_step",
        "First assistant step (0-based) where the rollout and reference trajectories took a different "
        "action: tool choice compared first, then tool arguments, then normalised content; a trajectory "
        "that ends early diverges at its end. Reported as the mean and min over diverged pairs (left out "
        "when none diverged), the share of diverged pairs, and the share by kind (tool_choice, "
        "tool_arguments, content, length). The lower the step, the earlier the rollout rolled off-policy.",
        aliases=("diverged_fraction", "divergence_kind"),
    )

    def compute(self) -> dict[str, Tensor]:
        return _divergence_compute(**self.state_values())


class AnswerMatchRate(_AgentMetric):
    """Share of pairs whose final answers match, ``agent/answer/match_rate``.

    Answers are compared after folding whitespace runs to one space, stripping and lower-casing; a
    missing final answer counts as the empty string, and two empty answers (neither side answered, e.g.
    both stopped at the step limit) are no match. No data in the window: no keys.

    Example:
        >>> roll = [{"role": "assistant", "content": "The answer is  42."}]
        >>> ref = [{"role": "assistant", "content": "the answer is 42."}]
        >>> metric = AnswerMatchRate()
        >>> metric.update(trajectory_pairs=[(roll, ref), (roll, [{"role": "assistant", "content": "41"}])])
        >>> metric.compute()
        tensor(0.5000, dtype=torch.float64)
    """

    keys, higher_is_better, states = (ANSWER_KEY,), True, table("matches", "pairs")
    plot_lower_bound, plot_upper_bound = 0.0, 1.0
    glossary = _entry(
        "answer_match",
        "Whether the rollout engine and reference engine reached the same final assistant answer "
        "(normalised whitespace + case; when neither side reached an answer they did not reach the same "
        "one: no match), as a rate over all comparisons (answer_match_rate): the "
        "fraction of tasks where rollout and reference produced the same final answer. The headline "
        "trajectory metric: small per-token drift can compound into a different answer over multi-step "
        "tool use.",
        aliases=("answer_match_rate",),
    )


class SoftAnswerMatch(_AgentMetric):
    r"""Mean token-overlap F1 of the final answers, ``agent/answer/soft_match_mean``.

    Per pair, with the answers normalised as for ``answer_match`` and split on whitespace, ``c`` the
    size of the multiset intersection of the two token lists: :math:`F_1 = 2c / (|a| + |b|)` (SQuAD's
    token F1; 0 when either answer is empty). Partial credit where ``answer_match`` is all or nothing:
    "the answer is 42" against "42" scores 0.4. Mean over pairs. No data in the window: no key.

    Example:
        >>> roll = [{"role": "assistant", "content": "The capital is Paris"}]
        >>> ref = [{"role": "assistant", "content": "paris"}]
        >>> metric = SoftAnswerMatch()
        >>> metric.update(trajectory_pairs=[(roll, ref), (ref, ref)])
        >>> metric.compute()  # (0.4 + 1) / 2
        tensor(0.7000, dtype=torch.float64)
    """

    keys, higher_is_better, states = (SOFT_ANSWER_KEY,), True, table("soft_sum", "pairs")
    plot_lower_bound, plot_upper_bound = 0.0, 1.0
    glossary = _entry(
        "answer_soft_match",
        "Soft answer match: token-overlap F1 of the normalised final answers of the rollout and reference "
        "trajectories (SQuAD's F1 over whitespace tokens, multiset overlap; 0 when either side has no "
        "answer), averaged over pairs. The trajectory lab's partial-credit counterpart of answer_match.",
        aliases=("soft_answer_match", "answer_f1"),
    )


class TrajectoryStepCounts(_AgentMetric):
    """Mean assistant steps per trajectory, ``agent/steps/{rollout_mean, reference_mean}``.

    The number of assistant steps of each side of a pair, averaged over pairs: a rollout that takes more
    steps than the reference to finish (or runs to the step limit) shows here. No data in the window: no keys.

    Example:
        >>> from opbc_metrics.agent import Step, Trajectory
        >>> a = Trajectory([Step(tool_calls=[("search", "{}")]), Step("done")])
        >>> metric = TrajectoryStepCounts()
        >>> metric.update(trajectory_pairs=[(a, Trajectory([Step("done")])), (a, a)])
        >>> [v.item() for v in metric.compute().values()]
        [2.0, 1.5]
    """

    keys, higher_is_better = STEP_COUNT_KEYS, None
    states = table("rollout_steps", "reference_steps", "pairs")
    glossary = _entry("trajectory_step_count", "Mean number of assistant steps of the rollout trajectories and of "
                      "the reference trajectories (the trajectory lab's step counts), over pairs.",
                      aliases=("rollout_steps", "reference_steps", "num_steps"))


class ToolChoiceDisagreementRate(_AgentMetric):
    """Per-step tool disagreement, ``agent/steps/tool_choice_disagreement_rate``.

    Steps whose ordered tool-name lists differ, over steps where either side calls a tool; steps
    are aligned by index and a side without step ``i`` has no tool calls there. Sums over all
    pairs (a pooled rate, not a mean of per-pair rates). No step of the window calls a tool (or no pair): no
    key (0 / 0 has no value).

    Example:
        >>> from opbc_metrics.agent import Step, Trajectory
        >>> a = Trajectory([Step(tool_calls=[("search", "{}")]), Step("done")])
        >>> b = Trajectory([Step(tool_calls=[("search", "{}")]), Step(tool_calls=[("calc", "{}")])])
        >>> metric = ToolChoiceDisagreementRate()
        >>> metric.update(trajectory_pairs=[(a, b)])
        >>> metric.compute()
        tensor(0.5000, dtype=torch.float64)
    """

    keys, higher_is_better = (TOOL_CHOICE_KEY,), False
    plot_lower_bound, plot_upper_bound = 0.0, 1.0
    glossary = _entry(
        "tool_choice_disagreement_rate",
        "Fraction of assistant steps where rollout and reference invoked different tools: steps whose "
        "tool-name lists differ / steps where either side calls a tool. The per-step counterpart to "
        "tool_call_jaccard; > 0 means the trajectories diverged at the step level.",
        unit="assistant steps (aligned by index) where either side calls a tool, summed over pairs, the "
        "window and all ranks",
    )
    # The rate's data are the steps where either side calls a tool: pairs without any tool call give no value.
    states, data_counts = table("disagree", "tool_steps"), ("tool_steps",)


AGENT_METRICS: tuple[type[_AgentMetric], ...] = (
    ToolCallJaccard, FirstDivergenceStep, AnswerMatchRate, SoftAnswerMatch, ToolChoiceDisagreementRate,
    TrajectoryStepCounts,
)


def agent_section(**kwargs: Any) -> list[OPBCMetric]:
    """The ``agent`` section of :class:`~opbc_metrics.collection.OPBCCollection`: the four trajectory
    metrics."""
    return [cls(**kwargs) for cls in AGENT_METRICS]
