"""On-policy distillation as the rest of rlfleet knows it (:mod:`rlfleet.config.algorithm`)."""

from __future__ import annotations

from rlfleet.algorithms.distillation.checks import distillation_problems
from rlfleet.algorithms.distillation.config import DistillationConfig
from rlfleet.config.algorithm import (
    AlgorithmSettings,
    AlgorithmSpec,
    Rows,
    StepFacts,
    sampled_group_rows,
    sampled_groups,
)
from rlfleet.config.schema import MasterConfig


def distillation_settings(cfg: MasterConfig) -> AlgorithmSettings:
    # the logprob pass: the teacher's top k at every position of every sample
    return sampled_groups(cfg, "distillation", keeps_reference=False, has_teacher=True)


def distillation_step_rows(cfg: MasterConfig, facts: StepFacts) -> Rows:
    teacher = cfg.teacher.model_name if cfg.teacher else "none"
    then = f", then the teacher's top {cfg.distillation.topk_logits_k} at every position ({teacher})"
    return sampled_group_rows(cfg, facts, "distillation", then)


SPEC = AlgorithmSpec(
    name="distillation",
    order=4,
    command="distill",
    summary="on-policy distillation of a teacher into the policy (the student)",
    section=DistillationConfig,
    trainer="rlfleet.algorithms.distillation.loop:Distillation",
    settings=distillation_settings,
    # distillation validates the task's greedy accuracy, as GRPO
    metrics=frozenset({"val/accuracy", "val/reward", "val/mean_response_length", "train/loss"}),
    step_rows=distillation_step_rows,
    checks=distillation_problems,
    preflight="rlfleet.algorithms.distillation.teacher_setup:preflight_teacher",
    reads=("teacher",),
)
