"""``rlfleet eval``: pass@1 and pass@k of a recipe's model or a checkpoint on the validation prompts.

The episodes are those training and validation run (:mod:`rlfleet.rollouts.validation`): the same
environments, the same notion of a correct response.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rlfleet.config import ConfigError, MasterConfig
from rlfleet.config.capabilities import uses_ray
from rlfleet.config.checks import rollout_turn_problems
from rlfleet.config.layout import resource_layout
from rlfleet.data import load_task, resolve_system_prompt
from rlfleet.environments.runner import EnvRunner
from rlfleet.generation import SamplingParams
from rlfleet.logging import write_jsonl
from rlfleet.rollouts.environment_setup import (
    build_episode_runner,
    close_runners,
    load_environments,
    prompt_tools,
    start_runners,
)
from rlfleet.rollouts.rollout import (
    correct_per_group,
    mean_response_length,
)
from rlfleet.rollouts.validation import pass_at_k
from rlfleet.runtime.components import build_policy, load_prompts


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
    """Generates ``eval.num_tests_per_prompt`` responses per validation prompt (episodes of at most
    ``eval.max_rollout_turns`` model turns) and scores them; with
    ``samples_path``, writes every scored response there as JSON lines (``prompt``, ``response``, ``gold``,
    ``reward``, groups in order), so a user can read why a model scores what it scores."""
    start = time.perf_counter()
    if cfg.policy.reward_model_cfg.enabled:
        raise ConfigError(
            "policy.reward_model_cfg.enabled=true: a reward model scores replies, it does not write them, so "
            "`rlfleet eval` has nothing to sample; fix: `rlfleet export` its checkpoint and score a policy's "
            "replies with it (data.env_name=reward_model, env.reward_model.model_name=<export dir>)"
        )
    eval_cfg, gen = cfg.eval, cfg.policy.generation
    turns = eval_cfg.max_rollout_turns
    problems = rollout_turn_problems(cfg, turns, "eval.max_rollout_turns")
    if problems:
        raise ConfigError(problems)
    examples = load_task(cfg.data)  # every data row checked before the model loads
    layout = resource_layout(cfg)
    rows, on_ray = [*examples[0], *examples[1]], uses_ray(cfg, layout=layout)
    environments = load_environments(cfg, rows, on_ray=on_ray)  # a bad one fails here
    policy, backend = build_policy(cfg, layout, seed=eval_cfg.seed, keep_reference=False)
    runners: dict[str, EnvRunner] = {}
    try:
        runners = start_runners(cfg, layout, environments)
        if checkpoint is not None:
            policy.load_weights(checkpoint)
            backend.refit()
        limit = eval_cfg.max_val_samples or 10**9
        prompts = load_prompts(cfg, policy.tokenizer, limit, examples, tools=prompt_tools(cfg, runners)).val
        n, greedy = eval_cfg.num_tests_per_prompt, eval_cfg.num_tests_per_prompt == 1
        params = SamplingParams(gen.max_new_tokens, gen.temperature, gen.top_p, gen.top_k, greedy=greedy)
        system_prompt = resolve_system_prompt(cfg.data)
        episodes = build_episode_runner(cfg, backend, policy.tokenizer, runners, system_prompt, turns)
        rollouts = episodes.run(prompts, n, params, eval_cfg.seed).rollouts
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
