"""The command line: bad input fails fast with a clear message and exit code 2; export round-trips."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlfleet.algorithms.grpo import GRPO
from rlfleet.cli import main
from tests.conftest import small_grpo_config, small_grpo_overrides


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
    trained = GRPO(small_grpo_config(tiny_model_dir, tmp_path, "grpo.max_num_steps=2")).ctx.worker.model
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(exported(ids).logits, trained(ids).logits)
