"""Measuring a policy on the validation prompts: the loops' validation and ``rlfleet eval``.

Both sample and score with :func:`~rlfleet.algorithms.rollouts.sample_and_score` and count a response as
correct by :func:`~rlfleet.rewards.correctness.is_correct`: validation reports ``val/accuracy`` (fraction
correct) and ``val/reward`` (mean reward); ``rlfleet eval`` reports pass@1 and pass@k.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from math import comb
from pathlib import Path
from typing import Any

from rlfleet.algorithms.builders import build_policy, build_verifier, load_prompts
from rlfleet.algorithms.envs import build_episode_runner, close_runners, environment_runners, prompt_tools
from rlfleet.algorithms.episodes import EpisodeRunner
from rlfleet.algorithms.rollouts import (
    Rollout,
    accuracy,
    correct_per_group,
    mean_response_length,
    mean_reward,
    sample_and_score,
)
from rlfleet.config import MasterConfig
from rlfleet.config.layout import resource_layout
from rlfleet.data import Prompt, load_task, resolve_system_prompt
from rlfleet.generation import GenerationBackend, SamplingParams
from rlfleet.logging import write_jsonl
from rlfleet.rewards import ScoringPool


@dataclass
class EvalResult:
    """Validation of one policy: one response per prompt."""

    accuracy: float
    reward: float
    mean_response_length: float
    samples: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)  # the episodes' metrics (turns, tool calls...)

    def metrics(self, prefix: str = "val") -> dict[str, float]:
        return {
            f"{prefix}/accuracy": self.accuracy,
            f"{prefix}/reward": self.reward,
            f"{prefix}/mean_response_length": self.mean_response_length,
            **{f"{prefix}/{key}": value for key, value in self.extra.items()},
        }


def evaluate(
    backend: GenerationBackend,
    prompts: Sequence[Prompt],
    verifier: ScoringPool,
    params: SamplingParams,
    seed: int,
    num_samples_to_keep: int = 4,
    episodes: EpisodeRunner | None = None,
) -> EvalResult:
    """Generates one response (or, with ``episodes``, one episode) per prompt and scores it: fraction
    correct, mean reward, mean length (and the episodes' metrics)."""
    rollouts, metrics = scored_rollouts(backend, prompts, verifier, 1, params, seed, episodes)
    return EvalResult(
        accuracy=accuracy(rollouts),
        reward=mean_reward(rollouts),
        mean_response_length=mean_response_length(rollouts),
        samples=[r.sample() for r in rollouts[:num_samples_to_keep]],
        extra=metrics,
    )


def scored_rollouts(
    backend: GenerationBackend,
    prompts: Sequence[Prompt],
    verifier: ScoringPool,
    group_size: int,
    params: SamplingParams,
    seed: int,
    episodes: EpisodeRunner | None,
) -> tuple[list[Rollout], dict[str, float]]:
    """``group_size`` scored responses per prompt, or episodes with the environments; and their metrics."""
    if episodes is None:
        return sample_and_score(backend, prompts, verifier, group_size, params, seed)[0], {}
    batch = episodes.run(prompts, group_size, params, seed)
    return batch.rollouts, batch.metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al., 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclass(frozen=True)
class EvalReport:
    model: str
    checkpoint: str | None
    num_prompts: int
    samples_per_prompt: int
    greedy: bool
    k: int
    pass_at_1: float
    pass_at_k: float
    mean_response_length: float
    seconds: float
    samples_file: str | None = None  # every scored response (prompt, response, gold, reward), JSON lines

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def table(self) -> str:
        mode = "greedy" if self.greedy else f"{self.samples_per_prompt} samples/prompt"
        return "\n".join(
            [
                f"model        {self.model}"
                + (f" (checkpoint {self.checkpoint})" if self.checkpoint else ""),
                f"prompts      {self.num_prompts} ({mode})",
                f"pass@1       {self.pass_at_1:.4f}",
                *([f"pass@{self.k:<7} {self.pass_at_k:.4f}"] if self.k > 1 else []),
                f"mean length  {self.mean_response_length:.1f} tokens",
                f"time         {self.seconds:.1f} s",
                *([f"samples      {self.samples_file}"] if self.samples_file else []),
            ]
        )


def run_eval(
    cfg: MasterConfig, checkpoint: Path | None = None, samples_path: Path | None = None
) -> EvalReport:
    """Generates ``eval.num_tests_per_prompt`` responses per validation prompt and scores them; with
    ``samples_path``, writes every scored response there as JSON lines (``prompt``, ``response``, ``gold``,
    ``reward``, groups in order), so a user can read why a model scores what it scores."""
    start = time.perf_counter()
    eval_cfg, gen = cfg.eval, cfg.policy.generation
    examples = load_task(cfg.data)  # every data row checked before the model loads
    layout = resource_layout(cfg)
    runners = environment_runners(cfg, layout, [*examples[0], *examples[1]])
    try:
        policy, backend = build_policy(cfg, layout, seed=eval_cfg.seed, keep_reference=False)
    except BaseException:
        close_runners(runners)
        raise
    try:
        if checkpoint is not None:
            policy.load_weights(checkpoint)
            backend.refit()
        limit = eval_cfg.max_val_samples or 10**9
        prompts = load_prompts(cfg, policy.tokenizer, limit, examples, tools=prompt_tools(cfg, runners)).val
        n, greedy = eval_cfg.num_tests_per_prompt, eval_cfg.num_tests_per_prompt == 1
        params = SamplingParams(gen.max_new_tokens, gen.temperature, gen.top_p, gen.top_k, greedy=greedy)
        episodes = None
        if runners:
            system_prompt = resolve_system_prompt(cfg.data)
            episodes = build_episode_runner(cfg, layout, backend, policy.tokenizer, runners, system_prompt)
        with build_verifier(cfg, layout) as verifier:
            rollouts, _ = scored_rollouts(backend, prompts, verifier, n, params, eval_cfg.seed, episodes)
    finally:
        close_runners(runners)
        policy.close()
    if samples_path is not None:
        write_jsonl(samples_path, [r.sample() for r in rollouts])
    correct = correct_per_group(rollouts, n)
    count = max(len(prompts), 1)
    return EvalReport(
        model=cfg.policy.model_name,
        checkpoint=str(checkpoint) if checkpoint else None,
        num_prompts=len(prompts),
        samples_per_prompt=n,
        greedy=greedy,
        k=eval_cfg.pass_k_value,
        pass_at_1=sum(pass_at_k(n, c, 1) for c in correct) / count,
        pass_at_k=sum(pass_at_k(n, c, eval_cfg.pass_k_value) for c in correct) / count,
        mean_response_length=mean_response_length(rollouts),
        seconds=time.perf_counter() - start,
        samples_file=str(samples_path) if samples_path is not None else None,
    )
