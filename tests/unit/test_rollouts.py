"""One meaning of "correct": training accuracy, validation accuracy and pass@k all count ``is_correct``."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from rlfleet.algorithms.evaluation import evaluate, pass_at_k
from rlfleet.algorithms.grpo import rollout_metrics
from rlfleet.algorithms.rollouts import (
    accuracy,
    correct_per_group,
    generate_rollouts,
    mean_reward,
    sample_and_score,
)
from rlfleet.data import Example, Prompt
from rlfleet.generation import GenerationResult, SamplingParams
from rlfleet.rewards import RewardBatch
from rlfleet.rewards.correctness import is_correct

PARAMS = SamplingParams(max_new_tokens=4)


class FakeBackend:
    """Answers prompt ``i``'s ``k``-th sample with the text ``"i.k"`` (``k`` counts the prompt's samples)."""

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int
    ) -> list[GenerationResult]:
        seen: dict[int, int] = {}
        out = []
        for ids in prompts:
            k = seen[ids[0]] = seen.get(ids[0], -1) + 1
            out.append(GenerationResult((ids[0], k), (0.0, 0.0), f"{ids[0]}.{k}", True))
        return out

    def refit(self) -> None: ...

    def take_metrics(self) -> dict[str, float]:
        return {}


class TableVerifier:
    """Rewards each response by a lookup table keyed by its text (the ``score`` of a ``ScoringPool``)."""

    def __init__(self, table: dict[str, float]) -> None:
        self.table = table

    def score(self, items: Sequence[tuple[str, str, str]]) -> RewardBatch:
        return RewardBatch([self.table[response] for _, response, _ in items])


def prompts(n: int) -> list[Prompt]:
    return [Prompt(Example(f"q{i}", f"a{i}", str(i)), f"p{i}", (i,)) for i in range(n)]


@pytest.mark.parametrize(("reward", "correct"), [(1.0, True), (0.51, True), (0.5, False), (0.0, False)])
def test_a_reward_above_one_half_is_correct(reward: float, correct: bool) -> None:
    assert is_correct(reward) is correct


def test_samples_of_a_prompt_are_contiguous() -> None:
    pairs = generate_rollouts(FakeBackend(), prompts(2), 3, PARAMS, seed=0)
    assert [r.text for _, r in pairs] == ["0.0", "0.1", "0.2", "1.0", "1.1", "1.2"]
    assert [p.example.gold for p, _ in pairs] == ["0", "0", "0", "1", "1", "1"]


def test_validation_reports_fraction_correct_and_mean_reward_apart() -> None:
    verifier = TableVerifier({"0.0": 1.0, "1.0": 0.5, "2.0": 0.2, "3.0": 0.9})
    result = evaluate(FakeBackend(), prompts(4), verifier, PARAMS, seed=0)
    assert result.metrics("val") == {
        "val/accuracy": 0.5,  # 1.0 and 0.9; the half credit is not correct
        "val/reward": pytest.approx(0.65),
        "val/mean_response_length": 2.0,
    }


def test_train_accuracy_and_pass_at_k_count_the_same_responses() -> None:
    table = {"0.0": 1.0, "0.1": 0.5, "1.0": 0.0, "1.1": 0.75}
    rollouts, _ = sample_and_score(FakeBackend(), prompts(2), TableVerifier(table), 2, PARAMS, seed=0)
    rewards = torch.tensor([r.reward for r in rollouts])
    metrics = rollout_metrics(rollouts, rewards, group_size=2)
    assert metrics["train/accuracy"] == accuracy(rollouts) == 0.5
    assert metrics["train/reward"] == pytest.approx(mean_reward(rollouts)) == pytest.approx(0.5625)
    assert correct_per_group(rollouts, 2) == [1, 1]
    assert [pass_at_k(2, c, 1) for c in correct_per_group(rollouts, 2)] == [0.5, 0.5]


def test_groups_must_be_whole() -> None:
    rollouts, _ = sample_and_score(
        FakeBackend(), prompts(3), TableVerifier({"0.0": 1, "1.0": 1, "2.0": 1}), 1, PARAMS, 0
    )
    with pytest.raises(ValueError, match="do not split into groups of 2"):
        correct_per_group(rollouts, 2)
