"""GRPO as the rest of rlfleet knows it (:mod:`rlfleet.config.algorithm`)."""

from __future__ import annotations

from rlfleet.algorithms.grpo.checks import grpo_problems
from rlfleet.algorithms.grpo.config import GRPOConfig
from rlfleet.algorithms.grpo.describe import describe_grpo
from rlfleet.config.algorithm import AlgorithmSettings, AlgorithmSpec, sampled_group_rows, sampled_groups
from rlfleet.config.schema import MasterConfig


def grpo_settings(cfg: MasterConfig) -> AlgorithmSettings:
    # the logprob pass: the previous policy's (and the reference's) logprobs of every sample; the
    # reference is kept only for the KL term
    return sampled_groups(cfg, "grpo", keeps_reference=cfg.loss_fn.reference_policy_kl_penalty > 0)


SPEC = AlgorithmSpec(
    name="grpo",
    order=0,
    command="grpo",
    summary="GRPO training",
    section=GRPOConfig,
    trainer="rlfleet.algorithms.grpo.loop:GRPO",
    settings=grpo_settings,
    metrics=frozenset(
        {"val/accuracy", "val/reward", "val/mean_response_length", "train/reward", "train/loss", "train/kl"}
    ),
    step_rows=lambda cfg, facts: sampled_group_rows(cfg, facts, "grpo"),
    checks=grpo_problems,
    describe=describe_grpo,
    reads=("loss_fn",),
)
