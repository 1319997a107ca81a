"""Dynamic batching and sequence packing change the layout, not the numbers: per-token logprobs, the loss,
its metrics and the gradients equal the padded computation (float32 at tight tolerance, float64 to rounding),
with the global token normalisation across micro-batches and across (simulated) data-parallel ranks, with a
separate ``prev`` pass or ``prev`` from the training forward, with reference logprobs and a KL penalty."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlfleet.models.loading import ModelSource
from rlfleet.policy.batch import TrainBatch, collate
from rlfleet.policy.logprobs import batch_logprobs, forward_logprobs
from rlfleet.policy.loss_functions import NLLLossFn
from rlfleet.policy.loss_math import Normalizer
from rlfleet.policy.microbatch import MicroBatching, plan_micro_batches, row_lengths
from rlfleet.policy.rank import LossFn, PolicyRank
from tests.conftest import TEST_OPTIMIZER, pg_loss

PADDED = MicroBatching(rows=8)  # one micro-batch of every row: the padded computation
LAYOUTS = {
    "rows": MicroBatching(rows=3),
    "dynamic": MicroBatching(rows=3, tokens=48, round_to=8),
    "packed": MicroBatching(rows=3, tokens=40, pack=True),
    "packed_concat": MicroBatching(rows=3, tokens=40, pack=True, algorithm="concatenative"),
}
PROMPT_LENGTHS = (5, 3, 9, 4, 2, 7, 6, 3)
RESPONSE_LENGTHS = (4, 12, 2, 5, 8, 1, 9, 3)


def make_worker(model_dir: Path) -> PolicyRank:
    return PolicyRank(ModelSource(str(model_dir)), TEST_OPTIMIZER, keep_reference=False)


def make_batch(worker: PolicyRank) -> TrainBatch:
    """Eight rows of mixed lengths with advantages, perturbed old and reference logprobs."""
    gen = torch.Generator().manual_seed(0)
    vocab = worker.tokenizer.vocab_size
    prompts = [torch.randint(3, vocab - 1, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    responses = [torch.randint(3, vocab - 1, (n,), generator=gen).tolist() for n in RESPONSE_LENGTHS]
    batch = collate(prompts, responses, pad_token_id=0)
    lp = worker.logprobs(batch, PADDED)
    noise = 0.1 * torch.randn(lp.shape, generator=gen) * batch.response_mask
    return batch.with_(
        advantages=torch.randn(len(batch), generator=gen), prev_logprobs=lp + noise, ref_logprobs=lp - noise
    )


def gradients(
    worker: PolicyRank, batch: TrainBatch, loss_fn: LossFn, batching: MicroBatching, num_shards: int = 1
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Gradients and metrics of one accumulation over ``batch``, split over ``num_shards`` simulated ranks
    that each normalise by the global counts and whose gradients and metrics are then summed (the
    all-reduce)."""
    norm = Normalizer(num_tokens=float(batch.response_mask.sum()), num_sequences=float(len(batch)))
    share = len(batch) // num_shards
    grads: dict[str, torch.Tensor] = {}
    metrics: dict[str, float] = {}
    worker.model.train()
    for shard, plan in enumerate(plan_micro_batches(row_lengths(batch), batching, num_shards)):
        mine = batch.select(shard * share, (shard + 1) * share)
        for key, value in worker._accumulate(mine, loss_fn, norm, plan, batching, 1.0).items():
            metrics[key] = metrics.get(key, 0.0) + value
        for name, p in worker.model.named_parameters():
            grads[name] = grads.get(name, 0.0) + p.grad.detach().clone()
    return grads, metrics


def assert_same(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float, atol: float
) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=name)


@pytest.fixture(scope="module")
def worker(tiny_model_dir: Path) -> PolicyRank:
    return make_worker(tiny_model_dir)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])  # packing turns sdpa into sdpa_packed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_logprobs_equal_the_padded_ones_in_batch_order(
    worker: PolicyRank, layout: str, attention: str
) -> None:
    worker.model.set_attn_implementation(attention)
    try:
        batch = make_batch(worker)
        want = worker.logprobs(batch, PADDED)
        got = worker.logprobs(batch, LAYOUTS[layout])
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
        expected = {"sdpa": "sdpa_packed" if LAYOUTS[layout].pack else "sdpa", "eager": "eager"}[attention]
        assert worker.model.config._attn_implementation == expected
        # two simulated ranks, each its contiguous half, as many forward passes each
        halves = [batch_logprobs(worker.model, batch, LAYOUTS[layout], 1.0, 2, s) for s in (0, 1)]
        torch.testing.assert_close(torch.cat(halves), want, rtol=0, atol=2e-6)
    finally:
        worker.model.set_attn_implementation("sdpa")


