"""Shipped recipes, the seed's command line, the resource layout and `rlfleet plan`."""

from __future__ import annotations

import shlex

import pytest

from rlfleet.cli import main
from rlfleet.config import (
    DEMO_TASKS,
    ConfigError,
    check_config,
    load_recipe,
    recipe_algorithm,
    resolve_recipe_path,
    shipped_recipe_names,
)
from rlfleet.config.checks import layout_problems
from rlfleet.config.embedded import GENERATED_MODELS
from rlfleet.config.layout import resource_layout
from rlfleet.memory.planner import count_parameters
from rlfleet.memory.report import make_plan
from rlfleet.rollouts.validation import pass_at_k
from tests.conftest import SEED_COMMAND_LINE

SEED = "grpo-gemma3-27b-it-2n8g-fsdp2tp8-noncolocated"


def test_every_shipped_recipe_validates() -> None:
    names = shipped_recipe_names()
    assert {SEED, "grpo-qwen2.5-0.5b-gsm8k-1n1g", "grpo-smollm2-135m-gsm8k-cpu"} <= set(names)
    for name in names:
        model = load_recipe(resolve_recipe_path(name), []).policy.model_name
        built = any(model.startswith(out) for _, _, out in DEMO_TASKS.values())
        tiny = ["policy.model_name=m"] if built else []  # models and data `make` builds
        written = (
            ["data.train_data_path=p.jsonl", "data.val_data_path=p.jsonl"] if name.startswith("rm-") else []
        )
        teacher = load_recipe(resolve_recipe_path(name), []).teacher
        if teacher is not None and teacher.model_name in GENERATED_MODELS:  # a teacher a run exports
            written.append("teacher.model_name=t")
        check_config(load_recipe(resolve_recipe_path(name), [*tiny, *written]), recipe_algorithm(name))


@pytest.mark.parametrize("split", [str.split, shlex.split], ids=["verbatim", "as-the-shell-passes-it"])
def test_seed_command_line_validates_and_plans(split) -> None:
    cfg = load_recipe(resolve_recipe_path(SEED), split(SEED_COMMAND_LINE))
    check_config(cfg, "grpo")
    assert cfg.data.subset == "main" and cfg.data.input_key == "question" and cfg.data.val_split == "test"
    assert cfg.logger.wandb.name == "nemo_rl_gemma3_27b_3_17" and cfg.logger.tensorboard_enabled is False
    plan, problems = make_plan(cfg)
    assert problems == []
    lay = plan.layout
    assert (lay.num_nodes, lay.gpus_per_node) == (2, 8)
    assert (lay.gen_nodes, lay.gen_gpus_per_node, lay.gen_tp, lay.gen_engines) == (1, 8, 8, 1)
    assert (lay.train_nodes, lay.train_gpus_per_node, lay.train_tp, lay.train_dp) == (1, 8, 8, 1)
    assert plan.samples_per_step == 1024
    assert 26.5e9 < plan.parameters < 27.5e9


def test_plan_command_prints_the_layout(capsys) -> None:
    assert main(["plan", SEED, *shlex.split(SEED_COMMAND_LINE)]) == 0
    out = capsys.readouterr().out
    assert "dedicated 1 node(s) x 8 GPU(s)" in out and "TP 8 x DP 1" in out and "16 x 64 = 1,024" in out
    assert "27.43B parameters" in out and "GiB" in out
    assert "per update          512 micro-batch(es) of 1 row(s) per optimizer step per rank (DP 1)" in out
    assert "vllm, TP 8 -> 1 engine(s)" in out and "1 vLLM engine actor(s) of 8 GPU(s) each" in out
    assert "weights at start: dummy, then the trainer's (broadcast from training rank 0)" in out
    assert "not in this build" not in out


def test_plan_says_token_budgets_not_rows_split_packed_batches(capsys) -> None:
    """With packing the micro-batch rows are not used: the plan says so instead of counting them."""
    tiny = ["policy.model_name=m", "policy.sequence_packing.enabled=true", "policy.train_micro_batch_size=2"]
    assert main(["plan", "grpo-tiny-arithmetic-cpu", *tiny]) == 0
    rows = next(line for line in capsys.readouterr().out.splitlines() if "per update" in line)
    unused = "(train_micro_batch_size and logprob_batch_size are not used)"
    assert f"split by the token budgets below {unused}" in rows
    assert "256 row(s) per optimizer step per rank (DP 1)" in rows and "micro-batch(es) of 2" not in rows


