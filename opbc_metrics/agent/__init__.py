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

from opbc_metrics.agent import metrics, trajectory
from opbc_metrics.agent.metrics import *  # noqa: F403
from opbc_metrics.agent.trajectory import *  # noqa: F403

__all__ = metrics.__all__ + trajectory.__all__
