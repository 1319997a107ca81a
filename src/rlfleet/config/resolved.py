"""What a config means where a key is left null: the one reading shared by the components that build from
the config and by :mod:`rlfleet.config.describe`."""

from __future__ import annotations

from typing import Literal

from rlfleet.config.schema import LossConfig

Truncation = Literal["tis", "icepop", "seq-mask-tis"]


def truncation_type(loss_cfg: LossConfig) -> Truncation | None:
    """The importance-sampling truncation ``loss_cfg`` asks for: ``truncated_importance_sampling_type``,
    else ``"tis"`` when only the cap (``truncated_importance_sampling_ratio``) is set, else None."""
    kind = loss_cfg.truncated_importance_sampling_type
    if kind is None and loss_cfg.truncated_importance_sampling_ratio is not None:
        return "tis"
    return kind