LOSSES = {
    "pg_kl_token": (pg_loss(kl_penalty=0.1), False),
    "pg_sequence_level": (replace(pg_loss(kl_penalty=0.1), token_level=False), False),
    "pg_prev_from_training_forward": (
        replace(pg_loss(kl_penalty=0.1), prev_from_training_forward=True),
        True,
    ),
    "nll": (NLLLossFn(), False),
}


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_loss_and_gradients_equal_the_padded_ones(worker: PolicyRank, loss: str) -> None:
    """Over two simulated ranks (each its half of the rows, its own micro-batch plan, the global counts)
    against one process computing every row in one padded micro-batch."""
    loss_fn, prev_from_forward = LOSSES[loss]
    batch = make_batch(worker)
    if prev_from_forward:
        batch = batch.with_(prev_logprobs=None)
    want_grads, want_metrics = gradients(worker, batch, loss_fn, PADDED)
    for layout, batching in LAYOUTS.items():
        grads, metrics = gradients(worker, batch, loss_fn, batching, num_shards=2)
        assert metrics.keys() == want_metrics.keys()
        for key, value in want_metrics.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (layout, key)
        assert_same(grads, want_grads, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_float64_layouts_agree_to_rounding(tiny_model_dir: Path) -> None:
    worker = make_worker(tiny_model_dir)
    batch = make_batch(worker)
    worker.model.double()
    batch = batch.with_(prev_logprobs=batch.prev_logprobs.double(), ref_logprobs=batch.ref_logprobs.double())
    with torch.no_grad():
        want = forward_logprobs(worker.model, batch, PADDED, 1.0)
        for batching in LAYOUTS.values():
            plan = plan_micro_batches(row_lengths(batch), batching)[0]
            got = torch.zeros_like(want)
            for rows in plan:
                lp = forward_logprobs(worker.model, batch.take(rows), batching, 1.0)
                got[rows, : lp.shape[1]] = lp
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    loss_fn = pg_loss(kl_penalty=0.1)
    want_grads, _ = gradients(worker, batch, loss_fn, PADDED)
    for batching in LAYOUTS.values():
        assert_same(gradients(worker, batch, loss_fn, batching, 2)[0], want_grads, rtol=1e-10, atol=1e-12)


def test_a_packed_training_step_equals_the_padded_one(tiny_model_dir: Path) -> None:
    padded, packed = make_worker(tiny_model_dir), make_worker(tiny_model_dir)
    batch = make_batch(padded)
    loss_fn = pg_loss(kl_penalty=0.1)
    want = padded.train(batch, loss_fn, global_batch_size=4, micro_batching=2)
    got = packed.train(batch, loss_fn, global_batch_size=4, micro_batching=LAYOUTS["packed"])
    for key in ("loss", "kl", "ratio", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    # a packed row's only padding is up to its width on the list (packed_width): under 1/16
    assert 0 <= got["padding_fraction"] < 1 / 16 < got["padding_fraction_fixed_rows"]
    assert want["padding_fraction"] == pytest.approx(want["padding_fraction_fixed_rows"])
    # AdamW's first step moves a weight by lr * g / (|g| + eps): float32 rounding of gradients near eps
    # shows up at a few 1e-6 (lr 1e-3); the gradients themselves agree to 1e-6 (test above).
    theirs = dict(padded.model.named_parameters())
    for name, p in packed.model.named_parameters():
        torch.testing.assert_close(p, theirs[name], rtol=0, atol=2e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_two_rank_packed_step_equals_one_padded_process(
    ray_cluster: None, request: pytest.FixtureRequest, tensor_parallel_size: int
) -> None:
    """The sharded worker plans through the same code. FSDP2 over two data-parallel ranks: they pack their
    halves into different numbers of rows (4 and 3 here), are evened out to as many forward passes, and
    one packed step equals one padded step in one process. Tensor parallelism 2: both ranks pack the same
    rows, attention heads split between them."""
    from rlfleet.distributed.cluster import create_node_placement_groups, remove_placement_groups
    from rlfleet.distributed.rank_group import RayRankGroup
    from rlfleet.policy.sharded_rank import ShardedPolicyRank, ShardingSettings

    model_dir = request.getfixturevalue(
        "tiny_tp_model_dir" if tensor_parallel_size == 2 else "tiny_model_dir"
    )
    packed = MicroBatching(rows=3, tokens=17, pack=True)
    single = make_worker(model_dir)
    batch = make_batch(single)
    lengths = row_lengths(batch)
    assert [len(plan_micro_batches(half, packed)[0]) for half in (lengths[:4], lengths[4:])] == [4, 3]
    want_lp = single.logprobs(batch, PADDED)
    loss_fn = pg_loss(kl_penalty=0.1)
    want = single.train(batch, loss_fn, global_batch_size=8, micro_batching=8)
    groups = create_node_placement_groups(num_nodes=1, bundles_per_node=2, use_gpus=False, timeout_s=30.0)
    init = {
        "source": ModelSource(str(model_dir)),
        "settings": TEST_OPTIMIZER,
        "sharding": ShardingSettings(tensor_parallel_size=tensor_parallel_size),
    }
    group = RayRankGroup(ShardedPolicyRank, groups, init, timeout_s=120.0)
    try:
        lps = group.run_all("logprobs", batch, packed)
        metrics = group.run_all("train", batch, loss_fn, global_batch_size=8, micro_batching=packed)
        state = group.run_all("full_state_dict")[0]
    finally:
        group.shutdown()
        remove_placement_groups(groups)
    for lp in lps:
        torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-5)
    for key in ("loss", "kl", "ratio", "grad_norm"):
        assert metrics[0][key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), key
    assert metrics[0]["padding_fraction"] < 1 / 16
    for name, p in single.model.named_parameters():  # AdamW's first step: see the one-process test
        torch.testing.assert_close(state[name], p.detach(), rtol=0, atol=2e-5, msg=name)


@pytest.mark.slow
def test_grpo_step_with_packing_or_dynamic_batching_equals_the_padded_one(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The recipe keys reach the loop: one GRPO step (a separate prev pass, a reference pass, two optimizer
    steps) gives the padded update, and the logged padding fraction says what was computed."""
    from rlfleet.algorithms.grpo.loop import GRPO
    from tests.conftest import small_grpo_config

    modes = {
        "padded": [],
        "packed": ["policy.sequence_packing.enabled=true"],
        "dynamic": [
            "policy.dynamic_batching.enabled=true",
            "policy.dynamic_batching.sequence_length_round=16",
        ],
    }
    results = {}
    for name, extra in modes.items():
        cfg = small_grpo_config(
            tiny_model_dir,
            tmp_path / name,
            "env.math.reward_fn=tests.functional.rewards_for_tests.digit_fraction_reward",
            "grpo.max_num_steps=1",
            "grpo.val_at_start=false",
            "grpo.val_at_end=false",
            "checkpointing.enabled=false",
            "loss_fn.reference_policy_kl_penalty=0.05",
            "policy.train_micro_batch_size=8",  # rows of two prompts (of different lengths) per micro-batch
            *extra,
        )
        trainer = GRPO(cfg)
        metrics = trainer.train()
        results[name] = (
            metrics,
            {n: p.detach().clone() for n, p in trainer.ctx.policy.model.named_parameters()},
        )
    want, want_params = results["padded"]
    assert want["train/padding_fraction"] == want["train/padding_fraction_fixed_rows"] > 0
    for name in ("packed", "dynamic"):
        got, params = results[name]
        for key in ("train/loss", "train/kl", "train/grad_norm", "train/reward"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (name, key)
        assert got["train/padding_fraction_fixed_rows"] == want["train/padding_fraction_fixed_rows"]
        for key, value in want_params.items():
            torch.testing.assert_close(params[key], value, rtol=0, atol=2e-5, msg=f"{name} {key}")
    assert results["packed"][0]["train/padding_fraction"] < 1 / 16
    # dynamic batching pads each micro-batch to a multiple of sequence_length_round (16): more or less
    # padding than fixed rows, depending on the lengths; it is the layout's own share either way
    assert 0 < results["dynamic"][0]["train/padding_fraction"] < 1


def test_packing_refuses_an_attention_that_ignores_position_ids(worker: PolicyRank) -> None:
    batch = make_batch(worker)
    worker.model.config._attn_implementation = "my_kernel"  # a registered custom attention, say
    try:
        with pytest.raises(ValueError, match=r"fix: policy\.sequence_packing\.enabled=false"):
            worker.logprobs(batch, LAYOUTS["packed"])
    finally:
        worker.model.config._attn_implementation = "sdpa"


def test_sdpa_packed_generates_as_sdpa(tiny_model_dir: Path) -> None:
    """A policy switched to sdpa_packed by a packed pass still generates as on sdpa (HF generation shares
    the module): padded batches and cached decoding take plain SDPA."""
    from rlfleet.generation import HFGenerationBackend, SamplingParams
    from rlfleet.policy.packed_attention import use_packed_sdpa

    worker = make_worker(tiny_model_dir)
    backend = HFGenerationBackend(worker.model, worker.tokenizer, batch_size=4)
    prompts = [[5, 9, 14, 3], [7, 8], [11, 12, 13, 14, 15, 16], [21]]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=None)
    before = [backend.generate(p, params, seed=3) for p in (prompts, prompts[:1])]
    use_packed_sdpa(worker.model)
    assert worker.model.config._attn_implementation == "sdpa_packed"
    after = [backend.generate(p, params, seed=3) for p in (prompts, prompts[:1])]
    for want, got in zip(before, after, strict=True):
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        for r_got, r_want in zip(got, want, strict=True):
            torch.testing.assert_close(torch.tensor(r_got.logprobs), torch.tensor(r_want.logprobs))


_WINDOWED = {  # a window of 4 tokens, shorter than most of the rows below
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "sliding_window": 4,
}
# every model type of WINDOW_AWARE_MODEL_TYPES that has a causal LM of its own
WINDOWED_MODELS = {
    "gemma3_text": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    ),
    "mistral": ("MistralForCausalLM", "MistralConfig", {}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {"use_sliding_window": True, "max_window_layers": 0}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"use_sliding_window": True, "max_window_layers": 0}),
}


@pytest.mark.parametrize("model_type", sorted(WINDOWED_MODELS))
def test_packed_sliding_window_attention_equals_the_models_own_masks(model_type: str) -> None:
    """Sequences longer than the window run under a banded mask of their own, shorter ones causal: a packed
    row's logprobs and gradients equal the padded rows' under the model's own sliding-window masks."""
    import transformers

    from rlfleet.policy.packed_attention import WINDOW_AWARE_MODEL_TYPES, use_packed_sdpa

    model_class, config_class, extra = WINDOWED_MODELS[model_type]
    config = getattr(transformers, config_class)(**_WINDOWED, **extra, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).double()
    assert config.model_type == model_type in WINDOW_AWARE_MODEL_TYPES
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 63, (n,), generator=gen).tolist() for n in (5, 2, 9, 3)]
    responses = [torch.randint(3, 63, (n,), generator=gen).tolist() for n in (7, 1, 12, 2)]
    batch = collate(prompts, responses, pad_token_id=0)
    packed = MicroBatching(rows=4, tokens=64, pack=True)

    def logprobs_and_grads(batching: MicroBatching) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        plan = plan_micro_batches(row_lengths(batch), batching)[0]
        assert len(plan) == 1
        lp = forward_logprobs(model, batch, batching, 1.0)
        (lp * batch.response_mask).sum().backward()
        return lp.detach(), [p.grad.clone() for p in model.parameters()]

    want, want_grads = logprobs_and_grads(PADDED)
    use_packed_sdpa(model)
    assert model.config._attn_implementation == "sdpa_packed"
    got, grads = logprobs_and_grads(packed)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)  # Gemma's norms compute in float32
    # the window matters here: as wide as the longest row (what ignoring it computes), the logprobs differ
    model.config.sliding_window = 64
    for layer in model.model.layers:
        if getattr(layer.self_attn, "sliding_window", None) is not None:
            layer.self_attn.sliding_window = 64
    assert not torch.allclose(forward_logprobs(model, batch, packed, 1.0)[mask], want[mask])


