"""LoRA on the tiny model: adapters-only optimizer, reference = adapters off, merged generation weights
(in-process HF, FSDP2 ranks on Ray; a vLLM engine's is test_vllm_backend's), GRPO that moves only adapters,
export, exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.checkpoint import CheckpointError, export_hf
from rlfleet.cli import main
from rlfleet.distributed.cluster import create_node_placement_groups, remove_placement_groups
from rlfleet.distributed.rank_group import RayRankGroup
from rlfleet.generation import HFGenerationBackend
from rlfleet.generation.interface import SamplingParams
from rlfleet.generation.weights import engine_state
from rlfleet.models.loading import ModelSource
from rlfleet.models.lora import LoRALinear, LoraSettings, LoraTargetError, WithoutAdapters
from rlfleet.policy.parallelize import is_checkpointed
from rlfleet.policy.rank import PolicyRank
from rlfleet.policy.sharded_rank import ShardedPolicyRank, ShardingSettings
from rlfleet.runtime.components import lora_settings
from tests.conftest import TEST_OPTIMIZER, kill_in_step, pg_loss, small_grpo_config, worker_batch

LORA = LoraSettings(dim=4, alpha=8.0)
ENABLE = "policy.dtensor_cfg.lora_cfg.enabled=true"
DENSE = "env.math.reward_fn=tests.functional.rewards_for_tests.digit_fraction_reward"
GREEDY = SamplingParams(max_new_tokens=12, greedy=True)
TIMEOUT_S = 120.0


def _lora_worker(
    model_dir: Path, keep_reference: bool = True, activation_checkpointing: bool = False, **kw: object
) -> PolicyRank:
    torch.manual_seed(0)
    settings = LoraSettings(**{"dim": 4, "alpha": 8.0, **kw})  # type: ignore[arg-type]
    return PolicyRank(
        ModelSource(str(model_dir)),
        TEST_OPTIMIZER,
        keep_reference=keep_reference,
        activation_checkpointing=activation_checkpointing,
        lora=settings,
    )


def _perturb_adapters(model: torch.nn.Module, seed: int = 1) -> None:
    """Non-zero B (a trained adapter), so that adapters change the output."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)


def _adapter_names(model: torch.nn.Module) -> set[str]:
    return {n for n, _ in model.named_parameters() if ".lora_" in n}


def test_only_adapters_train_and_the_optimizer_checkpoint_holds_only_theirs(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    worker = _lora_worker(tiny_model_dir, activation_checkpointing=True)  # gradients reach frozen-base layers
    model = worker.model
    assert is_checkpointed(model)
    adapters = _adapter_names(model)
    assert len(adapters) == 2 * 7 * 2  # 7 projections in each of 2 layers; lm_head is tied: not adapted
    in_optimizer = {id(p) for group in worker.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for n, p in model.named_parameters() if n in adapters}
    assert all(not p.requires_grad for n, p in model.named_parameters() if n not in adapters)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = worker_batch(worker, noise=0.05)
    worker.train(batch, pg_loss(0.05), global_batch_size=4, micro_batching=2)
    worker.train(batch, pg_loss(0.05), global_batch_size=4, micro_batching=2)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == adapters  # every adapter moved (A once B is non-zero), no base weight did
    worker.save(tmp_path / "step_1")
    metadata = dcp.FileSystemReader(tmp_path / "step_1" / "policy" / "optimizer").read_metadata()
    states = [k for k in metadata.state_dict_metadata if k.startswith("optim.state.")]
    assert states and all(".lora_" in k for k in states)
    assert {k.rsplit(".", 1)[0].removeprefix("optim.state.") for k in states} == adapters


def test_reference_is_the_policy_without_adapters_not_a_copy(tiny_model_dir: Path) -> None:
    worker = _lora_worker(tiny_model_dir)
    assert isinstance(worker.reference, WithoutAdapters) and worker.reference.model is worker.model
    assert worker.has_reference
    plain = PolicyRank(ModelSource(str(tiny_model_dir)), TEST_OPTIMIZER, keep_reference=False)
    batch = worker_batch(plain)
    base = plain.logprobs(batch, micro_batching=4)
    torch.testing.assert_close(worker.logprobs(batch, micro_batching=4), base, rtol=0, atol=0)  # B = 0
    _perturb_adapters(worker.model)
    assert not torch.allclose(worker.logprobs(batch, micro_batching=4), base, atol=1e-3)
    worker.model.train()
    torch.testing.assert_close(worker.logprobs(batch, 4, reference=True), base, rtol=0, atol=0)
    assert worker.model.training  # the reference pass left the policy's mode alone
    assert not _lora_worker(tiny_model_dir, keep_reference=False).has_reference


def test_unknown_target_modules_fail_at_build_naming_the_candidates(tiny_model_dir: Path) -> None:
    with pytest.raises(LoraTargetError, match=r"\['qkv_proj'\] match no linear.*'down_proj'.*'q_proj'"):
        _lora_worker(tiny_model_dir, match_all_linear=False, target_modules=("q_proj", "qkv_proj"))
    worker = _lora_worker(tiny_model_dir, match_all_linear=False, target_modules=("q_proj", "v_proj"))
    adapted = sorted(n for n, m in worker.model.named_modules() if isinstance(m, LoRALinear))
    assert adapted == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]


