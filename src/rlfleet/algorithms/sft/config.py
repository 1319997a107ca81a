"""SFT's config section (NeMo RL's ``sft.*`` keys)."""

from __future__ import annotations

from pydantic import Field

from rlfleet.config.strict import Strict


class SFTConfig(Strict):
    """Supervised fine-tuning on (prompt, worked answer) pairs; batch sizes come from ``policy.*``."""

    max_num_steps: int = Field(100, ge=0)
    max_num_epochs: int = Field(1, ge=1)
    max_rollout_turns: int = Field(
        1,
        ge=1,
        description="Model turns per validation episode (environments that answer tool calls need several).",
    )
    val_period: int = Field(10, ge=0)
    val_at_start: bool = True
    val_at_end: bool = True
    max_val_samples: int = Field(256, ge=1)
    seed: int = 42
