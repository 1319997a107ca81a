"""Mixed precision: float32 master weights and AdamW state on every path, compute in ``policy.precision``.

The update of one AdamW step at lr 1e-6 is checked against AdamW run in float64 on the same gradients:
Adam's first step moves each weight by ``lr * g / (|g| + eps)``, about ``lr``, which bfloat16 weights
(8 significant bits) would round away. The one-process and the 2-rank FSDP2 workers must agree in bfloat16.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.checkpoint import export_hf
from rlfleet.distributed.cluster import create_node_placement_groups, remove_placement_groups
from rlfleet.distributed.rank_group import RayRankGroup
from rlfleet.logging import read_metrics
from rlfleet.models.loading import ModelSource
from rlfleet.policy.build import build_policy_models, compute_autocast, require_master_dtype
from rlfleet.policy.rank import OptimizerSettings, PolicyRank, TrainablePolicy
from rlfleet.policy.sharded_rank import ShardedPolicyRank
from rlfleet.runtime.components import build_worker
from tests.conftest import TEST_OPTIMIZER as SETTINGS
from tests.conftest import pg_loss, small_grpo_config, worker_batch

DENSE = "env.math.reward_fn=tests.functional.rewards_for_tests.digit_fraction_reward"
BF16 = "policy.precision=bfloat16"
LOSS = pg_loss()


def dense(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a DTensor gathered), detached, on the CPU."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().cpu().clone()


@contextlib.contextmanager
def linear_output_dtypes(model: torch.nn.Module) -> Iterator[set[torch.dtype]]:
    """Collects the dtypes the linear layers of ``model`` compute in while the block runs."""
    seen: set[torch.dtype] = set()
    hooks = [
        m.register_forward_hook(lambda _m, _in, out: seen.add(out.dtype))
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


@dataclasses.dataclass
class Step:
    """One optimizer step seen from outside: weights before and after, the gradients it stepped on."""

    before: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    after: dict[str, torch.Tensor]
    compute_dtypes: set[torch.dtype]


def one_step(worker: TrainablePolicy) -> Step:
    """One optimizer step of ``worker`` on ``make_batch``."""
    # Before any forward pass: FSDP2 leaves the root module's parameters unsharded after one.
    before = {n: dense(p) for n, p in worker.model.named_parameters()}
    batch = worker_batch(worker)
    grads: dict[str, torch.Tensor] = {}

    def keep_grads(*_: object) -> None:
        grads.update({n: dense(p.grad) for n, p in worker.model.named_parameters() if p.grad is not None})

    hook = worker.optimizer.register_step_pre_hook(keep_grads)
    try:
        with linear_output_dtypes(worker.model) as seen:
            worker.train(batch, LOSS, global_batch_size=len(batch), micro_batching=2)
    finally:
        hook.remove()
    after = {n: dense(p) for n, p in worker.model.named_parameters()}
    return Step(before, grads, after, seen)


def float64_adamw_delta(
    before: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], settings: OptimizerSettings, lr: float
) -> dict[str, torch.Tensor]:
    """What one AdamW step in float64 does to float64 copies of ``before`` given ``grads``."""
    params = {n: w.double().requires_grad_(True) for n, w in before.items() if n in grads}
    for name, p in params.items():
        p.grad = grads[name].double()
    torch.optim.AdamW(
        params.values(), lr=lr, betas=settings.betas, eps=settings.eps, weight_decay=settings.weight_decay
    ).step()
    return {n: p.detach() - before[n].double() for n, p in params.items()}


def assert_float64_adamw_update(worker: TrainablePolicy, lr: float) -> None:
    """One step of ``worker`` computes in bfloat16 and moves its float32 master weights as float64 AdamW
    says, each by about lr."""
    step = one_step(worker)
    before, grads, after = step.before, step.grads, step.after
    assert step.compute_dtypes == {torch.bfloat16}
    assert grads, "no gradients reached the optimizer"
    expected = float64_adamw_delta(before, grads, worker.settings, lr)
    eps = worker.settings.eps
    for name, want in expected.items():
        got = after[name].double() - before[name].double()
        # float32 rounds w + delta to within one unit in the last place of |w| + |delta|
        ulp = 2.0**-23 * (before[name].double().abs() + want.abs()) + 1e-12
        worst = float(((got - want).abs() - ulp).max())
        assert worst <= 0, f"{name}: update off the float64 AdamW one by {worst:.3g} beyond float32 rounding"
        # Adam's first step, where |g| >> eps: |delta| = lr, up to float32 rounding
        steep = grads[name].double().abs() > 100 * eps
        off = ((got.abs() - lr).abs() - 0.01 * lr - ulp)[steep]
        assert steep.any() and float(off.max()) <= 0, f"{name}: |delta| is not lr (worst {off.max():.3g})"
    for name, value in after.items():
        assert value.dtype == torch.float32, name
    for state in worker.optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].dtype == torch.float32, key


def test_bf16_update_at_lr_1e6_moves_fp32_master_weights_as_float64_adamw(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    lr = 1e-6
    cfg = small_grpo_config(
        tiny_model_dir, tmp_path, BF16, f"policy.optimizer.kwargs.lr={lr}", "policy.scheduler.warmup_steps=0"
    )
    worker = build_worker(cfg, seed=0, keep_reference=False)
    assert_float64_adamw_update(worker, lr)


def test_sharded_bf16_update_moves_fp32_master_weights_as_float64_adamw(
    world_of_one: None, tiny_model_dir: Path
) -> None:
    lr = 1e-6
    settings = dataclasses.replace(SETTINGS, lr=lr)
    worker = ShardedPolicyRank(ModelSource(str(tiny_model_dir), "bfloat16"), settings)
    assert worker.autocast_dtype is None  # FSDP2 casts to bfloat16 itself
    assert_float64_adamw_update(worker, lr)


def test_reference_computes_exactly_as_the_policy_before_any_update(tiny_model_dir: Path) -> None:
    """The frozen reference holds float32 weights and runs under the policy's autocast: before an update
    its logprobs equal the policy's to the last bit (a bfloat16 copy would run embeddings, norms and the
    residual stream in bfloat16: a per-token offset that summed log ratios turn into a length bias)."""
    models = build_policy_models(
        ModelSource(str(tiny_model_dir), "bfloat16"),
        torch.device("cpu"),
        activation_checkpointing=True,
        keep_reference=True,
    )
    assert {p.dtype for p in models.model.parameters()} == {torch.float32}
    assert models.reference is not None and not models.reference.training
    assert {(p.dtype, p.requires_grad) for p in models.reference.parameters()} == {(torch.float32, False)}
    assert (models.compute_dtype, models.autocast_dtype) == (torch.bfloat16, torch.bfloat16)
    worker = PolicyRank(ModelSource(str(tiny_model_dir), "bfloat16"), SETTINGS, keep_reference=True)
    batch = worker_batch(worker)
    policy, reference = worker.logprobs(batch, 4), worker.logprobs(batch, 4, reference=True)
    assert policy.abs().sum() > 0
    torch.testing.assert_close(reference, policy, rtol=0, atol=0)


def test_compute_autocast_and_master_dtype_check() -> None:
    cpu = torch.device("cpu")
    layer = torch.nn.Linear(4, 4)
    with compute_autocast(cpu, torch.bfloat16):
        assert layer(torch.ones(1, 4)).dtype == torch.bfloat16
    for dtype in (None, torch.float32):
        with compute_autocast(cpu, dtype):
            assert layer(torch.ones(1, 4)).dtype == torch.float32
    require_master_dtype(layer)
    with pytest.raises(TypeError, match=r"torch.bfloat16: master weights .* must be float32"):
        require_master_dtype(layer.to(torch.bfloat16))


def test_bf16_grpo_runs_on_cpu_with_fp32_master_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    overrides = (
        "grpo.max_num_steps=2",
        "grpo.val_period=0",
        DENSE,
        "policy.dtensor_cfg.activation_checkpointing=true",
    )
    trainer = GRPO(small_grpo_config(tiny_model_dir, tmp_path, *overrides, BF16))
    worker = trainer.ctx.policy
    assert isinstance(worker, PolicyRank) and worker.has_reference
    assert trainer.backend.compute_dtype == torch.bfloat16  # generation on the master copy autocasts too
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    trainer.train()
    after = dict(worker.model.named_parameters())
    assert all(p.dtype == torch.float32 for p in after.values())
    assert all(not torch.equal(before[n], p) for n, p in after.items())
    records = [r for r in read_metrics(tmp_path / "logs") if "train/loss" in r]
    assert len(records) == 2
    for record in records:
        for key in ("train/loss", "train/grad_norm", "train/kl"):
            assert torch.isfinite(torch.tensor(record[key])), key
    # before the update the reference (bfloat16) and the policy (float32 under bfloat16 autocast) agree
    assert abs(records[0]["train/kl"]) < 1e-3
    # sampler and trainer compute in the same dtype: their logprobs of the sampled tokens agree closely
    assert all(r["train/gen_logprob_error"] < 0.05 for r in records)
    # checkpoints hold the float32 master weights; the export is in the run's compute dtype
    exported = export_hf(tmp_path / "ckpt" / "step_2", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert model.dtype == torch.bfloat16
    assert torch.equal(model.model.embed_tokens.weight, after["model.embed_tokens.weight"].to(torch.bfloat16))


def test_two_rank_fsdp_bf16_step_matches_one_process(ray_cluster: None, tiny_model_dir: Path) -> None:
    source = ModelSource(str(tiny_model_dir), "bfloat16")
    single = PolicyRank(source, SETTINGS, keep_reference=False)
    batch = worker_batch(single)
    before = {n: dense(p) for n, p in single.model.named_parameters()}
    expected = single.train(batch, LOSS, global_batch_size=4, micro_batching=1)
    groups = create_node_placement_groups(num_nodes=1, bundles_per_node=2, use_gpus=False, timeout_s=30.0)
    init = {"source": source, "settings": SETTINGS}
    group = RayRankGroup(ShardedPolicyRank, groups, init, timeout_s=120.0)
    try:
        lps = group.run_all("logprobs", batch, 2)
        metrics = group.run_all("train", batch, LOSS, global_batch_size=4, micro_batching=1)
        state = group.run_all("full_state_dict")[0]
    finally:
        group.shutdown()
        remove_placement_groups(groups)
    # FSDP2 computes in pure bfloat16, one process under autocast (norms and residuals in float32): the
    # forward passes agree to bfloat16 precision, the gradients to about 1e-3.
    mask = batch.response_mask.bool()
    for lp in lps:
        assert float((lp - batch.prev_logprobs)[mask].abs().max()) < 1e-2
    for key in ("loss", "grad_norm"):
        assert metrics[0][key] == pytest.approx(expected[key], rel=1e-2), key
    # Adam's first step moves each weight by about lr * sign(g): the two agree except where a gradient
    # element near zero changes sign (a few in a thousand here).
    moved = flipped = total = 0
    for name, value in single.model.named_parameters():
        assert state[name].dtype == torch.float32, name
        ours, theirs = value.detach() - before[name], state[name] - before[name]
        moved += int((ours.abs() > 0.5 * SETTINGS.lr).sum())
        flipped += int(((ours - theirs).abs() > 0.5 * SETTINGS.lr).sum())
        total += value.numel()
    assert moved / total > 0.9, f"only {moved} of {total} weights moved"
    assert flipped / total < 0.01, f"{flipped} of {total} weights moved differently"
