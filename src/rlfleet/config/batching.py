"""Micro-batch token budgets: ``policy.sequence_packing`` and ``policy.dynamic_batching`` arithmetic.

The one place that decides which of the two sections applies (:func:`token_budget_section`) and where the
recipe's own budgets and their defaults are derived (NeMo RL's recipes interpolate the same products). The
budgets a run uses are resolved once, before it is built, into a :class:`ResolvedBatching`: the recipe's,
or where it leaves one unset the largest that fits the machine
(:func:`rlfleet.memory.planner.resolve_batching`). Their cross-field checks are in
:mod:`rlfleet.config.checks`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from rlfleet.config.schema import PolicyConfig

Pass = Literal["train", "logprob"]
PASSES: tuple[Pass, ...] = ("train", "logprob")
BudgetSection = Literal["sequence_packing", "dynamic_batching"]

SET_BY_RECIPE = "set by the recipe"


def token_budget_section(policy: PolicyConfig) -> BudgetSection | None:
    """The section whose token budgets split the passes' rows: ``sequence_packing`` when it is enabled,
    else ``dynamic_batching`` when it is, else None (fixed rows per micro-batch). Both enabled at once is
    refused by :func:`rlfleet.config.checks.check_config`."""
    if policy.sequence_packing.enabled:
        return "sequence_packing"
    if policy.dynamic_batching.enabled:
        return "dynamic_batching"
    return None


def micro_batch_rows(policy: PolicyConfig, pass_: Pass) -> int:
    """Rows per fixed-size micro-batch of ``pass_``."""
    return policy.train_micro_batch_size if pass_ == "train" else policy.logprob_batch_size


def budget_key(pass_: Pass) -> str:
    """The key of ``pass_``'s token budget in either section."""
    return f"{pass_}_mb_tokens"


def set_budget(policy: PolicyConfig, section: BudgetSection, pass_: Pass) -> int | None:
    """``pass_``'s token budget as ``policy.<section>`` sets it (None: unset)."""
    budgets = policy.sequence_packing if section == "sequence_packing" else policy.dynamic_batching
    return budgets.train_mb_tokens if pass_ == "train" else budgets.logprob_mb_tokens


@dataclass(frozen=True)
class TokenBudget:
    """The token budget of one pass's micro-batches, and why it is what it is.

    ``fitted``: sized to this machine's memory by the planner (the recipe left it unset).
    """

    tokens: int
    why: str
    fitted: bool = False


def recipe_budget(policy: PolicyConfig, section: BudgetSection, pass_: Pass) -> TokenBudget:
    """``pass_``'s budget as the recipe states it: set, else ``max_total_sequence_length x`` its rows."""
    tokens = set_budget(policy, section, pass_)
    if tokens is not None:
        return TokenBudget(tokens, SET_BY_RECIPE)
    rows = "train_micro_batch_size" if pass_ == "train" else "logprob_batch_size"
    return TokenBudget(
        policy.max_total_sequence_length * micro_batch_rows(policy, pass_),
        f"max_total_sequence_length x {rows}",
    )


@dataclass(frozen=True)
class ResolvedBatching:
    """How the passes split their rows, resolved once before a run is built and read by its builders,
    ``rlfleet plan`` and ``validate``.

    Attributes:
        section: The enabled token-budget section (:func:`token_budget_section`); None: fixed rows.
        budgets: Each pass's token budget under ``section`` (empty without one).
    """

    section: BudgetSection | None
    budgets: Mapping[Pass, TokenBudget] = field(default_factory=dict)

    def budget(self, pass_: Pass) -> TokenBudget:
        """``pass_``'s token budget (a run resolves the passes its algorithm has)."""
        if pass_ not in self.budgets:
            resolved = sorted(self.budgets)
            raise KeyError(f"no token budget resolved for the {pass_} pass (resolved: {resolved})")
        return self.budgets[pass_]

    def fitted(self) -> dict[Pass, TokenBudget]:
        """The budgets the planner sized to this machine, by pass."""
        return {pass_: budget for pass_, budget in self.budgets.items() if budget.fitted}

    def micro_batch_tokens(self, policy: PolicyConfig, pass_: Pass) -> int:
        """Tokens of ``pass_``'s largest micro-batch: its token budget, else rows x sequence budget."""
        if self.section is not None and pass_ in self.budgets:
            return self.budgets[pass_].tokens
        return micro_batch_rows(policy, pass_) * policy.max_total_sequence_length


def recipe_batching(policy: PolicyConfig, passes: tuple[Pass, ...] = PASSES) -> ResolvedBatching:
    """The batching as the recipe states it, no machine consulted (what ``describe_grpo`` shows when it
    is given no resolved batching)."""
    section = token_budget_section(policy)
    if section is None:
        return ResolvedBatching(None)
    return ResolvedBatching(section, {pass_: recipe_budget(policy, section, pass_) for pass_ in passes})
