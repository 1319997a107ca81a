"""Building the recipe's environments (``env.<name>``) and the episode runner that uses them.

Every run rolls out episodes (:mod:`rlfleet.rollouts.episodes`) with the environments its rows use: the
default one (``data.env_name``, ``math`` unless set) and those rows name (``task_name``). A single-turn math
task is a one-turn episode of ``math``, scored in ``env.math.num_workers`` worker processes (Ray actors on
Ray), each step within ``env.math.timeout_s``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

from transformers import PreTrainedTokenizerBase

from rlfleet.config import MasterConfig
from rlfleet.config.capabilities import uses_ray
from rlfleet.config.layout import ResourceLayout
from rlfleet.data import Example
from rlfleet.environments.builtin import BUILTIN
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


def build_env_runners(
    cfg: MasterConfig, layout: ResourceLayout, names: Sequence[str]
) -> dict[str, EnvRunner]:
    """A runner per environment name: in the trainer (``num_workers=0``), else in worker processes (Ray
    actors on Ray). Each class is built here first, so a bad path or cfg fails before any worker starts.

    Raises:
        EnvironmentLoadError: A class that cannot be imported or built.
    """
    runners: dict[str, EnvRunner] = {}
    with ExitStack() as started:
        for name in names:
            path, settings, workers, timeout_s = environment_settings(cfg, name)
            environment = build_environment(path, settings)
            if workers == 0:
                runners[name] = InProcessRunner(name, environment)
                continue
            pool = _pool(cfg, layout, workers, timeout_s)
            started.callback(pool.close)
            runners[name] = PooledRunner(name, path, settings, environment, pool)
        started.pop_all()
    return runners


def environment_runners(
    cfg: MasterConfig, layout: ResourceLayout, examples: Iterable[Example]
) -> dict[str, EnvRunner]:
    """The runners of the environments the rows use (the default one for rows naming none)."""
    return build_env_runners(cfg, layout, environment_names(cfg, examples))


def prompt_tools(cfg: MasterConfig, runners: Mapping[str, EnvRunner]) -> Sequence[Mapping[str, Any]] | None:
    """The tool schemas the prompts render: the default environment's (None for ``math``)."""
    return runners[cfg.data.env_name].environment.tools


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
