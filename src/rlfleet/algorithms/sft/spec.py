"""SFT as the rest of rlfleet knows it (:mod:`rlfleet.config.algorithm`)."""

from __future__ import annotations

from rlfleet.algorithms.sft.config import SFTConfig
from rlfleet.config.algorithm import AlgorithmSettings, AlgorithmSpec, Rows, StepFacts, loop_settings
from rlfleet.config.schema import MasterConfig


def sft_settings(cfg: MasterConfig) -> AlgorithmSettings:
    batch = cfg.policy.train_global_batch_size
    return loop_settings(
        cfg.sft,
        rollout_turns=cfg.sft.max_rollout_turns,  # its validation's episodes
        turns_key="sft.max_rollout_turns",
        step_rows=batch,
        update_rows=batch,
        logprob_rows=None,
        keeps_reference=False,
    )


def sft_step_rows(cfg: MasterConfig, facts: StepFacts) -> Rows:
    return [
        ("examples per step", f"{cfg.policy.train_global_batch_size} (one optimizer step)"),
        ("per update", facts.per_update("row")),
    ]


SPEC = AlgorithmSpec(
    name="sft",
    order=1,
    command="sft",
    summary="supervised fine-tuning",
    section=SFTConfig,
    trainer="rlfleet.algorithms.sft.loop:SFT",
    settings=sft_settings,
    metrics=frozenset({"val/accuracy", "val/reward", "val/mean_response_length", "train/loss"}),
    step_rows=sft_step_rows,
)
