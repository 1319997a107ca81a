"""The algorithm's config section, ``reinforce.*`` in a recipe: the loop keys every algorithm has, and its
own."""

from __future__ import annotations

from pydantic import Field

from rlfleet.config.strict import Strict


class ReinforceConfig(Strict):
    num_prompts_per_step: int = Field(8, ge=1, description="Distinct prompts per step.")
    num_generations_per_prompt: int = Field(4, ge=1, description="Samples per prompt.")
    max_rollout_turns: int = Field(1, ge=1, description="Model turns per episode.")
    max_num_steps: int = Field(100, ge=0)
    max_num_epochs: int = Field(1, ge=1)
    val_period: int = Field(10, ge=0)
    val_at_start: bool = True
    val_at_end: bool = True
    max_val_samples: int = Field(64, ge=1)
    seed: int = 42
    baseline: bool = Field(True, description="Subtract the mean reward of the prompt's samples.")
