"""On a GPU: packed micro-batches give the padded logprobs and gradients, with SDPA (a block-diagonal mask
built from the restarting position ids) and, where flash-attn is installed, FlashAttention-2's
variable-length kernel (transformers derives the sequence boundaries from the same position ids)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from rlfleet.models.loading import ModelSource
from rlfleet.policy.microbatch import MicroBatching
from rlfleet.policy.rank import PolicyRank
from tests.conftest import TEST_OPTIMIZER, pg_loss
from tests.functional.test_packing import LAYOUTS, PADDED, gradients, make_batch

pytestmark = pytest.mark.gpu

ATTENTION = ["sdpa"] + (["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])


def cuda_worker(model_dir: Path, precision: str) -> PolicyRank:
    cuda = torch.device("cuda", torch.cuda.current_device())
    return PolicyRank(
        ModelSource(str(model_dir), precision), TEST_OPTIMIZER, keep_reference=False, device=cuda
    )


def test_packed_logprobs_and_gradients_on_cuda_float32(tiny_model_dir: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    worker = cuda_worker(tiny_model_dir, "float32")
    batch = make_batch(worker)
    want = worker.logprobs(batch, PADDED)
    loss_fn = pg_loss(kl_penalty=0.1)
    want_grads, _ = gradients(worker, batch, loss_fn, PADDED)
    for name, batching in LAYOUTS.items():
        torch.testing.assert_close(worker.logprobs(batch, batching), want, rtol=0, atol=1e-5, msg=name)
        grads, _ = gradients(worker, batch, loss_fn, batching, num_shards=2)
        for key, value in want_grads.items():
            torch.testing.assert_close(grads[key], value, rtol=1e-4, atol=1e-5, msg=f"{name} {key}")


@pytest.mark.parametrize("attention", ATTENTION)
def test_packed_bf16_logprobs_match_padded_ones(tiny_model_dir: Path, attention: str) -> None:
    """bfloat16 compute (FlashAttention needs a 16-bit dtype): packed and padded agree to bf16 precision,
    and packing a row beside others changes nothing beyond that (no attention across sequences)."""
    worker = cuda_worker(tiny_model_dir, "bfloat16")
    worker.model.set_attn_implementation(attention)
    batch = make_batch(worker)
    want = worker.logprobs(batch, MicroBatching(rows=1))  # each row alone: nothing to attend across
    got = worker.logprobs(batch, MicroBatching(rows=8, tokens=256, pack=True))  # all rows in one packed row
    mask = batch.attention_mask.bool()
    assert float((got - want)[mask].abs().max()) < 5e-2
    assert torch.equal(got[~mask], torch.zeros_like(got[~mask]))
