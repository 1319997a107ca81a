"""Whether a run needs the Ray worker layer (``uses_ray``).

What this build cannot honour is checked in :mod:`rlfleet.config.checks` (``unsupported_settings``).
"""

from __future__ import annotations

from rlfleet.config.layout import ResourceLayout, resource_layout
from rlfleet.config.schema import MasterConfig


def needs_several_processes(layout: ResourceLayout) -> bool:
    """Whether ``layout`` has more than one process: several training ranks, or dedicated generation."""
    return layout.train_world > 1 or not layout.colocated


def uses_ray(cfg: MasterConfig, *, layout: ResourceLayout | None = None) -> bool:
    """Whether the run's workers are Ray actors: ``cluster.use_ray``, or by default whenever the layout
    needs more than one process (several training ranks, or dedicated generation workers).

    ``layout``: the run's :func:`~rlfleet.config.layout.resource_layout`, computed from ``cfg`` if not given.
    """
    if cfg.cluster.use_ray is not None:
        return cfg.cluster.use_ray
    return needs_several_processes(layout if layout is not None else resource_layout(cfg))
