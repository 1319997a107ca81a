"""Config of on-policy distillation (NeMo RL's ``distillation.*`` keys, its defaults): the student samples,
the teacher (``teacher:``, the ``policy`` schema) grades every token with its top k, and the student is
trained on the KL between the two (``loss_fn.kl_type``, ``mixed_kl_weight``, ``zero_outside_topk``)."""

from __future__ import annotations

from pydantic import Field

from rlfleet.config.strict import Strict

# The keys of a ``teacher:`` block a teacher reads: where it loads from, how it computes, and the temperature
# its top-k is read at (NeMo RL divides a teacher's logits by its own ``generation.temperature``). The rest of
# the ``policy`` schema (optimizer, scheduler, the other generation keys, LoRA...) is there because NeMo RL's
# recipes copy the policy's block; a teacher is not trained and does not sample, so those keys may only hold
# their default or the policy's value (a copy), and any other value is refused (``unused_teacher_keys``).
TEACHER_KEYS = (
    "model_name",
    "gguf_file",
    "tokenizer.name",
    "tokenizer.chat_template",
    "precision",
    "logprob_batch_size",
    "logprob_chunk_size",
    "generation.temperature",
)
# read by ``rlfleet plan`` (the teacher's weights beside the student) and by the checks (refused when set)
TEACHER_PLAN_KEYS = ("architecture",)
TEACHER_REFUSED_KEYS = ("dtensor_cfg.lora_cfg.enabled", "reward_model_cfg.enabled")


class DistillationConfig(Strict):
    """On-policy distillation (NeMo RL ``distillation.*``). A step: ``num_prompts_per_step`` prompts x
    ``num_generations_per_prompt`` samples from the student, the teacher's top ``topk_logits_k`` at every
    position of those sequences, one optimizer step per ``policy.train_global_batch_size`` sequences on the
    per-token KL over the response tokens; validation is the task's greedy accuracy."""

    num_prompts_per_step: int = Field(128, ge=1, description="Prompts per step.")
    num_generations_per_prompt: int = Field(1, ge=1, description="Student samples per prompt.")
    max_rollout_turns: int = Field(1, ge=1, description="Model turns per episode (tool environments).")
    max_num_steps: int = Field(1000, ge=0)
    max_num_epochs: int = Field(10, ge=1)
    val_period: int = Field(20, ge=0, description="Validate every N steps (0 = only at start/end).")
    val_at_start: bool = False
    val_at_end: bool = False
    max_val_samples: int = Field(512, ge=1, description="Validation prompts used (first N).")
    topk_logits_k: int = Field(64, ge=1, description="Teacher logits kept per position (its top k).")
    seed: int = 42
