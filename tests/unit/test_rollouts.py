"""One meaning of "correct": training accuracy, validation accuracy and pass@k all count ``is_correct``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from rlfleet.algorithms.grpo.loop import rollout_metrics
from rlfleet.data import Example, Prompt
from rlfleet.environments import EnvironmentInterface, EnvironmentReturn
from rlfleet.environments.builtin import last_assistant
from rlfleet.environments.interface import MessageLog
from rlfleet.environments.runner import InProcessRunner
from rlfleet.generation import GenerationResult, SamplingParams
from rlfleet.rewards.correctness import is_correct
from rlfleet.rollouts.episodes import EpisodeRunner
from rlfleet.rollouts.rollout import Rollout, accuracy, correct_per_group, mean_reward
from rlfleet.rollouts.validation import evaluate, pass_at_k

PARAMS = SamplingParams(max_new_tokens=4)


class FakeBackend:
    """Answers prompt ``i``'s ``k``-th sample with the text ``"i.k"`` (``k`` counts the prompt's samples)."""

    def generate_rows(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[GenerationResult]:
        seen: dict[int, int] = {}
        out = []
        for ids in prompts:
            k = seen[ids[0]] = seen.get(ids[0], -1) + 1
            out.append(GenerationResult((ids[0], k), (0.0, 0.0), f"{ids[0]}.{k}", True))
        return out


class FakeTokenizer:
    eos_token = eos_token_id = None


class TableEnvironment(EnvironmentInterface[Any]):
    """One turn, rewarded by a lookup table keyed by the response's text."""

    def step(self, message_log_batch: list[MessageLog], metadata: list[Any]) -> EnvironmentReturn[Any]:
        rewards = [self.cfg["table"][last_assistant(log)] for log in message_log_batch]
        n = len(rewards)
        return EnvironmentReturn(
            [{"role": "environment", "content": ""}] * n, metadata, [None] * n, rewards, [True] * n, None
        )


def runner(table: dict[str, float]) -> EpisodeRunner:
    env = InProcessRunner("table", TableEnvironment({"table": table}))
    return EpisodeRunner(FakeBackend(), FakeTokenizer(), {"table": env}, "table", 1, 64)  # type: ignore[arg-type]


def rollouts_of(table: dict[str, float], num_prompts: int, group_size: int) -> list[Rollout]:
    return runner(table).run(prompts(num_prompts), group_size, PARAMS, seed=0).rollouts


def prompts(n: int) -> list[Prompt]:
    return [Prompt(Example(f"q{i}", f"a{i}", str(i)), f"p{i}", (i,)) for i in range(n)]


@pytest.mark.parametrize(("reward", "correct"), [(1.0, True), (0.51, True), (0.5, False), (0.0, False)])
def test_a_reward_above_one_half_is_correct(reward: float, correct: bool) -> None:
    assert is_correct(reward) is correct


def test_samples_of_a_prompt_are_contiguous() -> None:
    table = {f"{i}.{k}": 0.0 for i in range(2) for k in range(3)}
    rollouts = rollouts_of(table, 2, 3)
    assert [r.result.text for r in rollouts] == ["0.0", "0.1", "0.2", "1.0", "1.1", "1.2"]
    assert [r.prompt.example.gold for r in rollouts] == ["0", "0", "0", "1", "1", "1"]
    assert [r.sample()["response"] for r in rollouts] == [r.result.text for r in rollouts]


def test_validation_reports_fraction_correct_and_mean_reward_apart() -> None:
    episodes = runner({"0.0": 1.0, "1.0": 0.5, "2.0": 0.2, "3.0": 0.9})
    metrics = evaluate(episodes, prompts(4), PARAMS, seed=0).metrics("val")
    assert metrics["val/accuracy"] == 0.5  # 1.0 and 0.9; the half credit is not correct
    assert metrics["val/reward"] == pytest.approx(0.65)
    assert metrics["val/mean_response_length"] == 2.0
    assert metrics["val/turns_per_episode"] == 1.0


def test_train_accuracy_and_pass_at_k_count_the_same_responses() -> None:
    table = {"0.0": 1.0, "0.1": 0.5, "1.0": 0.0, "1.1": 0.75}
    rollouts = rollouts_of(table, 2, 2)
    rewards = torch.tensor([r.reward for r in rollouts])
    metrics = rollout_metrics(rollouts, rewards, group_size=2)
    assert metrics["train/accuracy"] == accuracy(rollouts) == 0.5
    assert metrics["train/reward"] == pytest.approx(mean_reward(rollouts)) == pytest.approx(0.5625)
    assert correct_per_group(rollouts, 2) == [1, 1]
    assert [pass_at_k(2, c, 1) for c in correct_per_group(rollouts, 2)] == [0.5, 0.5]


def test_groups_must_be_whole() -> None:
    rollouts = rollouts_of({"0.0": 1, "1.0": 1, "2.0": 1}, 3, 1)
    with pytest.raises(ValueError, match="do not split into groups of 2"):
        correct_per_group(rollouts, 2)
