"""Resource layout: which nodes and GPUs train, which generate, and the parallel sizes on each.

Pure arithmetic on the config (:func:`resource_layout`, computed once per run and passed on), used by
``rlfleet plan`` and the runs. The rules follow NeMo RL: tensor parallelism stays inside a node; a dedicated
(non-colocated) generation pool takes part of the single node, or whole nodes of a multi-node cluster, and
must leave training at least one GPU. Why a layout cannot run is one of the checks in
:mod:`rlfleet.config.checks` (``layout_problems``).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfleet.config.backends import BACKENDS
from rlfleet.config.resolved import BackendName, generation_backend
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
    backend: BackendName  # what it can do: rlfleet.config.backends.backend_of(layout)

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
    backend = BACKENDS[generation_backend(cfg).name]
    return ResourceLayout(
        num_nodes=c.num_nodes,
        gpus_per_node=c.gpus_per_node,
        colocated=colocated,
        train_nodes=train_nodes,
        train_gpus_per_node=train_gpn,
        gen_nodes=gen_nodes,
        gen_gpus_per_node=gen_gpn,
        train_tp=cfg.policy.dtensor_cfg.tensor_parallel_size,
        gen_tp=gen.vllm_cfg.tensor_parallel_size if backend.tensor_parallel else 1,
        backend=backend.name,
    )
