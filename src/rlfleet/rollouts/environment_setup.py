"""Building the recipe's environments (``env.<name>``) and the episode runner that uses them.

Every run rolls out episodes (:mod:`rlfleet.rollouts.episodes`) with the environments its rows use: the
default one (``data.env_name``, ``math`` unless set) and those rows name (``task_name``). A single-turn math
task is a one-turn episode of ``math``, scored in ``env.math.num_workers`` worker processes (Ray actors on
Ray), each step within ``env.math.timeout_s``. The environments that score with a model (``reward_model``,
``judge``) step a step's conversations in one batch: in the trainer in a one-process run, in a Ray actor of
their own (``env.<name>.resources``) on a Ray run, where the trainer never loads their model.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from rlfleet.config import MasterConfig
from rlfleet.config.capabilities import uses_ray
from rlfleet.config.env_models import JudgeEnvConfig, RewardModelEnvConfig, ScorerResources
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
    preflight_environment,
)
from rlfleet.errors import UserError
from rlfleet.generation import GenerationBackend
from rlfleet.pools import ProcessWorkerPool, WorkerPool
from rlfleet.rollouts.episodes import EpisodeRunner

log = logging.getLogger(__name__)


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
    if name == "reasoning_gym":
        return "reasoning_gym", {}, env.reasoning_gym.num_workers, env.reasoning_gym.timeout_s
    if name == "agent":  # in the trainer: its agents call the run's endpoint, each within its timeout_s
        a = env.agent
        settings = {
            "agent_fn": a.agent_fn,
            "max_concurrency": a.max_concurrency,
            "timeout_s": a.timeout_s,
            "max_requests": a.max_requests,
            "served_model_name": a.served_model_name,
        }
        return "agent", settings, 0, a.timeout_s
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
        "backend": judge.backend,
        "max_model_len": judge.max_model_len,
        "gpu_memory_utilization": judge.gpu_memory_utilization,
        "vllm_kwargs": dict(judge.vllm_kwargs),
    }


def actor_resources(cfg: MasterConfig, name: str) -> ScorerResources | None:
    """The Ray actor ``env.<name>`` steps in on a Ray run (an environment that scores with a model), else
    None (it steps in the trainer or in its workers)."""
    return {"reward_model": cfg.env.reward_model.resources, "judge": cfg.env.judge.resources}.get(name)


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
        from rlfleet.pools.ray_pool import RayWorkerPool  # the ray extra

        return RayWorkerPool(STEP_IN_WORKER, workers, timeout_s, num_cpus=0, convert=checked_outcome)
    return ProcessWorkerPool(STEP_IN_WORKER, workers, timeout_s, convert=checked_outcome)


@dataclass(frozen=True)
class LoadedEnvironment:
    """One ``env.<name>`` of the recipe, checked, and where it steps.

    ``environment`` is the trainer's own instance; None for one that is built in its Ray actor (and in
    ``rlfleet validate``, which builds nothing that loads a model)."""

    name: str
    path: str  # class path, or a built-in name
    settings: dict[str, Any]  # the constructor's cfg
    num_workers: int  # 0: steps in the trainer (or in its actor)
    timeout_s: float
    environment: EnvironmentInterface[Any] | None
    actor_gpus: int | None = None  # set: steps in a Ray actor of its own holding that many GPUs


def load_environments(
    cfg: MasterConfig,
    examples: Iterable[Example],
    also: Iterable[str] = (),
    *,
    on_ray: bool = False,
    build: bool = True,
) -> dict[str, LoadedEnvironment]:
    """The environments the rows use (the default one for rows naming none) and those named in ``also``,
    each checked here, so that a bad name, path or cfg fails before anything expensive starts: built once
    (the trainer's instance), or with ``on_ray`` for one that steps in its Ray actor, and without ``build``
    for all, only checked by the class's ``preflight`` (no model loaded).

    Raises:
        UserError: A row or ``data.env_name`` names an environment the recipe does not configure.
        EnvironmentLoadError: A class that cannot be imported or built.
    """
    loaded = {}
    for name in sorted({*environment_names(cfg, examples), *also}):
        path, settings, workers, timeout_s = environment_settings(cfg, name)
        resources = actor_resources(cfg, name)
        wanted = resources.gpus_per_node * resources.num_nodes if resources is not None else None
        if wanted and not on_ray:
            log.warning(
                "env.%s.resources asks for %d GPU(s) for the environment's Ray actor, but this run is not on "
                "Ray: it scores in the trainer, on the trainer's device",
                name,
                wanted,
            )
        gpus = wanted if on_ray else None
        environment = None
        if build and gpus is None:
            environment = build_environment(path, settings)
        else:
            preflight_environment(path, settings)
        loaded[name] = LoadedEnvironment(name, path, settings, workers, timeout_s, environment, gpus)
    return loaded


def _runner(cfg: MasterConfig, layout: ResourceLayout, env: LoadedEnvironment) -> EnvRunner:
    if env.actor_gpus is not None:
        from rlfleet.environments.ray_runner import RayActorRunner  # the ray extra

        return RayActorRunner(env.name, env.path, env.settings, num_gpus=env.actor_gpus)
    if env.environment is None:
        raise ValueError(f"environment {env.name} was checked, not built (load_environments(build=False))")
    if env.num_workers == 0:
        return InProcessRunner(env.name, env.environment)
    pool = _pool(cfg, layout, env.num_workers, env.timeout_s)
    return PooledRunner(env.name, env.path, env.settings, env.environment, pool)


def start_runners(
    cfg: MasterConfig, layout: ResourceLayout, environments: Mapping[str, LoadedEnvironment]
) -> dict[str, EnvRunner]:
    """A runner per environment: in the trainer (``num_workers=0``), in worker processes, or in a Ray actor
    of its own (start them once Ray is up, after the policy). The caller owns them: :func:`close_runners`
    stops them."""
    runners: dict[str, EnvRunner] = {}
    with ExitStack() as started:
        for name, env in environments.items():
            runners[name] = _runner(cfg, layout, env)
            started.callback(runners[name].close)
        started.pop_all()
    return runners


def prompt_tools(cfg: MasterConfig, runners: Mapping[str, EnvRunner]) -> Sequence[Mapping[str, Any]] | None:
    """The tool schemas the prompts render: the default environment's (None for ``math``)."""
    return runners[cfg.data.env_name].environment.tools


def build_episode_runner(
    cfg: MasterConfig,
    backend: GenerationBackend,
    tokenizer: PreTrainedTokenizerBase,
    runners: Mapping[str, EnvRunner],
    system_prompt: str | None,
    max_turns: int,
) -> EpisodeRunner:
    """The run's episodes of at most ``max_turns`` model turns (the caller's own ``max_rollout_turns``)."""
    return EpisodeRunner(
        backend,
        tokenizer,
        runners,
        default_env=cfg.data.env_name,
        max_turns=max_turns,
        max_seq_len=cfg.policy.max_total_sequence_length,
        system_prompt=system_prompt,
    )


def close_runners(runners: Mapping[str, EnvRunner]) -> None:
    for runner in runners.values():
        runner.close()
