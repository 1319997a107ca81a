"""The reward model's own config checks (its description's ``checks``): what ``rlfleet rm`` needs of the
policy section. Each problem names the key, the value, the constraint and a fix."""

from __future__ import annotations

from rlfleet.config.layout import ResourceLayout
from rlfleet.config.preferences import REWARD_MODEL_TYPES
from rlfleet.config.schema import MasterConfig


def reward_model_problems(cfg: MasterConfig, layout: ResourceLayout) -> list[str]:
    """What ``rlfleet rm`` needs of the policy section."""
    p, problems = cfg.policy, []
    rm_cfg = p.reward_model_cfg
    if not rm_cfg.enabled:
        problems.append(
            "policy.reward_model_cfg.enabled=false, but `rlfleet rm` trains the model loaded as a reward "
            "model (a one-label score head on the backbone of policy.model_name); fix: "
            "policy.reward_model_cfg.enabled=true"
        )
    if rm_cfg.reward_model_type not in REWARD_MODEL_TYPES:
        problems.append(
            f"policy.reward_model_cfg.reward_model_type: got {rm_cfg.reward_model_type!r}, but this build "
            f"trains {', '.join(REWARD_MODEL_TYPES)} reward models only (NeMo RL's regression type is not "
            "implemented); fix: policy.reward_model_cfg.reward_model_type=bradley_terry"
        )
    if p.dtensor_cfg.lora_cfg.enabled:
        problems.append(
            "policy.dtensor_cfg.lora_cfg.enabled=true: LoRA freezes every weight but its adapters, so the "
            "reward model's new score head would stay at its random start; fix: lora_cfg.enabled=false "
            "(full fine-tuning)"
        )
    if p.logprob_chunk_size is not None:
        problems.append(
            f"policy.logprob_chunk_size={p.logprob_chunk_size}: a reward model has one score per token, no "
            "vocabulary logits to compute in chunks, so the setting would be ignored; fix: "
            "policy.logprob_chunk_size=null"
        )
    if not p.generation.colocated.enabled:
        problems.append(
            "policy.generation.colocated.enabled=false sets GPUs aside for generation, but a reward model "
            "generates nothing, so they would stay idle; fix: policy.generation.colocated.enabled=true "
            "(every GPU of the cluster trains)"
        )
    return problems
