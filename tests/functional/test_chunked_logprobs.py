"""Chunked logprobs (``policy.logprob_chunk_size``): the same numbers, without the [tokens x vocab] logits.

The chunked path computes each chunk's logprobs from the final hidden states and recomputes the chunk in
the backward. These tests hold its logprobs, losses, gradients and AdamW updates to the whole-logits
computation at tight tolerance in every micro-batch layout (padded, fixed rows, dynamic, packed), with the
KL term, at a sampling temperature, with LoRA (adapters on the output layer too) and under tensor
parallelism on two Ray ranks; and they check what the chunking is for: no tensor as wide as the
vocabulary has more rows than one chunk.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from rlfleet.models.loading import ModelSource
from rlfleet.models.lora import LoraSettings, WithoutAdapters
from rlfleet.models.tiny import create_tiny_model
from rlfleet.policy.logprobs import batch_logprobs, token_logprobs
from rlfleet.policy.microbatch import MicroBatching
from rlfleet.policy.rank import PolicyRank
from tests.conftest import TEST_OPTIMIZER, TEST_SPEC, _arithmetic_corpus, pg_loss
from tests.functional.test_packing import LAYOUTS, PADDED, make_batch, make_worker
from tests.functional.test_skip_inert_rows import assert_same_step, train_on_two_ray_ranks

CHUNK = 5  # smaller than most rows: chunks straddle row boundaries


def chunked(batching: MicroBatching, chunk: int = CHUNK) -> MicroBatching:
    return replace(batching, logprob_chunk=chunk)


def weights(worker: PolicyRank) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in worker.model.named_parameters()}


def _ids(model: Any, rows: int = 3, width: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, model.config.vocab_size, (rows, width), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # a right-padded row
    return ids, mask


@pytest.mark.parametrize("chunk", [1, 4, CHUNK, 30, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_gradients_equal_the_whole_logits(
    tiny_model_dir: Path, chunk: int, temperature: float
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    ids, mask = _ids(model)
    weight = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    results = []
    for c in (None, chunk):
        model.zero_grad()
        lp = token_logprobs(model, ids, mask, temperature, c)
        (lp * weight * mask).sum().backward()
        results.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    assert got.shape == want.shape and torch.all(got[:, 0] == 0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("kl_penalty", [0.0, 0.05], ids=["no-kl", "kl"])
@pytest.mark.parametrize("layout", ["padded", *sorted(LAYOUTS)])
def test_the_update_is_the_same_in_every_layout(tiny_model_dir: Path, layout: str, kl_penalty: float) -> None:
    batching = PADDED if layout == "padded" else LAYOUTS[layout]
    whole, chunks = make_worker(tiny_model_dir), make_worker(tiny_model_dir)
    batch = make_batch(whole)
    loss_fn = pg_loss(kl_penalty=kl_penalty)
    want = whole.train(batch, loss_fn, global_batch_size=4, micro_batching=batching, temperature=0.8)
    got = chunks.train(batch, loss_fn, global_batch_size=4, micro_batching=chunked(batching), temperature=0.8)
    for key in ("loss", "grad_norm", "ratio", "kl_penalty"):
        if key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    theirs = weights(whole)
    for name, p in weights(chunks).items():  # two AdamW steps: see test_packing for the tolerance
        torch.testing.assert_close(p, theirs[name], rtol=0, atol=2e-5, msg=name)
    # the logprob pass of the updated weights, in the same layout
    lp_whole = batch_logprobs(whole.model, batch, batching, temperature=0.8)
    lp_chunks = batch_logprobs(chunks.model, batch, chunked(batching), temperature=0.8)
    torch.testing.assert_close(lp_chunks, lp_whole, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def untied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its own output layer (not tied to the embedding), so LoRA can adapt it."""
    spec = replace(TEST_SPEC, tie_word_embeddings=False)
    return create_tiny_model(tmp_path_factory.mktemp("untied") / "model", _arithmetic_corpus(), spec, seed=0)


def _lora_worker(model_dir: Path) -> PolicyRank:
    torch.manual_seed(0)
    settings = LoraSettings(dim=4, alpha=8.0, match_all_linear=True)  # lm_head included: it is untied
    worker = PolicyRank(ModelSource(str(model_dir)), TEST_OPTIMIZER, keep_reference=True, lora=settings)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # trained adapters: they change the output
        for name, p in worker.model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return worker


