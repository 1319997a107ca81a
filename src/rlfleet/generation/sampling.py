"""Batch-invariant sampling: each response's random draws depend on its own seed only.

A sampled response must not depend on which other prompts shared its batch, or on which worker generated
it: then one generation worker and two (or a dedicated pool) give the same samples, and a run can be
reproduced across layouts. Each row gets a seed derived from the step seed and the row's index in the
whole step; its uniforms are drawn up front, and each token is picked by inverse-CDF sampling from the
row's filtered distribution (temperature, top-k, top-p).

The sampler also records each drawn token's logprob as it goes, so generation never keeps a step's
full-vocabulary logits: memory stays ``[B, N]`` instead of ``[B, N, V]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LogitsProcessor

from rlfleet.generation.interface import SamplingParams

_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1


def row_seeds(seed: int, count: int, offset: int = 0) -> list[int]:
    """Seeds of rows ``offset .. offset + count - 1`` of a call seeded with ``seed`` (a splitmix64 mix)."""
    out = []
    for row in range(offset, offset + count):
        z = (seed * _MIX + (row + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
        out.append((z ^ (z >> 31)) & _MASK)
    return out


def turn_seed(episode_seed: int, turn: int) -> int:
    """Turn 0 uses the episode's own seed (as a single-turn rollout does); later turns a derived one."""
    return episode_seed if turn == 0 else row_seeds(episode_seed, 1, offset=turn)[0]


def filtered_probs(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[B, V]`` sampling distribution: softmax of ``scaled`` (logits / temperature), top-k/top-p applied."""
    probs = torch.softmax(scaled, dim=-1)
    top_k = params.top_k or 0
    if top_k <= 0 and params.top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if 0 < top_k < probs.shape[-1]:
        keep[:, top_k:] = False
    if params.top_p < 1.0:
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above
        keep &= before < params.top_p  # the first token always stays
    sorted_probs = sorted_probs * keep
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def inverse_cdf_sample(
    probs: torch.Tensor, uniforms: torch.Tensor, *, in_place: bool = False
) -> torch.Tensor:
    """``[B]`` token ids: for each row the first token whose cumulative mass exceeds ``u * total``
    (``in_place``: ``probs`` becomes the cumulative sums, saving a ``[B, V]`` buffer)."""
    cdf = probs.cumsum_(dim=-1) if in_place else probs.cumsum(dim=-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    picked = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return picked.clamp_(max=probs.shape[-1] - 1)


class SeededRowSampler(LogitsProcessor):
    """A logits processor that turns greedy decoding into per-row seeded sampling.

    It replaces the scores with a one-hot (0 at the sampled token, -inf elsewhere), so HF's greedy search
    emits exactly the token this processor drew. It must be the only processor, so that the scores it sees
    are the model's raw logits (see ``HFGenerationBackend``).

    Args:
        seeds: One seed per row of the batch.
        params: Temperature, top-k, top-p and the number of new tokens.
        prompt_width: Width of the (left-padded) prompt block, to know which new token is being drawn.
    """

    def __init__(self, seeds: Sequence[int], params: SamplingParams, prompt_width: int) -> None:
        self.params = params
        self.prompt_width = prompt_width
        draws = [
            torch.rand(params.max_new_tokens, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
            for s in seeds
        ]
        self.uniforms = torch.stack(draws) if draws else torch.empty((0, params.max_new_tokens))
        self._steps: list[torch.Tensor] = []  # per step, [B] logprobs of the drawn tokens
        self._onehot: torch.Tensor | None = None  # the [B, V] scores returned, one buffer for every step

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """Each step sums the probabilities in place and writes the returned scores into one buffer kept for
        every step: with a large vocabulary (Gemma 3's 262k) each fresh ``[B, V]`` block costs page faults,
        on each of hundreds of steps."""
        position = input_ids.shape[1] - self.prompt_width
        scaled = scores.float()
        if self.params.temperature != 1.0:
            scaled = scaled / self.params.temperature  # [B, V], drawn from and scored
        probs = filtered_probs(scaled, self.params)  # a new tensor: summed in place below
        tokens = inverse_cdf_sample(probs, self.uniforms[:, position].to(probs.device), in_place=True)
        self._steps.append(scaled_logprobs(scaled, tokens))
        if self._onehot is None or self._onehot.shape != scores.shape:
            self._onehot = torch.empty_like(scores)
        # generate reads the scores once (its greedy argmax) and keeps none (output_scores=False)
        onehot = self._onehot.fill_(float("-inf")).scatter_(-1, tokens.unsqueeze(-1), 0.0)
        # transformers annotates logits as the legacy FloatTensor class; they are plain float tensors
        return onehot  # type: ignore[return-value]

    def logprobs(self) -> torch.Tensor:
        """``[B, steps]`` logprob of each drawn token, on the scores' device.

        After a row's EOS, HF emits padding instead of the drawn token; those entries are meaningless and
        callers cut each row at its EOS.
        """
        if not self._steps:
            return torch.empty((len(self.uniforms), 0))
        return torch.stack(self._steps, dim=1)


def scaled_logprobs(scaled: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[B]`` logprob of ``tokens`` under ``softmax(scaled)`` over the full vocabulary.

    With ``scaled = logits / temperature``: before top-k/top-p, as the trainer computes it.
    """
    picked = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)
