"""Reward-model training as the rest of rlfleet knows it (:mod:`rlfleet.config.algorithm`)."""

from __future__ import annotations

from rlfleet.algorithms.dpo.spec import pair_step_rows
from rlfleet.algorithms.rm.checks import reward_model_problems
from rlfleet.algorithms.rm.config import RMConfig
from rlfleet.config.algorithm import AlgorithmSettings, AlgorithmSpec, loop_settings
from rlfleet.config.schema import MasterConfig


def rm_settings(cfg: MasterConfig) -> AlgorithmSettings:
    rows = 2 * cfg.policy.train_global_batch_size
    return loop_settings(
        cfg.rm,
        rollout_turns=None,  # a reward model samples nothing
        turns_key=None,
        step_rows=rows,
        update_rows=rows,
        logprob_rows=None,
        keeps_reference=False,
    )


SPEC = AlgorithmSpec(
    name="rm",
    order=3,
    command="rm",
    summary="Bradley-Terry reward-model training on preference pairs",
    section=RMConfig,
    trainer="rlfleet.algorithms.rm.loop:RM",
    settings=rm_settings,
    # a reward model validates its loss and pair accuracy (the chosen reply scoring higher) on held-out pairs
    metrics=frozenset({"val/accuracy", "val/loss", "train/loss", "train/accuracy"}),
    step_rows=pair_step_rows,
    checks=reward_model_problems,
    pairs="always",
    reward_model=True,
)
