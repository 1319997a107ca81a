"""Settings the schema knows (NeMo RL keys) that this build cannot honour yet: refused, never ignored.

Each entry names the key, the value asked for, and what to do instead. The list shrinks as features land
(the Ray layer lifts the cluster and parallelism entries).
"""

from __future__ import annotations

from rlfleet.config.errors import ConfigError
from rlfleet.config.schema import MasterConfig


def unsupported_settings(cfg: MasterConfig) -> list[str]:
    """Problems for every configured feature that this build would otherwise silently skip."""
    problems: list[str] = []
    world = cfg.cluster.num_nodes * max(cfg.cluster.gpus_per_node, 1)
    if world > 1:
        problems.append(
            f"cluster: {cfg.cluster.num_nodes} node(s) x {cfg.cluster.gpus_per_node} GPU(s) asks for "
            f"{world} training processes, but this build trains in one process; "
            "fix: cluster.num_nodes=1 cluster.gpus_per_node=1 (the Ray worker layer lifts this)"
        )
    d = cfg.policy.dtensor_cfg
    if not d.enabled:
        problems.append(
            "policy.dtensor_cfg.enabled: got false, but rlfleet trains with the DTensor/FSDP2 path only "
            "(there is no Megatron backend); fix: policy.dtensor_cfg.enabled=true"
        )
    for key, value, default in (
        ("tensor_parallel_size", d.tensor_parallel_size, 1),
        ("cpu_offload", d.cpu_offload, False),
        ("sequence_parallel", d.sequence_parallel, False),
    ):
        if value != default:
            problems.append(
                f"policy.dtensor_cfg.{key}: got {value!r}, but this build has no sharded trainer yet; "
                f"fix: policy.dtensor_cfg.{key}={str(default).lower()}"
            )
    if cfg.policy.generation.backend != "hf":
        problems.append(
            f"policy.generation.backend: got {cfg.policy.generation.backend!r}, but this build has the HF "
            "backend only; fix: policy.generation.backend=hf"
        )
    if not cfg.policy.generation.colocated.enabled:
        problems.append(
            "policy.generation.colocated.enabled: got false, but this build generates in the training "
            "process; fix: policy.generation.colocated.enabled=true"
        )
    return problems


def ensure_runnable(cfg: MasterConfig) -> None:
    """Raises ``ConfigError`` listing every setting this build would have to ignore to run ``cfg``."""
    problems = unsupported_settings(cfg)
    if problems:
        raise ConfigError(problems, header=f"this build cannot run the config as given ({len(problems)}):")
