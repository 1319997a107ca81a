"""The data-parallel, FSDP2-sharded policy worker: one instance per rank of a process group.

A plain class (the Ray layer hosts it; see ``rlfleet.distributed.rank_group``). Every rank receives the
whole batch and works on its contiguous share of each global batch; the loss is divided by the token and
sequence counts of the *global* batch (all-reduced first), and gradients are summed across ranks, so one
step equals the single-process ``PolicyRank`` step on the same batch.

It is also the trainer's end of the weight path to the generation engines (``rlfleet.generation.weights``):
colocated, each rank gathers the full weights into the engine it hosts (``refit``); dedicated, rank 0
broadcasts them to the generation workers (``join_refit_group``, ``broadcast_weights``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from rlfleet.generation import SamplingParams
from rlfleet.generation.rank import GenerationRank, RankOutput
from rlfleet.generation.vllm import VLLMSettings
from rlfleet.generation.weights import RefitGroup, WeightSpec, engine_state, weight_spec
from rlfleet.models.loading import ModelSource
from rlfleet.models.lora import LoraSettings
from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.build import MASTER_DTYPE, build_policy_models
from rlfleet.policy.interface import LossFn
from rlfleet.policy.logprobs import batch_logprobs
from rlfleet.policy.microbatch import (
    MicroBatching,
    plan_trained_micro_batches,
    row_lengths,
    step_counts,
    step_normalizer,
    trained_rows,
)
from rlfleet.policy.parallelize import build_mesh, clip_grad_norm
from rlfleet.policy.rank import OptimizerSettings, TrainablePolicy


@dataclass(frozen=True)
class ShardingSettings:
    """How the policy is split: ``policy.dtensor_cfg`` plus the colocated generation engine."""

    tensor_parallel_size: int = 1
    activation_checkpointing: bool = False
    generation_batch_size: int | None = None  # None: no colocated generation engine on this rank
    generation_vllm: VLLMSettings | None = None  # the colocated engine is vLLM (else HF)
    lora: LoraSettings | None = None  # train LoRA adapters only (policy.dtensor_cfg.lora_cfg)


class ShardedPolicyRank(TrainablePolicy):
    """Holds this rank's shard of the policy (and optionally of a frozen reference) and its optimizer.

    Ranks form a 2-D (data-parallel x tensor-parallel) mesh; FSDP2 shards over the data-parallel axis.
    Built by ``build_policy_models`` on that mesh: float32 master weights, FSDP2 mixed precision computing
    in ``source.precision`` and reducing gradients in float32 (on the CPU as on the GPU); the reference is
    held in ``source.precision``.

    Args:
        source: The policy to load (``policy.model_name`` and friends).
        settings: Optimizer, warm-up schedule and gradient clipping (as ``PolicyRank``).
        sharding: Tensor parallelism, activation checkpointing, colocated generation.
        keep_reference: Also hold a frozen, sharded copy of the initial weights.
        seed: Seeds torch on this rank before the model is built.

    Needs an initialised ``torch.distributed`` process group.
    """

    def __init__(
        self,
        source: ModelSource,
        settings: OptimizerSettings,
        sharding: ShardingSettings = ShardingSettings(),
        *,
        keep_reference: bool = False,
        seed: int = 0,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ShardedPolicyRank needs a process group; build it through RayRankGroup")
        torch.manual_seed(seed)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.mesh = build_mesh(sharding.tensor_parallel_size, self.device.type)
        self.dp_group = self.mesh.get_group("dp")
        self.dp_rank = self.mesh["dp"].get_local_rank()
        self.dp_size = self.mesh["dp"].size()  # overrides TrainablePolicy.dp_size
        self.settings = settings
        self.sharding = sharding
        self.tokenizer = source.load_tokenizer()
        models = build_policy_models(
            source,
            self.device,
            activation_checkpointing=sharding.activation_checkpointing,
            keep_reference=keep_reference,
            mesh=self.mesh,
            lora=sharding.lora,
        )
        self._init_models(models)
        self.generator: GenerationRank | None = None
        if sharding.generation_batch_size is not None:
            vllm = self._group_engine(sharding.generation_vllm)
            if vllm is not None or sharding.generation_vllm is None:
                self.generator = GenerationRank(source, sharding.generation_batch_size, vllm)
        self.refit_group: RefitGroup | None = None
        self.busy_seconds = 0.0

    def _group_engine(self, vllm: VLLMSettings | None) -> VLLMSettings | None:
        """The colocated vLLM engine's settings on the first rank of each group of its tensor-parallel
        size, spanning the group's GPUs; None on the other ranks (and without vLLM). Collective."""
        if vllm is None or vllm.tensor_parallel_size == 1:
            return vllm
        tp = vllm.tensor_parallel_size
        devices: list[str] = [""] * self.world_size
        dist.all_gather_object(devices, os.environ.get("CUDA_VISIBLE_DEVICES", ""))
        if self.rank % tp:
            return None
        group = devices[self.rank : self.rank + tp]
        return replace(vllm, visible_devices=",".join(group)) if self.device.type == "cuda" else vllm

    def placement(self) -> dict[str, int]:
        """This rank's coordinates (for logs and tests)."""
        tp = self.mesh["tp"]
        return {"rank": self.rank, "dp_rank": self.dp_rank, "tp_rank": tp.get_local_rank()}

    def _my_rows(self, start: int, size: int) -> tuple[int, int]:
        """This data-parallel rank's contiguous share of rows ``start : start + size``."""
        share = size // self.dp_size
        return start + self.dp_rank * share, start + (self.dp_rank + 1) * share

    def _check_divisible(self, what: str, rows: int) -> None:
        if rows % self.dp_size:
            raise ValueError(
                f"{what} of {rows} rows does not split evenly over {self.dp_size} data-parallel ranks "
                "(every rank must run the same number of forward passes)"
            )

    @torch.no_grad()
    def logprobs(
        self,
        batch: TrainBatch,
        micro_batching: MicroBatching | int,
        *,
        reference: bool = False,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """``[B, T]`` token logprobs of the whole ``batch``: each rank computes its rows (as many forward
        passes on every rank, however ``micro_batching`` plans them), then all gather."""
        model = self._scoring_model(reference)
        self._check_divisible("logprob batch", len(batch))
        start = time.perf_counter()
        with self._compute():
            mine = batch_logprobs(model, batch, micro_batching, temperature, self.dp_size, self.dp_rank)
        self.busy_seconds += time.perf_counter() - start
        parts = [torch.empty_like(mine).to(self.device) for _ in range(self.dp_size)]
        dist.all_gather(parts, mine.to(self.device), group=self.dp_group)
        return torch.cat([p.cpu() for p in parts]).to(batch.response_mask.dtype)

    def _all_reduce(self, values: list[float]) -> list[float]:
        """Sums over the data-parallel ranks (tensor-parallel peers hold the same rows)."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, group=self.dp_group)
        return tensor.cpu().tolist()

    def _optimizer_step(
        self, global_batch: TrainBatch, loss_fn: LossFn, batching: MicroBatching, temperature: float
    ) -> dict[str, float]:
        first, stop = self._my_rows(0, len(global_batch))
        batch = global_batch.select(first, stop)
        lengths, trained = row_lengths(global_batch), trained_rows(global_batch)
        plan = plan_trained_micro_batches(lengths, trained, batching, self.dp_size)[self.dp_rank]
        norm = step_normalizer(self._all_reduce(step_counts(batch)))
        start = time.perf_counter()
        # FSDP averages gradients over data-parallel ranks; each rank's loss is already its share of the
        # global loss, so undo the average.
        metrics = self._accumulate(batch, loss_fn, norm, plan, batching, temperature, self.dp_size)
        self.busy_seconds += time.perf_counter() - start
        keys = sorted(metrics)
        metrics = dict(zip(keys, self._all_reduce([metrics[k] for k in keys]), strict=True))
        grad_norm = clip_grad_norm(self.trainable_parameters(), self.settings.max_grad_norm)
        return self._apply_update(metrics, grad_norm)

    def take_busy_seconds(self) -> float:
        """Seconds this rank spent computing (logprobs and training) since the last call."""
        busy, self.busy_seconds = self.busy_seconds, 0.0
        return busy

    def full_state_dict(self, *, on_every_rank: bool = False) -> dict[str, torch.Tensor]:
        """The unsharded weights (on CPU on rank 0 only, or on every rank). Collective: call on all ranks."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=not on_every_rank)
        # a full state dict of a model holds plain tensors (no DTensor, no nested state)
        return cast(dict[str, torch.Tensor], get_model_state_dict(self.model, options=options))

    def engine_state(self, *, on_every_rank: bool = False) -> dict[str, torch.Tensor]:
        """What the generation engines load: the full weights with any LoRA adapters merged in (base
        names only). Collective: call on all ranks."""
        return engine_state(self.model, self.full_state_dict(on_every_rank=on_every_rank))

    # ---------------------------------------------------------------------------- generation and refit

    def _engine(self) -> GenerationRank:
        if self.generator is None:
            raise RuntimeError("this rank has no colocated generation engine (generation_batch_size=None)")
        return self.generator

    def generate_rows(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> RankOutput:
        """Colocated generation on this rank's engine."""
        return self._engine().generate_rows(prompts, params, seeds)

    def engine_tensor_parallel_size(self) -> int:
        """How many ranks' devices this rank's colocated engine spans (0: it hosts none)."""
        return 0 if self.generator is None else self.generator.tensor_parallel_size

    def refit(self) -> None:
        """Colocated refit: every rank gathers the current training weights (LoRA adapters merged) and
        loads them into its engine, if it hosts one (collective)."""
        state = self.engine_state(on_every_rank=True)
        if self.generator is not None:
            self.generator.update_weights(state)

    def weight_spec(self) -> WeightSpec:
        """Names and shapes of the full weights, as rank 0 will broadcast them, held in float32
        (collective)."""
        return weight_spec(self.engine_state(), MASTER_DTYPE)

    def join_refit_group(
        self, master_addr: str, master_port: int, rank: int, size: int, timeout_s: float
    ) -> None:
        """Dedicated refit: rank 0 joins the broadcast group as its source (``rank`` 0); the other
        training ranks do nothing."""
        if self.rank == 0:
            if self.refit_group is not None:
                self.refit_group.close()
            self.refit_group = RefitGroup(master_addr, master_port, rank, size, timeout_s)

    def broadcast_weights(self, spec: WeightSpec) -> None:
        """Dedicated refit: every rank helps gather the full weights; rank 0 broadcasts them as ``spec``
        says (its names, in its order and dtype)."""
        state = self.engine_state()
        if self.rank == 0:
            if self.refit_group is None:
                raise RuntimeError("join_refit_group must run before broadcast_weights")
            self.refit_group.send(state, spec)

    def close(self) -> None:
        """Stops this rank's colocated engine (a vLLM engine runs in its own process)."""
        if self.generator is not None:
            self.generator.close()
