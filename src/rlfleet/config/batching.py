"""Micro-batch token budgets: ``policy.dynamic_batching`` and ``policy.sequence_packing`` arithmetic.

The one place their defaults are derived (NeMo RL's recipes interpolate the same products) and their
cross-field checks live.
"""

from __future__ import annotations

from typing import Literal

from rlfleet.config.schema import MasterConfig, PolicyConfig

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


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def check_micro_batching(cfg: MasterConfig) -> list[str]:
    """Both modes at once, and token budgets a maximal sequence would not fit."""
    p = cfg.policy
    dyn, pack = p.dynamic_batching, p.sequence_packing
    if dyn.enabled and pack.enabled:
        return [
            "policy.dynamic_batching.enabled and policy.sequence_packing.enabled are both true, but a "
            "micro-batch is either padded rows grouped by tokens or packed rows, not both (NeMo RL refuses "
            "this too); fix: set one of them to false (sequence packing computes no padding at all)"
        ]
    problems = []
    for name, section in (("dynamic_batching", dyn), ("sequence_packing", pack)):
        if not section.enabled:
            continue
        longest, why = (
            p.max_total_sequence_length,
            f"policy.max_total_sequence_length={p.max_total_sequence_length}",
        )
        if name == "dynamic_batching":
            longest = _round_up(longest, dyn.sequence_length_round)
            why += f" rounded up to sequence_length_round={dyn.sequence_length_round}"
        for pass_ in ("train", "logprob"):
            tokens = micro_batch_tokens(p, pass_)
            if tokens is not None and tokens < longest:
                problems.append(
                    f"policy.{name}.{pass_}_mb_tokens={tokens} is smaller than the longest sequence a step "
                    f"can hold ({longest} tokens: {why}), so such a sequence would fit no micro-batch; fix: "
                    f"policy.{name}.{pass_}_mb_tokens={longest} or more (or null for "
                    "max_total_sequence_length x the micro-batch rows)"
                )
    return problems
