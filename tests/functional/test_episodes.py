"""Multi-turn episodes with the tiny model: token in, token out, observation masking, batch-invariant seeds,
the math environment equal to single-turn scoring, and one bad item costing that item only."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlfleet.data import Example, Prompt, build_prompts
from rlfleet.data.prompts import ObservationTemplate
from rlfleet.environments.runner import (
    STEP_IN_WORKER,
    InProcessRunner,
    PooledRunner,
    build_environment,
    checked_outcome,
)
from rlfleet.generation import GenerationResult, HFGenerationBackend, SamplingParams
from rlfleet.policy.batch import collate
from rlfleet.pools import ProcessWorkerPool
from rlfleet.rollouts.episodes import EpisodeRunner
from tests.functional.rewards_for_tests import first_digit_reward

FIRST_DIGIT = "tests.functional.rewards_for_tests.first_digit_reward"
SCRIPTED = "tests.functional.envs_for_tests:ScriptedEnv"
FLAKY = "tests.functional.envs_for_tests:FlakyEnv"


class Recording:
    """Wraps a backend and keeps every (context, sampled result) it returned."""

    def __init__(self, backend: HFGenerationBackend) -> None:
        self.backend = backend
        self.calls: list[tuple[list[int], GenerationResult]] = []

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int
    ) -> list[GenerationResult]:
        raise AssertionError("episodes sample with generate_rows")

    def generate_rows(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[GenerationResult]:
        results = self.backend.generate_rows(prompts, params, seeds)
        self.calls.extend(zip([list(p) for p in prompts], results, strict=True))
        return results

    def refit(self) -> None: ...

    def take_metrics(self) -> dict[str, float]:
        return {}


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir: Path) -> tuple[Any, Any]:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)


def make_prompts(tokenizer: Any, golds: Sequence[str]) -> list[Prompt]:
    examples = [Example(f"What is {i} + {i}?", "", gold) for i, gold in enumerate(golds)]
    return build_prompts(tokenizer, examples, system_prompt=None, max_prompt_tokens=None)[0]


def scripted_runner(
    backend: Any, tokenizer: Any, turns: int = 3, stops: list[str] | None = None, max_seq_len: int = 256
) -> EpisodeRunner:
    env = build_environment(SCRIPTED, {"turns": turns, "stops": stops, "paid": "constant"})
    return EpisodeRunner(
        backend, tokenizer, {"s": InProcessRunner("s", env)}, "s", max_turns=turns, max_seq_len=max_seq_len
    )


def test_training_ids_are_the_sampled_ids_and_logprobs_match_the_trainer(
    model_and_tokenizer: tuple[Any, Any],
) -> None:
    """For every assistant token of a multi-turn episode the training id is the sampled id, observation
    tokens are masked, and the trainer's logprob equals the engine's (NeMo RL's gen_logprob_error ~ 0)."""
    model, tokenizer = model_and_tokenizer
    backend = Recording(HFGenerationBackend(model, tokenizer, batch_size=8))
    runner = scripted_runner(backend, tokenizer, turns=3, stops=["1"])
    prompts = make_prompts(tokenizer, ["1", "2", "3", "4"])  # one episode each: every context is distinct
    batch = runner.run(prompts, 1, SamplingParams(max_new_tokens=12), seed=7)
    rollouts = batch.rollouts
    assert batch.metrics["turns_per_episode"] == 3.0
    template = ObservationTemplate(tokenizer)
    sampled_by_context = {tuple(ctx): result for ctx, result in backend.calls}
    for rollout in rollouts:
        assert rollout.mask is not None and rollout.conversation is not None
        assert rollout.reward == pytest.approx(0.75)
        ids, mask = list(rollout.result.token_ids), list(rollout.mask)
        context = list(rollout.prompt.token_ids)
        position = 0
        observations = [m for m in rollout.conversation if m["role"] == "tool"]
        for turn in range(3):
            sampled = sampled_by_context[tuple(context)]  # what the engine got and returned this turn
            n = len(sampled.token_ids)
            assert ids[position : position + n] == list(sampled.token_ids)
            assert mask[position : position + n] == [1] * n
            assert list(rollout.result.logprobs[position : position + n]) == list(sampled.logprobs)
            context += list(sampled.token_ids)
            position += n
            if turn < 2:
                obs = template.ids(
                    observations[turn], ended_with_eos=sampled.token_ids[-1] == tokenizer.eos_token_id
                )
                assert ids[position : position + len(obs)] == obs
                assert mask[position : position + len(obs)] == [0] * len(obs)
                context += obs
                position += len(obs)
        assert position == len(ids)
        assert rollout.num_response_tokens == sum(mask) < len(ids)
    # the trainer's logprobs of the sampled tokens
    train = collate(
        [r.prompt.token_ids for r in rollouts],
        [r.result.token_ids for r in rollouts],
        tokenizer.pad_token_id,
        [r.result.logprobs for r in rollouts],
        [r.mask for r in rollouts],
    )
    with torch.no_grad():
        logits = model(input_ids=train.input_ids, attention_mask=train.attention_mask).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, train.input_ids[:, 1:, None])[..., 0]
    gen = train.generation_logprobs
    assert gen is not None
    mask = train.response_mask[:, 1:]
    error = ((logprobs - gen[:, 1:]).abs() * mask).max()
    assert float(error) < 1e-4
    assert float(mask.sum()) == sum(r.num_response_tokens for r in rollouts)


