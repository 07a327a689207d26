"""Agent-trajectory metrics (section ``agent``) and the trajectory data model they read.

Example:
    >>> from opbc_metrics import OPBCCollection
    >>> rollout = [{"role": "user", "content": "capital of France?"},
    ...            {"role": "assistant", "content": "Paris"}]
    >>> reference = [{"role": "user", "content": "capital of France?"},
    ...              {"role": "assistant", "content": "paris "}]
    >>> metrics = OPBCCollection(sections=["agent"])
    >>> metrics.update(trajectory_pairs=[(rollout, reference)])
    >>> metrics.compute()["agent/answer/match_rate"]
    tensor(1., dtype=torch.float64)
"""

from opbc_metrics.agent.metrics import (
    AGENT_METRICS,
    AnswerMatchRate,
    FirstDivergenceStep,
    SoftAnswerMatch,
    ToolCallJaccard,
    ToolChoiceDisagreementRate,
    TrajectoryStepCounts,
    agent_section,
)
from opbc_metrics.trajectory import Step, ToolCall, Trajectory, as_trajectory, canonical_arguments

__all__ = [
    "AGENT_METRICS",
    "AnswerMatchRate",
    "FirstDivergenceStep",
    "SoftAnswerMatch",
    "Step",
    "ToolCall",
    "ToolCallJaccard",
    "ToolChoiceDisagreementRate",
    "Trajectory",
    "TrajectoryStepCounts",
    "agent_section",
    "as_trajectory",
    "canonical_arguments",
]
