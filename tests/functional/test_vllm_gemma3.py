"""Gemma 3's own paths through the vLLM engine and the trainer, on a tiny Gemma 3 built from a config: five
sliding-window layers to one global layer (the 5:1 pattern of every Gemma 3), a window shorter than the
sequences, local and global rotary bases, tied embeddings scaled by sqrt(hidden), ``<bos>`` first. The
engine gets the trainer's weights as a refit gives them; what it samples and the logprobs it reports must be
the trainer's (what GRPO's importance ratio and ``train/gen_logprob_error`` rest on), in padded and packed
layouts, and a change of the tied embedding must reach the engine's output layer too.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedTokenizerBase

pytest.importorskip("vllm")

from rlfleet.generation import HFGenerationBackend
from rlfleet.generation.interface import GenerationResult, SamplingParams
from rlfleet.generation.vllm import VLLMGenerationBackend, VLLMSettings
from rlfleet.generation.weights import buckets, engine_state
from rlfleet.models.tiny import train_tokenizer
from rlfleet.policy.batch import collate
from rlfleet.policy.logprobs import forward_logprobs
from rlfleet.policy.microbatch import MicroBatching
from rlfleet.policy.packed_attention import use_packed_sdpa
from tests.conftest import _arithmetic_corpus

pytestmark = pytest.mark.slow

WINDOW = 8  # tokens; every prompt below is longer, and so is what it generates
LAYER_TYPES = [*["sliding_attention"] * 5, "full_attention"]
PADDED = MicroBatching(rows=8)
PACKED = MicroBatching(rows=8, tokens=512, pack=True)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return train_tokenizer(_arithmetic_corpus(), 320)


@pytest.fixture(scope="module")
def model(tokenizer: PreTrainedTokenizerBase) -> Gemma3ForCausalLM:
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,  # the narrowest vLLM's CPU attention takes
        query_pre_attn_scalar=32,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )
    config.architectures = ["Gemma3ForCausalLM"]  # as a saved checkpoint names it: vLLM picks its class so
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # logits wide enough that a wrong window or rotary base shows in the samples
        model.get_input_embeddings().weight.normal_(0.0, 0.1)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return model


@pytest.fixture(scope="module")
def engine(model: Gemma3ForCausalLM, tokenizer: PreTrainedTokenizerBase) -> Iterator[VLLMGenerationBackend]:
    settings = VLLMSettings(precision="float32", max_model_len=128, seed=0, enforce_eager=True)
    backend = VLLMGenerationBackend.receiving(model.config, tokenizer, settings)
    try:
        backend.load_buckets(buckets(engine_state(model), torch.float32))
        yield backend
    finally:
        backend.close()


@pytest.fixture(scope="module")
def prompts(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    texts = ["What is 31 + 48 - 17?", "Tom has 53 apples and eats 21 of them.", "Add 12 and 9, then 40."]
    bos = tokenizer.bos_token_id
    encoded = [[bos, *tokenizer(t, add_special_tokens=False)["input_ids"]] for t in texts]
    assert all(len(p) > WINDOW for p in encoded)
    return encoded


def _trainer_logprobs(
    model: Gemma3ForCausalLM,
    prompts: list[list[int]],
    results: list[GenerationResult],
    batching: MicroBatching,
    temperature: float,
    pad: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch = collate(prompts, [r.token_ids for r in results], pad, [r.logprobs for r in results])
    with torch.no_grad():
        trainer = forward_logprobs(model, batch, batching, temperature)
    assert batch.generation_logprobs is not None
    return trainer, batch.generation_logprobs, batch.response_mask.bool()


def test_greedy_samples_equal_the_trainers_own_generation(
    engine: VLLMGenerationBackend,
    model: Gemma3ForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
) -> None:
    greedy = SamplingParams(max_new_tokens=24, greedy=True)
    want = HFGenerationBackend(model, tokenizer, batch_size=8).generate(prompts, greedy, seed=1)
    got = engine.generate(prompts, greedy, seed=1)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert max(len(p) + len(r.token_ids) for p, r in zip(prompts, got, strict=True)) > 2 * WINDOW


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_sampled_logprobs_are_the_trainers_beyond_the_window(
    engine: VLLMGenerationBackend,
    model: Gemma3ForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    layout: str,
) -> None:
    """At the recipes' temperature the engine's logprob of each sampled token is the trainer's (the
    padded rows under transformers' own sliding-window masks, or one packed row under rlfleet's): the
    importance ratio between them is 1 up to rounding."""
    sampled = SamplingParams(max_new_tokens=24, temperature=0.7)
    results = engine.generate(prompts, sampled, seed=3)
    scoring = Gemma3ForCausalLM(copy.deepcopy(model.config)).eval()  # a copy: its window changes below
    scoring.load_state_dict(model.state_dict())
    if layout == "packed":
        use_packed_sdpa(scoring)
    batching = PACKED if layout == "packed" else PADDED
    trainer, generated, mask = _trainer_logprobs(
        scoring, prompts, results, batching, 0.7, tokenizer.pad_token_id
    )
    assert mask.sum() > 3 * WINDOW
    assert float((trainer - generated).abs()[mask].max()) < 1e-4
    # the window is what the engine computes: without it the trainer would score another model
    scoring.config.sliding_window = 256
    for layer in scoring.model.layers:
        if layer.self_attn.sliding_window is not None:
            layer.self_attn.sliding_window = 256
    wide = _trainer_logprobs(scoring, prompts, results, batching, 0.7, tokenizer.pad_token_id)[0]
    assert float((wide - generated).abs()[mask].max()) > 1e-3


def test_a_refit_of_the_tied_embedding_reaches_the_engines_output_layer(
    engine: VLLMGenerationBackend,
    model: Gemma3ForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
) -> None:
    """Gemma's output layer is its input embedding (scaled by sqrt(hidden) on the way in only): changed in
    the trainer, the engine's next logprobs are the changed trainer's, in and out."""
    saved = model.get_input_embeddings().weight.detach().clone()
    sampled = SamplingParams(max_new_tokens=16, temperature=0.7)
    pad = tokenizer.pad_token_id
    try:
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(1.5)
        engine.load_buckets(buckets(engine_state(model), torch.float32))
        results = engine.generate(prompts, sampled, seed=5)
        trainer, generated, mask = _trainer_logprobs(model, prompts, results, PADDED, 0.7, pad)
        assert float((trainer - generated).abs()[mask].max()) < 1e-4
    finally:
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(saved)
        engine.load_buckets(buckets(engine_state(model), torch.float32))