def test_stop_strings_end_a_turn_after_the_completing_token(model_and_tokenizer: tuple[Any, Any]) -> None:
    model, tokenizer = model_and_tokenizer
    backend = HFGenerationBackend(model, tokenizer, batch_size=8)
    prompts = [p.token_ids for p in make_prompts(tokenizer, ["1"] * 6)]
    results = backend.generate(prompts, SamplingParams(max_new_tokens=40, stop_strings=("e",)), seed=3)
    stopped = 0
    for result in results:
        text = tokenizer.decode(list(result.token_ids), skip_special_tokens=False)
        before = tokenizer.decode(list(result.token_ids[:-1]), skip_special_tokens=False)
        if "e" in text:
            stopped += 1
            assert "e" not in before and result.finished
    assert stopped > 0


def test_episode_seeds_are_batch_invariant(model_and_tokenizer: tuple[Any, Any]) -> None:
    """An episode's turns do not depend on the other episodes of the call (each row has its own seed)."""
    model, tokenizer = model_and_tokenizer
    backend = HFGenerationBackend(model, tokenizer, batch_size=3)
    prompts = make_prompts(tokenizer, ["1", "2", "3"])
    params = SamplingParams(max_new_tokens=10)
    whole = (
        scripted_runner(backend, tokenizer, turns=2, stops=["2"]).run(prompts, 2, params, seed=11).rollouts
    )
    again = (
        scripted_runner(backend, tokenizer, turns=2, stops=["2"]).run(prompts, 2, params, seed=11).rollouts
    )
    assert [r.result.token_ids for r in whole] == [r.result.token_ids for r in again]
    assert len({r.result.token_ids for r in whole}) > 1


def test_the_sequence_budget_cuts_an_episode(model_and_tokenizer: tuple[Any, Any]) -> None:
    model, tokenizer = model_and_tokenizer
    backend = HFGenerationBackend(model, tokenizer, batch_size=8)
    prompts = make_prompts(tokenizer, ["1"])
    budget = len(prompts[0].token_ids) + 20
    runner = scripted_runner(backend, tokenizer, turns=5, max_seq_len=budget)
    batch = runner.run(prompts, 2, SamplingParams(max_new_tokens=12), seed=5)
    assert batch.metrics["episodes_cut"] == 1.0
    for rollout in batch.rollouts:
        assert len(rollout.prompt.token_ids) + len(rollout.result.token_ids) <= budget
        assert not rollout.result.finished and rollout.info is not None and rollout.info["cut"] == 1.0


