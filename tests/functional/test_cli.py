"""The command line: bad input fails fast with a clear message and exit code 2 (the traceback only with
--debug or RLFLEET_DEBUG=1); a corrupt checkpoint is skipped on resume and refused by eval/export; export
round-trips."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.checkpoint import CheckpointManager, save_policy, verify_checkpoint
from rlfleet.cli import main, user_error_message
from rlfleet.config import quote_override_value
from tests.conftest import small_grpo_config, small_grpo_overrides

ROOT = Path(__file__).resolve().parents[2]
SHARD = "policy/weights/__0_0.distcp"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_missing_recipe(capsys, tmp_path):
    code, _, err = run_cli(capsys, "grpo", str(tmp_path / "nope.yaml"))
    assert code == 2
    assert "nope" in err and "recipe" in err.lower()


def test_bad_yaml_names_the_line(capsys, tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("grpo:\n  max_num_steps: [1,\n")
    code, _, err = run_cli(capsys, "grpo", str(recipe))
    assert code == 2 and "bad.yaml" in err and "line" in err


def test_unknown_key_suggests_the_right_one(capsys):
    code, _, err = run_cli(capsys, "validate", "grpo-tiny-arithmetic-cpu", "grpo.num_prompts_per_stepp=4")
    assert code == 2
    assert "grpo.num_prompts_per_stepp" in err and "grpo.num_prompts_per_step" in err


def test_wrong_type(capsys):
    code, _, err = run_cli(
        capsys, "validate", "grpo-tiny-arithmetic-cpu", "policy.train_micro_batch_size=abc"
    )
    assert code == 2 and "policy.train_micro_batch_size" in err


def test_indivisible_batches_fail_before_any_model_is_loaded(capsys, tmp_path):
    code, _, err = run_cli(
        capsys,
        "grpo",
        "grpo-tiny-arithmetic-cpu",
        f"policy.model_name={tmp_path / 'does-not-exist'}",
        "policy.train_global_batch_size=64",
        "policy.train_micro_batch_size=48",
    )
    assert code == 2
    assert "policy.train_micro_batch_size" in err
    assert not (tmp_path / "does-not-exist").exists()


def test_validate_prints_the_resolved_config(capsys):
    code, out, _ = run_cli(
        capsys, "validate", "grpo-tiny-arithmetic-cpu", "policy.model_name=x", "grpo.seed=7"
    )
    assert code == 0
    assert "seed: 7" in out and "num_generations_per_prompt: 8" in out


def test_train_then_export_loads_with_from_pretrained(capsys, tiny_model_dir: Path, tmp_path: Path):
    overrides = [*small_grpo_overrides(tiny_model_dir, tmp_path), "grpo.max_num_steps=2"]
    assert main(["grpo", "grpo-tiny-arithmetic-cpu", *overrides]) == 0
    out_dir = tmp_path / "exported"
    code, out, _ = run_cli(capsys, "export", str(tmp_path / "ckpt" / "step_2"), str(out_dir))
    assert code == 0 and "exported" in out
    exported = AutoModelForCausalLM.from_pretrained(out_dir)
    trained = GRPO(small_grpo_config(tiny_model_dir, tmp_path, "grpo.max_num_steps=2")).ctx.policy.model
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(exported(ids).logits, trained(ids).logits)


# ----------------------------------------------------------------------------------------- user errors


def bad_row_overrides(tmp_path: Path) -> list[str]:
    good = json.dumps({"question": "What is 2 + 3?", "answer": "#### 5"})
    train = tmp_path / "train.jsonl"
    train.write_text(good + "\n" + json.dumps({"question": "What is 1 + 1?"}) + "\n")  # line 2: no answer
    val = tmp_path / "val.jsonl"
    val.write_text(good + "\n")
    return [
        "data.dataset_name=ResponseDataset",
        f"data.train_data_path={quote_override_value(str(train))}",
        f"data.val_data_path={quote_override_value(str(val))}",
    ]


def test_bad_data_row_is_a_message_with_exit_2_and_no_traceback(capsys, tiny_model_dir: Path, tmp_path):
    overrides = [*small_grpo_overrides(tiny_model_dir, tmp_path), *bad_row_overrides(tmp_path)]
    code, _, err = run_cli(capsys, "grpo", "grpo-tiny-arithmetic-cpu", *overrides)
    assert code == 2
    assert "train.jsonl:2" in err and "data.on_bad_row=skip" in err
    assert "Traceback" not in err


def test_data_rows_are_checked_before_the_model_loads(capsys, tmp_path: Path) -> None:
    overrides = [*small_grpo_overrides(tmp_path / "no-such-model", tmp_path), *bad_row_overrides(tmp_path)]
    code, _, err = run_cli(capsys, "grpo", "grpo-tiny-arithmetic-cpu", *overrides)
    assert code == 2
    assert "train.jsonl:2" in err and "no-such-model" not in err


def test_a_missing_model_is_a_message_with_exit_2(capsys, tmp_path: Path) -> None:
    code, _, err = run_cli(
        capsys, "grpo", "grpo-tiny-arithmetic-cpu", *small_grpo_overrides(tmp_path / "nope", tmp_path)
    )
    assert code == 2 and "Traceback" not in err
    assert "nope" in err and "no such file or directory" in err and "fix:" in err


@pytest.mark.parametrize("how", ["--debug", "RLFLEET_DEBUG=1"])
def test_debug_shows_the_traceback(capsys, monkeypatch, tiny_model_dir: Path, tmp_path, how: str):
    overrides = [*small_grpo_overrides(tiny_model_dir, tmp_path), *bad_row_overrides(tmp_path)]
    flags = [how] if how.startswith("--") else []
    if not flags:
        monkeypatch.setenv("RLFLEET_DEBUG", "1")
    code, _, err = run_cli(capsys, *flags, "grpo", "grpo-tiny-arithmetic-cpu", *overrides)
    assert code == 2
    assert "Traceback (most recent call last)" in err and "DataError" in err
    assert err.rstrip().splitlines()[-1].startswith("rlfleet: error:")  # the message still comes last


def test_config_error_exits_2_without_traceback_in_a_real_process():
    env = {k: v for k, v in os.environ.items() if k != "RLFLEET_DEBUG"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    argv = ["validate", "grpo-tiny-arithmetic-cpu", "policy.train_micro_batch_size=abc"]
    result = subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", *argv], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 2
    assert "policy.train_micro_batch_size" in result.stderr and "Traceback" not in result.stderr


class FakeRayTaskError(Exception):
    """What ``ray.get`` raises for an exception inside an actor: the original is its ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"ray::Worker.call() (pid=1)\nTraceback ...\n{cause}")
        self.cause = cause


