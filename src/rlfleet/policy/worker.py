"""The per-rank policy worker: holds the model, its optimizer and a frozen reference copy.

A plain Python class, tested in-process; the distributed layer wraps it in a Ray actor. It knows nothing
about GRPO: the algorithm hands it batches and a loss function.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlfleet.checkpoint import load_policy, save_policy
from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.logprobs import batch_logprobs, token_logprobs
from rlfleet.policy.loss import Normalizer

LossFn = Callable[[torch.Tensor, TrainBatch, Normalizer], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    warmup_steps: int
    warmup_start_factor: float
    max_grad_norm: float | None


def over_global_batches(
    batch: TrainBatch, global_batch_size: int, step_fn: Callable[[TrainBatch], dict[str, float]]
) -> dict[str, float]:
    """Runs ``step_fn`` (one optimizer step) on each ``global_batch_size`` slice; metrics averaged."""
    totals: dict[str, float] = {}
    num_steps = len(batch) // global_batch_size
    for start in range(0, len(batch), global_batch_size):
        for key, value in step_fn(batch.select(start, start + global_batch_size)).items():
            totals[key] = totals.get(key, 0.0) + value / num_steps
    return totals


def warmup_factor(step: int, warmup_steps: int, start_factor: float) -> float:
    """Linear warm-up multiplier: ``start_factor`` at step 0 rising to 1.0 at ``warmup_steps``."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return 1.0
    return start_factor + (1.0 - start_factor) * step / warmup_steps


class PolicyWorker:
    """Computes logprobs and applies optimizer steps for one model replica (or shard).

    Args:
        model: The trainable policy (moved to train mode).
        tokenizer: Its tokenizer (saved with checkpoints).
        settings: Optimizer, warm-up schedule and gradient clipping.
        keep_reference: Keep a frozen copy of the initial weights for KL / reference logprobs.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        settings: OptimizerSettings,
        *,
        keep_reference: bool,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings
        self.reference = self._frozen_copy(model) if keep_reference else None
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=settings.lr,
            weight_decay=settings.weight_decay,
            betas=settings.betas,
            eps=settings.eps,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: warmup_factor(s, settings.warmup_steps, settings.warmup_start_factor),
        )

    @property
    def has_reference(self) -> bool:
        return self.reference is not None

    def take_metrics(self, total_tokens: int) -> dict[str, float]:
        """Per-worker balance metrics (Ray workers report them; one in-process worker has none)."""
        return {}

    def close(self) -> None:
        """Nothing to release in-process (the Ray policy stops its actors)."""

    @staticmethod
    def _frozen_copy(model: PreTrainedModel) -> PreTrainedModel:
        ref = copy.deepcopy(model)
        ref.eval()
        ref.requires_grad_(False)
        return ref

    @torch.no_grad()
    def logprobs(
        self, batch: TrainBatch, micro_batch_size: int, *, reference: bool = False, temperature: float = 1.0
    ) -> torch.Tensor:
        """``[B, T]`` token logprobs of the policy (or the frozen reference) over ``batch``."""
        model = self.reference if reference else self.model
        if model is None:
            raise RuntimeError("this worker keeps no reference model (keep_reference=False)")
        return batch_logprobs(model, batch, 0, len(batch), micro_batch_size, temperature).to(
            batch.response_mask.dtype
        )

    def train(
        self,
        batch: TrainBatch,
        loss_fn: LossFn,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """One optimizer step per ``global_batch_size`` rows of ``batch``, accumulating micro-batches.

        Returns metrics averaged over the optimizer steps: the loss function's metrics plus ``grad_norm``
        and ``lr``.
        """
        if len(batch) % global_batch_size or global_batch_size % micro_batch_size:
            raise ValueError(
                f"batch of {len(batch)} rows, global batch {global_batch_size}, "
                f"micro-batch {micro_batch_size}: "
                "the batch must split into global batches and each global batch into micro-batches"
            )
        self.model.train()
        return over_global_batches(
            batch,
            global_batch_size,
            lambda gb: self._optimizer_step(gb, loss_fn, micro_batch_size, temperature),
        )

    def _optimizer_step(
        self, batch: TrainBatch, loss_fn: LossFn, micro_batch_size: int, temperature: float
    ) -> dict[str, float]:
        mask = batch.response_mask
        norm = Normalizer(num_tokens=float(mask.sum()), num_sequences=float(len(batch)))
        metrics: dict[str, float] = {}
        self.optimizer.zero_grad(set_to_none=True)
        for start in range(0, len(batch), micro_batch_size):
            mb = batch.select(start, start + micro_batch_size).to(self.model.device)
            lp = token_logprobs(self.model, mb.input_ids, mb.attention_mask, temperature)
            loss, mb_metrics = loss_fn(lp, mb, norm)
            loss.backward()
            for key, value in mb_metrics.items():
                metrics[key] = metrics.get(key, 0.0) + value
        max_norm = self.settings.max_grad_norm if self.settings.max_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics["grad_norm"] = float(grad_norm)
        return metrics

    def save(self, step_dir: Path) -> None:
        """Writes ``step_dir/policy/{weights,optimizer,scheduler.pt,tokenizer}`` (DCP layout)."""
        save_policy(step_dir, self.model, self.optimizer, self.scheduler, self.tokenizer)

    def load(self, step_dir: Path) -> None:
        """Restores weights, optimizer and scheduler written by ``save``."""
        load_policy(step_dir, self.model, self.optimizer, self.scheduler)

    def load_weights(self, step_dir: Path) -> None:
        """Restores the weights only (evaluation of a checkpoint)."""
        load_policy(step_dir, self.model)
