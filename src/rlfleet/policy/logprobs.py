"""Token logprobs of a causal LM over a right-padded batch, in any micro-batch layout; a reward model's
per-token scores in their place.

A reward model (a sequence classifier, ``rlfleet.models.loading.is_reward_model``) goes through the same
machinery (micro-batching, packing, the training step): where a causal LM gives ``log p(x_t | x_<t)``, it
gives its score head's output at every position, ``score(h_t)`` (no shift, no temperature), and the loss
reads each row's score at its last token (``rlfleet.policy.loss_functions.PreferenceLossFn``).

With ``MicroBatching.logprob_chunk`` (``policy.logprob_chunk_size``) the logprobs come from the final
hidden states a chunk of tokens at a time: the model's output layer runs inside its forward on one chunk,
the chosen token's logprob is kept and the chunk's logits dropped; the backward recomputes them chunk by
chunk. No ``[tokens x vocabulary]`` tensor exists, so the memory of that step grows with the chunk, not with
the micro-batch (NeMo RL's fused linear logprobs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from rlfleet.models.loading import is_reward_model
from rlfleet.models.lora import WithoutAdapters
from rlfleet.policy import packed_attention
from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.microbatch import (
    MicroBatching,
    as_micro_batching,
    packed_width,
    plan_micro_batches,
    row_lengths,
)
from rlfleet.utils.intmath import round_up

# transformers builds a block-diagonal causal mask (sdpa, eager) or runs the variable-length kernel
# (flash_attention_2) from position ids that restart at 0, when no attention mask is given; sdpa_packed
# (what packing switches sdpa to) runs SDPA sequence by sequence
PACKED_ATTENTION = ("sdpa", "eager", "flash_attention_2", packed_attention.NAME)

# what the logprob code scores with: a model, or a LoRA policy seen with its adapters off
ScoringModel = PreTrainedModel | WithoutAdapters

# what a pass reads from the logits of each position at that position's targets (see ``Readout``)
Pick = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]

# set on a model whose decoder layers ``rlfleet.policy.compile.compile_layers`` compiled: its logprobs then
# come from a compiled ``picked_logprobs`` too (the cast, max, exp-sum and log over the vocabulary fuse into
# one pass, forward and backward)
COMPILED_MARK = "_rlfleet_compiled"


def picked_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log softmax(logits / temperature)[target]`` over the last dim, as ``logit[target] - logsumexp``
    in float32 (float64 logits stay float64), without the full log-softmax over the vocabulary."""
    logits = logits if logits.dtype == torch.float64 else logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


@dataclass(frozen=True)
class Readout:
    """What a forward reads from the distribution at each position, in place of the next token's logprob.

    ``targets(mb)`` gives ``[n, T, ...]`` aligned with the micro-batch's ``input_ids`` (position ``t``: what
    the distribution over token ``t`` is read at, as token ``t`` itself is for logprobs); ``pick(logits
    [N, V], targets [N, ...], temperature)`` gives ``[N, width]`` from it. The result is ``[n, T, width]``
    (position 0 and padding 0) in every layout: padded, dynamic batching, packed, chunked. Distillation
    reads the teacher's top k (``rlfleet.algorithms.distillation.teacher``) and the student at the teacher's
    tokens (``rlfleet.algorithms.distillation.loss.DistillationLossFn``) this way.
    """

    targets: Callable[[TrainBatch], torch.Tensor]
    pick: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def _from_second_position(picked: torch.Tensor) -> torch.Tensor:
    """``[B, T-1, ...]`` values of positions ``1..T-1`` as ``[B, T, ...]`` with position 0 at 0."""
    return torch.nn.functional.pad(picked, (0, 0) * (picked.ndim - 2) + (1, 0), value=0.0)


@functools.cache
def _compiled_picked_logprobs() -> Pick:
    compiled: Pick = torch.compile(picked_logprobs, dynamic=True)
    return compiled


def default_pick(model: ScoringModel) -> Pick:
    """``picked_logprobs``, compiled when ``model``'s layers are (``COMPILED_MARK``)."""
    inner = model.model if isinstance(model, WithoutAdapters) else model
    return _compiled_picked_logprobs() if getattr(inner, COMPILED_MARK, False) else picked_logprobs