def _generate(model: torch.nn.Module, worker: PolicyRank, prompts: list[list[int]]) -> list[tuple[int, ...]]:
    backend = HFGenerationBackend(model, worker.tokenizer, batch_size=8)  # type: ignore[arg-type]
    return [r.token_ids for r in backend.generate(prompts, GREEDY, seed=0)]


def _prompts(worker: PolicyRank) -> list[list[int]]:
    texts = ["What is 3 + 4?", "Tom has 5 apples and eats 2.", "7 - 3 =", "Add 12 and 9."]
    return [worker.tokenizer(t)["input_ids"] for t in texts]


def test_in_process_generation_uses_the_adapters_and_merged_weights_match_it(tiny_model_dir: Path) -> None:
    worker = _lora_worker(tiny_model_dir)
    _perturb_adapters(worker.model)
    prompts = _prompts(worker)
    adapted = _generate(worker.model, worker, prompts)  # the HF backend shares the trainer's module
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    base = _generate(plain, worker, prompts)
    plain.load_state_dict(engine_state(worker.model))
    assert _generate(plain, worker, prompts) == adapted != base
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, worker.model(ids).logits, rtol=1e-5, atol=1e-5)


def _params(trainer: GRPO) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.ctx.policy.model.named_parameters()}


@pytest.mark.slow
def test_grpo_with_lora_moves_only_adapters_and_exports(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = small_grpo_config(
        tiny_model_dir,
        tmp_path,
        "grpo.max_num_steps=2",
        "grpo.val_period=0",
        "grpo.val_at_end=false",
        ENABLE,
        DENSE,
    )
    assert cfg.loss_fn.reference_policy_kl_penalty > 0  # the reference is used: adapters off
    trainer = GRPO(cfg)
    worker = trainer.ctx.policy
    assert isinstance(worker.reference, WithoutAdapters)
    before = _params(trainer)
    trainer.train()
    after = _params(trainer)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed == _adapter_names(worker.model)
    step = tmp_path / "ckpt" / "step_2"

    merged_dir = export_hf(step, tmp_path / "merged")
    exported = AutoModelForCausalLM.from_pretrained(str(merged_dir))
    assert not any("lora" in k for k in exported.state_dict())
    ids = torch.tensor([_prompts(worker)[1]])
    worker.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, worker.model(ids).logits, rtol=1e-5, atol=1e-5)

    adapter_dir = tmp_path / "adapter"
    assert main(["export", str(step), str(adapter_dir), "--adapter-only"]) == 0
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    lo = cfg.policy.dtensor_cfg.lora_cfg
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", lo.dim, lo.alpha)
    assert (
        "model.layers.0.self_attn.q_proj" in config["target_modules"] and len(config["target_modules"]) == 14
    )
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    assert set(tensors) == {f"base_model.model.{n}" for n in _adapter_names(worker.model)}
    torch.testing.assert_close(tensors[key], after[key.removeprefix("base_model.model.")], rtol=0, atol=0)
    peft = pytest.importorskip("peft")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(ids).logits, worker.model(ids).logits, rtol=1e-5, atol=1e-5)


