"""DPO as the rest of rlfleet knows it (:mod:`rlfleet.config.algorithm`)."""

from __future__ import annotations

from rlfleet.algorithms.dpo.checks import dpo_problems
from rlfleet.algorithms.dpo.config import DPOConfig
from rlfleet.config.algorithm import AlgorithmSettings, AlgorithmSpec, Rows, StepFacts, loop_settings
from rlfleet.config.preferences import PREFERENCE_DATASETS
from rlfleet.config.schema import MasterConfig


def dpo_settings(cfg: MasterConfig) -> AlgorithmSettings:
    rows = 2 * cfg.policy.train_global_batch_size  # the pairs of one step, chosen and rejected
    return loop_settings(
        cfg.dpo,
        rollout_turns=cfg.dpo.max_rollout_turns,  # its sampled pairs' and its task validation's episodes
        turns_key="dpo.max_rollout_turns",
        step_rows=rows,
        update_rows=rows,
        logprob_rows=rows,  # the reference's logprobs of the pairs (sampled pairs: of those kept, not drawn)
        keeps_reference=True,  # the implicit reward is the policy's logprobs against the reference's
    )


def pair_step_rows(cfg: MasterConfig, facts: StepFacts, source: str = "") -> Rows:
    """``plan``'s step rows of an algorithm that trains on pairs (``source``: where they come from; the
    dataset by default)."""
    batch = cfg.policy.train_global_batch_size
    return [
        ("pairs per step", f"{batch} = {facts.samples_per_step} rows (chosen, rejected), one optimizer step"),
        ("pairs from", source or f"the dataset ({cfg.data.dataset_name})"),
        ("per update", facts.per_update("pair")),
    ]


def dpo_step_rows(cfg: MasterConfig, facts: StepFacts) -> Rows:
    if cfg.data.dataset_name in PREFERENCE_DATASETS:
        return pair_step_rows(cfg, facts)
    sampled = cfg.dpo.sampled_pairs
    return pair_step_rows(
        cfg,
        facts,
        f"the model's own samples: {sampled.num_generations_per_prompt} per prompt, best vs worst, up to "
        f"{sampled.max_rounds} round(s) of {cfg.policy.train_global_batch_size} prompts",
    )


SPEC = AlgorithmSpec(
    name="dpo",
    order=2,
    command="dpo",
    summary="direct preference optimisation",
    section=DPOConfig,
    trainer="rlfleet.algorithms.dpo.loop:DPO",
    settings=dpo_settings,
    # DPO validates a task's greedy accuracy (pairs from its own samples) or, on a preference dataset, the
    # loss and pair accuracy over the validation pairs
    metrics=frozenset({"val/accuracy", "val/reward", "val/mean_response_length", "val/loss", "train/loss"}),
    step_rows=dpo_step_rows,
    checks=dpo_problems,
    pairs="optional",
)
