"""Run logging: metrics JSONL + TensorBoard/W&B/MLflow, sample dumps, console step lines and plots.

``plot_run`` is imported lazily so that importing this package does not pull in matplotlib; the W&B and
MLflow packages are imported only when their backend is enabled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlfleet.logging.backends import MetricsBackendError, MlflowBackend, WandbBackend
from rlfleet.logging.console import Progress, format_step_line
from rlfleet.logging.logger import MetricsLogger
from rlfleet.logging.metrics import MetricsBackend, read_metrics, scrub_secrets, write_jsonl

if TYPE_CHECKING:
    from rlfleet.logging.plot import plot_run

__all__ = [
    "MetricsBackend",
    "MetricsBackendError",
    "MetricsLogger",
    "MlflowBackend",
    "Progress",
    "WandbBackend",
    "format_step_line",
    "plot_run",
    "read_metrics",
    "scrub_secrets",
    "write_jsonl",
]


def __getattr__(name: str) -> Any:
    if name == "plot_run":
        from rlfleet.logging.plot import plot_run

        return plot_run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
