"""The driver's handles on a policy trained by Ray actors: the same methods as the in-process worker.

``RayRuntime`` reserves the placement groups and starts the worker groups; ``RayPolicy`` (logprobs,
training, checkpoints) and ``RayGeneration`` (sampling, refit) are what the algorithms see, so the GRPO
and SFT loops do not change between one process and a cluster.

Layouts (``config.layout``): *colocated*, every training rank also holds a generation engine (HF, or a
vLLM engine process) refitted from the gathered weights; *dedicated*, generation engines run on their own
bundles (a vLLM engine of tensor-parallel size N takes a bundle of N GPUs) and receive the weights by
broadcast from training rank 0.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import ray

from rlfleet.config.layout import ResourceLayout
from rlfleet.distributed.cluster import (
    connect_or_start,
    create_node_placement_groups,
    remove_placement_groups,
)
from rlfleet.distributed.generation_worker import GenerationWorker, WorkerOutput
from rlfleet.distributed.refit import WeightSpec
from rlfleet.distributed.sharded_worker import ShardedPolicyWorker, ShardingSettings
from rlfleet.distributed.worker_group import RayWorkerGroup, WorkerDiedError, WorkerTimeoutError, gather
from rlfleet.errors import UserError
from rlfleet.generation import GenerationResult, SamplingParams
from rlfleet.generation.sampling import row_seeds
from rlfleet.generation.vllm import VLLMSettings
from rlfleet.models.loading import ModelSource
from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.microbatch import MicroBatching
from rlfleet.policy.worker import LossFn, OptimizerSettings

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

T = TypeVar("T")


def split_rows(count: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` ranges of ``count`` rows over ``parts`` workers, sizes within one."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


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
        layout: Where training and generation run (``compute_layout``).
        source: The policy to load.
        settings: Optimizer settings of the training ranks.
        sharding: Tensor parallelism and activation checkpointing (its generation batch is set here).
        generation_batch_size: Prompts per ``generate`` call in each engine (HF).
        vllm: The vLLM engines' settings; None generates with HF.
        keep_reference: Training ranks also hold the frozen reference policy.
        seed: Seeds the training ranks.
        call_timeout_s: Limit on every call to an actor.
        placement_timeout_s: Limit on reserving the placement groups.
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
    ) -> None:
        self.layout = layout
        self.source = source
        self.generation_batch_size = generation_batch_size
        self.vllm = vllm
        self.call_timeout_s = call_timeout_s
        self.placement_timeout_s = placement_timeout_s
        processes = layout.train_world + (0 if layout.colocated else layout.gen_engines)
        self.owns_ray = connect_or_start(None, num_cpus=processes + 2, timeout_s=placement_timeout_s)
        self.use_gpus = ray.cluster_resources().get("GPU", 0) > 0
        self.groups: list[Any] = []
        self.train: RayWorkerGroup | None = None
        self.gen: RayWorkerGroup | None = None
        try:
            self.train_pgs = self._reserve(layout.train_nodes, layout.train_gpus_per_node, "rlfleet-train")
            self.gen_pgs = (
                []
                if layout.colocated
                else self._reserve(
                    layout.gen_nodes,
                    layout.gen_gpus_per_node // layout.gen_tp,  # one bundle per engine
                    "rlfleet-generation",
                    gpus_per_bundle=layout.gen_tp,
                )
            )
            colocated_batch = generation_batch_size if layout.colocated else None
            colocated_vllm = vllm if layout.colocated else None
            init = {
                "source": source,
                "settings": settings,
                "sharding": replace(
                    sharding, generation_batch_size=colocated_batch, generation_vllm=colocated_vllm
                ),
                "keep_reference": keep_reference,
                "seed": seed,
            }
            self.train = RayWorkerGroup(ShardedPolicyWorker, self.train_pgs, init, call_timeout_s)
            engines = f"{layout.gen_engines} {layout.backend} engine(s) x TP {layout.gen_tp}"
            log.info(
                "training on %d Ray worker(s) (tensor parallel %d); generation: %s, %s",
                self.train.world_size,
                layout.train_tp,
                engines,
                "colocated" if layout.colocated else "dedicated",
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

    def training(self) -> RayWorkerGroup:
        if self.train is None:
            raise RuntimeError("the training workers are shut down")
        return self.train

    def start_generation_group(self) -> RayWorkerGroup:
        """(Re)starts the dedicated generation workers on their placement groups."""
        if self.gen is not None:
            self.gen.shutdown()
            self.gen = None
        vllm = None if self.vllm is None else replace(self.vllm, shares_gpu=False)  # its GPUs to itself
        init = {"source": self.source, "batch_size": self.generation_batch_size, "vllm": vllm}
        self.gen = RayWorkerGroup(GenerationWorker, self.gen_pgs, init, self.call_timeout_s)
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
    def from_death(cls, exc: WorkerDiedError) -> TrainingWorkerLostError:
        return cls(
            f"training {exc}. The sharded state of this step is lost; rerun the same command to resume "
            "from the last checkpoint (checkpointing.checkpoint_dir)"
        )


class GenerationWorkerLostError(UserError, RuntimeError):
    """The dedicated generation workers kept failing (dying, or not answering within
    ``cluster.call_timeout_s``) after the ``cluster.generation_retries`` restarts allowed; the message
    names both settings (exit 2 from the CLI, like every error the user can act on)."""

    @classmethod
    def out_of_retries(cls, exc: Exception, retries: int) -> GenerationWorkerLostError:
        return cls(
            f"generation failed after {retries} restart(s) of the dedicated generation workers "
            f"(cluster.generation_retries={retries}); the last failure: {exc}. Check the generation workers' "
            "logs (an out-of-memory kill?), then raise cluster.generation_retries to allow more restarts, or "
            "cluster.call_timeout_s if they were only slow; rerun the same command to resume from the last "
            "checkpoint (checkpointing.checkpoint_dir)"
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
        except WorkerDiedError as exc:
            raise TrainingWorkerLostError.from_death(exc) from exc

    def accelerator_name(self) -> str:
        """The training ranks' device (rank 0's): a CUDA device name, or ``cpu``."""
        name: str = self._run("accelerator_name")[0]
        return name

    def logprobs(
        self,
        batch: TrainBatch,
        micro_batch_size: int | MicroBatching,
        *,
        reference: bool = False,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        logprobs: torch.Tensor = self._run(
            "logprobs", batch, micro_batch_size, reference=reference, temperature=temperature
        )[0]
        return logprobs

    def train(
        self,
        batch: TrainBatch,
        loss_fn: LossFn,
        *,
        global_batch_size: int,
        micro_batch_size: int | MicroBatching,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        metrics: dict[str, float] = self._run(
            "train",
            batch,
            loss_fn,
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
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


class RayGeneration:
    """Generation on the engines of a ``RayRuntime`` (implements ``rlfleet.generation.GenerationBackend``).

    Rows are split into contiguous shares, one per engine, and sampled from per-row seeds, so the
    responses do not depend on the number of engines. A dead dedicated engine is replaced, refitted and the
    generation retried (``retries`` times, a failed restart counting as a failed retry; then
    ``GenerationWorkerLostError``); a dead colocated engine is a dead training rank: that raises.
    """

    def __init__(self, runtime: RayRuntime, retries: int) -> None:
        self.runtime = runtime
        self.retries = retries
        self.spec: WeightSpec | None = None
        self.last_metrics: dict[str, float] = {}
        self.restarts = 0
        if runtime.layout.colocated:
            self.refit()  # a colocated vLLM engine starts with dummy weights
        else:
            self._start_dedicated()

    def _engines(self) -> RayWorkerGroup:
        if self.runtime.layout.colocated:
            return self.runtime.training()
        if self.runtime.gen is None:
            raise RuntimeError("the generation workers are shut down")
        return self.runtime.gen

    def _start_dedicated(self) -> None:
        """Starts the engines and the refit group, then sends them the trainer's current weights."""
        gen = self.runtime.start_generation_group()
        train = self.runtime.training()
        spec = train.run_all("weight_spec")[0]
        for rank, theirs in enumerate(gen.run_all("weight_spec")):
            if theirs != spec:
                raise ValueError(
                    f"generation rank {rank} expects other weights than the trainer sends "
                    f"({len(theirs)} vs {len(spec)} tensors); both must load policy.model_name"
                )
        self.spec = spec
        precisions = set(gen.run_all("refit_precision"))
        if len(precisions) != 1:
            raise RuntimeError(f"the generation engines run in different precisions: {sorted(precisions)}")
        addr, port = train.free_port_on_rank0()
        size = 1 + gen.world_size
        timeout = self.runtime.call_timeout_s
        refs = train.submit("join_refit_group", addr, port, size, timeout, precisions.pop())
        refs += [
            gen.submit_to(i, "join_refit_group", addr, port, i + 1, size, timeout) for i in range(size - 1)
        ]
        gather(refs, timeout)
        self._broadcast()

    def _broadcast(self) -> None:
        gen, train = self._engines(), self.runtime.training()
        refs = train.submit("send_weights", self.spec) + gen.submit("receive_weights", self.spec)
        gather(refs, self.runtime.call_timeout_s)

    def refit(self) -> None:
        """Makes every engine use the trainer's current weights."""
        if self.runtime.layout.colocated:
            self.runtime.training().run_all("refit_colocated")
        else:
            self._retrying(self._broadcast)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int
    ) -> list[GenerationResult]:
        seeds = row_seeds(seed, len(prompts))
        return self._retrying(lambda: self._generate(prompts, params, seeds))

    def _engine_ranks(self) -> list[int]:
        """The ranks that host an engine: every dedicated worker; colocated, the first rank of each group
        of ``gen_tp`` training ranks (a tensor-parallel vLLM engine spans its group's GPUs)."""
        lay = self.runtime.layout
        return list(range(0, self._engines().world_size, lay.gen_tp if lay.colocated else 1))

    def _generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: list[int]
    ) -> list[GenerationResult]:
        ranks = self._engine_ranks()
        shares = split_rows(len(prompts), len(ranks))
        outputs: list[WorkerOutput] = self._engines().run_on(
            ranks, "generate_rows", [([list(p) for p in prompts[a:b]], params, seeds[a:b]) for a, b in shares]
        )
        self.last_metrics = balance_metrics(
            "generation", [o.seconds for o in outputs], [o.tokens for o in outputs]
        )
        return [result for output in outputs for result in output.results]

    def _retrying(self, action: Callable[[], T]) -> T:
        attempt = 0
        while True:
            try:
                if attempt:  # replace the failed engines; a restart that fails is a failed retry too
                    start = time.perf_counter()
                    self._start_dedicated()
                    log.warning("generation engines restarted in %.1fs", time.perf_counter() - start)
                return action()
            except (WorkerDiedError, WorkerTimeoutError) as exc:
                if self.runtime.layout.colocated and isinstance(exc, WorkerDiedError):
                    raise TrainingWorkerLostError.from_death(exc) from exc  # the engines are trainers
                if self.runtime.layout.colocated:
                    raise
                if attempt >= self.retries:
                    raise GenerationWorkerLostError.out_of_retries(exc, self.retries) from exc
                attempt += 1
                self.restarts += 1
                log.warning("generation worker failed (%s); restarting the engines, retry %d", exc, attempt)

    def take_metrics(self) -> dict[str, float]:
        """Per-engine throughput and imbalance of the last ``generate``, and restarts so far."""
        metrics, self.last_metrics = self.last_metrics, {}
        return {**metrics, "perf/generation_restarts": float(self.restarts)}
