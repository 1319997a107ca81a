"""DAPO's overlong reward shaping, one config section read by GRPO (``grpo.reward_shaping``, NeMo RL's key)
and by DPO's sampled pairs (``dpo.sampled_pairs.reward_shaping``), and the one check of it against the
response limit."""

from __future__ import annotations

from pydantic import Field

from rlfleet.config.strict import Strict


class RewardShapingConfig(Strict):
    """DAPO's overlong reward shaping (NeMo RL ``grpo.reward_shaping``): a response longer than
    ``max_response_length - overlong_buffer_length`` tokens loses ``overlong_buffer_penalty`` x the share of
    the buffer it uses, down to ``-overlong_buffer_penalty`` at ``max_response_length``."""

    enabled: bool = Field(False, description="Apply the overlong penalty to the rewards.")
    overlong_buffer_length: int = Field(
        128, ge=1, description="Tokens before the limit where the penalty grows."
    )
    overlong_buffer_penalty: float = Field(1.0, ge=0.0, description="Penalty at (and beyond) the limit.")
    max_response_length: int | None = Field(
        None, ge=1, description="The response limit; null means policy.generation.max_new_tokens."
    )


def shaping_problems(rs: RewardShapingConfig, key: str, max_new_tokens: int) -> list[str]:
    """What keeps the shaping section at ``key`` (``grpo.reward_shaping``...) from ever applying or fitting
    the responses of at most ``max_new_tokens`` tokens."""
    limit = rs.max_response_length or max_new_tokens
    if rs.enabled and rs.overlong_buffer_length > limit:
        return [
            f"{key}.overlong_buffer_length={rs.overlong_buffer_length} exceeds the response "
            f"limit {limit} (reward_shaping.max_response_length, else policy.generation.max_new_tokens); "
            f"fix: a buffer of at most {limit} tokens (DAPO: a fifth of the limit, e.g. {max(1, limit // 5)})"
        ]
    if rs.enabled and limit - rs.overlong_buffer_length >= max_new_tokens:
        return [
            f"{key}: the penalty starts after {limit - rs.overlong_buffer_length} tokens "
            f"(max_response_length {limit} - overlong_buffer_length {rs.overlong_buffer_length}), but "
            f"responses stop at policy.generation.max_new_tokens={max_new_tokens}, so it would never apply; "
            f"fix: {key}.max_response_length=null (follows max_new_tokens) or a longer buffer"
        ]
    return []
