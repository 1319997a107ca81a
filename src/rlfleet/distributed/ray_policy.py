"""The driver's handles on a policy trained by Ray actors: the same methods as the in-process worker.

``RayRuntime`` reserves the placement groups and starts the worker groups (the training ranks host
``rlfleet.policy.sharded_rank.ShardedPolicyRank``, dedicated generation ranks
``rlfleet.generation.rank.GenerationRank``); ``RayPolicy`` (logprobs, training, checkpoints) and
``rlfleet.distributed.ray_generation.RayGeneration`` (sampling, refit) are what the algorithms see, so
the loops do not change between one process and a cluster.

Layouts (``config.layout``): *colocated*, every training rank also holds a generation engine (HF, or a
vLLM engine process) refitted from the gathered weights; *dedicated*, generation engines run on their own
bundles (a vLLM engine of tensor-parallel size N takes a bundle of N GPUs) and receive the weights by
broadcast from training rank 0 (see ``rlfleet.generation.weights``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from rlfleet.config.layout import ResourceLayout
from rlfleet.distributed.cluster import (
    connect_or_start,
    create_node_placement_groups,
    remove_placement_groups,
)
from rlfleet.distributed.rank_group import RankDiedError, RayRankGroup
from rlfleet.errors import UserError
from rlfleet.generation.rank import GenerationRank
from rlfleet.generation.vllm import VLLMSettings
from rlfleet.models.loading import ModelSource
from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.interface import LossFn
from rlfleet.policy.microbatch import MicroBatching
from rlfleet.policy.rank import OptimizerSettings
from rlfleet.policy.sharded_rank import ShardedPolicyRank, ShardingSettings

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def balance_metrics(prefix: str, seconds: Sequence[float], tokens: Sequence[int]) -> dict[str, float]:
    """Per-worker throughput and how uneven the workers' times were (1.0 = perfectly even)."""
    rates = [t / s for t, s in zip(tokens, seconds, strict=True) if s > 0]
    mean_s = sum(seconds) / len(seconds)
    return {
        f"perf/{prefix}_tokens_per_s_per_worker": sum(rates) / len(rates) if rates else 0.0,
        f"perf/{prefix}_imbalance": max(seconds) / mean_s if mean_s > 0 else 1.0,
        f"perf/{prefix}_workers": float(len(seconds)),
    }


class RayRuntime:
    """Placement groups and worker groups for one run; ``close`` releases everything it started.

    Args:
        layout: Where training and generation run (``rlfleet.config.layout.resource_layout``).
        source: The policy to load.
        settings: Optimizer settings of the training ranks.
        sharding: Tensor parallelism and activation checkpointing (its generation batch is set here).
        generation_batch_size: Prompts per ``generate`` call in each engine (HF).
        vllm: The vLLM engines' settings; None generates with HF.
        keep_reference: Training ranks also hold the frozen reference policy.
        seed: Seeds the training ranks.
        call_timeout_s: Limit on every call to an actor.
        placement_timeout_s: Limit on reserving the placement groups.
        generation: Start generation engines (colocated or dedicated); False for a run that samples
            nothing (a reward model's): the training ranks alone.
    """

    def __init__(
        self,
        layout: ResourceLayout,
        source: ModelSource,
        settings: OptimizerSettings,
        sharding: ShardingSettings,
        *,
        generation_batch_size: int,
        vllm: VLLMSettings | None = None,
        keep_reference: bool,
        seed: int,
        call_timeout_s: float,
        placement_timeout_s: float,
        generation: bool = True,
    ) -> None:
        self.layout = layout
        self.source = source
        self.generation_batch_size = generation_batch_size
        self.vllm = vllm
        self.call_timeout_s = call_timeout_s
        self.placement_timeout_s = placement_timeout_s
        dedicated = generation and not layout.colocated
        processes = layout.train_world + (layout.gen_engines if dedicated else 0)
        self.owns_ray = connect_or_start(None, num_cpus=processes + 2, timeout_s=placement_timeout_s)
        self.use_gpus = ray.cluster_resources().get("GPU", 0) > 0
        self.groups: list[Any] = []
        self.train: RayRankGroup | None = None
        self.gen: RayRankGroup | None = None
        try:
            self.train_pgs = self._reserve(layout.train_nodes, layout.train_gpus_per_node, "rlfleet-train")
            self.gen_pgs = (
                []
                if not dedicated
                else self._reserve(
                    layout.gen_nodes,
                    layout.gen_gpus_per_node // layout.gen_tp,  # one bundle per engine
                    "rlfleet-generation",
                    gpus_per_bundle=layout.gen_tp,
                )
            )
            colocated = generation and layout.colocated
            colocated_batch = generation_batch_size if colocated else None
            colocated_vllm = vllm if colocated else None
            init = {
                "source": source,
                "settings": settings,
                "sharding": replace(
                    sharding, generation_batch_size=colocated_batch, generation_vllm=colocated_vllm
                ),
                "keep_reference": keep_reference,
                "seed": seed,
            }
            self.train = RayRankGroup(ShardedPolicyRank, self.train_pgs, init, call_timeout_s)
            engines = f"{layout.gen_engines} {layout.backend} engine(s) x TP {layout.gen_tp}, " + (
                "colocated" if layout.colocated else "dedicated"
            )
            log.info(
                "training on %d Ray worker(s) (tensor parallel %d); generation: %s",
                self.train.world_size,
                layout.train_tp,
                engines if generation else "none",
            )
        except BaseException:
            self.close()
            raise

    def _reserve(self, nodes: int, per_node: int, name: str, gpus_per_bundle: int = 1) -> list[Any]:
        groups = create_node_placement_groups(
            nodes, per_node, self.use_gpus, self.placement_timeout_s, name, gpus_per_bundle
        )
        self.groups.extend(groups)
        return groups

    def training(self) -> RayRankGroup:
        if self.train is None:
            raise RuntimeError("the training workers are shut down")
        return self.train

    def start_generation_group(self) -> RayRankGroup:
        """(Re)starts the dedicated generation workers on their placement groups."""
        if self.gen is not None:
            self.gen.shutdown()
            self.gen = None
        # its GPUs to itself; the engine core in the worker's process, which hosts nothing else
        vllm = None if self.vllm is None else replace(self.vllm, shares_gpu=False, in_process=True)
        init = {"source": self.source, "batch_size": self.generation_batch_size, "vllm": vllm}
        self.gen = RayRankGroup(GenerationRank, self.gen_pgs, init, self.call_timeout_s)
        return self.gen

    def close(self) -> None:
        """Stops the workers, frees the placement groups, and shuts Ray down if this run started it."""
        for group in (self.gen, self.train):
            if group is not None:
                group.shutdown()
        self.gen = self.train = None
        remove_placement_groups(self.groups)
        self.groups = []
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()
            self.owns_ray = False


