"""Micro-batch token budgets: ``policy.dynamic_batching`` and ``policy.sequence_packing`` arithmetic.

The one place their defaults are derived (NeMo RL's recipes interpolate the same products); their
cross-field checks are in :mod:`rlfleet.config.checks`.
"""

from __future__ import annotations

from typing import Literal

from rlfleet.config.schema import PolicyConfig

Pass = Literal["train", "logprob"]


def micro_batch_rows(policy: PolicyConfig, pass_: Pass) -> int:
    """Rows per fixed-size micro-batch of ``pass_``."""
    return policy.train_micro_batch_size if pass_ == "train" else policy.logprob_batch_size


def micro_batch_tokens(policy: PolicyConfig, pass_: Pass) -> int | None:
    """The token budget of a ``pass_`` micro-batch under sequence packing or dynamic batching (whichever
    is enabled), defaulting to ``max_total_sequence_length x`` its row count; None when neither is."""
    for section in (policy.sequence_packing, policy.dynamic_batching):
        if section.enabled:
            tokens = section.train_mb_tokens if pass_ == "train" else section.logprob_mb_tokens
            return (
                tokens
                if tokens is not None
                else policy.max_total_sequence_length * micro_batch_rows(policy, pass_)
            )
    return None
