"""The per-rank policy worker: holds the model, its optimizer and a frozen reference copy.

A plain Python class, tested in-process; the distributed layer wraps it in a Ray actor. It knows nothing
about GRPO: the algorithm hands it batches and a loss function.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlfleet.checkpoint import load_policy, save_policy
from rlfleet.memory.probes import HeapReleaser, release_free_memory
from rlfleet.models.loading import ModelSource
from rlfleet.models.lora import LoraSettings, WithoutAdapters
from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.build import PolicyModels, build_policy_models, compute_autocast, require_master_dtype
from rlfleet.policy.compile import compile_seconds
from rlfleet.policy.interface import LossFn
from rlfleet.policy.logprobs import Readout, batch_logprobs, forward_logprobs
from rlfleet.policy.loss_math import Normalizer
from rlfleet.policy.microbatch import (
    MicroBatching,
    as_micro_batching,
    padding_metrics,
    plan_trained_micro_batches,
    row_lengths,
    step_counts,
    step_normalizer,
    trained_rows,
)
from rlfleet.policy.schedule import LrSchedule, lr_factor


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    max_grad_norm: float | None
    schedule: LrSchedule = field(default_factory=LrSchedule)  # constant lr
    foreach: bool | None = None  # torch's multi-tensor AdamW; None: torch's choice
    fused: bool | None = None  # torch's fused AdamW; None: fused on the CPU and CUDA unless foreach


FUSED_ADAMW_DEVICES = ("cpu", "cuda")  # where torch has a fused AdamW kernel for float32 parameters


def adamw_implementation(settings: OptimizerSettings, device_type: str) -> tuple[bool | None, bool]:
    """``(foreach, fused)`` for ``torch.optim.AdamW``: the settings' choice, and where they leave it open
    (``fused`` None), the fused kernel on devices that have one, unless ``foreach`` asks for the
    multi-tensor one. All three compute the same update up to rounding (``tests/unit/test_optimizer.py``)."""
    fused = settings.fused
    if fused is None:
        fused = device_type in FUSED_ADAMW_DEVICES and not settings.foreach
    return settings.foreach, fused


def over_global_batches(
    batch: TrainBatch, global_batch_size: int, step_fn: Callable[[TrainBatch], dict[str, float]]
) -> dict[str, float]:
    """Runs ``step_fn`` (one optimizer step) on each ``global_batch_size`` slice; each metric averaged over
    the steps that report it (a step that trains no row reports no ratio)."""
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for start in range(0, len(batch), global_batch_size):
        for key, value in step_fn(batch.select(start, start + global_batch_size)).items():
            totals[key] = totals.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1
    return {key: total / counts[key] for key, total in totals.items()}


def default_device() -> torch.device:
    """The current CUDA device when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class TrainablePolicy(ABC):
    """What the in-process and the sharded policy workers share: optimizer, update, checkpoints.

    A subclass sets ``tokenizer``, ``settings`` and ``device``, builds its models with
    ``build_policy_models`` and hands them to ``_init_models`` (which also creates the optimizer).
    """

    model: PreTrainedModel  # float32 master weights
    tokenizer: PreTrainedTokenizerBase
    settings: OptimizerSettings
    reference: PreTrainedModel | WithoutAdapters | None  # frozen copy, or the policy without its adapters
    device: torch.device
    autocast_dtype: torch.dtype | None  # forward passes run under torch.autocast in it (None: no autocast)

    def _init_models(self, models: PolicyModels) -> None:
        """Takes the built models, then creates AdamW (float32 state) with the lr schedule over the
        trainable parameters (all of them, or only the LoRA adapters)."""
        require_master_dtype(models.model)
        self.heap = HeapReleaser()
        self.model = models.model
        self.reference = models.reference
        self.autocast_dtype = models.autocast_dtype
        self.compiled = models.compiled
        s = self.settings
        foreach, fused = adamw_implementation(s, self.device.type)
        self.optimizer = torch.optim.AdamW(
            self.trainable_parameters(),
            lr=s.lr,
            weight_decay=s.weight_decay,
            betas=s.betas,
            eps=s.eps,
            foreach=foreach,
            fused=fused,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, s.schedule)
        )

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer updates (with LoRA: the adapters only)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def _compute(self) -> AbstractContextManager[None]:
        """Around forward passes: autocast to the compute dtype where the model does not cast itself."""
        return compute_autocast(self.device, self.autocast_dtype)

    @property
    def has_reference(self) -> bool:
        return self.reference is not None

    def accelerator_name(self) -> str:
        """This worker's device: the CUDA device name (e.g. ``NVIDIA H200``), or ``cpu``."""
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else self.device.type

    def _scoring_model(self, reference: bool) -> PreTrainedModel | WithoutAdapters:
        """The policy, or the frozen reference when ``reference`` (which the worker must keep)."""
        if not reference:
            return self.model
        if self.reference is None:
            raise RuntimeError("this worker keeps no reference model (build it with keep_reference=True)")
        return self.reference

    dp_size = 1  # data-parallel ranks that split each global batch (the sharded worker sets its own)

    def train(
        self,
        batch: TrainBatch,
        loss_fn: LossFn,
        *,
        global_batch_size: int,
        micro_batching: MicroBatching | int,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """One optimizer step per ``global_batch_size`` rows of ``batch``, accumulating micro-batches.

        ``micro_batching``: how each global batch splits into micro-batches, a ``MicroBatching`` (fixed rows,
        or token budgets: dynamic batching or sequence packing) or a row count (fixed rows). Under data
        parallelism every rank receives the whole batch and trains on its share of each global batch.
        Returns metrics averaged over the optimizer steps (summed over micro-batches and ranks): the loss
        function's metrics plus ``grad_norm``, ``lr`` and the padding shares of ``padding_metrics``; the
        same on every rank. With compiled layers also ``compile_s``: this process's seconds of compiling
        so far (``rlfleet.policy.compile``; it stops growing once every shape class has compiled).
        """
        if len(batch) % global_batch_size or global_batch_size % self.dp_size:
            raise ValueError(
                f"batch of {len(batch)} rows, global batch {global_batch_size}, {self.dp_size} "
                "data-parallel rank(s): the batch must split into global batches and each global batch "
                "evenly over the ranks (every rank must run the same number of forward passes)"
            )
        batching = as_micro_batching(micro_batching)
        self.model.train()
        metrics = over_global_batches(
            batch, global_batch_size, lambda gb: self._optimizer_step(gb, loss_fn, batching, temperature)
        )
        self.heap.after_pass()  # the freed activations back to the OS once they add up (memory.probes)
        if self.compiled:
            metrics["compile_s"] = compile_seconds()
        return {**metrics, **padding_metrics(batch, global_batch_size, batching, self.dp_size)}

    @abstractmethod
    def _optimizer_step(
        self, batch: TrainBatch, loss_fn: LossFn, batching: MicroBatching, temperature: float
    ) -> dict[str, float]:
        """One optimizer step on one global batch (each worker normalises, reduces and clips its own way)."""

    def _accumulate(
        self,
        batch: TrainBatch,
        loss_fn: LossFn,
        norm: Normalizer,
        plan: list[list[int]],
        batching: MicroBatching,
        temperature: float,
        loss_scale: float = 1.0,
    ) -> dict[str, float]:
        """Zeroes the gradients, then backpropagates ``batch`` micro-batch by micro-batch as ``plan`` groups
        its rows (laid out as ``batching`` says; see ``rlfleet.policy.microbatch``).

        Returns the loss function's metrics summed over the micro-batches.
        """
        metrics: dict[str, float] = {}
        # a loss that reads more than the tokens' logprobs (distillation: the student at the teacher's top
        # k) says what in its ``readout`` (rlfleet.policy.logprobs.Readout)
        readout: Readout | None = getattr(loss_fn, "readout", None)
        self.optimizer.zero_grad(set_to_none=True)
        for rows in plan:
            mb = batch.take(rows).to(self.device)
            with self._compute():
                lp = forward_logprobs(self.model, mb, batching, temperature, readout)
            loss, mb_metrics = loss_fn(lp, mb, norm)
            (loss * loss_scale if loss_scale != 1.0 else loss).backward()
            for key, value in mb_metrics.items():
                metrics[key] = metrics.get(key, 0.0) + value
        return metrics

    def _apply_update(self, metrics: dict[str, float], grad_norm: float) -> dict[str, float]:
        """Steps the optimizer and the schedule (gradients already clipped); adds ``lr`` and ``grad_norm``."""
        metrics["lr"] = float(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics["grad_norm"] = grad_norm
        return metrics

    def save(self, step_dir: Path) -> None:
        """Writes ``step_dir/policy/{weights,optimizer,scheduler.pt,tokenizer}`` (DCP layout; collective
        under a process group: one ``__<rank>_0.distcp`` per rank)."""
        save_policy(step_dir, self.model, self.optimizer, self.scheduler, self.tokenizer)

    def load(self, step_dir: Path) -> None:
        """Restores weights, optimizer and scheduler written by ``save``, on any world size."""
        load_policy(step_dir, self.model, self.optimizer, self.scheduler)

    def load_weights(self, step_dir: Path) -> None:
        """Restores the weights only (evaluation of a checkpoint)."""
        load_policy(step_dir, self.model)


class PolicyRank(TrainablePolicy):
    """Computes logprobs and applies optimizer steps for one whole model replica in this process.

    Built by ``build_policy_models`` without a mesh: float32 master weights, forward passes under
    ``torch.autocast`` in ``source.precision`` (when not float32), the reference in that precision.

    Args:
        source: The policy to load; ``source.precision`` is the compute dtype.
        settings: Optimizer, warm-up schedule and gradient clipping.
        keep_reference: Keep a frozen copy of the initial weights for KL / reference logprobs.
        activation_checkpointing: Recompute each decoder layer's activations in the backward pass.
        device: Where the model lives; default the current CUDA device when there is one, else the CPU.
        lora: Train LoRA adapters only (the reference is then the policy with its adapters off).
        torch_compile: Compile each decoder layer (``rlfleet.policy.compile``).
    """

    def __init__(
        self,
        source: ModelSource,
        settings: OptimizerSettings,
        *,
        keep_reference: bool,
        activation_checkpointing: bool = False,
        device: torch.device | None = None,
        lora: LoraSettings | None = None,
        torch_compile: bool = False,
    ) -> None:
        self.settings = settings
        self.device = device if device is not None else default_device()
        self.closers: list[Callable[[], None]] = []  # what close() releases (e.g. a colocated vLLM engine)
        self.tokenizer = source.load_tokenizer()
        models = build_policy_models(
            source,
            self.device,
            activation_checkpointing=activation_checkpointing,
            keep_reference=keep_reference,
            lora=lora,
            torch_compile=torch_compile,
        )
        self._init_models(models)

    def take_metrics(self, total_tokens: int) -> dict[str, float]:
        """Per-worker balance metrics (Ray workers report them; one in-process worker has none)."""
        return {}

    def close(self) -> None:
        """Runs ``closers`` (last attached first) and drops AdamW's state: a closed worker trains no more
        (the Ray policy stops its actors instead). The weights stay for the caller
        (``trainer.ctx.policy.model`` after a run); ``release`` frees them too."""
        while self.closers:
            self.closers.pop()()
        self.optimizer.state.clear()
        release_free_memory()  # the allocator hands the pages back now, not after the next run's first pass

    def release(self) -> None:
        """``close``, and the weights go too: the model and the reference move to the meta device, so that
        whatever still holds this worker holds no memory. vLLM's engine start keeps the Python frames that
        built it (and so the worker) alive: in ``rlfleet demo``'s one process, the SFT stage's weights and
        AdamW moments would otherwise stay through the whole GRPO stage."""
        self.close()
        self.optimizer.param_groups.clear()  # the last references to the parameters beside the modules'
        for module in (self.model, self.reference):
            if isinstance(module, torch.nn.Module):
                torch.nn.Module.to(module, torch.device("meta"))  # parameters and buffers without storage
        release_free_memory()

    @torch.no_grad()
    def logprobs(
        self,
        batch: TrainBatch,
        micro_batching: MicroBatching | int,
        *,
        reference: bool = False,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """``[B, T]`` token logprobs of the policy (or the frozen reference) over ``batch``, micro-batched by
        rows or by a ``MicroBatching`` token budget; rows in ``batch`` order."""
        with self._compute():
            lp = batch_logprobs(self._scoring_model(reference), batch, micro_batching, temperature)
        return lp.to(batch.response_mask.dtype)

    def _optimizer_step(
        self, batch: TrainBatch, loss_fn: LossFn, batching: MicroBatching, temperature: float
    ) -> dict[str, float]:
        norm = step_normalizer(step_counts(batch))
        plan = plan_trained_micro_batches(row_lengths(batch), trained_rows(batch), batching)[0]
        metrics = self._accumulate(batch, loss_fn, norm, plan, batching, temperature)
        max_norm = self.settings.max_grad_norm if self.settings.max_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), max_norm)
        return self._apply_update(metrics, float(grad_norm))