class TrainingWorkerLostError(UserError, RuntimeError):
    """A training rank died: the step cannot finish; the run resumes from its last checkpoint.

    A user error in the CLI's sense: its message says what to do (rerun to resume), so ``rlfleet`` prints
    it alone and exits 2 rather than reporting a bug."""

    @classmethod
    def from_death(cls, exc: RankDiedError) -> TrainingWorkerLostError:
        return cls(
            f"training {exc}. The sharded state of this step is lost; rerun the same command to resume "
            "from the last checkpoint (checkpointing.checkpoint_dir)"
        )


class RayPolicy:
    """The training ranks, seen as one policy (implements :class:`rlfleet.policy.interface.Policy`)."""

    def __init__(self, runtime: RayRuntime, tokenizer: PreTrainedTokenizerBase, keep_reference: bool) -> None:
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.has_reference = keep_reference

    def _run(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        try:
            return self.runtime.training().run_all(method, *args, **kwargs)
        except RankDiedError as exc:
            raise TrainingWorkerLostError.from_death(exc) from exc

    def accelerator_name(self) -> str:
        """The training ranks' device (rank 0's): a CUDA device name, or ``cpu``."""
        name: str = self._run("accelerator_name")[0]
        return name

    def logprobs(
        self,
        batch: TrainBatch,
        micro_batching: MicroBatching | int,
        *,
        reference: bool = False,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        logprobs: torch.Tensor = self._run(
            "logprobs", batch, micro_batching, reference=reference, temperature=temperature
        )[0]
        return logprobs

    def train(
        self,
        batch: TrainBatch,
        loss_fn: LossFn,
        *,
        global_batch_size: int,
        micro_batching: MicroBatching | int,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        metrics: dict[str, float] = self._run(
            "train",
            batch,
            loss_fn,
            global_batch_size=global_batch_size,
            micro_batching=micro_batching,
            temperature=temperature,
        )[0]
        return metrics

    def take_metrics(self, total_tokens: int) -> dict[str, float]:
        """Busy-time balance of the training ranks since the last call, which processed ``total_tokens``
        (each data-parallel rank its share; tensor-parallel peers the same rows)."""
        seconds = self._run("take_busy_seconds")
        per_rank = total_tokens // self.runtime.layout.train_dp
        return balance_metrics("training", seconds, [per_rank] * len(seconds))

    def save(self, step_dir: Path) -> None:
        self._run("save", step_dir)

    def load(self, step_dir: Path) -> None:
        self._run("load", step_dir)

    def load_weights(self, step_dir: Path) -> None:
        self._run("load_weights", step_dir)

    def close(self) -> None:
        self.runtime.close()