def test_adapter_only_export_of_a_full_fine_tuning_checkpoint_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    GRPO(
        small_grpo_config(tiny_model_dir, tmp_path, "grpo.max_num_steps=2", "grpo.val_period=0", DENSE)
    ).train()
    with pytest.raises(ValueError, match="holds no LoRA adapters"):
        export_hf(tmp_path / "ckpt" / "step_2", tmp_path / "adapter", adapter_only=True)


@pytest.mark.slow
def test_lora_run_resumes_to_identical_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    extra = ("grpo.max_num_steps=4", ENABLE, DENSE)
    full = GRPO(small_grpo_config(tiny_model_dir, tmp_path / "full", *extra))
    full.train()
    interrupted = GRPO(small_grpo_config(tiny_model_dir, tmp_path / "resumed", *extra))
    kill_in_step(interrupted, 3)  # after the step-2 checkpoint, in the middle of step 3
    resumed = GRPO(small_grpo_config(tiny_model_dir, tmp_path / "resumed", *extra))
    assert resumed.ctx.step == 2
    resumed.train()
    want = _params(full)
    assert len(want) > len(_adapter_names(full.ctx.policy.model)) > 0
    for name, p in _params(resumed).items():
        torch.testing.assert_close(p, want[name], rtol=0, atol=0, msg=name)


# --------------------------------------------------------------------------------------------- FSDP2 on Ray


