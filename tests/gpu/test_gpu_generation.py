"""On a GPU: the HF generation backend samples on CUDA, returns well-formed responses, and reproduces them
from the per-row seeds (same seed: same responses; another batch split: the same rows, in float32)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rlfleet.generation import GenerationResult, HFGenerationBackend, SamplingParams

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(max_new_tokens=24, temperature=1.0)


def load_on_cuda(model_dir: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    model = AutoModelForCausalLM.from_pretrained(model_dir).to("cuda", dtype)
    return model, AutoTokenizer.from_pretrained(model_dir)


def prompts(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Eight prompts of different lengths (so rows are left-padded differently)."""
    texts = [
        f"What is {a} + {b}?" + " Think." * (a % 3) for a, b in zip(range(1, 9), range(9, 1, -1), strict=True)
    ]
    return [tokenizer(t)["input_ids"] for t in texts]


def assert_well_formed(
    result: GenerationResult, tokenizer: PreTrainedTokenizerBase, vocab_size: int, params: SamplingParams
) -> None:
    ids = result.token_ids
    assert 0 < len(ids) <= params.max_new_tokens
    assert len(result.logprobs) == len(ids)
    assert all(0 <= t < vocab_size for t in ids)
    assert result.finished == (ids[-1] == tokenizer.eos_token_id)
    assert tokenizer.eos_token_id not in ids[:-1]  # nothing after EOS
    if not result.finished:
        assert len(ids) == params.max_new_tokens
    assert all(math.isfinite(lp) and lp <= 1e-6 for lp in result.logprobs)
    assert result.text == tokenizer.decode(list(ids), skip_special_tokens=True)


def test_hf_backend_on_cuda_is_well_formed_and_seed_reproducible(tiny_model_dir: Path) -> None:
    model, tokenizer = load_on_cuda(tiny_model_dir, torch.bfloat16)
    assert model.device.type == "cuda"
    backend = HFGenerationBackend(model, tokenizer, batch_size=8)
    rows = prompts(tokenizer)
    first = backend.generate(rows, PARAMS, seed=11)
    assert len(first) == len(rows)
    for result in first:
        assert_well_formed(result, tokenizer, model.config.vocab_size, PARAMS)
    again = backend.generate(rows, PARAMS, seed=11)
    assert [r.token_ids for r in again] == [r.token_ids for r in first]
    other = backend.generate(rows, PARAMS, seed=12)
    assert [r.token_ids for r in other] != [r.token_ids for r in first]


def test_rows_do_not_depend_on_the_batch_split_on_cuda(tiny_model_dir: Path) -> None:
    model, tokenizer = load_on_cuda(tiny_model_dir, torch.float32)
    rows = prompts(tokenizer)
    whole = HFGenerationBackend(model, tokenizer, batch_size=8).generate(rows, PARAMS, seed=5)
    split = HFGenerationBackend(model, tokenizer, batch_size=3).generate(rows, PARAMS, seed=5)
    assert [r.token_ids for r in split] == [r.token_ids for r in whole]
    for a, b in zip(whole, split, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