def test_the_math_environment_scores_as_single_turn_grpo(model_and_tokenizer: tuple[Any, Any]) -> None:
    """Episodes with the math environment give the single-turn rollouts and rewards, token for token."""
    model, tokenizer = model_and_tokenizer
    backend = HFGenerationBackend(model, tokenizer, batch_size=8)
    examples = [Example(f"What is {i} + 1?", "", str(i + 1)) for i in range(4)]
    prompts = build_prompts(tokenizer, examples, system_prompt=None, max_prompt_tokens=None)[0]
    params = SamplingParams(max_new_tokens=8)
    # single-turn sampling and scoring by hand: G samples per prompt with the call's seed, then the reward
    repeated = [p for p in prompts for _ in range(3)]
    single = backend.generate([p.token_ids for p in repeated], params, seed=2)
    rewards = [
        first_digit_reward(p.text, r.text, p.example.gold) for p, r in zip(repeated, single, strict=True)
    ]
    math = build_environment("math", {"reward_fn": "tests.functional.rewards_for_tests.first_digit_reward"})
    pool = ProcessWorkerPool(STEP_IN_WORKER, 1, 5.0, convert=checked_outcome)
    runners = {
        "in-process": InProcessRunner("math", math),
        "worker-processes": PooledRunner("math", "math", {"reward_fn": FIRST_DIGIT}, math, pool),
    }
    for runner in runners.values():
        with closing(runner):
            episodes = EpisodeRunner(backend, tokenizer, {"math": runner}, "math", 1, 256).run(
                prompts, 3, params, seed=2
            )
        assert [r.result.token_ids for r in episodes.rollouts] == [r.token_ids for r in single]
        assert [r.result.logprobs for r in episodes.rollouts] == [r.logprobs for r in single]
        assert [r.result.text for r in episodes.rollouts] == [r.text for r in single]
        assert [r.result.finished for r in episodes.rollouts] == [r.finished for r in single]  # truncation
        assert [r.reward for r in episodes.rollouts] == rewards
        assert all(r.mask == (1,) * len(r.result.token_ids) for r in episodes.rollouts)


@pytest.mark.parametrize("pooled", [False, True], ids=["in-process", "worker-processes"])
def test_a_failing_item_costs_that_item_only(model_and_tokenizer: tuple[Any, Any], pooled: bool) -> None:
    model, tokenizer = model_and_tokenizer
    backend = HFGenerationBackend(model, tokenizer, batch_size=8)
    kinds = ["ok", "raise", "malformed", "ok"] + (["hang"] if pooled else [])
    prompts = make_prompts(tokenizer, kinds)
    env = build_environment(FLAKY, {})
    if pooled:
        pool = ProcessWorkerPool(STEP_IN_WORKER, 2, 3.0, convert=checked_outcome)
        runner: Any = PooledRunner("f", FLAKY, {}, env, pool)
    else:
        runner = InProcessRunner("f", env)
    try:
        batch = EpisodeRunner(backend, tokenizer, {"f": runner}, "f", 1, 256).run(
            prompts, 1, SamplingParams(max_new_tokens=4), seed=0
        )
    finally:
        runner.close()
    rewards = {kind: r.reward for kind, r in zip(kinds, batch.rollouts, strict=True)}
    assert rewards["ok"] == 1.0
    assert all(rewards[k] == 0.0 for k in kinds if k != "ok")
    failed = [r.info["env_failed"] for r in batch.rollouts if r.info is not None]
    assert failed == [float(k != "ok") for k in kinds]
    assert batch.num_errors + batch.num_timeouts == len(kinds) - 2
    if pooled:
        assert batch.num_timeouts >= 1  # the hang
