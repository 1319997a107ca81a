"""The HF generation backend: the sampler's logprobs, raw logits, length-sorted batches, batch invariance."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, LogitsProcessorList

import rlfleet.generation.hf as hf
from rlfleet.generation import HFGenerationBackend, SamplingParams
from rlfleet.generation.hf import length_sorted_batches
from rlfleet.generation.sampling import SeededRowSampler, row_seeds

PAD, EOS, VOCAB = 0, 1, 64  # a small vocabulary, so some rows sample EOS and stop early
PARAMS = SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=20)


class StubTokenizer:
    """What the backend needs from a tokenizer: pad and EOS ids, and ``decode``."""

    pad_token_id = PAD
    eos_token_id = EOS

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i in (PAD, EOS)))


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        initializer_range=0.5,  # peaked distributions, so top-k/top-p cut something
    )
    return LlamaForCausalLM(config).eval()


def make_prompts(lengths: Sequence[int]) -> list[list[int]]:
    return [[2 + (7 * row + j) % (VOCAB - 2) for j in range(n)] for row, n in enumerate(lengths)]


def old_generate(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    seeds: list[int],
    sampler_class: type[SeededRowSampler] = SeededRowSampler,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """The backend before issue 9: keeps every step's raw logits and scores the drawn tokens from them.

    Returns ``[B, N]`` new tokens, ``[B, N]`` logprobs and the ``N`` raw ``[B, V]`` logits.
    """
    width = max(map(len, prompts))
    input_ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    attention = (input_ids != PAD).long()
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=PARAMS.max_new_tokens,
        eos_token_id=EOS,
        pad_token_id=PAD,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=True,
    )
    sampler = sampler_class(seeds, PARAMS, prompt_width=width)
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            generation_config=config,
            logits_processor=LogitsProcessorList([sampler]),
        )
    tokens = out.sequences[:, width:]
    stacked = torch.stack(out.logits, dim=1).float() / PARAMS.temperature  # [B, N, V]
    picked = stacked.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, picked - torch.logsumexp(stacked, dim=-1), out.logits


LENGTHS = [9, 7, 7, 5, 3, 2]  # longest first, so the backend's one batch is this one, row for row


def test_logprobs_equal_the_old_stacked_logits_computation(model: LlamaForCausalLM) -> None:
    prompts, seeds = make_prompts(LENGTHS), row_seeds(3, len(LENGTHS))
    tokens, logprobs, _ = old_generate(model, prompts, seeds)
    results = HFGenerationBackend(model, StubTokenizer(), batch_size=8).generate(prompts, PARAMS, seed=3)
    assert any(r.finished for r in results) and not all(r.finished for r in results)
    for i, r in enumerate(results):
        n = len(r.token_ids)
        assert list(r.token_ids) == tokens[i, :n].tolist()
        assert torch.equal(torch.tensor(r.logprobs), logprobs[i, :n])  # bit for bit


class ScoreSpy(SeededRowSampler):
    """Records the scores the sampler receives."""

    seen: ClassVar[list[torch.Tensor]] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        ScoreSpy.seen.append(scores.clone())
        return super().__call__(input_ids, scores)


def test_sampler_gets_raw_logits_whatever_the_model_generation_config_says(
    model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts, seeds = make_prompts(LENGTHS), row_seeds(3, len(LENGTHS))
    _, _, raw_logits = old_generate(model, prompts, seeds)
    checkpoint_defaults = GenerationConfig(
        do_sample=True,
        temperature=0.3,
        top_k=3,
        repetition_penalty=1.5,
        no_repeat_ngram_size=2,
        suppress_tokens=[5],
    )
    monkeypatch.setattr(model, "generation_config", checkpoint_defaults)
    ScoreSpy.seen = []
    old_generate(model, prompts, seeds, ScoreSpy)  # control: through plain `generate` they reach the sampler
    assert not torch.equal(ScoreSpy.seen[0], raw_logits[0])

    monkeypatch.setattr(hf, "SeededRowSampler", ScoreSpy)
    ScoreSpy.seen = []
    HFGenerationBackend(model, StubTokenizer(), batch_size=8).generate(prompts, PARAMS, seed=3)
    assert len(ScoreSpy.seen) == len(raw_logits)
    assert all(torch.equal(a, b) for a, b in zip(ScoreSpy.seen, raw_logits, strict=True))
    assert model.generation_config is checkpoint_defaults  # restored


def test_length_sorted_batches_longest_first_ties_in_order() -> None:
    prompts = make_prompts([3, 7, 5, 7, 1])
    assert length_sorted_batches(prompts, 2) == [[1, 3], [2, 0], [4]]
    assert length_sorted_batches([], 2) == []


def test_each_row_keeps_its_response_however_rows_are_grouped(model: LlamaForCausalLM) -> None:
    prompts = make_prompts([4, 9, 2, 6, 9, 3, 5])
    seeds = row_seeds(11, len(prompts))

    def responses(batch_size: int, order: list[int]) -> dict[int, tuple[tuple[int, ...], tuple[float, ...]]]:
        backend = HFGenerationBackend(model, StubTokenizer(), batch_size)
        out = backend.generate_rows([prompts[i] for i in order], PARAMS, [seeds[i] for i in order])
        return {row: (r.token_ids, r.logprobs) for row, r in zip(order, out, strict=True)}

    rows = list(range(len(prompts)))
    reference = responses(len(prompts), rows)
    for batch_size, order in ((1, rows), (2, rows), (3, [5, 0, 6, 2, 1, 4, 3])):
        got = responses(batch_size, order)
        for row in rows:
            assert got[row][0] == reference[row][0], (batch_size, row)
            # the same tokens; logprobs to float32 noise (padding width changes the attention sums:
            # 1.4e-5 apart with transformers 5.19)
            torch.testing.assert_close(
                torch.tensor(got[row][1]), torch.tensor(reference[row][1]), atol=1e-4, rtol=1e-5
            )


def test_greedy_gives_zero_logprobs_and_restores_training_mode(model: LlamaForCausalLM) -> None:
    backend = HFGenerationBackend(model, StubTokenizer(), batch_size=4)
    prompts = make_prompts([5, 2, 8])
    greedy = SamplingParams(max_new_tokens=6, greedy=True)
    model.train()
    try:
        first = backend.generate(prompts, greedy, seed=0)
        assert model.training
    finally:
        model.eval()
    assert backend.generate(prompts, greedy, seed=1) == first
    assert all(r.logprobs == (0.0,) * len(r.token_ids) for r in first)
