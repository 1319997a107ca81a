"""One spelling rule for metric names: what config validation accepts is exactly what ranks checkpoints.

Chosen behaviour: a name is normalised (surrounding whitespace dropped, ``:`` read as ``/``), so
``checkpointing.metric_name=" val:accuracy"`` validates as ``val/accuracy`` and ranks by it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

import rlfleet.checkpoint
import rlfleet.config
from rlfleet.checkpoint import CheckpointManager, save_policy
from rlfleet.config import ConfigError, apply_overrides, check_config, validate_config
from rlfleet.config.algorithm import algorithm_spec
from rlfleet.config.metric_names import normalize_metric_name

RAW = {
    "policy": {"model_name": "tiny-model", "train_global_batch_size": 32, "train_micro_batch_size": 8},
    "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 4},
    "checkpointing": {"keep_top_k": 1},
}


def test_validation_and_ranking_share_one_rule() -> None:
    assert (
        rlfleet.config.normalize_metric_name
        is rlfleet.checkpoint.normalize_metric_name
        is normalize_metric_name
    )


@pytest.mark.parametrize("name", [" val:accuracy", "val/accuracy ", "\tval:accuracy\n", "val:accuracy"])
def test_a_padded_name_means_the_logged_key(name: str) -> None:
    assert normalize_metric_name(name) == "val/accuracy"


@pytest.mark.parametrize("algorithm", ["grpo", "sft"])
@pytest.mark.parametrize("name", [" val:accuracy", "val:reward", "val/reward"])
def test_validation_accepts_what_the_loops_log(algorithm: str, name: str) -> None:
    cfg = validate_config(apply_overrides(RAW, [f"checkpointing.metric_name='{name}'"]))
    check_config(cfg, algorithm)  # type: ignore[arg-type]
    assert normalize_metric_name(name) in algorithm_spec(algorithm).metrics


def test_an_unlogged_name_is_refused_with_the_valid_ones() -> None:
    cfg = validate_config(apply_overrides(RAW, ["checkpointing.metric_name='val:acc'"]))
    with pytest.raises(ConfigError, match=r"got 'val:acc'.*val/accuracy.*fix: set checkpointing.metric_name"):
        check_config(cfg, "grpo")


def test_a_padded_name_ranks_by_the_logged_key(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, metric_name=" val:accuracy", higher_is_better=True, keep_top_k=1)
    for step, acc in [(1, 0.2), (2, 0.9), (3, 0.5), (4, 0.1)]:
        manager.save(
            step,
            config_yaml="{}\n",
            training_info={"val/accuracy": acc},
            dataloader_state={},
            write_policy=lambda d: save_policy(d, nn.Linear(2, 2), None, None, None),
        )
    kept = sorted(int(p.name.split("_")[1]) for p in tmp_path.iterdir() if p.name.startswith("step_"))
    assert kept == [2, 4]  # the best by val/accuracy plus the newest (an unknown key would keep step 4 only)
