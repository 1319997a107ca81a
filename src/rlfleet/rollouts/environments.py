"""Building the recipe's environments (``env.<name>``) and the episode runner that uses them.

Every run rolls out episodes (:mod:`rlfleet.rollouts.episodes`) with the environments its rows use: the
default one (``data.env_name``, ``math`` unless set) and those rows name (``task_name``). A single-turn math
task is a one-turn episode of ``math``, scored in ``env.math.num_workers`` worker processes (Ray actors on
Ray), each step within ``env.math.timeout_s``. The environments that score with a model (``reward_model``,
``judge``) step in the trainer, a step's conversations in one batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from rlfleet.config import MasterConfig
from rlfleet.config.capabilities import uses_ray
from rlfleet.config.env_models import JudgeEnvConfig, RewardModelEnvConfig
from rlfleet.config.layout import ResourceLayout
from rlfleet.data import Example
from rlfleet.environments.builtin import BUILTIN
from rlfleet.environments.interface import EnvironmentInterface
from rlfleet.environments.runner import (
    STEP_IN_WORKER,
    EnvRunner,
    InProcessRunner,
    PooledRunner,
    build_environment,
    checked_outcome,
)
from rlfleet.errors import UserError
from rlfleet.generation import GenerationBackend
from rlfleet.rollouts.episodes import EpisodeRunner
from rlfleet.workers import ProcessWorkerPool, WorkerPool


def environment_settings(cfg: MasterConfig, name: str) -> tuple[str, dict[str, Any], int, float]:
    """``(class path, constructor cfg, num_workers, timeout_s)`` of ``env.<name>``.

    Raises:
        UserError: The recipe configures no environment of that name.
    """
    env = cfg.env
    if name == "math":
        return "math", {"reward_fn": env.math.reward_fn}, env.math.num_workers, env.math.timeout_s
    if name == "tools":
        t = env.tools
        sandbox = {"cpu_seconds": t.sandbox_cpu_seconds, "wall_seconds": t.sandbox_wall_seconds}
        settings = {
            "tools": list(t.tools),
            "reward_fn": t.reward_fn,
            "max_tool_calls": t.max_tool_calls,
            "sandbox": sandbox,
        }
        return "tools", settings, t.num_workers, t.timeout_s
    if name == "code":
        c = env.code
        settings = {
            "terminate_on_evaluation": c.terminate_on_evaluation,
            "cpu_seconds": c.cpu_seconds,
            "wall_seconds": c.wall_seconds,
        }
        return "code", settings, c.num_workers, c.timeout_s
    if name == "reward_model":  # in the trainer, one batch per step: no workers, no per-item bound
        return "reward_model", _reward_model_settings(env.reward_model), 0, math.inf
    if name == "judge":  # in the trainer; a server request is bounded by env.judge.timeout_s itself
        return "judge", _judge_settings(env.judge), 0, env.judge.timeout_s
    custom = env.custom()
    if name not in custom:
        known = sorted([*BUILTIN, *custom])
        raise UserError(
            f"environment {name!r} is not configured (known: {', '.join(known)}); set data.env_name to "
            f"one of "
            f"them, or add env.{name}.environment=<import path of your EnvironmentInterface class>"
        )
    entry = custom[name]
    return entry.environment, dict(entry.cfg), entry.num_workers, entry.timeout_s


def _reward_model_settings(rm: RewardModelEnvConfig) -> dict[str, Any]:
    return {
        "model_name": rm.model_name,
        "tokenizer": {"name": rm.tokenizer.name},
        "precision": rm.precision,
        "batch_size": rm.batch_size,
        "max_model_len": rm.max_model_len,
    }


def _judge_settings(judge: JudgeEnvConfig) -> dict[str, Any]:
    return {
        "model_name": judge.model_name,
        "gguf_file": judge.gguf_file,
        "base_url": judge.base_url,
        "api_key_env": judge.api_key_env,
        "rubric": judge.rubric,
        "score_pattern": judge.score_pattern,
        "max_score": judge.max_score,
        "max_new_tokens": judge.max_new_tokens,
        "batch_size": judge.batch_size,
        "timeout_s": judge.timeout_s,
    }


def environment_names(cfg: MasterConfig, examples: Iterable[Example]) -> list[str]:
    """The environments the rows use (the default for rows naming none), each checked to be configured.

    Raises:
        UserError: A row or ``data.env_name`` names an environment the recipe does not configure.
    """
    names = sorted({cfg.data.env_name, *(ex.env for ex in examples if ex.env is not None)})
    for name in names:
        environment_settings(cfg, name)
    return names


def _pool(cfg: MasterConfig, layout: ResourceLayout, workers: int, timeout_s: float) -> WorkerPool:
    if uses_ray(cfg, layout=layout):
        from rlfleet.workers.ray_pool import RayWorkerPool  # the ray extra

        return RayWorkerPool(STEP_IN_WORKER, workers, timeout_s, num_cpus=0, convert=checked_outcome)
    return ProcessWorkerPool(STEP_IN_WORKER, workers, timeout_s, convert=checked_outcome)


@dataclass(frozen=True)
class LoadedEnvironment:
    """One ``env.<name>`` of the recipe, its class built (the trainer's own instance) and where it steps."""

    name: str
    path: str  # class path, or a built-in name
    settings: dict[str, Any]  # the constructor's cfg
    num_workers: int  # 0: steps in the trainer
    timeout_s: float
    environment: EnvironmentInterface[Any]


def load_environments(
    cfg: MasterConfig, examples: Iterable[Example], also: Iterable[str] = ()
) -> dict[str, LoadedEnvironment]:
    """The environments the rows use (the default one for rows naming none) and those named in ``also``,
    each class built once here, so that a bad name, path or cfg fails before anything expensive starts.

    Raises:
        UserError: A row or ``data.env_name`` names an environment the recipe does not configure.
        EnvironmentLoadError: A class that cannot be imported or built.
    """
    loaded = {}
    for name in sorted({*environment_names(cfg, examples), *also}):
        path, settings, workers, timeout_s = environment_settings(cfg, name)
        environment = build_environment(path, settings)
        loaded[name] = LoadedEnvironment(name, path, settings, workers, timeout_s, environment)
    return loaded


def start_runners(
    cfg: MasterConfig, layout: ResourceLayout, environments: Mapping[str, LoadedEnvironment]
) -> dict[str, EnvRunner]:
    """A runner per environment: in the trainer (``num_workers=0``), else in worker processes (Ray actors
    when the run is on Ray: start them once Ray is up, after the policy). The caller owns the workers:
    :func:`close_runners` stops them."""
    runners: dict[str, EnvRunner] = {}
    with ExitStack() as started:
        for name, env in environments.items():
            if env.num_workers == 0:
                runners[name] = InProcessRunner(name, env.environment)
                continue
            pool = _pool(cfg, layout, env.num_workers, env.timeout_s)
            started.callback(pool.close)
            runners[name] = PooledRunner(name, env.path, env.settings, env.environment, pool)
        started.pop_all()
    return runners


def prompt_tools(
    cfg: MasterConfig, environments: Mapping[str, LoadedEnvironment]
) -> Sequence[Mapping[str, Any]] | None:
    """The tool schemas the prompts render: the default environment's (None for ``math``)."""
    return environments[cfg.data.env_name].environment.tools


def build_episode_runner(
    cfg: MasterConfig,
    backend: GenerationBackend,
    tokenizer: PreTrainedTokenizerBase,
    runners: Mapping[str, EnvRunner],
    system_prompt: str | None,
) -> EpisodeRunner:
    return EpisodeRunner(
        backend,
        tokenizer,
        runners,
        default_env=cfg.data.env_name,
        max_turns=cfg.grpo.max_rollout_turns,
        max_seq_len=cfg.policy.max_total_sequence_length,
        system_prompt=system_prompt,
    )


def close_runners(runners: Mapping[str, EnvRunner]) -> None:
    for runner in runners.values():
        runner.close()
