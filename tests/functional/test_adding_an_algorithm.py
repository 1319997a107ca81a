"""The worked example of ``docs/adding-an-algorithm.md``: a toy REINFORCE algorithm in four source files and
a recipe (``examples/reinforce``), installed as a plugin through the ``rlfleet.algorithms`` entry point
group, runs two steps from the command line, checkpoints, and is planned and validated, with no change to
rlfleet itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from rlfleet.config import quote_override_value
from rlfleet.logging.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "reinforce"
RECIPE = EXAMPLE / "reinforce-tiny-arithmetic-cpu.yaml"


def install_plugin(tmp_path: Path) -> Path:
    """The example's package and the metadata ``pip install`` would write for it (its entry point), on a
    directory the test puts on ``PYTHONPATH``."""
    site = tmp_path / "site"
    shutil.copytree(EXAMPLE / "toy_reinforce", site / "toy_reinforce")
    info = site / "toy_reinforce-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-reinforce\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[rlfleet.algorithms]\nreinforce = toy_reinforce.spec:SPEC\n")
    return site


def rlfleet(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(site), "RLFLEET_DISK_CHECK": "off"}
    return subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_the_example_is_four_source_files_and_a_recipe() -> None:
    sources = sorted(p.relative_to(EXAMPLE).as_posix() for p in EXAMPLE.rglob("*.py"))
    assert sources == [
        "toy_reinforce/config.py",
        "toy_reinforce/loop.py",
        "toy_reinforce/loss.py",
        "toy_reinforce/spec.py",
    ]
    assert sorted(p.name for p in EXAMPLE.glob("*.yaml")) == [RECIPE.name]
    page = (ROOT / "docs" / "adding-an-algorithm.md").read_text(encoding="utf-8")
    assert all(f"examples/reinforce/{name}" in page for name in [*sources, RECIPE.name])


def test_a_plugin_algorithm_trains_two_steps_and_is_planned(tiny_model_dir: Path, tmp_path: Path) -> None:
    site = install_plugin(tmp_path)
    overrides = [
        f"policy.model_name={quote_override_value(str(tiny_model_dir))}",
        f"checkpointing.checkpoint_dir={quote_override_value(str(tmp_path / 'ckpt'))}",
        f"logger.log_dir={quote_override_value(str(tmp_path / 'logs'))}",
        "logger.tensorboard_enabled=false",
        "logger.progress_bar=false",
        "reinforce.num_prompts_per_step=4",
        "reinforce.max_num_steps=2",
        "reinforce.val_period=2",
        "reinforce.max_val_samples=8",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=4",
        "policy.generation.max_new_tokens=12",
        "data.arithmetic.num_train=64",
        "data.arithmetic.num_val=8",
        "checkpointing.save_period=2",
        "checkpointing.keep_top_k=null",
        "env.math.num_workers=1",
    ]
    trained = rlfleet(site, tmp_path, "reinforce", str(RECIPE), *overrides)
    assert trained.returncode == 0, trained.stderr[-3000:]
    steps = {row["step"]: row for row in read_metrics(tmp_path / "logs")}
    assert {1, 2} <= set(steps) and "train/loss" in steps[1] and "val/accuracy" in steps[2]
    saved = yaml.safe_load((tmp_path / "ckpt" / "step_2" / "config.yaml").read_text())
    assert saved["algorithm"] == "reinforce" and saved["reinforce"]["max_num_steps"] == 2

    # the recipe is a REINFORCE recipe by its own section (its parent is a GRPO recipe)
    planned = rlfleet(site, tmp_path, "plan", str(RECIPE), *overrides)
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "(reinforce)" in planned.stdout and "4 x 4 = 16" in planned.stdout
    # and so is the checkpoint's saved config (its algorithm key); a key its section lacks is refused as any
    # other recipe's, with the closest valid one
    saved_config = str(tmp_path / "ckpt" / "step_2" / "config.yaml")
    typo = rlfleet(site, tmp_path, "validate", saved_config, "reinforce.baselin=false")
    assert typo.returncode == 2 and "reinforce.baseline" in typo.stderr
    assert "names no algorithm" not in typo.stderr and "ambiguous" not in typo.stderr
