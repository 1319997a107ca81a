"""GRPO's config section (NeMo RL's ``grpo.*`` keys); its loss is ``loss_fn``, in
:mod:`rlfleet.config.schema`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfleet.config.shaping import RewardShapingConfig
from rlfleet.config.strict import Strict


class AsyncGRPOConfig(Strict):
    """Asynchronous GRPO (NeMo RL ``grpo.async_grpo``): with dedicated generation workers, the next step's
    rollouts are generated and scored while the current step trains (see
    :mod:`rlfleet.rollouts.prefetch`)."""

    enabled: bool = Field(False, description="Overlap the next step's generation with this step's training.")
    max_trajectory_age_steps: int = Field(
        1, ge=1, description="Most policy updates between the weights that sampled a batch and its training."
    )


class GRPOConfig(Strict):
    num_prompts_per_step: int = Field(8, ge=1, description="Distinct prompts per step.")
    num_generations_per_prompt: int = Field(8, ge=1, description="Samples per prompt (the group size G).")
    max_num_steps: int = Field(100, ge=0, description="Stop after this many GRPO steps.")
    max_num_epochs: int = Field(1, ge=1, description="Stop after this many passes over the training prompts.")
    max_rollout_turns: int = Field(
        1, ge=1, description="Model turns per episode (environments that answer tool calls need several)."
    )
    normalize_rewards: bool = Field(True, description="Divide advantages by a std (where std > 0).")
    use_leave_one_out_baseline: bool = Field(True, description="Baseline = mean of the *other* samples.")
    advantage_std: Literal["baseline_samples", "group"] = Field(
        "baseline_samples",
        description="The std normalize_rewards divides by: baseline_samples = of the samples the baseline "
        "averages (the other G-1 with a leave-one-out baseline, as NeMo RL); group = the whole group's "
        "(one scale per group, as the DeepSeekMath paper). Not a NeMo RL key.",
    )
    val_period: int = Field(10, ge=0, description="Validate every N steps (0 = only at start/end).")
    val_at_start: bool = Field(True, description="Validate before the first step.")
    val_at_end: bool = Field(True, description="Validate after the last step.")
    max_val_samples: int = Field(256, ge=1, description="Validation prompts used (first N).")
    val_greedy: bool = Field(True, description="Greedy decoding for validation (else the train sampler).")
    seed: int = Field(42, description="Seeds data order, generation sampling and initialisation.")
    use_dynamic_sampling: bool = Field(
        False,
        description="DAPO dynamic sampling: drop groups whose rewards are all equal and keep drawing prompts "
        "until the step has num_prompts_per_step informative groups (or dynamic_sampling_max_gen_batches "
        "rounds were used; the step then trains on what it has).",
    )
    dynamic_sampling_max_gen_batches: int = Field(
        10, ge=1, description="Most generation rounds a dynamic-sampling step may use (never loops forever)."
    )
    batch_multiplier: float = Field(
        1.0,
        ge=1.0,
        description="Each dynamic-sampling round draws int(num_prompts_per_step * batch_multiplier) prompts "
        "(1.0 without dynamic sampling).",
    )
    overlong_filtering: bool = Field(
        False,
        description="Mask truncated responses (no EOS within max_new_tokens) out of the loss; they still "
        "count in their group's baseline.",
    )
    skip_zero_advantage_rows: bool = Field(
        True,
        description="Rows whose loss is exactly zero (advantage 0 without a KL term, e.g. every row of a "
        "group whose rewards are all equal; rows with no response token) count in the loss's normaliser "
        "but skip the logprob and training passes: the same update, less work. Not a NeMo RL key.",
    )
    reward_shaping: RewardShapingConfig = RewardShapingConfig()
    async_grpo: AsyncGRPOConfig = AsyncGRPOConfig()