def logprobs_from_logits(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float,
    readout: tuple[Pick, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[B, T]`` with ``out[:, t] = log p(x_t | x_<t)`` from ``[B, T, V]`` logits; ``out[:, 0] = 0``. With
    ``readout`` ``(pick, targets [B, T, ...])``: ``pick`` of each position's logits at the next position's
    targets, ``[B, T, width]``."""
    pick, targets = readout if readout is not None else (picked_logprobs, input_ids)
    return _from_second_position(pick(logits[:, :-1], targets[:, 1:], temperature))


def _chunk_logprobs(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, pick: Pick
) -> torch.Tensor:
    """``[c, ...]`` ``pick`` of the logits of ``[c, H]`` hidden states through the output layer ``head``."""
    return pick(head(hidden), targets, temperature)


def chunked_logprobs(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float,
    chunk: int,
    readout: tuple[Pick, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[B, T]`` token logprobs (``out[:, 0] = 0``) from ``[B, T, H]`` final hidden states, ``chunk`` tokens
    at a time through the output layer ``head``; with ``readout`` as ``logprobs_from_logits``.

    With autograd on, each chunk is checkpointed: the forward keeps only the chunk's hidden states and its
    ``[c]`` logprobs, and the backward recomputes that chunk's logits alone. Values and gradients are those
    of the whole computation (the operations are row-wise).
    """
    pick, targets = readout if readout is not None else (picked_logprobs, input_ids)
    batch, width, size = hidden.shape
    flat = hidden[:, :-1].reshape(-1, size)  # [N, H]: position t predicts token t + 1
    flat_targets = targets[:, 1:].reshape(-1, *targets.shape[2:])
    pieces = []
    for start in range(0, len(flat), chunk):
        args = (head, flat[start : start + chunk], flat_targets[start : start + chunk], temperature, pick)
        if torch.is_grad_enabled():
            pieces.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(*args))
    if not pieces:
        return torch.zeros(hidden.shape[:2], device=hidden.device)
    picked = torch.cat(pieces)
    return _from_second_position(picked.view(batch, width - 1, *picked.shape[1:]))


class _LogprobHead(torch.nn.Module):
    """Stands in for a model's output layer during one forward: returns ``chunked_logprobs`` of the tokens
    it was given instead of logits (``result`` keeps what it returned)."""

    def __init__(
        self,
        head: torch.nn.Module,
        input_ids: torch.Tensor,
        temperature: float,
        chunk: int,
        readout: tuple[Pick, torch.Tensor] | None,
    ) -> None:
        super().__init__()
        self.head = head
        self.input_ids, self.temperature, self.chunk, self.readout = input_ids, temperature, chunk, readout
        self.result: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:2] != self.input_ids.shape:
            raise ValueError(
                f"chunked logprobs need the output layer applied to every position ({tuple(hidden.shape)} "
                f"hidden states for {tuple(self.input_ids.shape)} tokens); "
                "fix: policy.logprob_chunk_size=null"
            )
        self.result = chunked_logprobs(
            self.head, hidden, self.input_ids, self.temperature, self.chunk, self.readout
        )
        return self.result


@contextmanager
def _output_layer_replaced(inner: PreTrainedModel, stand_in: _LogprobHead) -> Iterator[None]:
    name = next(n for n, m in inner.named_children() if m is stand_in.head)
    setattr(inner, name, stand_in)
    try:
        yield
    finally:
        setattr(inner, name, stand_in.head)


def _per_token_scores(model: PreTrainedModel, input_ids: torch.Tensor, **inputs: Any) -> torch.Tensor:
    """A sequence classifier's forward without the pooling: ``[B, T]`` float32 score of every position."""
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, **inputs).last_hidden_state  # [B, T, H]
    scores: torch.Tensor = model.get_submodule("score")(hidden)[..., 0]  # [B, T]: the head has one label
    return scores.float()


@contextmanager
def _forward_per_token(model: PreTrainedModel) -> Iterator[None]:
    """``model(...)`` returns ``_per_token_scores`` during this block. The model is still called as a
    whole, so the hooks around its forward run (FSDP2 gathers its own parameters, the score head's among
    them, and its backward reduces their gradients, because the loss depends on that call's output)."""
    previous = model.__dict__.get("forward")
    model.forward = functools.partial(_per_token_scores, model)
    try:
        yield
    finally:
        if previous is None:
            del model.forward
        else:
            model.forward = previous


def token_scores(model: PreTrainedModel, input_ids: torch.Tensor, **inputs: Any) -> torch.Tensor:
    """``[B, T]`` a reward model's score at every position of ``input_ids`` (called with ``inputs``: attention
    mask or position ids), each from the hidden state there; the row's score is the one at its last token.

    Raises:
        ValueError: The model has no one-label ``score`` head.
    """
    head = getattr(model, "score", None)
    if not isinstance(head, torch.nn.Linear) or head.out_features != 1:
        raise ValueError(
            f"{type(model).__name__} has no one-label `score` head; a Bradley-Terry reward model is a "
            "transformers *ForSequenceClassification with num_labels=1"
        )
    with _forward_per_token(model):
        scores: torch.Tensor = model(input_ids=input_ids, use_cache=False, **inputs)
    return scores


