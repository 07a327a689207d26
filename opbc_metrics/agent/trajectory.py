"""The trajectory data model, re-exported from :mod:`opbc_metrics.trajectory` (where it lives, outside this
package, so that the kernels can import it without importing the metric classes)."""

from opbc_metrics.trajectory import Step, ToolCall, Trajectory, as_trajectory, canonical_arguments

__all__ = ["Step", "ToolCall", "Trajectory", "as_trajectory", "canonical_arguments"]
