"""Distillation on Ray: two FSDP2 training ranks and the teacher in a Ray actor of its own give the run of one
process, step for step (the same samples, the same teacher top-k, the same updates up to float rounding)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlfleet.algorithms.distillation.loop import Distillation
from rlfleet.algorithms.distillation.ray_teacher import RayTeacher
from tests.functional.test_distillation import small_distillation_config, teacher_dir  # noqa: F401
from tests.functional.test_ray_grpo import RAY, assert_same_run, comparable

EXACT = ("train/reward", "train/accuracy", "train/num_tokens", "train/mean_response_length", "val/accuracy")
CLOSE = ("train/loss", "train/grad_norm", "train/teacher_top1_agreement")


def run(student: Path, teacher: Path, run_dir: Path, *overrides: str) -> list[dict]:
    cfg = small_distillation_config(
        student,
        teacher,
        run_dir,
        "distillation.max_num_steps=2",
        "policy.sequence_packing.enabled=true",
        *overrides,
    )
    Distillation(cfg).train()
    return comparable(run_dir)


def test_two_fsdp_workers_and_a_teacher_actor_match_one_process(
    ray_cluster: None,
    tiny_model_dir: Path,
    teacher_dir: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    single = run(tiny_model_dir, teacher_dir, tmp_path / "single")
    started: list[RayTeacher] = []
    original = RayTeacher.start

    def recorded(*args: Any, **kwargs: Any) -> RayTeacher:
        started.append(original(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(RayTeacher, "start", recorded)
    two = run(tiny_model_dir, teacher_dir, tmp_path / "two", *RAY, "cluster.gpus_per_node=2")
    assert_same_run(two, single, EXACT, CLOSE)
    assert len(started) == 1 and started[0]._actor is None  # the run's end killed its actor
