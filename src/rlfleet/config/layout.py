"""Resource layout: which nodes and GPUs train, which generate, and the parallel sizes on each.

Pure arithmetic on the config (:func:`resource_layout`, computed once per run and passed on), used by
``rlfleet plan`` and the runs. The rules follow NeMo RL: tensor parallelism stays inside a node; a dedicated
(non-colocated) generation pool takes part of the single node, or whole nodes of a multi-node cluster, and
must leave training at least one GPU. :func:`layout_problems` says why a layout cannot run;
:func:`rlfleet.config.check_config` reports those problems with every other one.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfleet.config.schema import MasterConfig


@dataclass(frozen=True)
class ResourceLayout:
    """Where each role runs. ``*_gpus_per_node`` count GPUs (CPU-only clusters: worker processes)."""

    num_nodes: int
    gpus_per_node: int
    colocated: bool
    train_nodes: int
    train_gpus_per_node: int
    gen_nodes: int
    gen_gpus_per_node: int
    train_tp: int
    gen_tp: int
    backend: str

    @property
    def train_world(self) -> int:
        return self.train_nodes * self.train_gpus_per_node

    @property
    def gen_world(self) -> int:
        return self.gen_nodes * self.gen_gpus_per_node

    @property
    def train_dp(self) -> int:
        return self.train_world // self.train_tp

    @property
    def gen_engines(self) -> int:
        return self.gen_world // self.gen_tp


def _dedicated_shape(cfg: MasterConfig) -> tuple[int, int, int, int]:
    """(train_nodes, train_gpn, gen_nodes, gen_gpn) for non-colocated generation."""
    c, res = cfg.cluster, cfg.policy.generation.colocated.resources
    gen_nodes, gen_gpn = res.num_nodes or 0, res.gpus_per_node or 0
    if c.num_nodes == 1:
        return 1, max(c.gpus_per_node - gen_gpn, 0), 1, gen_gpn
    return c.num_nodes - gen_nodes, c.gpus_per_node, gen_nodes, gen_gpn


def resource_layout(cfg: MasterConfig) -> ResourceLayout:
    """The layout ``cfg`` asks for, possible or not (:func:`layout_problems`)."""
    c, gen = cfg.cluster, cfg.policy.generation
    colocated = gen.colocated.enabled
    if colocated:
        shape = (c.num_nodes, c.gpus_per_node, c.num_nodes, c.gpus_per_node)
    else:
        shape = _dedicated_shape(cfg)
    train_nodes, train_gpn, gen_nodes, gen_gpn = shape
    return ResourceLayout(
        num_nodes=c.num_nodes,
        gpus_per_node=c.gpus_per_node,
        colocated=colocated,
        train_nodes=train_nodes,
        train_gpus_per_node=train_gpn,
        gen_nodes=gen_nodes,
        gen_gpus_per_node=gen_gpn,
        train_tp=cfg.policy.dtensor_cfg.tensor_parallel_size,
        gen_tp=gen.vllm_cfg.tensor_parallel_size if gen.backend == "vllm" else 1,
        backend=gen.backend,
    )


def compute_layout(cfg: MasterConfig) -> tuple[ResourceLayout, list[str]]:
    """The layout and every problem with it (an empty list when it can run)."""
    layout = resource_layout(cfg)
    return layout, layout_problems(cfg, layout)


def layout_problems(cfg: MasterConfig, layout: ResourceLayout) -> list[str]:
    """Why ``layout`` (``resource_layout(cfg)``) cannot run: a dedicated generation pool that does not fit
    the cluster, tensor parallelism that leaves a node or does not divide its pool, a global batch that the
    data-parallel size does not divide. Empty when it can run."""
    problems = [] if layout.colocated else _dedicated_pool_problems(cfg)
    problems += _tp_problems(
        "policy.dtensor_cfg.tensor_parallel_size",
        layout.train_tp,
        layout.train_gpus_per_node,
        layout.train_world,
    )
    if layout.backend == "vllm":
        problems += _tp_problems(
            "policy.generation.vllm_cfg.tensor_parallel_size",
            layout.gen_tp,
            layout.gen_gpus_per_node,
            layout.gen_world,
        )
    if not problems:
        problems += _data_parallel_problems(cfg, layout)
    return problems


def _dedicated_pool_problems(cfg: MasterConfig) -> list[str]:
    c, res = cfg.cluster, cfg.policy.generation.colocated.resources
    key = "policy.generation.colocated.resources"
    gen_nodes, gen_gpn = res.num_nodes or 0, res.gpus_per_node or 0
    problems: list[str] = []
    if gen_gpn > c.gpus_per_node:
        problems.append(
            f"{key}.gpus_per_node={gen_gpn} exceeds cluster.gpus_per_node={c.gpus_per_node}; "
            f"fix: at most {c.gpus_per_node}"
        )
    if c.num_nodes == 1:
        if gen_nodes > 1:
            problems.append(f"{key}.num_nodes={gen_nodes} but the cluster has 1 node; fix: {key}.num_nodes=1")
        if gen_gpn >= c.gpus_per_node:
            problems.append(
                f"{key}.gpus_per_node={gen_gpn} leaves no training GPU on the single node of "
                f"{c.gpus_per_node}; fix: at most {c.gpus_per_node - 1}, or colocated.enabled=true"
            )
    elif gen_nodes >= c.num_nodes:
        problems.append(
            f"{key}.num_nodes={gen_nodes} leaves no training node of cluster.num_nodes={c.num_nodes}; "
            f"fix: at most {c.num_nodes - 1} generation node(s), or more cluster nodes"
        )
    return problems


def _tp_problems(name: str, tp: int, gpus_per_node: int, world: int) -> list[str]:
    if gpus_per_node and (tp > gpus_per_node or gpus_per_node % tp):
        divisors = [d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0]
        return [
            f"{name}={tp} must divide the {gpus_per_node} GPUs per node it runs on (tensor parallelism "
            f"stays inside a node); fix: one of {divisors}"
        ]
    if world and world % tp:
        return [f"{name}={tp} does not divide the {world} GPUs of its pool"]
    return []


def _data_parallel_problems(cfg: MasterConfig, layout: ResourceLayout) -> list[str]:
    p = cfg.policy
    per_step = layout.train_dp * p.train_micro_batch_size
    # gbs % micro is checked on its own; this adds the data-parallel factor
    if p.train_global_batch_size % p.train_micro_batch_size == 0 and p.train_global_batch_size % per_step:
        return [
            f"policy.train_global_batch_size={p.train_global_batch_size} must be a multiple of data-parallel "
            f"size {layout.train_dp} x policy.train_micro_batch_size={p.train_micro_batch_size} "
            f"= {per_step}; "
            f"fix: policy.train_global_batch_size={per_step * max(1, p.train_global_batch_size // per_step)}"
        ]
    return []
