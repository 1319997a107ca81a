"""SDPA over packed rows without the quadratic mask: each packed sequence attends on its own.

With ``sdpa``, transformers runs a packed row (position ids restarting at 0, no attention mask) as one
``L x L`` attention under a block-diagonal causal mask: correct, but it computes every block, so a row of
``k`` sequences of length ``l`` costs ``(k l)^2`` instead of ``k l^2``, more than the padding it saves on long
rows (the CPU has no variable-length kernel). ``sdpa_packed`` cuts the row at the restarts and runs causal
SDPA per sequence: the same numbers as the masked computation, at ``k l^2``. On anything that is not a
packed row (padded batches, generation with a cache) it is plain ``sdpa``.

Sliding-window attention (Gemma 3's local layers, Mistral, Qwen2/3 with a window) keeps its window: the
attention modules of those families pass ``sliding_window`` to the attention function, and a sequence longer
than the window runs under a banded causal mask of its own length (``window_mask``); shorter ones, the
common case on a CPU, stay plain causal.

Nor does the model build the ``L x L`` mask it would hand to the attention: for one unpadded row without a
cache (``packed_sdpa_mask``) there is none, since a packed row's sequences bring their own masks and a
single sequence is causal (with its window, if any, built here). transformers builds a packed row's
block-diagonal boolean mask once per mask type and forward, quadratic in the packed row's length.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from rlfleet.utils.intmath import round_up

if TYPE_CHECKING:
    from rlfleet.models.lora import WithoutAdapters

NAME = "sdpa_packed"
# Each sequence's attention runs padded at its end to a multiple of this many tokens. Causal attention
# makes the padding invisible to the real tokens (no query attends to a later key, and the padded queries'
# outputs are dropped, so no gradient flows from them), while the CPU kernels see a short list of lengths:
# PyTorch keeps one compiled brgemm kernel per attention shape for the life of the process (an unbounded
# cache) and oneDNN one matmul primitive per backward shape, so a new length per sequence grew the trainer
# step after step (issue 20: the README's memory section has the measurement).
SEQUENCE_ROUND = 32
# model types whose attention modules pass ``sliding_window`` to the attention function (checked in
# tests/functional/test_packing.py against each family's own masked attention); other windowed models stay
# on plain sdpa
WINDOW_AWARE_MODEL_TYPES = ("gemma3_text", "gemma3", "mistral", "qwen2", "qwen3")


def sequence_bounds(position_ids: torch.Tensor | None, length: int) -> list[tuple[int, int]] | None:
    """``(start, stop)`` of each sequence of one packed row whose positions restart at 0; None when the
    row is not packed (several rows, or a single sequence)."""
    if position_ids is None or position_ids.shape[0] != 1 or position_ids.shape[1] != length:
        return None
    starts = (position_ids[0] == 0).nonzero().flatten().tolist()
    if len(starts) < 2 or starts[0] != 0:
        return None
    return list(zip(starts, [*starts[1:], length], strict=True))


@torch.compiler.disable  # type: ignore[untyped-decorator]
def sdpa_packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, L, D]
    key: torch.Tensor,  # [1, Hkv, L, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``sdpa_attention_forward``, sequence by sequence on a packed row; ``[1, L, H, D]``.

    Never compiled (a compiled decoder layer runs it eagerly, between its compiled halves): the loop over a
    row's sequences depends on the data, so dynamo would trace it anew for each packing, unrolled, with a
    symbolic length per sequence. A GRPO step of 64 Gemma 3 sequences spent over 15 minutes in that trace
    before its first training pass; the kernels it calls are SDPA's either way."""
    bounds = sequence_bounds(position_ids, query.shape[2]) if query.shape[2] == key.shape[2] else None
    window = kwargs.get("sliding_window")
    if bounds is None:
        length = query.shape[2]
        if attention_mask is None and window is not None and length == key.shape[2] and length > window:
            # one unpadded sequence, whose mask packed_sdpa_mask left to this function
            attention_mask, kwargs["is_causal"] = window_mask(length, window, query.device), False
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, position_ids=position_ids, **kwargs
        )
    kwargs.pop("is_causal", None)
    kwargs.pop("sliding_window", None)
    parts = []
    for a, b in bounds:
        width = round_up(b - a, SEQUENCE_ROUND)
        pad = (0, 0, 0, width - (b - a))  # zeros after the sequence's last token
        q, k, v = (F.pad(t[:, :, a:b], pad) for t in (query, key, value))
        mask = window_mask(width, window, query.device) if window is not None and b - a > window else None
        out = sdpa_attention_forward(
            module, q, k, v, mask, dropout, scaling, is_causal=mask is None, **kwargs
        )[0]
        parts.append(out[:, : b - a])  # [1, l, H, D]
    return torch.cat(parts, dim=1), None


def window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, length, length]`` boolean: query ``i`` sees key ``j`` when ``i - window < j <= i``
    (transformers' causal mask and ``sliding_window_overlay``)."""
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    return ((j <= i) & (j > i - window))[None, None]


_SDPA_MASK_ARGS = inspect.signature(sdpa_mask)


def packed_sdpa_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' ``sdpa_mask``, except for one unpadded row without a cache (batch 1, no padding mask,
    queries and keys the same positions from 0), where it is None: ``sdpa_packed_attention`` masks each
    packed sequence itself, and a single sequence is causal, its sliding window applied there."""
    bound = _SDPA_MASK_ARGS.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    one_row = a["batch_size"] == 1 and a["attention_mask"] is None
    if one_row and a["q_offset"] == 0 and a["kv_offset"] == 0 and a["q_length"] == a["kv_length"]:
        return None
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(NAME, sdpa_packed_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, packed_sdpa_mask)


def use_packed_sdpa(model: PreTrainedModel | WithoutAdapters) -> None:
    """Switches a model on ``sdpa`` to ``sdpa_packed`` (for good: recomputation under activation
    checkpointing must see the same attention). Other implementations, and models with an active
    sliding window whose family is not known to pass it to the attention function
    (``WINDOW_AWARE_MODEL_TYPES``), are left as they are."""
    config = model.config
    window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if window and config.model_type not in WINDOW_AWARE_MODEL_TYPES:
        return
    if config._attn_implementation == "sdpa":
        model.set_attn_implementation(NAME)
