"""Settings the schema knows (NeMo RL keys) that this build cannot honour: refused, never ignored.

Each entry names the key, the value asked for, and what to do instead. Also decides whether a run needs
the Ray worker layer (``uses_ray``).
"""

from __future__ import annotations

import importlib.util

from rlfleet.config.errors import ConfigError
from rlfleet.config.layout import compute_layout
from rlfleet.config.schema import MasterConfig


def _processes(cfg: MasterConfig) -> tuple[int, bool]:
    """(training processes, colocated generation) of the layout."""
    layout, _ = compute_layout(cfg)
    return layout.train_world, layout.colocated


def uses_ray(cfg: MasterConfig) -> bool:
    """Whether the run's workers are Ray actors: ``cluster.use_ray``, or by default whenever the layout
    needs more than one process (several training ranks, or dedicated generation workers)."""
    if cfg.cluster.use_ray is not None:
        return cfg.cluster.use_ray
    world, colocated = _processes(cfg)
    return world > 1 or not colocated


def unsupported_settings(cfg: MasterConfig) -> list[str]:
    """Problems for every configured feature that this build would otherwise silently skip."""
    problems: list[str] = []
    world, colocated = _processes(cfg)
    if cfg.cluster.use_ray is False and (world > 1 or not colocated):
        problems.append(
            f"cluster.use_ray=false, but the layout needs {world} training process(es)"
            + ("" if colocated else " and dedicated generation workers")
            + "; fix: cluster.use_ray=true (or leave it unset), or a single-process layout"
        )
    if uses_ray(cfg) and importlib.util.find_spec("ray") is None:
        problems.append(
            "this run needs Ray (several workers), but ray is not installed; fix: pip install 'rlfleet[ray]'"
        )
    d = cfg.policy.dtensor_cfg
    if not d.enabled:
        problems.append(
            "policy.dtensor_cfg.enabled: got false, but rlfleet trains with the DTensor/FSDP2 path only "
            "(there is no Megatron backend); fix: policy.dtensor_cfg.enabled=true"
        )
    for key, value in (("cpu_offload", d.cpu_offload), ("sequence_parallel", d.sequence_parallel)):
        if value:
            problems.append(
                f"policy.dtensor_cfg.{key}: got true, but this build does not implement it yet; "
                f"fix: policy.dtensor_cfg.{key}=false"
            )
    if cfg.policy.generation.backend != "hf":
        problems.append(
            f"policy.generation.backend: got {cfg.policy.generation.backend!r}, but this build has the HF "
            "backend only; fix: policy.generation.backend=hf"
        )
    return problems


def ensure_runnable(cfg: MasterConfig) -> None:
    """Raises ``ConfigError`` listing every setting this build would have to ignore to run ``cfg``."""
    problems = unsupported_settings(cfg)
    if problems:
        raise ConfigError(problems, header=f"this build cannot run the config as given ({len(problems)}):")
