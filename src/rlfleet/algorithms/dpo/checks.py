"""DPO's own config checks (its description's ``checks``): the overlong shaping of its own samples. Each
problem names the key, the value, the constraint and a fix."""

from __future__ import annotations

from rlfleet.config.layout import ResourceLayout
from rlfleet.config.preferences import PREFERENCE_DATASETS
from rlfleet.config.schema import MasterConfig
from rlfleet.config.shaping import shaping_problems


def dpo_problems(cfg: MasterConfig, layout: ResourceLayout) -> list[str]:
    """DPO's overlong shaping of its own samples: against the response limit, and only where it samples."""
    key, shaping = "dpo.sampled_pairs.reward_shaping", cfg.dpo.sampled_pairs.reward_shaping
    if shaping.enabled and cfg.data.dataset_name in PREFERENCE_DATASETS:
        return [
            f"{key}.enabled=true ranks the model's own samples, but data.dataset_name="
            f"{cfg.data.dataset_name} gives the pairs (nothing is sampled); fix: {key}.enabled=false, or a "
            "task dataset to sample pairs from"
        ]
    return shaping_problems(shaping, key, cfg.policy.generation.max_new_tokens)
