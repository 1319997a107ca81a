"""Multi-turn GRPO end to end with the tiny model: in one process, with the variants (dynamic sampling,
packing, LoRA), resumed, and with the tools environment on the calculator task (with the vLLM backend:
test_vllm_backend and test_ray_vllm).

The episodes come from ``ScriptedEnv`` (a user's environment named by import path): every episode has
``turns`` model turns, each answered by a ``tool`` message, so the multi-turn machinery runs whatever the
untrained model writes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.logging import read_metrics
from rlfleet.runtime.eval_command import run_eval
from tests.conftest import comparable_metrics, small_grpo_config

SCRIPTED = [
    "env.script.environment=tests.functional.envs_for_tests:ScriptedEnv",
    "env.script.cfg.turns=2",
    "env.script.cfg.stops=[e]",
    "data.env_name=script",
    "grpo.max_rollout_turns=3",
    "policy.max_total_sequence_length=200",
]
TWO_STEPS = ["grpo.max_num_steps=2", "grpo.val_period=2"]


def train(model_dir: Path, run_dir: Path, *overrides: str) -> tuple[GRPO, list[dict]]:
    trainer = GRPO(small_grpo_config(model_dir, run_dir, *overrides))
    trainer.train()
    return trainer, read_metrics(run_dir / "logs")


def check_multi_turn(records: list[dict]) -> None:
    steps = [r for r in records if r["step"] > 0]
    assert steps
    for r in steps:
        assert r["train/turns_per_episode"] == 2.0
        assert r["train/gen_logprob_error"] < 1e-4  # the trainer scores the sampled tokens as the engine did
        assert math.isfinite(r["train/loss"]) and "timing/env" in r
    assert records[-1]["val/turns_per_episode"] == 2.0


def test_multi_turn_grpo_in_one_process_logs_whole_conversations(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    _, records = train(tiny_model_dir, tmp_path, *SCRIPTED, *TWO_STEPS)
    check_multi_turn(records)
    samples = [json.loads(line) for line in (tmp_path / "logs" / "samples.jsonl").read_text().splitlines()]
    roles = [m["role"] for m in samples[0]["conversation"]]
    assert roles == ["user", "assistant", "tool", "assistant"] and samples[0]["turns"] == 2


def test_multi_turn_grpo_resumes_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    train(tiny_model_dir, straight, *SCRIPTED, *TWO_STEPS, "checkpointing.save_period=1")
    resumed = tmp_path / "resumed"
    train(
        tiny_model_dir,
        resumed,
        *SCRIPTED,
        "grpo.max_num_steps=1",
        "grpo.val_period=2",
        "checkpointing.save_period=1",
    )
    train(tiny_model_dir, resumed, *SCRIPTED, *TWO_STEPS, "checkpointing.save_period=1")
    got, expected = (comparable_metrics(read_metrics(run / "logs")) for run in (resumed, straight))
    train_keys = [{k: v for k, v in r.items() if k.startswith("train/")} for r in got]
    assert train_keys == [{k: v for k, v in r.items() if k.startswith("train/")} for r in expected]
    assert got[-1] == expected[-1]  # step 2, validation included (the first run also validated at its end)


@pytest.mark.slow
def test_multi_turn_with_dynamic_sampling_packing_and_lora(tiny_model_dir: Path, tmp_path: Path) -> None:
    _, records = train(
        tiny_model_dir,
        tmp_path,
        *SCRIPTED,
        *TWO_STEPS,
        "grpo.use_dynamic_sampling=true",
        "grpo.batch_multiplier=1.5",
        "policy.sequence_packing.enabled=true",
        "policy.sequence_packing.train_mb_tokens=1024",
        "policy.sequence_packing.logprob_mb_tokens=2048",
        "policy.dtensor_cfg.lora_cfg.enabled=true",
        "policy.optimizer.kwargs.lr=1e-3",
    )
    check_multi_turn(records)
    assert all("train/dynamic_sampling_rounds" in r for r in records if r["step"] > 0)


def test_the_tools_environment_on_the_calculator_task(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The shipped tool task's keys on the tiny model, episodes stepped in worker processes: it runs, and
    rlfleet eval runs the same episodes."""
    keys = [
        "data.dataset_name=multiplication",
        "data.multiplication.num_train=64",
        "data.multiplication.num_val=8",
        "data.env_name=tools",
        "env.tools.tools=[calculator]",
        "env.tools.num_workers=1",
        "grpo.max_rollout_turns=3",
        "policy.max_total_sequence_length=200",
        "eval.max_val_samples=4",
        "eval.max_rollout_turns=3",  # eval's own turn count (it reads no algorithm's)
    ]
    _, records = train(tiny_model_dir, tmp_path, *keys, *TWO_STEPS)
    assert records[-1]["step"] == 2 and "train/tool_calls_per_episode" in records[-1]
    report = run_eval(
        small_grpo_config(tiny_model_dir, tmp_path / "eval", *keys), samples_path=tmp_path / "s.jsonl"
    )
    rows = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert report.num_prompts == 4 and all("conversation" in row for row in rows)


def test_an_unknown_environment_fails_before_the_model_loads(tiny_model_dir: Path, tmp_path: Path) -> None:
    from rlfleet.environments import EnvironmentLoadError

    with pytest.raises(EnvironmentLoadError, match="not a subclass"):
        GRPO(
            small_grpo_config(
                tiny_model_dir,
                tmp_path,
                "env.bad.environment=tests.functional.envs_for_tests:NotAnEnvironment",
                "data.env_name=bad",
            )
        )


def test_the_readme_environment_example_runs(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's own environment and command line, as written, for two GRPO steps on the tiny model."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    example = readme.split("<!-- environment-example -->\n```python\n", 1)[1]
    code, rest = example.split("```\n", 1)
    assert len(code.splitlines()) <= 30
    (tmp_path / "my_envs.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    command = rest.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ").split()
    overrides = [word for word in command[command.index("grpo-tiny-arithmetic-cpu") + 1 :] if "=" in word]
    overrides = [o for o in overrides if not o.startswith("policy.model_name=")]
    _, records = train(tiny_model_dir, tmp_path / "run", *overrides, *TWO_STEPS)
    steps = [r for r in records if r["step"] > 0]
    assert len(steps) == 2 and all(r["train/turns_per_episode"] > 1.0 for r in steps)