def test_lora_with_an_adapted_output_layer_and_its_reference(untied_model_dir: Path) -> None:
    whole, chunks = _lora_worker(untied_model_dir), _lora_worker(untied_model_dir)
    assert any(name.startswith("lm_head.") and "lora_" in name for name, _ in whole.model.named_parameters())
    batch = make_batch(whole)
    batching = LAYOUTS["packed"]
    # the reference is the policy with its adapters off
    assert isinstance(whole.reference, WithoutAdapters)
    ref_whole = batch_logprobs(whole.reference, batch, batching, temperature=1.0)
    ref_chunks = batch_logprobs(chunks.reference, batch, chunked(batching), temperature=1.0)
    torch.testing.assert_close(ref_chunks, ref_whole, rtol=0, atol=1e-6)
    assert not torch.allclose(ref_whole, batch_logprobs(whole.model, batch, batching, temperature=1.0))
    loss_fn = pg_loss(kl_penalty=0.05)
    want = whole.train(batch, loss_fn, global_batch_size=8, micro_batching=batching)
    got = chunks.train(batch, loss_fn, global_batch_size=8, micro_batching=chunked(batching))
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    theirs = weights(whole)
    for name, p in weights(chunks).items():
        torch.testing.assert_close(p, theirs[name], rtol=0, atol=2e-5, msg=name)


class WidestVocabTensor(TorchDispatchMode):
    """Records the most rows of any tensor produced with the vocabulary as its last dimension, except the
    output layer's weight seen transposed (``[hidden, vocab]``, which a linear layer computes with)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab, self.weight_t, self.rows = vocab, (hidden, vocab), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            wide = isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab
            if wide and tuple(t.shape) != self.weight_t:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("chunk", [None, 4])
def test_no_vocabulary_wide_tensor_exceeds_one_chunk(tiny_model_dir: Path, chunk: int | None) -> None:
    """What the chunking is for, forward and backward: the widest [rows x vocab] tensor has a chunk's rows."""
    worker = make_worker(tiny_model_dir)
    batch = make_batch(worker)
    vocab = worker.model.config.vocab_size
    tokens = int(batch.attention_mask.sum())
    batching = LAYOUTS["packed"] if chunk is None else chunked(LAYOUTS["packed"], chunk)
    with WidestVocabTensor(vocab, worker.model.config.hidden_size) as probe:
        worker.train(batch, pg_loss(), global_batch_size=8, micro_batching=batching)
    if chunk is None:
        assert probe.rows >= 12  # a packed micro-batch's logits: many rows at once
    else:
        assert 0 < probe.rows <= chunk
    assert tokens > 4 * 8


def test_a_model_that_transforms_its_logits_is_refused() -> None:
    """Gemma 2 soft-caps its logits after the output layer: chunking would skip that, so it is refused."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        final_logit_softcapping=30.0,
    )
    model = Gemma2ForCausalLM(config)
    ids = torch.randint(0, 64, (2, 6))
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM transforms.*policy\.logprob_chunk_size=null"):
        token_logprobs(model, ids, torch.ones_like(ids), 1.0, chunk=4)
    head = model.get_output_embeddings()
    assert model.lm_head is head  # the output layer is back in place after the refusal
    model.config.final_logit_softcapping = None
    torch.testing.assert_close(
        token_logprobs(model, ids, torch.ones_like(ids), 1.0, chunk=4),
        token_logprobs(model, ids, torch.ones_like(ids), 1.0),
        rtol=0,
        atol=1e-6,
    )


def test_the_recipe_key_reaches_both_passes() -> None:
    from rlfleet.algorithms.grpo.describe import describe_grpo
    from rlfleet.config.batching import recipe_batching
    from rlfleet.config.loader import load_recipe, resolve_recipe_path
    from rlfleet.runtime.components import micro_batching

    for extra in ([], ["policy.sequence_packing.enabled=false", "policy.dynamic_batching.enabled=true"]):
        cfg = load_recipe(
            resolve_recipe_path("grpo-smollm2-135m-arithmetic-cpu"), ["policy.logprob_chunk_size=512", *extra]
        )
        assert micro_batching(cfg, "train", recipe_batching(cfg.policy)).logprob_chunk == 512
        assert micro_batching(cfg, "logprob", recipe_batching(cfg.policy)).logprob_chunk == 512
        assert "in chunks of 512 tokens" in dict(describe_grpo(cfg))["micro-batches"]
    cfg = load_recipe(
        resolve_recipe_path("grpo-smollm2-135m-arithmetic-cpu"), ["policy.logprob_chunk_size=null"]
    )
    assert micro_batching(cfg, "train", recipe_batching(cfg.policy)).logprob_chunk is None
    with pytest.raises(ValueError, match="positive"):
        MicroBatching(rows=2, logprob_chunk=0)


@pytest.mark.slow
def test_tensor_parallel_ranks_with_chunks_equal_one_process(
    ray_cluster: None, tiny_tp_model_dir: Path
) -> None:
    """Two tensor-parallel ranks (Ray, FSDP2 over a (1, 2) mesh) computing logprobs in chunks train as one
    process computing whole logits."""
    single = make_worker(tiny_tp_model_dir)
    batch = make_batch(single)
    loss_fn = pg_loss(kl_penalty=0.05)
    want = single.train(batch, loss_fn, global_batch_size=8, micro_batching=MicroBatching(rows=4))
    batching = MicroBatching(rows=4, logprob_chunk=CHUNK)
    got, state = train_on_two_ray_ranks(tiny_tp_model_dir, 2, batch, loss_fn, batching)
    assert_same_step(got, state, want, single)