def model_logprobs(
    model: ScoringModel,
    input_ids: torch.Tensor,
    temperature: float,
    chunk: int | None,
    readout: tuple[Pick, torch.Tensor] | None = None,
    **inputs: Any,
) -> torch.Tensor:
    """``[B, T]`` logprobs of ``input_ids`` under ``model`` called with ``inputs`` (attention mask or
    position ids): from its logits, or, with ``chunk``, from its final hidden states ``chunk`` tokens at a
    time (the output layer is swapped for the chunked computation during this forward only). A reward
    model gives its per-token scores instead (``token_scores``). ``readout`` ``(pick, targets)``: what
    ``pick`` reads at each position instead (``[B, T, width]``, see ``Readout``).

    Raises:
        ValueError: With ``chunk``, the model changes its output layer's result (logit soft-capping or
            scaling, as Gemma 2 or Granite do): chunking would skip that, so it is refused; or the model is
            a reward model, which has no vocabulary logits to chunk.
    """
    if not isinstance(model, WithoutAdapters) and is_reward_model(model):
        if readout is not None:
            raise ValueError("a reward model has no vocabulary distribution to read a top k from")
        if chunk is not None:
            raise ValueError(
                "a reward model has no vocabulary logits to compute in chunks; "
                "fix: policy.logprob_chunk_size=null"
            )
        return token_scores(model, input_ids, **inputs)
    if readout is None:
        readout = (default_pick(model), input_ids)
    if chunk is None:
        logits = model(input_ids=input_ids, use_cache=False, **inputs).logits  # [B, T, V]
        return logprobs_from_logits(logits, input_ids, temperature, readout)
    inner = model.model if isinstance(model, WithoutAdapters) else model
    stand_in = _LogprobHead(inner.get_output_embeddings(), input_ids, temperature, chunk, readout)
    with _output_layer_replaced(inner, stand_in):
        out = model(input_ids=input_ids, use_cache=False, **inputs).logits
    result = stand_in.result
    if result is None or out is not result:
        raise ValueError(
            f"{type(inner).__name__} transforms its output layer's logits (soft-capping or scaling), which "
            "chunked logprobs would skip; fix: policy.logprob_chunk_size=null"
        )
    return result


