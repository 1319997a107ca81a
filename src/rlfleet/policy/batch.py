"""The training batch: right-padded token sequences plus per-token and per-sample tensors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch


@dataclass
class TrainBatch:
    """Sequences of ``prompt + response`` tokens, right-padded to a common length ``T``.

    Logprob tensors are aligned with ``input_ids``: position ``t`` holds ``log p(x_t | x_<t)`` (position 0
    holds 0). ``response_mask`` is 1.0 exactly on response tokens, so masking a logprob tensor with it keeps
    the tokens the policy generated (EOS included).

    Attributes:
        input_ids: ``[B, T]`` long.
        attention_mask: ``[B, T]`` long, 1 on real tokens.
        response_mask: ``[B, T]`` float, 1 on response tokens.
        advantages: ``[B]`` per-sample advantages (GRPO), or None.
        prev_logprobs: ``[B, T]`` logprobs of the policy before this update, or None.
        ref_logprobs: ``[B, T]`` logprobs of the frozen reference policy, or None.
        generation_logprobs: ``[B, T]`` logprobs reported by the generation backend, or None.
        inert: ``[B]`` bool, rows whose loss and gradient are exactly zero (GRPO: advantage 0 and no KL
            term); the training pass counts them in the loss's normaliser but does not compute them. None:
            every row is computed.
        teacher_topk_logprobs: ``[B, T, k]`` distillation: the teacher's top-k logprobs for token ``t``
            (from its logits at ``t - 1``), renormalised over the k; or None.
        teacher_topk_ids: ``[B, T, k]`` long, the token ids of those logprobs; or None.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor | None = None
    prev_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    generation_logprobs: torch.Tensor | None = None
    inert: torch.Tensor | None = None
    teacher_topk_logprobs: torch.Tensor | None = None
    teacher_topk_ids: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, start: int, stop: int) -> TrainBatch:
        """Rows ``start:stop``, with trailing all-padding columns removed."""
        width = int(self.attention_mask[start:stop].sum(dim=1).max())
        return TrainBatch(**_columns(self, lambda value: _slice(value, start, stop, width)))

    def take(self, rows: Sequence[int]) -> TrainBatch:
        """Rows ``rows`` (any order), with trailing all-padding columns removed."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        width = int(self.attention_mask[index].sum(dim=1).max())
        return TrainBatch(**_columns(self, lambda value: _take(value, index, width)))

    def with_(self, **changes: torch.Tensor | None) -> TrainBatch:
        columns: dict[str, Any] = changes  # field names checked by replace at run time
        return replace(self, **columns)

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch with every tensor on ``device`` (no copy when already there)."""
        return TrainBatch(**_columns(self, lambda value: _to(value, device)))


def _columns(batch: TrainBatch, fn: Callable[[torch.Tensor | None], torch.Tensor | None]) -> dict[str, Any]:
    """``fn`` of each field of ``batch``, by name: ``TrainBatch``'s keyword arguments (a dict over all
    fields, whose values mypy cannot match to each field's own type, hence Any)."""
    return {f.name: fn(getattr(batch, f.name)) for f in fields(batch)}


def _to(value: torch.Tensor | None, device: torch.device | str) -> torch.Tensor | None:
    return None if value is None else value.to(device)


def _take(value: torch.Tensor | None, index: torch.Tensor, width: int) -> torch.Tensor | None:
    if value is None:
        return None
    rows = value[index.to(value.device)]
    return rows[:, :width] if rows.ndim >= 2 else rows


def _slice(value: torch.Tensor | None, start: int, stop: int, width: int) -> torch.Tensor | None:
    if value is None:
        return None
    rows = value[start:stop]
    return rows[:, :width] if rows.ndim >= 2 else rows


def collate(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_token_id: int,
    response_logprobs: Sequence[Sequence[float]] | None = None,
    response_masks: Sequence[Sequence[int] | None] | None = None,
) -> TrainBatch:
    """Builds a right-padded batch from prompt and response token lists (one pair per sample).

    ``response_masks[i]`` (when given and not None) marks which of response ``i``'s tokens the model sampled
    (a multi-turn episode's observation tokens are 0): only those are in ``response_mask``.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    length = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    n = len(prompts)
    input_ids = torch.full((n, length), pad_token_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    response_mask = torch.zeros((n, length), dtype=torch.float32)
    gen_lp = torch.zeros((n, length), dtype=torch.float32) if response_logprobs is not None else None
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        end = len(p) + len(r)
        input_ids[i, :end] = torch.tensor([*p, *r], dtype=torch.long)
        attention[i, :end] = 1
        mask = None if response_masks is None else response_masks[i]
        if mask is None:
            response_mask[i, len(p) : end] = 1.0
        else:
            if len(mask) != len(r):
                raise ValueError(f"response {i}: {len(r)} tokens but a mask of {len(mask)}")
            response_mask[i, len(p) : end] = torch.tensor(mask, dtype=torch.float32)
        if gen_lp is not None and response_logprobs is not None:
            gen_lp[i, len(p) : end] = torch.tensor(response_logprobs[i], dtype=torch.float32)
    return TrainBatch(input_ids, attention, response_mask, generation_logprobs=gen_lp)
