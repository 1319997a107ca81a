"""``policy.torch_compile``: the compiled decoder layers compute what the eager ones do.

Both workers load the same tiny model in bfloat16 compute (float32 masters), with activation checkpointing
and sequence packing as the CPU fast path runs them; the compiled one must give the eager one's logprobs, loss
and gradients within bfloat16's rounding, on two packings of different lengths (dynamic shapes), and report
its compile time. One test: compiling is the expensive part, so it is paid once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlfleet.models.loading import ModelSource
from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.compile import CACHE_ENV, compile_cache_dir, compile_seconds
from rlfleet.policy.microbatch import (
    MicroBatching,
    plan_trained_micro_batches,
    row_lengths,
    step_counts,
    step_normalizer,
    trained_rows,
)
from rlfleet.policy.rank import PolicyRank
from tests.conftest import TEST_OPTIMIZER, pg_loss, worker_batch

PACKED = MicroBatching(rows=4, tokens=64, pack=True)
# bfloat16 keeps 8 bits of mantissa (relative rounding 2^-8 = 0.4%); the compiled kernels round at other
# points (a fused kernel keeps float32 where eager rounds each op's output to bfloat16)
BF16_TOLERANCE = {"rtol": 3e-2, "atol": 3e-3}


def _gradients(worker: PolicyRank, batch: TrainBatch) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """The loss metrics and every parameter's gradient of one packed training pass over ``batch``."""
    plan = plan_trained_micro_batches(row_lengths(batch), trained_rows(batch), PACKED)[0]
    norm = step_normalizer(step_counts(batch))
    worker.model.train()
    metrics = worker._accumulate(batch, pg_loss(kl_penalty=0.1), norm, plan, PACKED, 1.0)
    grads = {n: p.grad.detach().clone() for n, p in worker.model.named_parameters() if p.grad is not None}
    worker.optimizer.zero_grad(set_to_none=True)
    return metrics, grads


def test_compiled_layers_give_the_eager_logprobs_loss_and_gradients(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLFLEET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(CACHE_ENV, raising=False)  # set again (to rlfleet's cache) by compile_layers
    source = ModelSource(str(tiny_model_dir), "bfloat16")
    kwargs = {"keep_reference": True, "activation_checkpointing": True}
    eager = PolicyRank(source, TEST_OPTIMIZER, **kwargs)
    before = compile_seconds()
    compiled = PolicyRank(source, TEST_OPTIMIZER, torch_compile=True, **kwargs)
    assert compiled.compiled and not eager.compiled
    assert compile_cache_dir() == tmp_path / "cache" / "inductor"

    first = worker_batch(eager, noise=0.05)
    longer = first.select(0, 2)  # another packing: two rows, another length
    for batch in (first, longer):
        for reference in (False, True):
            torch.testing.assert_close(
                compiled.logprobs(batch, PACKED, reference=reference),
                eager.logprobs(batch, PACKED, reference=reference),
                **BF16_TOLERANCE,
            )
        (eager_metrics, eager_grads), (metrics, grads) = _gradients(eager, batch), _gradients(compiled, batch)
        assert eager_grads.keys() == grads.keys() and len(grads) == len(list(eager.model.parameters()))
        assert metrics["loss"] == pytest.approx(eager_metrics["loss"], rel=3e-2, abs=1e-3)
        for name, grad in grads.items():
            assert grad.abs().sum() > 0, name
            torch.testing.assert_close(grad, eager_grads[name], **BF16_TOLERANCE, msg=name)

    assert compile_seconds() > before  # the compiled worker compiled (and the eager one did not need to)
    # packings never seen (other sequence counts and bounds) compile nothing more: the packed attention's loop
    # over a row's sequences runs eagerly between a layer's compiled halves (traced, it compiled anew for each
    # packing, unrolled: 64 Gemma 3 sequences took over 15 minutes)
    spent = compile_seconds()
    for batch in (first.select(1, 4), first.take([3, 0, 2])):
        compiled.logprobs(batch, PACKED)
        _gradients(compiled, batch)
    assert compile_seconds() == spent
    assert any((tmp_path / "cache" / "inductor").iterdir())  # inductor wrote its cache where rlfleet said
    # HF generation on the policy's own module (the hf backend) runs the layers eagerly: a KV cache whose
    # state changes every decoding step would recompile them; the same tokens, nothing compiled
    spent = compile_seconds()
    prompt = first.input_ids[:1, :5]
    with torch.no_grad(), compiled._compute():
        tokens = compiled.model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    with torch.no_grad(), eager._compute():
        want = eager.model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    assert tokens.shape == (1, 11) and torch.equal(tokens, want)
    assert compile_seconds() == spent

    report = compiled.train(first, pg_loss(), global_batch_size=4, micro_batching=PACKED)
    assert report["compile_s"] == pytest.approx(compile_seconds())
    assert "compile_s" not in eager.train(first, pg_loss(), global_batch_size=4, micro_batching=PACKED)
