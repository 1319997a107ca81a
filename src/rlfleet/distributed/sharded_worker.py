"""The data-parallel, FSDP2-sharded policy worker: one instance per rank of a process group.

A plain class (the Ray layer hosts it; see ``RayWorkerGroup``). Every rank receives the whole batch and
works on its contiguous share of each global batch; the loss is divided by the token and sequence counts
of the *global* batch (all-reduced first), and gradients are summed across ranks, so one step equals the
single-process ``PolicyWorker`` step on the same batch.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import PreTrainedModel

from rlfleet.checkpoint import load_policy, save_policy
from rlfleet.models.loading import load_model, load_tokenizer
from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.logprobs import batch_logprobs, token_logprobs
from rlfleet.policy.loss import Normalizer
from rlfleet.policy.worker import LossFn, OptimizerSettings, over_global_batches, warmup_factor

# Metrics that are not sums over micro-batches (and so are not summed over ranks).
_NOT_SUMMED = ("lr", "grad_norm")


def _decoder_layers(model: PreTrainedModel) -> list[torch.nn.Module]:
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no .model.layers; FSDP2 sharding per decoder layer supports "
            "Llama-style causal LMs"
        )
    return list(layers)


def _shard(model: PreTrainedModel, device_type: str) -> PreTrainedModel:
    """``fully_shard`` on every decoder layer and on the root, over all ranks."""
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class ShardedPolicyWorker:
    """Holds this rank's shard of the policy (and optionally of a frozen reference) and its optimizer.

    Args:
        model_path: An HF model directory or hub name (see ``rlfleet.models.loading``).
        settings: Optimizer, warm-up schedule and gradient clipping (as ``PolicyWorker``).
        precision: "float32", "bfloat16" or "float16".
        keep_reference: Also hold a frozen, sharded copy of the initial weights.

    Needs an initialised ``torch.distributed`` process group.
    """

    def __init__(
        self,
        model_path: str,
        settings: OptimizerSettings,
        precision: str = "float32",
        *,
        keep_reference: bool = False,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ShardedPolicyWorker needs a process group; build it through RayWorkerGroup")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.settings = settings
        self.tokenizer = load_tokenizer(model_path)
        self.model = _shard(load_model(model_path, precision), self.device.type)
        self.reference: PreTrainedModel | None = None
        if keep_reference:
            self.reference = _shard(load_model(model_path, precision), self.device.type)
            self.reference.eval()
            self.reference.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=settings.lr,
            weight_decay=settings.weight_decay,
            betas=settings.betas,
            eps=settings.eps,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: warmup_factor(s, settings.warmup_steps, settings.warmup_start_factor),
        )

    def _my_rows(self, start: int, size: int) -> tuple[int, int]:
        """This rank's contiguous share of rows ``start : start + size`` (size divisible by world size)."""
        share = size // self.world_size
        return start + self.rank * share, start + (self.rank + 1) * share

    def _check_divisible(self, what: str, rows: int, micro_batch_size: int) -> None:
        share, rest = divmod(rows, self.world_size)
        if rest or share % micro_batch_size:
            raise ValueError(
                f"{what} of {rows} rows over {self.world_size} ranks with micro-batch {micro_batch_size}: "
                "it must split evenly into ranks and each rank's share into micro-batches "
                "(every rank must run the same number of forward passes)"
            )

    @torch.no_grad()
    def logprobs(
        self, batch: TrainBatch, micro_batch_size: int, *, reference: bool = False, temperature: float = 1.0
    ) -> torch.Tensor:
        """``[B, T]`` token logprobs of the whole ``batch``: each rank computes its rows, then all gather."""
        model = self.reference if reference else self.model
        if model is None:
            raise RuntimeError("this worker keeps no reference model (keep_reference=True builds one)")
        self._check_divisible("logprob batch", len(batch), micro_batch_size)
        first, stop = self._my_rows(0, len(batch))
        mine = batch_logprobs(model, batch, first, stop, micro_batch_size, temperature)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(parts, mine.to(self.device))
        return torch.cat([p.cpu() for p in parts]).to(batch.response_mask.dtype)

    def train(
        self,
        batch: TrainBatch,
        loss_fn: LossFn,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """One optimizer step per ``global_batch_size`` rows of the (whole, identical on every rank) batch.

        Returns metrics averaged over the optimizer steps, summed over ranks as ``PolicyWorker`` sums them
        over micro-batches: the loss function's metrics plus ``grad_norm`` and ``lr``. Same on every rank.
        """
        if len(batch) % global_batch_size:
            raise ValueError(
                f"batch of {len(batch)} rows does not split into global batches of {global_batch_size}"
            )
        self._check_divisible("global batch", global_batch_size, micro_batch_size)
        self.model.train()
        return over_global_batches(
            batch,
            global_batch_size,
            lambda gb: self._optimizer_step(gb, loss_fn, micro_batch_size, temperature),
        )

    def _global_normalizer(self, batch: TrainBatch) -> Normalizer:
        counts = torch.tensor([float(batch.response_mask.sum()), float(len(batch))], dtype=torch.float64)
        counts = counts.to(self.device)
        dist.all_reduce(counts)
        return Normalizer(num_tokens=float(counts[0]), num_sequences=float(counts[1]))

    def _optimizer_step(
        self, global_batch: TrainBatch, loss_fn: LossFn, micro_batch_size: int, temperature: float
    ) -> dict[str, float]:
        first, stop = self._my_rows(0, len(global_batch))
        batch = global_batch.select(first, stop)
        norm = self._global_normalizer(batch)
        metrics: dict[str, float] = {}
        self.optimizer.zero_grad(set_to_none=True)
        for start in range(0, len(batch), micro_batch_size):
            mb = batch.select(start, start + micro_batch_size).to(self.device)
            lp = token_logprobs(self.model, mb.input_ids, mb.attention_mask, temperature)
            loss, mb_metrics = loss_fn(lp, mb, norm)
            # FSDP averages gradients over ranks; each rank's loss is already its share of the global loss.
            (loss * self.world_size).backward()
            for key, value in mb_metrics.items():
                metrics[key] = metrics.get(key, 0.0) + value
        metrics = self._sum_over_ranks(metrics)
        max_norm = self.settings.max_grad_norm if self.settings.max_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        full_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        metrics["grad_norm"] = float(full_norm)
        return metrics

    def _sum_over_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        keys = sorted(k for k in metrics if k not in _NOT_SUMMED)
        values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(values)
        return dict(zip(keys, values.cpu().tolist(), strict=True))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded weights on CPU, on rank 0 (empty elsewhere). Collective: call on every rank."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    def save(self, step_dir: Path) -> None:
        """Writes the policy checkpoint (DCP, collective). Call on every rank."""
        save_policy(step_dir, self.model, self.optimizer, self.scheduler, self.tokenizer)

    def load(self, step_dir: Path) -> None:
        """Restores weights, optimizer and scheduler written by ``save`` (collective)."""
        load_policy(step_dir, self.model, self.optimizer, self.scheduler)
