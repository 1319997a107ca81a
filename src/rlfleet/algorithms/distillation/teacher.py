"""The distillation teacher: a frozen model that gives, for every position of the student's sequences, its
``k`` most likely next tokens and their logprobs (NeMo RL's ``get_topk_logits``), never its whole vocabulary.

One prefill pass over the batch, micro-batched and laid out as the policy's logprob pass is (fixed rows,
dynamic batching or packing; chunked over the output layer with ``policy.logprob_chunk_size``), through
the same ``Readout`` machinery (:mod:`rlfleet.policy.logprobs`), so a packed row gives what the padded rows
give. The ``k`` ids travel beside the logprobs in one float32 tensor (exact below 2**24) and are split here.
"""

from __future__ import annotations

import functools

import torch
from transformers import PreTrainedModel

from rlfleet.algorithms.distillation.kl import MAX_EXACT_ID, teacher_topk
from rlfleet.models.loading import ModelSource
from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.logprobs import Readout, batch_logprobs
from rlfleet.policy.microbatch import MicroBatching
from rlfleet.policy.rank import default_device


def _teacher_pick(k: int, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[..., 2k]``: the teacher's top-k logprobs (renormalised), then their ids as floats."""
    if temperature != 1.0:
        logits = logits.float() / temperature
    logprobs, ids = teacher_topk(logits, k)
    return torch.cat([logprobs, ids.float()], dim=-1)


def _input_ids(mb: TrainBatch) -> torch.Tensor:
    return mb.input_ids


def topk_readout(k: int) -> Readout:
    """The teacher pass's ``Readout``: ``[n, T, 2k]``, see :func:`split_topk`."""
    return Readout(targets=_input_ids, pick=functools.partial(_teacher_pick, k))


def split_topk(read: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs [B, T, k] float32, ids [B, T, k] long)`` from a ``topk_readout`` result ``[B, T, 2k]``."""
    k = read.shape[-1] // 2
    return read[..., :k].float(), read[..., k:].round().long()


def model_topk(
    model: PreTrainedModel,
    batch: TrainBatch,
    micro_batching: MicroBatching | int,
    k: int,
    *,
    temperature: float = 1.0,
    num_shards: int = 1,
    shard: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``model``'s top-k over shard ``shard`` of ``num_shards`` of ``batch``: ``(logprobs, ids)``, each
    ``[B / num_shards, T, k]`` on the CPU, position ``t`` the distribution of token ``t`` (0 at position 0
    and on padding), from the logits divided by ``temperature`` (the ids do not depend on it, the k
    renormalised logprobs do)."""
    read = batch_logprobs(
        model, batch, micro_batching, temperature, num_shards, shard, readout=topk_readout(k)
    )
    return split_topk(read)


class Teacher:
    """A frozen teacher in this process: loaded in ``source.precision``, eval mode, no gradients.

    Args:
        source: The teacher's model (``teacher.*`` of the recipe).
        temperature: Its top-k is read from its logits divided by this (``teacher.generation.temperature``,
            as NeMo RL's teacher scales its logits by its own generation temperature).
        device: Where it runs; default the current CUDA device when there is one, else the CPU.
    """

    def __init__(
        self, source: ModelSource, temperature: float = 1.0, device: torch.device | None = None
    ) -> None:
        if not temperature > 0:
            raise ValueError(f"a teacher temperature must be > 0, got {temperature}")
        self.temperature = temperature
        self.device = device if device is not None else default_device()
        self.model = source.load_model()
        # transformers' @wraps on PreTrainedModel.to hides the bound self from mypy
        self.model.to(self.device)  # type: ignore[arg-type]
        self.model.eval()
        self.model.requires_grad_(False)
        vocabulary = self.model.get_output_embeddings().weight.shape[0]
        if vocabulary >= MAX_EXACT_ID:
            raise ValueError(f"a teacher vocabulary of {vocabulary} tokens is above {MAX_EXACT_ID}")
        self.vocabulary = vocabulary

    @torch.no_grad()
    def topk(
        self, batch: TrainBatch, micro_batching: MicroBatching | int, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's top-k logprobs and ids over ``batch`` (``model_topk`` at its temperature), rows in
        ``batch`` order."""
        return model_topk(self.model, batch, micro_batching, k, temperature=self.temperature)

    def close(self) -> None:
        """Drops the model (the run's clean-up calls it; a second call does nothing)."""
        self.__dict__.pop("model", None)
