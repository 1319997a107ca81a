"""What the algorithms that learn from preferences share (NeMo RL's names): which datasets are preference
data, and ``policy.reward_model_cfg`` (the policy loaded as a reward model). Each algorithm's own section is
in its folder (``rlfleet.algorithms.dpo.config``, ``rlfleet.algorithms.rm.config``)."""

from __future__ import annotations

from pydantic import Field

from rlfleet.config.strict import Strict

PREFERENCE_DATASETS = ("PreferenceDataset", "BinaryPreferenceDataset")
"""``data.dataset_name`` values that are preference data (NeMo RL's names); any other is a task."""


REWARD_MODEL_TYPES = ("bradley_terry",)
"""``policy.reward_model_cfg.reward_model_type`` values this build trains (NeMo RL also has ``regression``,
its token-level value models)."""


class RewardModelCfg(Strict):
    """``policy.reward_model_cfg`` (NeMo RL's keys): load the policy as a reward model, a sequence classifier
    with one label (the backbone of ``policy.model_name`` and a new score head), which ``rlfleet rm``
    trains and no other algorithm can (it has no language-model head)."""

    enabled: bool = Field(False, description="Load the model as a reward model (rm recipes: true).")
    reward_model_type: str = Field(
        "bradley_terry", description="bradley_terry (one scalar score per sequence) is the one trained here."
    )