def test_which_errors_are_the_users_to_fix():
    from rlfleet.data import DataError

    missing_extra = ModuleNotFoundError("No module named 'wandb'", name="wandb")
    assert "pip install 'rlfleet[wandb]'" in (user_error_message(missing_extra) or "")
    k8s = ModuleNotFoundError("No module named 'kubernetes_validate'", name="kubernetes_validate")
    assert "rlfleet[k8s]" in (user_error_message(k8s) or "")
    assert user_error_message(ModuleNotFoundError("No module named 'torchx'", name="torchx")) is None
    assert user_error_message(FileNotFoundError("no such model dir")) == "error: no such model dir"
    wrapped = user_error_message(FakeRayTaskError(DataError("bad row at x.jsonl:3")))
    assert wrapped == "error: bad row at x.jsonl:3"
    assert user_error_message(RuntimeError("a bug")) is None
    assert user_error_message(FakeRayTaskError(KeyError("a bug"))) is None


def test_cluster_capacity_is_a_user_error():
    pytest.importorskip("ray")
    from rlfleet.distributed.cluster import ClusterCapacityError

    message = user_error_message(ClusterCapacityError("placement groups not ready after 60s: need 8 GPU"))
    assert message == "error: placement groups not ready after 60s: need 8 GPU"


# ----------------------------------------------------------------------------------- corrupt checkpoints


