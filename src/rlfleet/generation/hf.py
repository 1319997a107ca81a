"""Generation with Hugging Face ``model.generate`` (batched, left-padded, on the trainer's own model)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase

from rlfleet.generation.interface import GenerationResult, SamplingParams
from rlfleet.generation.sampling import SeededRowSampler, row_seeds


class HFGenerationBackend:
    """Samples with ``model.generate``, sharing the policy's module (so refit is a no-op).

    Sampling is batch-invariant (see ``rlfleet.generation.sampling``): row ``i`` of a call seeded with
    ``seed`` draws from its own seed, so splitting the rows over workers gives the same responses.

    Args:
        model: The causal LM; generation runs in eval mode and restores the previous mode.
        tokenizer: Supplies pad/EOS ids and decodes responses.
        batch_size: Prompts per ``generate`` call.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, batch_size: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
            raise ValueError("HF generation needs a tokenizer with eos and pad tokens")

    def refit(self) -> None:
        """Colocated and in-process: the backend already holds the trainer's weights."""

    def take_metrics(self) -> dict[str, float]:
        """One in-process engine: nothing per worker to report."""
        return {}

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int
    ) -> list[GenerationResult]:
        return self.generate_rows(prompts, params, row_seeds(seed, len(prompts)))

    @torch.no_grad()
    def generate_rows(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[GenerationResult]:
        """One response per prompt, row ``i`` sampled from ``seeds[i]`` alone."""
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        was_training = self.model.training
        self.model.eval()
        try:
            results: list[GenerationResult] = []
            for start in range(0, len(prompts), self.batch_size):
                stop = start + self.batch_size
                results.extend(self._generate_batch(prompts[start:stop], params, seeds[start:stop]))
            return results
        finally:
            self.model.train(was_training)

    def _generate_batch(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[GenerationResult]:
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, p in enumerate(prompts):  # left padding
            input_ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            attention[i, width - len(p) :] = 1
        config = GenerationConfig(
            do_sample=False,  # the seeded processor below does the sampling
            max_new_tokens=params.max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            use_cache=True,
            return_dict_in_generate=True,
            output_logits=not params.greedy,
        )
        processors = LogitsProcessorList(
            [] if params.greedy else [SeededRowSampler(seeds, params, prompt_width=width)]
        )
        out = self.model.generate(
            input_ids=input_ids.to(self.model.device),
            attention_mask=attention.to(self.model.device),
            generation_config=config,
            logits_processor=processors,
        )
        new_tokens = out.sequences[:, width:].cpu()  # [B, N]
        logprobs = self._sampler_logprobs(out.logits, new_tokens, params) if not params.greedy else None
        return [self._result(new_tokens[i], logprobs, i, eos) for i in range(len(prompts))]

    @staticmethod
    def _sampler_logprobs(
        logits: tuple[torch.Tensor, ...], tokens: torch.Tensor, params: SamplingParams
    ) -> torch.Tensor:
        stacked = torch.stack(logits, dim=1).float().cpu() / params.temperature  # [B, N, V]
        picked = stacked.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(stacked, dim=-1)  # [B, N]

    def _result(self, row: torch.Tensor, logprobs: torch.Tensor | None, i: int, eos: int) -> GenerationResult:
        ids = row.tolist()
        finished = eos in ids
        length = ids.index(eos) + 1 if finished else len(ids)
        ids = ids[:length]
        lps = tuple(logprobs[i, :length].tolist()) if logprobs is not None else (0.0,) * length
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return GenerationResult(token_ids=tuple(ids), logprobs=lps, text=text, finished=finished)