@pytest.mark.parametrize("model_type", sorted(WINDOWED_MODELS))
def test_no_quadratic_mask_is_built_for_one_row_and_a_lone_sequence_keeps_its_window(
    model_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For one unpadded row without a cache the model builds no ``L x L`` mask (``packed_sdpa_mask``; a
    packed row's is what transformers would build per mask type and forward: 1.4 GiB for Gemma 3 at 27,648
    tokens). A lone sequence longer than the window then gets its banded mask from the attention itself:
    its logits equal the model's own under ``sdpa``; a padded batch still gets transformers' masks."""
    import transformers

    from rlfleet.policy import packed_attention

    model_class, config_class, extra = WINDOWED_MODELS[model_type]
    config = getattr(transformers, config_class)(**_WINDOWED, **extra, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).double().eval()
    ids = torch.randint(3, 63, (1, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        packed_attention.use_packed_sdpa(model)
        built: list[object] = []
        real = packed_attention.sdpa_mask
        monkeypatch.setattr(packed_attention, "sdpa_mask", lambda *a, **k: built.append(k) or real(*a, **k))
        got = model(input_ids=ids).logits  # one sequence of 13 tokens, a window of 4
        assert built == []
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        positions = torch.tensor([[*range(5), *range(8)]])  # a packed row: 5 + 8 tokens
        model(input_ids=ids, position_ids=positions)
        assert built == []
        padded = torch.cat([ids, ids])
        mask = torch.ones_like(padded)
        mask[1, :3] = 0
        model(input_ids=padded, attention_mask=mask)
        assert built, "a padded batch needs transformers' masks"
