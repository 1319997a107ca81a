"""Rollouts: sample ``G`` responses per prompt and score each one, the step GRPO, validation and
``rlfleet eval`` share.

GRPO calls the two halves (:func:`generate_rollouts`, then :func:`score`) so that it can time them apart;
validation and evaluation call :func:`sample_and_score`. Whether a response is correct is decided by
:func:`rlfleet.rewards.correctness.is_correct` alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rlfleet.data import Prompt
from rlfleet.generation import GenerationBackend, GenerationResult, SamplingParams
from rlfleet.rewards import RewardBatch, ScoringPool
from rlfleet.rewards.correctness import is_correct


@dataclass(frozen=True)
class Rollout:
    """One sampled response to one prompt (or one multi-turn episode), with its reward.

    Attributes:
        prompt: The prompt.
        result: The tokens after the prompt and their logprobs (an episode's: every turn and observation).
        reward: The reward (an episode's return).
        mask: 1 on the tokens the model sampled, 0 on observation tokens; None: every token is sampled.
        conversation: An episode's messages, turn by turn; None for a single response.
        info: An episode's counters (``turns``, ``cut``, ``tool_calls``...).
    """

    prompt: Prompt
    result: GenerationResult
    reward: float
    mask: tuple[int, ...] | None = None
    conversation: tuple[dict[str, str], ...] | None = None
    info: Mapping[str, float] | None = None

    @property
    def correct(self) -> bool:
        return is_correct(self.reward)

    @property
    def num_response_tokens(self) -> int:
        """Tokens the model generated (observation tokens excluded)."""
        return len(self.result.token_ids) if self.mask is None else sum(self.mask)

    def sample(self) -> dict[str, object]:
        """The record ``samples.jsonl`` keeps of this rollout (an episode's whole conversation)."""
        ex = self.prompt.example
        record: dict[str, object] = {
            "prompt": ex.question,
            "response": self.result.text,
            "gold": ex.gold,
            "reward": self.reward,
        }
        if self.conversation is not None:
            record["conversation"] = list(self.conversation)
            record.update(self.info or {})
        return record


def generate_rollouts(
    backend: GenerationBackend, prompts: Sequence[Prompt], group_size: int, params: SamplingParams, seed: int
) -> list[tuple[Prompt, GenerationResult]]:
    """Samples ``group_size`` responses per prompt; the samples of a prompt are contiguous."""
    repeated = [p for p in prompts for _ in range(group_size)]
    results = backend.generate([p.token_ids for p in repeated], params, seed)
    return list(zip(repeated, results, strict=True))


def score(
    pairs: Sequence[tuple[Prompt, GenerationResult]], verifier: ScoringPool
) -> tuple[list[Rollout], RewardBatch]:
    """Rewards every response with the verifier pool (bounded time per response)."""
    batch = verifier.score([(p.text, r.text, p.example.gold) for p, r in pairs])
    rollouts = [Rollout(p, r, float(x)) for (p, r), x in zip(pairs, batch.rewards, strict=True)]
    return rollouts, batch


def sample_and_score(
    backend: GenerationBackend,
    prompts: Sequence[Prompt],
    verifier: ScoringPool,
    group_size: int,
    params: SamplingParams,
    seed: int,
) -> tuple[list[Rollout], RewardBatch]:
    """``group_size`` scored responses per prompt, the samples of a prompt contiguous."""
    return score(generate_rollouts(backend, prompts, group_size, params, seed), verifier)


def accuracy(rollouts: Sequence[Rollout]) -> float:
    """Fraction of the rollouts that are correct (0.0 for none)."""
    return sum(r.correct for r in rollouts) / max(len(rollouts), 1)


def mean_reward(rollouts: Sequence[Rollout]) -> float:
    return sum(r.reward for r in rollouts) / max(len(rollouts), 1)


def mean_response_length(rollouts: Sequence[Rollout]) -> float:
    """Mean response length in tokens (0.0 for none)."""
    return sum(r.num_response_tokens for r in rollouts) / max(len(rollouts), 1)


def correct_per_group(rollouts: Sequence[Rollout], group_size: int) -> list[int]:
    """Correct responses in each prompt's group of ``group_size`` contiguous rollouts."""
    if len(rollouts) % group_size:
        raise ValueError(f"{len(rollouts)} rollouts do not split into groups of {group_size}")
    return [sum(r.correct for r in rollouts[i : i + group_size]) for i in range(0, len(rollouts), group_size)]