def corrupt_checkpoint(root: Path) -> Path:
    manager = CheckpointManager(root, metric_name=None, higher_is_better=True, keep_top_k=None)
    linear = nn.Linear(2, 2)
    recipe = "policy:\n  model_name: does-not-matter\n"
    path = manager.save(
        1,
        config_yaml=recipe,
        training_info={},
        dataloader_state={},
        write_policy=lambda d: save_policy(d, linear, None, None, None),
    )
    shard = path / SHARD
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return path


@pytest.mark.parametrize("command", ["eval", "export"])
def test_eval_and_export_refuse_a_corrupt_checkpoint(capsys, tmp_path, command: str):
    step_dir = corrupt_checkpoint(tmp_path / "ckpt")
    argv = [command, str(step_dir), *([str(tmp_path / "out")] if command == "export" else [])]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert "is corrupt" in err and SHARD in err and "truncated" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_resume_skips_a_truncated_newest_checkpoint(caplog, tiny_model_dir: Path, tmp_path: Path):
    """The newest checkpoint's weight shard cut in half (a node died while GCS FUSE copied it): the rerun
    resumes from the checkpoint before it and finishes, instead of crashing on every retry."""
    overrides = [*small_grpo_overrides(tiny_model_dir, tmp_path), "grpo.max_num_steps=4", "grpo.val_period=0"]
    assert main(["grpo", "grpo-tiny-arithmetic-cpu", *overrides]) == 0
    shard = tmp_path / "ckpt" / "step_4" / SHARD
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with caplog.at_level(logging.INFO):
        assert main(["grpo", "grpo-tiny-arithmetic-cpu", *overrides]) == 0
    assert f"Skipping checkpoint {tmp_path / 'ckpt' / 'step_4'}: {SHARD}" in caplog.text
    assert f"resumed from {tmp_path / 'ckpt' / 'step_2'} (step 2)" in caplog.text
    assert verify_checkpoint(tmp_path / "ckpt" / "step_4")  # step 4 was trained and saved again


def test_no_usable_checkpoint_exits_2_listing_each(capsys, tiny_model_dir: Path, tmp_path: Path):
    corrupt_checkpoint(tmp_path / "ckpt")
    code, _, err = run_cli(
        capsys, "grpo", "grpo-tiny-arithmetic-cpu", *small_grpo_overrides(tiny_model_dir, tmp_path)
    )
    assert code == 2
    assert "none of the 1 checkpoint(s)" in err and f"step_1: {SHARD}" in err and "Traceback" not in err


def test_help_reads_as_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":class:" not in out and "exits with code 2" in out


# ------------------------------------------- validate finds what the run would refuse, before any model


def _local_data(tmp_path: Path, train_text: str) -> list[str]:
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"question": "What is 2 + 3?", "answer": "#### 5"}) + "\n")
    train = tmp_path / "train.jsonl"
    train.write_text(train_text)
    return [
        "data.dataset_name=ResponseDataset",
        f"+data.train_data_path={train}",
        f"+data.val_data_path={val}",
        "policy.model_name=no-such-model-is-loaded",
    ]


@pytest.mark.parametrize(
    ("train_text", "expected"),
    [
        ('{"question": "What is 1 + 1?", "answer": "#### 2"}\n{"question": "broken\n', "train.jsonl:2"),
        ('{"question": "What is 1 + 1?"}\n', "train.jsonl:1"),
    ],
    ids=["broken-json-line", "row-missing-its-answer"],
)
def test_validate_reads_local_data_as_the_run_would(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, train_text: str, expected: str
) -> None:
    code, _, err = run_cli(capsys, "validate", "grpo-tiny-arithmetic-cpu", *_local_data(tmp_path, train_text))
    assert code == 2 and expected in err


