"""The reward model's config section (NeMo RL's ``rm.*`` keys)."""

from __future__ import annotations

from pydantic import Field

from rlfleet.config.strict import Strict


class RMConfig(Strict):
    """Bradley-Terry reward-model training (NeMo RL ``rm.*``, its defaults). A step takes
    ``policy.train_global_batch_size`` pairs of a preference dataset (twice as many rows: chosen and
    rejected) and makes one optimizer step on ``-log sigmoid(r_chosen - r_rejected)``, ``r`` the model's
    score of the sequence at its last token; ``policy.train_micro_batch_size`` counts pairs too.
    """

    max_num_steps: int = Field(
        -1, ge=-1, description="Stop after this many steps; -1: no limit (max_num_epochs decides)."
    )
    max_num_epochs: int = Field(1, ge=1)
    val_period: int = Field(16, ge=0)
    val_batches: int = Field(-1, ge=-1, description="Validation batches of pairs; -1: every validation pair.")
    val_global_batch_size: int = Field(32, ge=1, description="Pairs per validation batch.")
    val_micro_batch_size: int = Field(1, ge=1, description="Pairs per validation forward pass.")
    val_at_start: bool = False
    val_at_end: bool = False
    seed: int = 42
