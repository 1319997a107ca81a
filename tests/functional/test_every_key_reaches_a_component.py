"""No config key is silently ignored: every schema field is read by the component that uses it.

The config handed to each component is wrapped in a recorder that notes the dotted path of every field
read through it. Validation (``check_config``) runs on the unwrapped config, so a key counts only when
a component (data, model, generation, loss, optimizer, logging, checkpointing, plan, eval) reads it.
Scenarios together must read every leaf key of the schema.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import rlfleet.algorithms.base as base_module
from rlfleet.algorithms.distillation.config import TEACHER_KEYS
from rlfleet.algorithms.distillation.loop import Distillation
from rlfleet.algorithms.dpo.loop import DPO
from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.algorithms.rm.loop import RM
from rlfleet.algorithms.sft.loop import SFT
from rlfleet.config import MasterConfig, check_config, load_recipe, resolve_recipe_path, schema_keys
from rlfleet.config.layout import resource_layout
from rlfleet.memory.report import make_plan
from rlfleet.runtime.eval_command import run_eval
from rlfleet.runtime.rehearse import rank_jobs
from tests.conftest import save_tiny_reward_model, small_grpo_config
from tests.functional.test_distillation import small_distillation_config
from tests.functional.test_dpo import small_dpo_config
from tests.functional.test_rm import small_pairs, small_rm_config

DENSE = "env.math.reward_fn=tests.functional.rewards_for_tests.digit_fraction_reward"


class ReadRecorder:
    """Forwards attribute reads to a pydantic model and records the dotted path of each field read."""

    def __init__(self, model: BaseModel, seen: set[str], prefix: str = "") -> None:
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_seen", seen)
        object.__setattr__(self, "_prefix", prefix)

    def __getattr__(self, name: str) -> Any:
        model = object.__getattribute__(self, "_model")
        value = getattr(model, name)
        if name in type(model).model_fields:
            path = object.__getattribute__(self, "_prefix") + name
            seen = object.__getattribute__(self, "_seen")
            seen.add(path)
            if isinstance(value, BaseModel):
                return ReadRecorder(value, seen, path + ".")
        return value


def _unwrap_check(cfg: Any, algorithm: str, **kwargs: Any) -> None:
    check_config(object.__getattribute__(cfg, "_model"), algorithm, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def recorded(monkeypatch) -> set[str]:
    monkeypatch.setattr(base_module, "check_config", _unwrap_check)  # every loop's set-up chain
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    return set()


def _gsm8k_files(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    rows = [
        {"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}
        for i in range(1, 9)
    ]
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    for path in (train, val):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompt, system = tmp_path / "prompt.txt", tmp_path / "system.txt"
    prompt.write_text("Solve: {}")
    system.write_text("You are careful.")
    return train, val, prompt, system


@pytest.mark.slow
def test_every_schema_key_is_read_by_some_component(
    recorded: set[str], tiny_model_dir: Path, tmp_path: Path, no_ray: None
) -> None:
    one_step = ["grpo.max_num_steps=1", "grpo.max_val_samples=4", DENSE]
    # A: GRPO on the built-in task with every logging backend and checkpointing on.
    cfg = small_grpo_config(
        tiny_model_dir,
        tmp_path / "a",
        *one_step,
        "logger.tensorboard_enabled=true",
        "logger.wandb_enabled=true",
        "logger.mlflow_enabled=true",
        "policy.generation.top_k=50",
        "policy.dtensor_cfg.activation_checkpointing=true",
        "loss_fn.use_importance_sampling_correction=true",
        "loss_fn.ratio_clip_c=3.0",
        "loss_fn.token_level_loss=false",
        "grpo.use_leave_one_out_baseline=false",
        f"logger.tensorboard.log_dir={tmp_path / 'a' / 'tb'}",
        "data.max_input_seq_length=200",
        "policy.sequence_packing.enabled=true",
        "policy.sequence_packing.train_mb_tokens=1024",
        "policy.sequence_packing.logprob_mb_tokens=2048",
        "policy.sequence_packing.algorithm=concatenative",
    )
    GRPO(ReadRecorder(cfg, recorded)).train()  # type: ignore[arg-type]
    # B: SFT with LoRA adapters on some projections.
    sft_cfg = small_grpo_config(
        tiny_model_dir,
        tmp_path / "b",
        "sft.max_num_steps=1",
        "sft.max_val_samples=4",
        "policy.dtensor_cfg.lora_cfg.enabled=true",
        "policy.dtensor_cfg.lora_cfg.match_all_linear=false",
        "policy.dtensor_cfg.lora_cfg.target_modules=[*_proj]",
        "policy.dtensor_cfg.lora_cfg.exclude_modules=[model.layers.0.mlp.down_proj]",
        "policy.dtensor_cfg.lora_cfg.dim=4",
        "policy.dtensor_cfg.lora_cfg.alpha=16",
        "policy.dtensor_cfg.lora_cfg.dropout=0.1",
        "policy.dtensor_cfg.lora_cfg.dropout_position=pre",
        "policy.dtensor_cfg.lora_cfg.lora_A_init=uniform",
    )
    SFT(ReadRecorder(sft_cfg, recorded)).train()  # type: ignore[arg-type]
    # C: GRPO on a local GSM8k-format file with prompt and system-prompt files, tokenizer named apart.
    train, val, prompt, system = _gsm8k_files(tmp_path)
    gsm = small_grpo_config(
        tiny_model_dir,
        tmp_path / "c",
        *one_step,
        "data.dataset_name=ResponseDataset",
        f"data.train_data_path={train}",
        f"data.val_data_path={val}",
        "data.input_key=question",
        "data.output_key=answer",
        "data.train_split=train",
        "data.val_split=test",
        "data.subset=main",
        f"data.prompt_file={prompt}",
        f"data.system_prompt_file={system}",
        "data.on_bad_row=skip",
        f"policy.tokenizer.name={tiny_model_dir}",
        "checkpointing.enabled=false",
        "policy.dynamic_batching.enabled=true",
        "policy.dynamic_batching.train_mb_tokens=1024",
        "policy.dynamic_batching.logprob_mb_tokens=2048",
        "policy.dynamic_batching.sequence_length_round=16",
    )
    GRPO(ReadRecorder(gsm, recorded)).train()  # type: ignore[arg-type]
    # D: eval with sampling; E: plan of the seed recipe (architecture, cluster, vLLM sizes).
    ev = small_grpo_config(
        tiny_model_dir,
        tmp_path / "d",
        "eval.num_tests_per_prompt=2",
        "eval.pass_k_value=2",
        "eval.max_val_samples=2",
        "data.system_prompt=Be brief.",
    )
    run_eval(ReadRecorder(ev, recorded))  # type: ignore[arg-type]
    # F: SFT on Ray, one training and one dedicated generation worker (a local Ray it starts and stops);
    # LoRA, so the broadcast refit sends merged weights.
    on_ray = small_grpo_config(
        tiny_model_dir,
        tmp_path / "f",
        "policy.dtensor_cfg.lora_cfg.enabled=true",
        "sft.max_num_steps=1",
        "sft.max_val_samples=4",
        "cluster.gpus_per_node=2",
        "cluster.use_ray=true",
        "cluster.call_timeout_s=300",
        "cluster.placement_timeout_s=60",
        "cluster.generation_retries=0",
        "policy.generation.colocated.enabled=false",
        "policy.generation.colocated.resources.num_nodes=1",
        "policy.generation.colocated.resources.gpus_per_node=1",
    )
    monkeypatch_env = os.environ.pop("RAY_ADDRESS", None)
    try:
        SFT(ReadRecorder(on_ray, recorded)).train()  # type: ignore[arg-type]
    finally:
        if monkeypatch_env is not None:
            os.environ["RAY_ADDRESS"] = monkeypatch_env
    # G: multi-turn GRPO with the tools environment (in a worker process) on the multiplication task.
    tools = small_grpo_config(
        tiny_model_dir,
        tmp_path / "g",
        *one_step,
        "data.dataset_name=multiplication",
        "data.multiplication.num_train=16",
        "data.multiplication.num_val=4",
        "data.multiplication.min_digits=2",
        "data.multiplication.max_digits=3",
        "data.multiplication.sft_target=direct",
        "data.multiplication.seed=3",
        "data.env_name=tools",
        "grpo.max_rollout_turns=2",
        "env.tools.num_workers=1",
        "env.tools.timeout_s=20",
        "env.tools.tools=[calculator,python]",
        "env.tools.max_tool_calls=2",
        "env.tools.reward_fn=rlfleet.rewards.math_reward",
        "env.tools.sandbox_cpu_seconds=2",
        "env.tools.sandbox_wall_seconds=4",
        "policy.max_total_sequence_length=200",
    )
    GRPO(ReadRecorder(tools, recorded)).train()  # type: ignore[arg-type]
    # H: eval with the code environment on arithmetic rows (they carry no code problem: each item fails,
    # counted, and the run goes on).
    code = small_grpo_config(
        tiny_model_dir,
        tmp_path / "h",
        "data.env_name=code",
        "eval.max_val_samples=2",
        "env.code.num_workers=1",
        "env.code.timeout_s=20",
        "env.code.terminate_on_evaluation=false",
        "env.code.cpu_seconds=2",
        "env.code.wall_seconds=4",
    )
    run_eval(ReadRecorder(code, recorded))  # type: ignore[arg-type]
    # I: DPO on pairs of its own samples, averaged logprobs, an SFT term.
    dpo = small_dpo_config(
        tiny_model_dir,
        tmp_path / "i",
        "dpo.max_num_steps=1",
        "dpo.val_at_start=false",
        "dpo.sft_loss_weight=0.1",
        "dpo.preference_average_log_probs=true",
        "dpo.sft_average_log_probs=true",
        "dpo.sampled_pairs.max_rounds=1",
    )
    DPO(ReadRecorder(dpo, recorded)).train()  # type: ignore[arg-type]
    # J: DPO on a binary preference file with its own column names (validation loss over its pairs).
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"q": f"{i} + {i}?", "good": f"#### {2 * i}", "bad": f"#### {i}"}) + "\n"
            for i in range(1, 9)
        )
    )
    dpo_data = small_dpo_config(
        tiny_model_dir,
        tmp_path / "j",
        "dpo.max_num_steps=1",
        "data.dataset_name=BinaryPreferenceDataset",
        f"data.train_data_path={pairs}",
        f"data.val_data_path={pairs}",
        "data.prompt_key=q",
        "data.chosen_key=good",
        "data.rejected_key=bad",
        "dpo.val_batches=1",
        "dpo.val_global_batch_size=4",
        "dpo.val_micro_batch_size=2",
        "checkpointing.enabled=false",
    )
    DPO(ReadRecorder(dpo_data, recorded)).train()  # type: ignore[arg-type]
    # K: eval scored by a reward model; L: eval scored by an in-process judge (the tiny model's verdicts
    # do not parse: each item 0, counted).
    from transformers import AutoTokenizer

    reward_model = save_tiny_reward_model(tmp_path / "rm", AutoTokenizer.from_pretrained(tiny_model_dir))
    for name, env in (
        ("k", ["data.env_name=reward_model", f"env.reward_model.model_name={reward_model}"]),
        (
            "l",
            ["data.env_name=judge", f"env.judge.model_name={tiny_model_dir}", "env.judge.max_new_tokens=4"],
        ),
    ):
        scored = small_grpo_config(tiny_model_dir, tmp_path / name, "eval.max_val_samples=2", *env)
        run_eval(ReadRecorder(scored, recorded))  # type: ignore[arg-type]
    # O: eval of reasoning-gym rows, scored by the tasks' own verifiers; P: eval of episodes an OpenAI-API
    # agent plays through the endpoint
    for name, env in (
        (
            "o",
            [
                "data.dataset_name=reasoning_gym",
                "data.env_name=reasoning_gym",
                "data.reasoning_gym.tasks=[chain_sum]",
                "data.reasoning_gym.train_size=4",
                "data.reasoning_gym.val_size=2",
                "data.reasoning_gym.seed=5",
                "+data.reasoning_gym.task_config.chain_sum.max_terms=3",
                "env.reasoning_gym.num_workers=0",
                "env.reasoning_gym.timeout_s=5",
            ],
        ),
        (
            "p",
            [
                "data.env_name=agent",
                "env.agent.agent_fn=tests.functional.agents_for_tests:two_turns",
                "env.agent.max_concurrency=2",
                "env.agent.timeout_s=60",
                "env.agent.max_requests=4",
                "env.agent.served_model_name=tiny",
            ],
        ),
    ):
        scored = small_grpo_config(tiny_model_dir, tmp_path / name, "eval.max_val_samples=2", *env)
        run_eval(ReadRecorder(scored, recorded))  # type: ignore[arg-type]
    # M: a Bradley-Terry reward model on arithmetic pairs (the policy loaded as a sequence classifier).
    rm = small_rm_config(
        tiny_model_dir,
        tmp_path / "m",
        small_pairs(tmp_path / "m_pairs"),
        "rm.max_num_steps=1",
        "rm.max_num_epochs=1",
        "rm.val_batches=1",
        "rm.val_at_end=true",
        "rm.seed=3",
        "checkpointing.enabled=false",
    )
    RM(ReadRecorder(rm, recorded)).train()  # type: ignore[arg-type]
    # N: on-policy distillation, the student its own teacher (a GGUF-free teacher named with its
    # tokenizer), the student's full vocabulary, chunked teacher logits.
    distill = small_distillation_config(
        tiny_model_dir,
        tiny_model_dir,
        tmp_path / "n",
        "distillation.max_num_steps=1",
        "distillation.max_rollout_turns=1",
        "distillation.max_num_epochs=1",
        "distillation.val_at_end=true",
        "distillation.seed=3",
        "loss_fn.kl_type=mixed",
        "loss_fn.mixed_kl_weight=0.3",
        "loss_fn.zero_outside_topk=true",
        f"teacher.tokenizer.name={tiny_model_dir}",
        "teacher.precision=float32",
        "teacher.logprob_chunk_size=16",
        "checkpointing.enabled=false",
    )
    Distillation(ReadRecorder(distill, recorded)).train()  # type: ignore[arg-type]
    seed: MasterConfig = load_recipe(resolve_recipe_path("grpo-gemma3-27b-it-2n8g-fsdp2tp8-noncolocated"))
    make_plan(ReadRecorder(seed, recorded))  # type: ignore[arg-type]
    # the rehearsal of its ranks reads which algorithm the recipe is for (``algorithm``)
    rank_jobs(ReadRecorder(seed, recorded), resource_layout(seed))  # type: ignore[arg-type]

    # a teacher: block has the policy's schema (NeMo RL's recipes copy the policy's block into it); a
    # teacher reads TEACHER_KEYS of it, and the rest is documented as not used
    keys = {k for k in schema_keys() if not k.startswith("teacher.") or k[len("teacher.") :] in TEACHER_KEYS}
    unread = sorted(keys - recorded)
    assert unread == [], f"config keys no component reads (silently ignored): {unread}"