def test_two_rank_fsdp_lora_equals_one_process_and_refits_merged_weights(
    ray_cluster: None, tiny_model_dir: Path
) -> None:
    single = _lora_worker(tiny_model_dir)
    batch = worker_batch(single, noise=0.05)
    prompts = _prompts(single)
    loss = pg_loss(kl_penalty=0.05)
    expected = single.train(batch, loss, global_batch_size=4, micro_batching=1)
    single.train(batch, loss, global_batch_size=4, micro_batching=1)  # A moves once B is non-zero
    expected_ref = single.logprobs(batch, 2, reference=True)
    want_tokens = _generate(single.model, single, prompts)
    want_state = engine_state(single.model)
    groups = create_node_placement_groups(num_nodes=1, bundles_per_node=2, use_gpus=False, timeout_s=30.0)
    sharding = ShardingSettings(generation_batch_size=8, lora=LORA)
    init = {
        "source": ModelSource(str(tiny_model_dir)),
        "settings": TEST_OPTIMIZER,
        "sharding": sharding,
        "keep_reference": True,
    }
    group = RayRankGroup(ShardedPolicyRank, groups, init, timeout_s=TIMEOUT_S)
    try:
        metrics = group.run_all("train", batch, loss, global_batch_size=4, micro_batching=1)
        group.run_all("train", batch, loss, global_batch_size=4, micro_batching=1)
        ref = group.run_all("logprobs", batch, 2, reference=True)
        state = group.run_all("engine_state")[0]
        group.run_all("refit")
        out = group.run_all("generate_rows", prompts, GREEDY, [0] * len(prompts))
    finally:
        group.shutdown()
        remove_placement_groups(groups)
    for key in ("loss", "kl", "grad_norm"):
        assert metrics[0][key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    torch.testing.assert_close(ref[0], expected_ref, atol=1e-5, rtol=1e-5)
    assert set(state) == set(want_state) and not any("lora" in k for k in state)
    for name, value in want_state.items():
        torch.testing.assert_close(state[name], value, atol=1e-5, rtol=1e-4, msg=name)
    assert [r.token_ids for r in out[0].results] == want_tokens


def test_lora_settings_follow_the_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert lora_settings(small_grpo_config(tiny_model_dir, tmp_path)) is None
    cfg = small_grpo_config(
        tiny_model_dir,
        tmp_path,
        ENABLE,
        "policy.dtensor_cfg.lora_cfg.dim=16",
        "policy.dtensor_cfg.lora_cfg.alpha=16",
        "policy.dtensor_cfg.lora_cfg.match_all_linear=false",
        "policy.dtensor_cfg.lora_cfg.target_modules=[q_proj]",
        "policy.dtensor_cfg.lora_cfg.dropout_position=pre",
    )
    settings = lora_settings(cfg)
    assert settings is not None and settings.scaling == 1.0 and settings.target_modules == ("q_proj",)
    assert settings.dropout_position == "pre" and not settings.match_all_linear


def test_a_lora_checkpoint_is_not_loaded_into_a_full_policy_or_back(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    lora = _lora_worker(tiny_model_dir, keep_reference=False)
    lora.save(tmp_path / "lora")
    full = PolicyRank(ModelSource(str(tiny_model_dir)), TEST_OPTIMIZER, keep_reference=False)
    full.save(tmp_path / "full")
    with pytest.raises(CheckpointError, match=r"(?s)with LoRA adapters.*without.*enabled=true"):
        full.load(tmp_path / "lora")
    with pytest.raises(CheckpointError, match=r"(?s)without LoRA adapters.*with them.*enabled=false"):
        lora.load_weights(tmp_path / "full")
    lora.load(tmp_path / "lora")


def _snapshot(worker: PolicyRank | ShardedPolicyRank) -> dict[str, torch.Tensor]:
    """The float32 master weights, whole (FSDP2 keeps the root's parameters gathered, in the compute
    dtype, between a forward pass and the next backward: read them through the state-dict API)."""
    if isinstance(worker, ShardedPolicyRank):
        return {n: v.clone() for n, v in worker.full_state_dict(on_every_rank=True).items()}
    return {n: p.detach().clone() for n, p in worker.model.state_dict().items()}


@pytest.mark.parametrize("sharded", [False, True], ids=["one-process-autocast", "fsdp2-mixed-precision"])
def test_bf16_lora_trains_float32_adapters_and_scores_the_reference_without_them(
    request: pytest.FixtureRequest, tiny_model_dir: Path, sharded: bool
) -> None:
    source = ModelSource(str(tiny_model_dir), "bfloat16")
    torch.manual_seed(0)
    if sharded:
        request.getfixturevalue("world_of_one")
        worker: PolicyRank | ShardedPolicyRank = ShardedPolicyRank(
            source, TEST_OPTIMIZER, ShardingSettings(lora=LORA), keep_reference=True
        )
    else:
        worker = PolicyRank(source, TEST_OPTIMIZER, keep_reference=True, lora=LORA)
    batch = worker_batch(worker, noise=0.05)
    # a fresh adapter (B = 0) adds exact zeros: the reference pass equals the policy's, in bf16 compute too
    torch.testing.assert_close(
        worker.logprobs(batch, 4, reference=True), worker.logprobs(batch, 4), rtol=0, atol=0
    )
    before = _snapshot(worker)
    worker.train(batch, pg_loss(0.05), global_batch_size=4, micro_batching=2)
    assert all(p.dtype == torch.float32 for p in worker.trainable_parameters())
    after = _snapshot(worker)
    assert set(after) == set(before) and all(v.dtype == torch.float32 for v in after.values())
    changed = {n for n, v in after.items() if not torch.equal(v, before[n])}
    assert changed and all(".lora_B." in n for n in changed)  # one step: B moves, A waits for B != 0
    assert not torch.equal(worker.logprobs(batch, 4), worker.logprobs(batch, 4, reference=True))
