"""opbc-metrics: distributed-exact metrics of train/rollout mismatch for RL post-training of LLMs.

Every name a section package exports (its ``__all__``) is exported here too.
"""

# In this order the sections register their metric classes, which orders the glossary (collection before controller).
from opbc_metrics import agent, collection, controller, endpoint, mismatch, moe, per_round, rollout, training  # noqa: F401
from opbc_metrics.agent import *  # noqa: F403
from opbc_metrics.batch import BatchView, host_floats
from opbc_metrics.collection import OPBCCollection
from opbc_metrics.controller import *  # noqa: F403
from opbc_metrics.endpoint import *  # noqa: F403
from opbc_metrics.metric import GlossaryEntry, OPBCMetric
from opbc_metrics.mismatch import *  # noqa: F403
from opbc_metrics.moe import *  # noqa: F403
from opbc_metrics.naming import make_key, parse_key
from opbc_metrics.per_round import *  # noqa: F403
from opbc_metrics.rollout import *  # noqa: F403
from opbc_metrics.training import *  # noqa: F403

__version__ = "0.1.0"

__all__ = ["BatchView", "GlossaryEntry", "OPBCCollection", "OPBCMetric", "host_floats", "make_key", "parse_key"]
__all__ += agent.__all__
__all__ += controller.__all__
__all__ += endpoint.__all__
__all__ += mismatch.__all__
__all__ += moe.__all__
__all__ += per_round.__all__
__all__ += rollout.__all__
__all__ += training.__all__
