"""Shared code reads the section of the algorithm it serves, never GRPO's for another one (issue 50).

A recipe carries every algorithm's section, and an algorithm ignores those it does not use: the settings, the
checks and the plan of an SFT, DPO, reward-model or distillation run stay the same when the recipe's ``grpo``
section changes, and follow the algorithm's own section. The episodes of each job (training, validation,
``rlfleet eval``) have that job's own turn count, and ``rlfleet serve`` reads no algorithm's seed.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import rlfleet.algorithms.distillation.teacher_setup as teacher_setup_module
import rlfleet.rollouts.environment_setup as environments_module
import rlfleet.runtime.eval_command as evaluation_module
import rlfleet.runtime.loop as loop_module
import rlfleet.runtime.serve_command as serve_module
from rlfleet.algorithms.distillation.loop import Distillation
from rlfleet.algorithms.dpo.loop import DPO
from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.algorithms.rm.loop import RM
from rlfleet.algorithms.sft.loop import SFT
from rlfleet.config import ConfigError, MasterConfig, check_config, load_recipe, resolve_recipe_path
from rlfleet.config.algorithm import Algorithm, algorithm_names, algorithm_settings, algorithm_spec
from rlfleet.config.layout import resource_layout
from rlfleet.memory.planner import memory_problems, resolve_batching
from rlfleet.memory.report import format_plan, make_plan
from rlfleet.runtime.eval_command import run_eval
from rlfleet.serving.server import ServerSettings
from tests.unit.test_memory_estimate import _machine  # a CPU machine of a fixed size

# every key of GRPO's sections that shared code once read for other algorithms (loss_fn's KL is GRPO's)
GRPO_CHANGES = [
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2",
    "grpo.max_rollout_turns=3",
    "grpo.seed=7",
    "loss_fn.reference_policy_kl_penalty=0",
]
# a change to each algorithm's own section that shared code reads
OWN_CHANGES: dict[Algorithm, list[str]] = {
    "grpo": ["grpo.max_rollout_turns=3", "grpo.seed=7", "loss_fn.reference_policy_kl_penalty=0"],
    "sft": ["sft.max_rollout_turns=2", "sft.seed=7"],
    "dpo": ["dpo.seed=7"],
    "rm": ["rm.seed=7"],
    "distillation": [
        "distillation.num_prompts_per_step=64",
        "distillation.max_rollout_turns=2",
        "distillation.seed=7",
    ],
}
RECIPES: dict[Algorithm, str] = {
    "grpo": "grpo-tiny-arithmetic-cpu",
    "sft": "sft-tiny-arithmetic-cpu",
    "dpo": "dpo-tiny-arithmetic-cpu",
    "rm": "rm-tiny-arithmetic-cpu",
    "distillation": "distillation-tiny-arithmetic-cpu",
}
# models and data the recipes name that `make` builds
BUILT = ["policy.model_name=m", "teacher.model_name=t"]


def _recipe(name: str, *overrides: str) -> MasterConfig:
    extra = [*BUILT] if name.startswith("distillation-") else ["policy.model_name=m"]
    return load_recipe(resolve_recipe_path(name), [*extra, *overrides])


def _other_sections(algorithm: Algorithm) -> list[str]:
    """Changes to every section but ``algorithm``'s own (for GRPO: the other algorithms')."""
    if algorithm != "grpo":
        return GRPO_CHANGES + [
            o for a, own in OWN_CHANGES.items() if a not in (algorithm, "grpo") for o in own
        ]
    return [o for a, own in OWN_CHANGES.items() if a != "grpo" for o in own]


class SectionRecorder:
    """Forwards attribute reads to a config and records the top-level sections read."""

    def __init__(self, cfg: MasterConfig) -> None:
        self._cfg, self.read = cfg, set[str]()

    def __getattr__(self, name: str) -> Any:
        self.read.add(name)
        return getattr(self._cfg, name)


# ------------------------------------------------------------------------------------------ the one table


def test_every_built_in_algorithm_is_described() -> None:
    assert set(algorithm_names()) >= set(RECIPES) == {"grpo", "sft", "dpo", "rm", "distillation"}


@pytest.mark.parametrize("algorithm", ["grpo", "sft", "dpo", "rm", "distillation"])
def test_an_algorithms_settings_read_its_own_sections_and_the_policy_only(algorithm: Algorithm) -> None:
    """Its own section and those its description says it reads (GRPO's loss_fn), nothing else."""
    spec = algorithm_spec(algorithm)
    recorder = SectionRecorder(MasterConfig())
    algorithm_settings(recorder, algorithm)  # type: ignore[arg-type]
    assert recorder.read <= {spec.name, *spec.reads, "policy"}, recorder.read
    assert spec.name in recorder.read


@pytest.mark.parametrize("algorithm", list(RECIPES))
def test_an_algorithms_settings_move_with_its_own_section_alone(algorithm: Algorithm) -> None:
    recipe = RECIPES[algorithm]
    base = algorithm_settings(_recipe(recipe), algorithm)
    assert algorithm_settings(_recipe(recipe, *_other_sections(algorithm)), algorithm) == base
    assert algorithm_settings(_recipe(recipe, *OWN_CHANGES[algorithm]), algorithm) != base


def test_the_settings_say_what_each_step_scores() -> None:
    """The logprob pass scores GRPO's and distillation's samples, DPO's pairs (both rows, sampled or not);
    SFT and reward models have none; a reference model is kept by DPO, and by GRPO with a KL term only."""
    grpo = algorithm_settings(_recipe("grpo-tiny-arithmetic-cpu", "grpo.num_prompts_per_step=16"), "grpo")
    assert (grpo.logprob_rows, grpo.update_rows, grpo.keeps_reference) == (16 * 8, 256, True)
    no_kl = _recipe("grpo-tiny-arithmetic-cpu", "loss_fn.reference_policy_kl_penalty=0")
    assert not algorithm_settings(no_kl, "grpo").keeps_reference
    dpo = algorithm_settings(_recipe("dpo-tiny-arithmetic-cpu"), "dpo")
    assert (dpo.step_rows, dpo.logprob_rows, dpo.keeps_reference, dpo.rollout_turns) == (64, 64, True, 1)
    distillation = algorithm_settings(_recipe("distillation-tiny-arithmetic-cpu"), "distillation")
    assert (distillation.logprob_rows, distillation.has_teacher, distillation.keeps_reference) == (
        128,
        True,
        False,
    )
    sft, rm = (algorithm_settings(_recipe(RECIPES[a]), a) for a in ("sft", "rm"))
    assert sft.logprob_rows is None and not sft.keeps_reference and sft.samples
    assert rm.logprob_rows is None and rm.rollout_turns is None and not rm.samples


# ------------------------------------------------------------------- each run's policy and episode runner


class _Built(Exception):
    """Raised by the fake episode runner: the run got as far as building its episodes."""


class _FakePolicy:
    tokenizer = None

    def close(self) -> None:
        pass


def _capture_run(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Stubs what starting a run would load (environments, models, prompts) and records the seed and
    reference the policy is built with, and the turn count of the episode runner."""
    seen: dict[str, Any] = {}

    def build_policy(cfg: Any, layout: Any, **kwargs: Any) -> tuple[_FakePolicy, None]:
        seen["policy"] = kwargs
        return _FakePolicy(), None

    class EpisodeRunner:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            seen["max_turns"] = kwargs["max_turns"]
            raise _Built

    for module in (loop_module, evaluation_module):
        monkeypatch.setattr(module, "build_policy", build_policy)
        monkeypatch.setattr(module, "load_environments", lambda *a, **k: {})
        monkeypatch.setattr(module, "load_prompts", lambda *a, **k: SimpleNamespace(train=[], val=[]))
    monkeypatch.setattr(loop_module, "ensure_disk", lambda *a, **k: None)
    monkeypatch.setattr(evaluation_module, "prompt_tools", lambda *a, **k: None)
    monkeypatch.setattr(environments_module, "EpisodeRunner", EpisodeRunner)
    monkeypatch.setattr(
        teacher_setup_module, "preflight_teacher", lambda cfg: None
    )  # reads the teacher's files
    return seen


def _pairs(tmp_path: Path) -> list[str]:
    row = {"prompt": "What is 1 + 1?", "chosen": "#### 2", "rejected": "#### 3"}
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return [f"data.train_data_path={path}", f"data.val_data_path={path}"]


TRAINERS = {"grpo": GRPO, "sft": SFT, "dpo": DPO, "rm": RM, "distillation": Distillation}


@pytest.mark.parametrize("algorithm", list(TRAINERS))
def test_each_run_starts_with_the_seed_reference_and_turns_of_its_own_section(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, algorithm: Algorithm
) -> None:
    seen = _capture_run(monkeypatch)
    extra = _pairs(tmp_path) if algorithm == "rm" else []
    for overrides in ([], _other_sections(algorithm), OWN_CHANGES[algorithm]):
        cfg = _recipe(RECIPES[algorithm], *extra, *overrides)
        with pytest.raises(_Built):
            TRAINERS[algorithm](cfg)
        run = algorithm_settings(cfg, algorithm)
        policy = seen["policy"]
        assert (policy["seed"], policy["keep_reference"]) == (run.seed, run.keeps_reference), overrides
        assert policy.get("generation", True) == run.samples
        one_turn = inspect.signature(loop_module.start_run).parameters["max_turns"].default
        assert seen["max_turns"] == (run.rollout_turns or one_turn), overrides


@pytest.mark.parametrize(
    ("recipe", "job", "overrides", "turns"),
    [
        ("grpo-tiny-arithmetic-cpu", GRPO, ["sft.max_rollout_turns=2", "eval.max_rollout_turns=4"], 1),
        ("grpo-tiny-arithmetic-cpu", GRPO, ["grpo.max_rollout_turns=3"], 3),
        ("sft-tiny-arithmetic-cpu", SFT, ["grpo.max_rollout_turns=3"], 1),  # its validation's episodes
        ("sft-tiny-arithmetic-cpu", SFT, ["grpo.max_rollout_turns=3", "sft.max_rollout_turns=2"], 2),
        ("dpo-tiny-arithmetic-cpu", DPO, ["grpo.max_rollout_turns=3"], 1),
        ("dpo-tiny-arithmetic-cpu", DPO, ["grpo.max_rollout_turns=3", "dpo.max_rollout_turns=2"], 2),
        ("distillation-tiny-arithmetic-cpu", Distillation, ["grpo.max_rollout_turns=3"], 1),
        ("grpo-tiny-arithmetic-cpu", run_eval, ["grpo.max_rollout_turns=3"], 1),
        ("grpo-tiny-arithmetic-cpu", run_eval, ["grpo.max_rollout_turns=3", "eval.max_rollout_turns=4"], 4),
    ],
)
def test_the_episodes_of_each_job_have_its_own_turn_count(
    monkeypatch: pytest.MonkeyPatch, recipe: str, job: Any, overrides: list[str], turns: int
) -> None:
    seen = _capture_run(monkeypatch)
    with pytest.raises(_Built):
        job(_recipe(recipe, *overrides))
    assert seen["max_turns"] == turns


def test_the_episode_runner_has_no_turn_count_of_its_own() -> None:
    """No fallback to an algorithm's section: the caller says how many turns its episodes have."""
    parameter = inspect.signature(environments_module.build_episode_runner).parameters["max_turns"]
    assert parameter.default is inspect.Parameter.empty


# ---------------------------------------------------------------------------------------------- checks


def _problems(cfg: MasterConfig, algorithm: Algorithm) -> list[str]:
    try:
        check_config(cfg, algorithm)
    except ConfigError as err:
        return err.problems
    return []


TOOLS = ["data.env_name=tools"]


@pytest.mark.parametrize(
    ("recipe", "algorithm", "own"),
    [
        ("sft-tiny-multiplication-tools-cpu", "sft", "sft.max_rollout_turns=3"),
        ("dpo-tiny-arithmetic-cpu", "dpo", "dpo.max_rollout_turns=3"),
        ("distillation-tiny-arithmetic-cpu", "distillation", "distillation.max_rollout_turns=3"),
    ],
)
def test_the_tools_check_reads_the_turns_of_the_algorithm_it_checks(
    recipe: str, algorithm: Algorithm, own: str
) -> None:
    refused = _problems(_recipe(recipe, *TOOLS), algorithm)
    assert any("tools environment answers a tool call" in p for p in refused), refused
    assert _problems(_recipe(recipe, *TOOLS, *GRPO_CHANGES), algorithm) == refused  # grpo's turns: no help
    assert _problems(_recipe(recipe, *TOOLS, own), algorithm) == []


def test_grpo_and_its_tools_recipe_keep_their_turn_check() -> None:
    assert _problems(_recipe("grpo-tiny-multiplication-tools-cpu"), "grpo") == []
    [problem] = _problems(_recipe("grpo-tiny-multiplication-tools-cpu", "grpo.max_rollout_turns=1"), "grpo")
    assert problem.startswith("grpo.max_rollout_turns:") and "fix: grpo.max_rollout_turns=3" in problem


def test_eval_refuses_one_turn_tool_episodes_whatever_grpo_says(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _capture_run(monkeypatch)  # nothing loads, refused or not
    cfg = _recipe("grpo-tiny-multiplication-tools-cpu", "eval.max_rollout_turns=1")  # its grpo section: 3
    with pytest.raises(ConfigError, match=r"eval.max_rollout_turns: .*fix: eval.max_rollout_turns=3"):
        run_eval(cfg)
    assert "max_turns" not in seen  # refused before anything starts
    with pytest.raises(_Built):
        run_eval(_recipe("grpo-tiny-multiplication-tools-cpu"))  # the recipe sets eval's turns too
    assert seen["max_turns"] == 3


# ------------------------------------------------------------------------------------------------ plan


def _plan(recipe: str, algorithm: Algorithm, *overrides: str) -> tuple[Any, ...]:
    """Everything ``rlfleet plan`` and the run's memory check derive from the recipe."""
    cfg = _recipe(recipe, *overrides)
    layout = resource_layout(cfg)
    plan, problems = make_plan(cfg, algorithm)
    batching = resolve_batching(cfg, layout, algorithm)
    return (
        format_plan(cfg, plan, recipe),
        problems,
        (plan.samples_per_step, plan.optimizer_steps_per_step),
        batching.fitted(),
        memory_problems(cfg, layout, algorithm, batching),
    )


@pytest.mark.parametrize(
    ("recipe", "algorithm", "own"),
    [
        ("dpo-smollm2-135m-arithmetic-cpu", "dpo", ["dpo.sampled_pairs.num_generations_per_prompt=4"]),
        (
            "distillation-smollm2-135m-arithmetic-cpu",
            "distillation",
            ["distillation.num_prompts_per_step=32"],
        ),
        ("sft-gemma3-270m-gsm8k-cpu", "sft", None),  # the sft section holds nothing the plan reads
    ],
)
def test_the_plan_of_a_run_follows_its_own_section_not_grpos(
    monkeypatch: pytest.MonkeyPatch, recipe: str, algorithm: Algorithm, own: list[str] | None
) -> None:
    """Packed sequences with no token budget set: the plan fits the budgets to a rank's share of the step's
    rows, which are the algorithm's own (DPO's pairs, distillation's samples), never GRPO's samples."""
    _machine(monkeypatch, 64)
    base = _plan(recipe, algorithm)
    assert base[3], "the recipe leaves its token budgets to be fitted to the machine"
    assert _plan(recipe, algorithm, *GRPO_CHANGES) == base
    if own is not None:
        assert _plan(recipe, algorithm, *own) != base


def test_the_dpo_plan_counts_the_pairs_rows() -> None:
    plan, _ = make_plan(_recipe("dpo-tiny-arithmetic-cpu", *GRPO_CHANGES), "dpo")
    assert (plan.samples_per_step, plan.optimizer_steps_per_step) == (64, 1)  # 32 pairs, one optimizer step


# ---------------------------------------------------------------------------------------------- serving


def test_serving_builds_its_model_with_no_algorithms_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    seeds = []

    def build_policy(cfg: Any, layout: Any, *, seed: int, keep_reference: bool) -> Any:
        seeds.append(seed)
        raise _Built

    monkeypatch.setattr(serve_module, "build_policy", build_policy)
    for seed in (1, 2):
        cfg = _recipe("grpo-tiny-arithmetic-cpu", f"grpo.seed={seed}")
        with pytest.raises(_Built):
            serve_module.serve(cfg, None, ServerSettings(), "policy", lambda url: None)
    assert seeds == [serve_module.SERVE_SEED] * 2
