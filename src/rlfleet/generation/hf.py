"""Generation with Hugging Face ``model.generate`` (batched, left-padded): on the trainer's own model in
process, or on a generation worker's own copy (refitted through ``load_buckets``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StoppingCriteria,
    StoppingCriteriaList,
)

from rlfleet.generation.interface import GenerationResult, SamplingParams
from rlfleet.generation.sampling import SeededRowSampler, row_seeds


class HFGenerationBackend:
    """Samples with ``model.generate``, sharing the policy's module (so refit is a no-op).

    Sampling is batch-invariant (see ``rlfleet.generation.sampling``): row ``i`` of a call seeded with
    ``seed`` draws from its own seed, so splitting the rows over workers, or regrouping them, gives the
    same responses. Prompts are batched longest first, so each ``generate`` call pads to a similar width.
    Memory is ``[B, N]`` per call, not ``[B, N, V]``: the sampler records each drawn token's logprob and
    no step's full-vocabulary logits are kept.

    ``SamplingParams`` are the whole sampling spec: the model's own ``generation_config`` (a checkpoint's
    repetition penalty, temperature, suppressed tokens) is ignored, so the sampler sees raw logits.

    Args:
        model: The causal LM; generation runs in eval mode and restores the previous mode.
        tokenizer: Supplies pad/EOS ids and decodes responses.
        batch_size: Prompts per ``generate`` call.
        compute_dtype: Run ``generate`` under ``torch.autocast`` in this dtype (the trainer's compute dtype
            when the model is its float32 master copy); None runs in the model's own dtype.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        batch_size: int,
        *,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.compute_dtype = compute_dtype
        if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
            raise ValueError("HF generation needs a tokenizer with eos and pad tokens")

    def refit(self) -> None:
        """Colocated and in-process: the backend already holds the trainer's weights."""

    @torch.no_grad()
    def load_buckets(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> None:
        """Copies full tensors (checkpoint names) into the model in place, casting to its dtype: how a
        generation worker's own copy is refitted (see ``rlfleet.generation.weights``)."""
        target = self.model.state_dict()
        for bucket in buckets:
            for name, tensor in bucket.items():
                target[name].copy_(tensor)

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
        """One response per prompt, row ``i`` sampled from ``seeds[i]`` alone, in the prompts' order."""
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        was_training = self.model.training
        self.model.eval()
        results: dict[int, GenerationResult] = {}
        try:
            with _without_model_generation_defaults(self.model):
                for rows in length_sorted_batches(prompts, self.batch_size):
                    batch = self._generate_batch([prompts[i] for i in rows], params, [seeds[i] for i in rows])
                    results.update(zip(rows, batch, strict=True))
        finally:
            self.model.train(was_training)
        return [results[i] for i in range(len(prompts))]

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
            return_dict_in_generate=False,
            output_logits=False,  # the sampler records the drawn tokens' logprobs instead
            output_scores=False,
        )
        sampler = None if params.greedy else SeededRowSampler(seeds, params, prompt_width=width)
        stops = StopStrings(self.tokenizer, params.stop_strings, len(prompts), width)
        device = self.model.device
        # A float32 master module shared with the trainer computes in the trainer's compute dtype.
        with torch.autocast(device.type, dtype=self.compute_dtype, enabled=self.compute_dtype is not None):
            # transformers 5 types PreTrainedModel without GenerationMixin; causal LMs have generate
            sequences = self.model.generate(  # type: ignore[operator]
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                generation_config=config,
                logits_processor=LogitsProcessorList([] if sampler is None else [sampler]),
                stopping_criteria=StoppingCriteriaList([stops] if params.stop_strings else []),
            )
        new_tokens = sequences[:, width:].cpu()  # [B, N]
        logprobs = None if sampler is None else sampler.logprobs().cpu()  # [B, N]
        if logprobs is not None and logprobs.shape != new_tokens.shape:
            raise RuntimeError(f"sampler saw {logprobs.shape[1]} steps, generate made {new_tokens.shape[1]}")
        return [self._result(new_tokens[i], logprobs, i, eos, stops.lengths[i]) for i in range(len(prompts))]

    def _result(
        self, row: torch.Tensor, logprobs: torch.Tensor | None, i: int, eos: int, stopped_at: int | None
    ) -> GenerationResult:
        ids = row.tolist()
        ends = [n for n in (ids.index(eos) + 1 if eos in ids else None, stopped_at) if n is not None]
        finished = bool(ends)
        length = min(ends) if ends else len(ids)
        ids = ids[:length]
        lps = tuple(logprobs[i, :length].tolist()) if logprobs is not None else (0.0,) * length
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence decodes to one string
        return GenerationResult(token_ids=tuple(ids), logprobs=lps, text=text, finished=finished)


class StopStrings(StoppingCriteria):
    """Ends each row after the token that completes one of ``stop_strings`` in its new text, and records
    where (``lengths[i]``: the row's new tokens up to and including that one).

    Each step decodes only a tail of the row long enough to hold the longest stop string (every token decodes
    to at least one character, special tokens included), so a check costs the same at every length.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, stop_strings: Sequence[str], rows: int, prompt_width: int
    ) -> None:
        self.tokenizer, self.stop_strings, self.prompt_width = tokenizer, tuple(stop_strings), prompt_width
        self.window = max((len(s) for s in self.stop_strings), default=0) + 1
        self.lengths: list[int | None] = [None] * rows

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: object
    ) -> torch.BoolTensor:
        new = input_ids.shape[1] - self.prompt_width
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if not self.stop_strings:
            return done  # type: ignore[return-value]
        tails = input_ids[:, max(self.prompt_width, input_ids.shape[1] - self.window) :].tolist()
        for i, tail in enumerate(tails):
            if self.lengths[i] is not None:
                done[i] = True
                continue
            text = self.tokenizer.decode(tail[-min(new, self.window) :], skip_special_tokens=False)
            if any(stop in text for stop in self.stop_strings):
                self.lengths[i] = new
                done[i] = True
        return done  # type: ignore[return-value]


def length_sorted_batches(prompts: Sequence[Sequence[int]], batch_size: int) -> list[list[int]]:
    """Row indices grouped into batches of similar prompt length, longest first.

    Similar widths cut left padding; longest first makes a batch too big for memory fail on the first call.
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


@contextmanager
def _without_model_generation_defaults(model: PreTrainedModel) -> Iterator[None]:
    """Hides the model's ``generation_config`` while generating.

    ``generate`` fills every field our config leaves unset from it, and some (``repetition_penalty``,
    ``suppress_tokens``, ``bad_words_ids``...) add logits processors ahead of the sampler: it would then draw
    from, and score, other logits than the ones the trainer computes.
    """
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved
