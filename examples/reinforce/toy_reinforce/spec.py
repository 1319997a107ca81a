"""How the rest of rlfleet knows the algorithm: its command, its section, its trainer, what it logs."""

from __future__ import annotations

from toy_reinforce.config import ReinforceConfig

from rlfleet.config.algorithm import AlgorithmSettings, AlgorithmSpec, loop_settings, sampled_group_rows
from rlfleet.config.schema import MasterConfig


def settings(cfg: MasterConfig) -> AlgorithmSettings:
    r = cfg.reinforce  # type: ignore[attr-defined]  # the section the plugin adds to the schema
    samples = r.num_prompts_per_step * r.num_generations_per_prompt
    return loop_settings(
        r,
        rollout_turns=r.max_rollout_turns,
        turns_key="reinforce.max_rollout_turns",
        step_rows=samples,
        update_rows=samples,  # one optimizer step per step: on-policy, no ratio to clip
        logprob_rows=None,  # so no logprob pass either
        keeps_reference=False,
    )


SPEC = AlgorithmSpec(
    name="reinforce",
    command="reinforce",
    summary="REINFORCE with a group-mean baseline (a worked example of adding an algorithm)",
    section=ReinforceConfig,
    trainer="toy_reinforce.loop:Reinforce",
    settings=settings,
    metrics=frozenset({"val/accuracy", "val/reward", "train/reward", "train/loss"}),
    step_rows=lambda cfg, facts: sampled_group_rows(cfg, facts, "reinforce"),
)
