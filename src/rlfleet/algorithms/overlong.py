"""DAPO's overlong handling: a length penalty on the rewards, and truncated responses masked from the loss.

DAPO (Yu et al. 2025, section 3.4) shapes the reward of a response of ``L`` tokens with a limit ``L_max``
and a buffer ``L_buf``::

    penalty = 0                                  if L <= L_max - L_buf
            = -p * (L - (L_max - L_buf)) / L_buf  if L_max - L_buf < L <= L_max
            = -p                                 if L > L_max

(NeMo RL's ``grpo.reward_shaping`` keys; ``p`` is ``overlong_buffer_penalty``). Overlong *filtering*
(NeMo RL's ``grpo.overlong_filtering``) instead drops truncated responses from the loss: their tokens'
mask becomes 0, so they neither push the policy nor count in the token normaliser.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlfleet.config.shaping import RewardShapingConfig


def overlong_penalty(
    lengths: torch.Tensor, max_response_length: int, buffer_length: int, penalty: float
) -> torch.Tensor:
    """``[N]`` penalties (<= 0) for responses of ``lengths`` tokens; see the module docstring."""
    if buffer_length < 1 or buffer_length > max_response_length:
        raise ValueError(f"buffer of {buffer_length} tokens does not fit a limit of {max_response_length}")
    excess = (lengths.to(torch.float64) - (max_response_length - buffer_length)).clamp(0, buffer_length)
    return (-penalty * excess / buffer_length).to(torch.float32)


def shape_overlong_rewards(
    rewards: torch.Tensor, lengths: torch.Tensor, max_response_length: int, buffer_length: int, penalty: float
) -> torch.Tensor:
    """``rewards + overlong_penalty(lengths, ...)``."""
    return rewards + overlong_penalty(lengths, max_response_length, buffer_length, penalty).to(rewards.dtype)


def mask_truncated(response_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` response mask with every row of a truncated response (``truncated[i]``) zeroed."""
    return response_mask * (~truncated).to(response_mask.dtype).unsqueeze(1)


@dataclass(frozen=True)
class OverlongShaping:
    """The configured penalty: ``apply(rewards, lengths)`` adds it to the rewards."""

    max_response_length: int
    buffer_length: int
    penalty: float

    @classmethod
    def of(cls, section: RewardShapingConfig, max_new_tokens: int) -> OverlongShaping | None:
        """The penalty a ``reward_shaping`` section configures, or None when it is off (its keys are read
        either way: a key nothing reads would be silently ignored)."""
        shaping = cls(
            section.max_response_length or max_new_tokens,
            section.overlong_buffer_length,
            section.overlong_buffer_penalty,
        )
        return shaping if section.enabled else None

    def apply(self, rewards: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return shape_overlong_rewards(
            rewards, lengths, self.max_response_length, self.buffer_length, self.penalty
        )

    def score(self, reward: float, length: int) -> float:
        """One response's shaped reward."""
        return float(self.apply(torch.tensor([reward]), torch.tensor([length]))[0])
