"""Token logprobs of a causal LM over a right-padded batch."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from rlfleet.policy.batch import TrainBatch


def token_logprobs(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``[B, T]`` with ``out[:, t] = log p(x_t | x_<t)`` at ``temperature``; ``out[:, 0] = 0``.

    Computed as ``logit[token] - logsumexp(logits)`` in float32, without materialising the full
    log-softmax over the vocabulary.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # [B, T, V]
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)  # [B, T-1, 1]
    picked = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # [B, T-1]
    return torch.nn.functional.pad(picked, (1, 0), value=0.0)


@torch.no_grad()
def batch_logprobs(
    model: PreTrainedModel,
    batch: TrainBatch,
    start: int,
    stop: int,
    micro_batch_size: int,
    temperature: float,
) -> torch.Tensor:
    """Token logprobs of rows ``start:stop`` of ``batch`` in eval mode, micro-batch by micro-batch.

    Returns:
        ``[stop - start, T]`` float32 on the CPU, ``T`` being the width of the whole ``batch``.
    """
    was_training = model.training
    model.eval()
    out = torch.zeros((stop - start, batch.response_mask.shape[1]), dtype=torch.float32)
    try:
        for first in range(start, stop, micro_batch_size):
            mb = batch.select(first, min(first + micro_batch_size, stop)).to(model.device)
            lp = token_logprobs(model, mb.input_ids, mb.attention_mask, temperature)
            out[first - start : first - start + len(mb), : lp.shape[1]] = lp.cpu()
    finally:
        model.train(was_training)
    return out