def test_plan_of_a_reward_model_shows_pairs_and_no_generation(capsys) -> None:
    name = "rm-tiny-arithmetic-cpu"
    assert recipe_algorithm(name) == "rm"
    written = ["policy.model_name=m", "data.train_data_path=p.jsonl", "data.val_data_path=p.jsonl"]
    assert main(["plan", name, *written, "cluster.gpus_per_node=2"]) == 0
    out = capsys.readouterr().out
    assert "plan for rm-tiny-arithmetic-cpu (rm)" in out
    assert "generation          none: a reward model samples nothing" in out and "engine" not in out
    assert "Ray: 2 training actor(s)" in out and "TP 1 x DP 2" in out
    assert "pairs per step      32 = 64 rows (chosen, rejected)" in out
    assert "pairs from          the dataset (BinaryPreferenceDataset)" in out


def test_plan_shows_the_colocated_vllm_engines_on_ray(capsys) -> None:
    tiny = ["policy.model_name=m", "policy.generation.backend=vllm", "cluster.gpus_per_node=4"]
    assert (
        main(["plan", "grpo-tiny-arithmetic-cpu", *tiny, "policy.generation.vllm_cfg.tensor_parallel_size=2"])
        == 0
    )
    out = capsys.readouterr().out
    assert "colocated with training; vllm, TP 2 -> 2 engine(s)" in out
    assert (
        "4 training actor(s) in 1 placement group(s); 2 of them also host a vLLM engine over the GPU(s) of 2"
        in out
    )
    assert "dummy, then the trainer's (gathered) before the first generation" in out


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["policy.dtensor_cfg.tensor_parallel_size=3"], "must divide the 8 GPUs per node"),
        (["policy.generation.colocated.resources.num_nodes=2"], "leaves no training node"),
        (["policy.generation.colocated.resources.gpus_per_node=16"], "exceeds cluster.gpus_per_node=8"),
        (["policy.generation.vllm_cfg.tensor_parallel_size=16"], "vllm_cfg.tensor_parallel_size=16"),
        (["cluster.num_nodes=1", "policy.generation.colocated.resources.gpus_per_node=8"], "no training GPU"),
        (
            [
                "policy.dtensor_cfg.tensor_parallel_size=2",
                "policy.train_micro_batch_size=3",
                "policy.train_global_batch_size=390",
                "grpo.num_prompts_per_step=13",
                "grpo.num_generations_per_prompt=30",
            ],
            "data-parallel size 4",
        ),
    ],
)
def test_impossible_layouts_are_refused_with_a_fix(overrides, fragment) -> None:
    cfg = load_recipe(resolve_recipe_path(SEED), overrides)
    with pytest.raises(ConfigError, match="fix") as info:
        check_config(cfg, "grpo")
    assert fragment in str(info.value)


def test_single_node_dedicated_generation_splits_the_node() -> None:
    cfg = load_recipe(
        resolve_recipe_path(SEED),
        [
            "cluster.num_nodes=1",
            "policy.generation.colocated.resources.gpus_per_node=4",
            "policy.generation.vllm_cfg.tensor_parallel_size=2",
            "policy.dtensor_cfg.tensor_parallel_size=2",
        ],
    )
    layout = resource_layout(cfg)
    problems = layout_problems(cfg, layout)
    assert problems == []
    assert (layout.gen_world, layout.gen_engines, layout.train_world, layout.train_dp) == (4, 2, 4, 2)


def test_parameter_count_matches_known_models() -> None:
    qwen = load_recipe(resolve_recipe_path("grpo-qwen2.5-0.5b-gsm8k-1n1g")).policy.architecture
    smol = load_recipe(resolve_recipe_path("grpo-smollm2-135m-gsm8k-cpu")).policy.architecture
    assert abs(count_parameters(qwen) - 494_032_768) / 494_032_768 < 0.01
    assert abs(count_parameters(smol) - 134_515_008) / 134_515_008 < 0.01


def test_pass_at_k() -> None:
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)