def test_validate_refuses_a_data_file_that_does_not_exist(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    overrides = _local_data(tmp_path, "")
    overrides[1] = f"+data.train_data_path={tmp_path / 'missing.jsonl'}"
    code, _, err = run_cli(capsys, "validate", "grpo-tiny-arithmetic-cpu", *overrides)
    assert code == 2 and "missing.jsonl" in err


def test_validate_imports_the_environments(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(
        capsys,
        "validate",
        "grpo-tiny-arithmetic-cpu",
        "policy.model_name=x",
        "+env.mine.environment=nope.mod:Cls",
    )
    assert code == 2 and "nope.mod:Cls" in err


def test_validate_says_which_hub_datasets_it_did_not_read(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys, "validate", "grpo-tiny-arithmetic-cpu", "policy.model_name=x", "data.dataset_name=gsm8k"
    )
    assert code == 0 and "not read by validate" in out and "openai/gsm8k" in out


def test_a_recipe_is_checked_for_the_algorithm_its_content_says(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, _ = run_cli(capsys, "validate", "sft-tiny-arithmetic-cpu", "policy.model_name=x")
    assert code == 0 and "grpo as configured" not in out
    code, out, _ = run_cli(capsys, "plan", "sft-tiny-arithmetic-cpu", "policy.model_name=x")
    assert code == 0 and "(sft)" in out.splitlines()[0]
    code, out, _ = run_cli(capsys, "validate", "grpo-tiny-arithmetic-cpu", "policy.model_name=x")
    assert code == 0 and "grpo as configured" in out
    # its file name says nothing: a GRPO recipe's child that sets a dpo section is a DPO recipe
    child = tmp_path / "my-run.yaml"
    child.write_text(f"defaults: {ROOT / 'recipes' / 'grpo-tiny-arithmetic-cpu.yaml'}\ndpo:\n  seed: 3\n")
    code, out, _ = run_cli(capsys, "plan", str(child), "policy.model_name=x")
    assert code == 0 and "(dpo)" in out.splitlines()[0]
    # two algorithms' sections in one file: ambiguous, and the message says how to settle it
    both = tmp_path / "both.yaml"
    both.write_text("grpo:\n  seed: 1\nsft:\n  seed: 2\n")
    code, _, err = run_cli(capsys, "validate", str(both), "policy.model_name=x")
    assert code == 2 and "ambiguous" in err and "algorithm: grpo" in err
    # settled by the key, or by --algorithm
    both.write_text("algorithm: sft\ngrpo:\n  seed: 1\nsft:\n  seed: 2\n")
    code, out, _ = run_cli(capsys, "plan", str(both), "policy.model_name=x")
    assert code == 0 and "(sft)" in out.splitlines()[0]
    none = tmp_path / "none.yaml"
    none.write_text("policy:\n  model_name: x\n")
    code, _, err = run_cli(capsys, "validate", str(none))
    assert code == 2 and "names no algorithm" in err and "--algorithm" in err
    assert run_cli(capsys, "validate", str(none), "--algorithm", "grpo")[0] == 0


def test_a_command_refuses_a_recipe_keyed_to_another_algorithm(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = run_cli(capsys, "sft", "grpo-tiny-arithmetic-cpu", "policy.model_name=x", "algorithm=grpo")
    assert code == 2 and "the recipe is for grpo, but this runs sft" in err and "`rlfleet grpo RECIPE`" in err
    code, _, err = run_cli(
        capsys, "validate", "grpo-tiny-arithmetic-cpu", "policy.model_name=x", "algorithm=ppo"
    )
    assert code == 2 and "algorithm: got 'ppo', expected one of grpo, sft, dpo, rm, distillation" in err


def test_a_tiny_recipe_says_which_command_builds_its_model(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no runs/ here
    code, _, err = run_cli(capsys, "validate", "grpo-tiny-multiplication-tools-cpu")
    assert code == 2 and "runs/tools/sft_model" in err and "make train-tools" in err
    code, _, err = run_cli(capsys, "plan", "sft-tiny-arithmetic-cpu")
    assert code == 2 and "runs/demo/base_model" in err and "`make train`" in err
    (tmp_path / "runs" / "demo" / "base_model").mkdir(parents=True)
    assert run_cli(capsys, "validate", "sft-tiny-arithmetic-cpu")[0] == 0
