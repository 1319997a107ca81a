"""DPO's config section (NeMo RL's ``dpo.*`` keys)."""

from __future__ import annotations

from pydantic import Field

from rlfleet.config.shaping import RewardShapingConfig
from rlfleet.config.strict import Strict


class SampledPairsConfig(Strict):
    """Pairs from the model's own samples (when ``data`` is a task rather than a preference dataset): each
    prompt gets ``num_generations_per_prompt`` responses from the current policy, scored by its environment;
    a prompt whose responses differ in reward gives one pair, its best (chosen) and its worst (rejected).

    ``reward_shaping`` (GRPO's ``grpo.reward_shaping`` keys, DAPO's overlong penalty) ranks the samples by
    their shaped reward: among equally scored responses, one that ran into the length buffer loses to one
    that stopped early, so a prompt whose samples are all wrong still gives a pair when their lengths differ.
    """

    num_generations_per_prompt: int = Field(4, ge=2, description="Responses sampled per prompt.")
    max_rounds: int = Field(
        3, ge=1, description="Rounds of policy.train_global_batch_size prompts to find that many pairs."
    )
    reward_shaping: RewardShapingConfig = RewardShapingConfig()


class DPOConfig(Strict):
    """Direct preference optimisation (NeMo RL ``dpo.*``). A step takes ``policy.train_global_batch_size``
    pairs (twice as many rows: chosen and rejected) and makes one optimizer step;
    ``policy.train_micro_batch_size`` counts pairs too.

    The loss is ``preference_loss_weight * -log sigmoid(beta * (r_chosen - r_rejected))`` plus
    ``sft_loss_weight`` x the chosen response's NLL, with ``r = sum (logp - ref_logp)`` over its tokens
    (the mean with ``preference_average_log_probs``) and ``beta = reference_policy_kl_penalty``.
    """

    max_num_steps: int = Field(150, ge=0)
    max_num_epochs: int = Field(1, ge=1)
    max_rollout_turns: int = Field(
        1,
        ge=1,
        description="Model turns per episode of its own samples (dpo.sampled_pairs) and of validation on a "
        "task (environments that answer tool calls need several).",
    )
    val_period: int = Field(25, ge=0)
    val_batches: int = Field(8, ge=1, description="Validation batches of preference pairs.")
    val_global_batch_size: int = Field(8, ge=1, description="Pairs per validation batch.")
    val_micro_batch_size: int = Field(1, ge=1, description="Pairs per validation forward pass.")
    val_at_start: bool = True
    val_at_end: bool = False
    max_val_samples: int = Field(256, ge=1, description="Task prompts scored when data is a task.")
    seed: int = 42
    reference_policy_kl_penalty: float = Field(0.05, ge=0.0, description="beta, the implicit reward scale.")
    preference_loss_weight: float = Field(1.0, ge=0.0)
    sft_loss_weight: float = Field(0.0, ge=0.0)
    preference_average_log_probs: bool = Field(False, description="Mean, not sum, of the logprob ratios.")
    sft_average_log_probs: bool = Field(False, description="Token mean, not sum, of the SFT term's NLL.")
    sampled_pairs: SampledPairsConfig = SampledPairsConfig()
