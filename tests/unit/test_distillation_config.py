"""The distillation config: its keys, the recipe's algorithm, the teacher against the student (vocabulary,
top k) and the teacher's memory in the plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.algorithms.distillation.checks import teacher_problems
from rlfleet.config import ConfigError, load_recipe, recipe_algorithm, resolve_recipe_path
from rlfleet.config.layout import resource_layout
from rlfleet.memory.planner import count_parameters, memory_plan
from rlfleet.memory.report import make_plan

RECIPE = "distillation-tiny-arithmetic-cpu"
ARCH = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2}
ARCH |= {"num_key_value_heads": 1, "vocab_size": 320}


def _architecture(section: str, **changes: int) -> list[str]:
    return [f"{section}.architecture.{k}={v}" for k, v in (ARCH | changes).items()]


class Vocab:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def test_a_distillation_recipe_is_checked_as_distillation_whatever_its_file_name(tmp_path: Path) -> None:
    assert recipe_algorithm(RECIPE) == "distillation"
    mine = tmp_path / "my-run.yaml"  # its name says nothing; its section does
    mine.write_text("distillation:\n  max_num_steps: 2\n")
    assert recipe_algorithm(mine) == "distillation"
    cfg = load_recipe(resolve_recipe_path(RECIPE))
    assert (cfg.loss_fn.kl_type, cfg.loss_fn.mixed_kl_weight, cfg.distillation.topk_logits_k) == (
        "mixed",
        0.5,
        64,
    )
    assert cfg.teacher is not None and cfg.teacher.model_name == "runs/demo/grpo_model"


@pytest.mark.parametrize("override", ["loss_fn.mixed_kl_weight=1.5", "loss_fn.kl_type=jensen"])
def test_loss_keys_out_of_range_are_refused(override: str) -> None:
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_recipe(resolve_recipe_path(RECIPE), [override])


def test_the_same_vocabulary_passes_and_a_differing_token_is_named() -> None:
    cfg = load_recipe(resolve_recipe_path(RECIPE))
    same = Vocab({"a": 0, "b": 1, "c": 2})
    assert teacher_problems(cfg, same, same, 320, 320) == []
    (problem,) = teacher_problems(cfg, same, Vocab({"a": 0, "b": 2, "c": 1}), 320, 320)
    assert "2 token(s) differ: 'b': student 1, teacher 2, 'c': student 2, teacher 1" in problem
    (problem,) = teacher_problems(cfg, same, same, 320, 352)  # the same tokens, another embedding size
    assert "0 token(s) differ: none; output layers of 320 and 352 rows" in problem


def test_top_k_above_the_vocabulary_is_refused_with_a_fix() -> None:
    cfg = load_recipe(resolve_recipe_path(RECIPE), ["distillation.topk_logits_k=400"])
    same = Vocab({"a": 0})
    (problem,) = teacher_problems(cfg, same, same, 320, 320)
    assert "distillation.topk_logits_k=400 is larger than the vocabulary (320 tokens)" in problem
    assert "fix: distillation.topk_logits_k=64" in problem


def test_the_plan_counts_the_teachers_weights_beside_the_student_or_in_its_ray_actor() -> None:
    overrides = [*_architecture("policy"), *_architecture("teacher", hidden_size=256, intermediate_size=512)]
    cfg = load_recipe(resolve_recipe_path(RECIPE), overrides)
    plan, problems = make_plan(cfg, "distillation")
    assert problems == [] and plan.samples_per_step == 32 * 4
    assert cfg.teacher is not None and cfg.teacher.architecture is not None
    teacher = 4 * count_parameters(cfg.teacher.architecture)  # float32
    here = memory_plan(
        cfg, resource_layout(cfg), plan.parameters or 0, plan.parameters or 0, algorithm="distillation"
    )
    assert here.passes["train"]["teacher weights"] == teacher
    assert "teacher actor weights" not in here.generation
    ray = load_recipe(resolve_recipe_path(RECIPE), [*overrides, "cluster.use_ray=true"])
    there = memory_plan(
        ray, resource_layout(ray), plan.parameters or 0, plan.parameters or 0, algorithm="distillation"
    )
    assert "teacher weights" not in there.passes["train"]
    assert there.generation["teacher actor weights"] == teacher


def _distillation_problems(*overrides: str) -> list[str]:
    from rlfleet.algorithms.distillation.checks import distillation_problems

    cfg = load_recipe(resolve_recipe_path(RECIPE), ["teacher.model_name=org/teacher", *overrides])
    return distillation_problems(cfg, resource_layout(cfg))


@pytest.mark.parametrize(
    ("recipe", "command"),
    [
        (RECIPE, "`make train-distill` writes it"),
        ("distillation-smollm2-135m-arithmetic-cpu", "`rlfleet grpo grpo-smollm2-135m-arithmetic-cpu`, then"),
    ],
)
def test_a_shipped_teacher_not_written_yet_is_refused_naming_the_commands_that_write_it(
    recipe: str, command: str, tmp_path, monkeypatch
) -> None:
    from rlfleet.algorithms.distillation.checks import distillation_problems

    monkeypatch.chdir(tmp_path)  # no runs/ nor results/ here
    cfg = load_recipe(resolve_recipe_path(recipe))
    assert cfg.teacher is not None
    (problem,) = [p for p in distillation_problems(cfg, resource_layout(cfg)) if p.startswith("teacher.")]
    assert problem.startswith(f"teacher.model_name={cfg.teacher.model_name}: that model is not written yet; ")
    assert command in problem and "rlfleet export" in problem


def test_the_teachers_temperature_is_read_and_a_copy_of_the_policys_block_passes() -> None:
    """NeMo RL's teacher scales its logits by its own ``generation.temperature``, and its recipes copy the
    policy's block into the teacher's: both pass, whatever the copied values are."""
    assert _distillation_problems("teacher.generation.temperature=0.7") == []
    copied = ["policy.generation.top_p=0.9", "teacher.generation.top_p=0.9", "teacher.generation.top_k=7"]
    copied += ["policy.generation.top_k=7", "teacher.optimizer.kwargs.lr=1.0e-4"]  # the recipe's policy lr
    assert _distillation_problems(*copied) == []


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ("teacher.generation.top_p=0.9", "the teacher does not sample"),
        ("teacher.generation.max_new_tokens=512", "the teacher does not sample"),
        ("teacher.optimizer.kwargs.lr=0.5", "the teacher is frozen"),
        ("teacher.dtensor_cfg.tensor_parallel_size=4", "the teacher is frozen"),
    ],
)
def test_a_teacher_key_that_would_be_ignored_is_refused_naming_it(override: str, why: str) -> None:
    (problem,) = _distillation_problems(override)
    key, value = override.split("=")
    assert problem.startswith(f"{key}={value}: not used: {why}")
    assert f"fix: remove {key} from the recipe" in problem and "generation.temperature" in problem