def token_logprobs(
    model: ScoringModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk: int | None = None,
    readout: tuple[Pick, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[B, T]`` with ``out[:, t] = log p(x_t | x_<t)`` at ``temperature``; ``out[:, 0] = 0``."""
    return model_logprobs(model, input_ids, temperature, chunk, readout, attention_mask=attention_mask)


def pack_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, width: int | None = None
) -> tuple[torch.Tensor, ...]:
    """Concatenates the real tokens of right-padded rows into one row, padded to ``width`` tokens (at
    least its ``L`` real ones) with one more sequence of token 0 whose positions restart at 0 like any other,
    so that no real token attends to it.

    Returns:
        ``(packed_ids [1, W], position_ids [1, W], rows [L], cols [L])``: ``position_ids`` restart at 0 at
        each sequence; token ``k < L`` of the packed row came from ``input_ids[rows[k], cols[k]]``.
    """
    lengths = attention_mask.sum(dim=1)
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    cols = torch.arange(len(rows), device=rows.device) - starts[rows]
    packed, positions = input_ids[rows, cols], cols
    pad = (width or 0) - len(rows)
    if pad > 0:
        packed = torch.cat([packed, packed.new_zeros(pad)])
        positions = torch.cat([positions, torch.arange(pad, device=positions.device)])
    return packed.unsqueeze(0), positions.unsqueeze(0), rows, cols


def packed_token_logprobs(
    model: ScoringModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk: int | None = None,
    budget: int | None = None,
    readout: tuple[Pick, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``token_logprobs`` of right-padded rows computed on one packed row, scattered back to ``[n, T]``
    (``[n, T, width]`` with a ``readout``, its targets packed like the tokens); the row runs at its
    ``packed_width`` within the token ``budget``.

    The model gets ``position_ids`` restarting at each sequence and no attention mask: transformers then
    builds a block-diagonal causal mask (SDPA / eager) or runs variable-length FlashAttention from the
    position ids (``flash_attention_2``). Each sequence's first position gets 0, as in the padded layout
    (the packed row's logit there conditions on the previous sequence); a reward model's scores are kept
    at every position (each depends on its own sequence alone).
    """
    packed_attention.use_packed_sdpa(model)
    attention = model.config._attn_implementation
    if attention not in PACKED_ATTENTION:
        raise ValueError(
            f"sequence packing needs an attention that separates sequences by their position ids "
            f"({', '.join(PACKED_ATTENTION)}); this model uses {attention!r}; fix: "
            "policy.sequence_packing.enabled=false (policy.dynamic_batching.enabled=true pads instead)"
        )
    real = int(attention_mask.sum())
    packed, positions, rows, cols = pack_rows(input_ids, attention_mask, packed_width(real, budget))
    if readout is not None:
        pick, targets = readout
        packed_targets = targets.new_zeros((packed.shape[1], *targets.shape[2:]))
        packed_targets[:real] = targets[rows, cols]
        readout = (pick, packed_targets.unsqueeze(0))
    lp = model_logprobs(model, packed, temperature, chunk, readout, position_ids=positions)  # [1, W, ...]
    picked = lp[0, :real]  # [L, ...]
    if not is_reward_model(model):
        picked = picked.masked_fill(_rows_like(cols == 0, picked), 0.0)
    return picked.new_zeros((*input_ids.shape, *picked.shape[1:])).index_put((rows, cols), picked)


def _rows_like(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``mask`` ``[...]`` with a trailing 1 for each dimension ``values`` has beyond it (to broadcast)."""
    return mask.view(*mask.shape, *(1,) * (values.ndim - mask.ndim))


def forward_logprobs(
    model: ScoringModel,
    mb: TrainBatch,
    batching: MicroBatching,
    temperature: float,
    readout: Readout | None = None,
) -> torch.Tensor:
    """``[n, T]`` token logprobs of the right-padded micro-batch ``mb`` (``[n, T, width]`` of ``readout``),
    whatever its layout: packed into one row, padded to its width rounded up (dynamic batching), or as it
    is (fixed rows). Padding positions hold 0 in every layout."""
    chunk = batching.logprob_chunk
    read = None if readout is None else (readout.pick, readout.targets(mb))
    if batching.pack:
        return packed_token_logprobs(
            model, mb.input_ids, mb.attention_mask, temperature, chunk, batching.tokens, read
        )
    width = mb.input_ids.shape[1]
    target = round_up(width, batching.round_to) if batching.tokens is not None else width
    pad = (0, target - width)
    ids = torch.nn.functional.pad(mb.input_ids, pad, value=0)
    mask = torch.nn.functional.pad(mb.attention_mask, pad, value=0)
    if read is not None and target > width:
        pick, targets = read
        read = (pick, torch.nn.functional.pad(targets, (0, 0) * (targets.ndim - 2) + pad, value=0))
    lp = token_logprobs(model, ids, mask, temperature, chunk, read)[:, :width]
    return lp.masked_fill(_rows_like(mb.attention_mask == 0, lp), 0.0)


@torch.no_grad()
def batch_logprobs(
    model: ScoringModel,
    batch: TrainBatch,
    micro_batching: MicroBatching | int,
    temperature: float,
    num_shards: int = 1,
    shard: int = 0,
    readout: Readout | None = None,
) -> torch.Tensor:
    """Token logprobs of shard ``shard`` of ``num_shards`` (contiguous equal row shares) of ``batch``, in eval
    mode, micro-batch by micro-batch as ``micro_batching`` plans (every shard runs the same number of passes).

    Returns:
        ``[B / num_shards, T]`` float32 on the CPU in the shard's row order, ``T`` the width of ``batch``
        (``[B / num_shards, T, width]`` of ``readout``).
    """
    batching = as_micro_batching(micro_batching)
    share = len(batch) // num_shards
    mine = batch.select(shard * share, (shard + 1) * share)
    plan = plan_micro_batches(row_lengths(batch), batching, num_shards)[shard]
    was_training = model.training
    model.eval()
    out: torch.Tensor | None = None
    try:
        for rows in plan:
            mb = mine.take(rows).to(model.device)
            lp = forward_logprobs(model, mb, batching, temperature, readout)
            if out is None:  # [share, T, width...]: a readout's width is known from its first result
                out = torch.zeros((share, batch.response_mask.shape[1], *lp.shape[2:]), dtype=torch.float32)
            out[rows, : lp.shape[1]] = lp.float().cpu()
    finally:
        model.train(was_training)
    return out if out is not None else torch.zeros((share, batch.response_mask.shape[1]))
