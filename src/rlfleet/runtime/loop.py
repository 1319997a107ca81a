"""The run around a loop's step: resume, validate, checkpoint, log, and release everything at the end.

Shared by every algorithm: :meth:`rlfleet.algorithms.base.Trainer.start` builds a loop's components with
:func:`start_run` (:mod:`rlfleet.runtime.components`, then :func:`make_context` and the resume), and
:meth:`~rlfleet.algorithms.base.Trainer.train` drives its ``step`` with :func:`run_loop`.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.checkpoint import CheckpointManager
from rlfleet.checkpoint.space import ensure_disk
from rlfleet.config import MasterConfig, check_config, config_to_yaml
from rlfleet.config.algorithm import Algorithm
from rlfleet.config.capabilities import uses_ray
from rlfleet.config.layout import ResourceLayout
from rlfleet.data import ResumableLoader, load_task, resolve_system_prompt
from rlfleet.generation import GenerationBackend
from rlfleet.logging import MetricsLogger, Progress, format_step_line, read_metrics
from rlfleet.memory.probes import step_memory_metrics
from rlfleet.policy.interface import Policy
from rlfleet.rollouts.environment_setup import (
    build_episode_runner,
    close_runners,
    load_environments,
    prompt_tools,
    start_runners,
)
from rlfleet.rollouts.episodes import EpisodeRunner
from rlfleet.rollouts.pairs import PairSource
from rlfleet.runtime.components import TaskData, build_policy, load_prompts

log = logging.getLogger("rlfleet")
STEP_RECORD = "step_record"  # training_info.json key holding the step's metrics.jsonl record
# Metrics that measure the machine, not the run: not carried across a resume nor used to rank checkpoints.
MACHINE_METRICS = ("timing/", "perf/", "memory/")  # measurements of the machine, not of the run


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """A distinct, reproducible RNG seed for each step (and purpose ``salt``)."""
    return (seed * 1_000_003 + step * 7_919 + salt) % (2**31 - 1)


@dataclass
class RunContext:
    """The live objects of a run, shared by every loop."""

    cfg: MasterConfig
    policy: Policy  # in-process worker, or the driver's handle on Ray actors
    loader: ResumableLoader[Any]
    logger: MetricsLogger
    checkpoints: CheckpointManager | None
    episodes: EpisodeRunner  # rollouts: the generation engines and the recipe's environments
    total_steps: int
    step: int = 0
    last_metrics: dict[str, float] = field(default_factory=dict)

    def training_info(self, step_metrics: dict[str, float], loader_state: dict[str, Any]) -> dict[str, Any]:
        """Counters, the latest value of every metric (ranks checkpoints), and this step's log record.

        ``step_metrics`` is the exact record for this step, so a run killed between writing the checkpoint
        and appending to ``metrics.jsonl`` gets the line back on resume.
        """
        kept = {k: v for k, v in self.last_metrics.items() if not k.startswith(MACHINE_METRICS)}
        return {"step": self.step, "epoch": loader_state["epoch"], **kept, STEP_RECORD: step_metrics}


def make_context(
    cfg: MasterConfig,
    policy: Policy,
    episodes: EpisodeRunner,
    items: Sequence[Any],
    batch_size: int,
    *,
    seed: int,
    max_num_steps: int,
    max_num_epochs: int,
) -> RunContext:
    """Creates the loader, logger and checkpoint manager, then resumes from the newest checkpoint.

    The context owns ``policy`` and the environments of ``episodes`` from here: :func:`run_loop` closes them
    at the end. When this raises, the logger it started is closed; the rest stays the caller's to close.
    """
    loader = ResumableLoader(items, batch_size, shuffle=cfg.data.shuffle, seed=seed)
    total = min(max_num_steps, max_num_epochs * loader.batches_per_epoch)
    ckpt = cfg.checkpointing
    checkpoints = (
        CheckpointManager(Path(ckpt.checkpoint_dir), ckpt.metric_name, ckpt.higher_is_better, ckpt.keep_top_k)
        if ckpt.enabled
        else None
    )
    logger = MetricsLogger.from_config(cfg.logger, run_config=cfg.model_dump(mode="json"))
    ctx = RunContext(cfg, policy, loader, logger, checkpoints, episodes, total_steps=total)
    try:
        resume(ctx)
    except BaseException:
        logger.close(failed=True)
        raise
    return ctx


def start_run(
    cfg: MasterConfig,
    layout: ResourceLayout,
    *,
    seed: int,
    keep_reference: bool,
    max_val_samples: int,
    batch_size: int,
    max_num_steps: int,
    max_num_epochs: int,
    pairs: PairSource | None = None,
    generation: bool = True,
    max_turns: int = 1,
) -> tuple[RunContext, GenerationBackend, TaskData]:
    """Starts a loop's components (environments, policy and generation, data, context) and resumes.

    The loader draws the task's prompts, or with ``pairs`` from a preference dataset (DPO, reward models)
    its pairs, tokenised once the policy's tokenizer is loaded (their rows were read and checked before).
    Without ``generation`` (a reward model's run: preference pairs, nothing sampled) no generation engine
    and no environment is started (the backend is ``NoGeneration``). ``max_turns``: the model turns of
    the algorithm's episodes (its ``rlfleet.config.algorithm`` ``rollout_turns``; one by default).

    When any step fails, whatever was already started (Ray actors, environment worker processes, loggers)
    is released before the error propagates; once this returns, the context owns it all and
    :func:`run_loop` releases it at the end.
    """
    ensure_disk(cfg, max_num_steps if max_num_steps < sys.maxsize else None)  # room for its checkpoints
    task = pairs is None or pairs.sampled
    # every data row checked before anything expensive starts (a pair source read its own already)
    examples = load_task(cfg.data) if task else ([], [])
    with ExitStack() as started:
        # every environment class is built once here: a bad one fails before any model loads
        rows = [*examples[0], *examples[1]]
        on_ray = uses_ray(cfg, layout=layout)
        environments = load_environments(cfg, rows, on_ray=on_ray) if generation else {}
        policy, backend = build_policy(
            cfg, layout, seed=seed, keep_reference=keep_reference, generation=generation
        )
        started.callback(policy.close)
        runners = start_runners(cfg, layout, environments)  # on Ray: once the policy has started it
        started.callback(close_runners, runners)
        tools = prompt_tools(cfg, runners) if runners else None
        data = load_prompts(cfg, policy.tokenizer, max_val_samples, examples, tools=tools)
        system_prompt = resolve_system_prompt(cfg.data)
        episodes = build_episode_runner(cfg, backend, policy.tokenizer, runners, system_prompt, max_turns)
        items = data.train if pairs is None or pairs.sampled else pairs.tokenize(policy.tokenizer, cfg)
        ctx = make_context(
            cfg,
            policy,
            episodes,
            items,
            batch_size,
            seed=seed,
            max_num_steps=max_num_steps,
            max_num_epochs=max_num_epochs,
        )
        started.callback(ctx.logger.close, failed=True)
        if ctx.step > 0:
            backend.refit()  # resumed weights reach engines that hold their own copy
        started.pop_all()
    return ctx, backend, data


def resume(ctx: RunContext) -> None:
    """Restores weights, optimizer, scheduler, RNG, dataloader and counters from the newest checkpoint."""
    if ctx.checkpoints is None:
        return
    path = ctx.checkpoints.latest()
    if path is None:
        ctx.logger.truncate_after(-1)  # a run killed before its first checkpoint starts over cleanly
        return
    info = ctx.checkpoints.load_training_info(path)
    ctx.policy.load(path)
    ctx.loader.load_state_dict(ctx.checkpoints.load_dataloader_state(path))
    ctx.checkpoints.restore_rng(path)
    ctx.step = int(info["step"])
    ctx.last_metrics = run_metrics(info)
    ctx.logger.truncate_after(ctx.step)
    if ctx.step not in {r["step"] for r in read_metrics(ctx.logger.log_dir)} and info.get(STEP_RECORD):
        ctx.logger.log(ctx.step, info[STEP_RECORD])  # killed after the checkpoint, before the log line
    log.info("resumed from %s (step %d)", path, ctx.step)


def save_checkpoint(
    ctx: RunContext, step_metrics: dict[str, float], loader_state: dict[str, Any]
) -> Path | None:
    """Writes ``step_N`` for the current step (no-op when checkpointing is disabled); ``loader_state`` is
    the dataloader position a resumed run restarts from."""
    if ctx.checkpoints is None:
        return None
    return ctx.checkpoints.save(
        ctx.step,
        config_yaml=config_to_yaml(ctx.cfg),
        training_info=ctx.training_info(step_metrics, loader_state),
        dataloader_state=loader_state,
        write_policy=ctx.policy.save,
    )


COMPLETE = "%s: already complete at step %d/%d; nothing to do"


def finished_run(cfg: MasterConfig, name: Algorithm, max_num_steps: int) -> dict[str, float] | None:
    """The last metrics of a run with nothing left to do, found before anything starts (no data, model,
    environment or Ray actor): the recipe passes its checks, the newest checkpoint is at ``max_num_steps`` or
    beyond, and the log ends with that step's line. None otherwise: the run starts and resumes as usual (it
    also recognises a run the epoch limit ended, and first restores a log line a kill lost).

    A finished job that is submitted again (a rerun of ``make train``, a Kubernetes job restarted after it
    ended) so exits at once instead of loading its model first.
    """
    ckpt = cfg.checkpointing
    if not ckpt.enabled or not Path(ckpt.checkpoint_dir).is_dir():
        return None
    manager = CheckpointManager(Path(ckpt.checkpoint_dir), ckpt.metric_name, ckpt.higher_is_better)
    path = manager.latest()
    if path is None:
        return None
    info = manager.load_training_info(path)
    step = int(info["step"])
    logged = [r["step"] for r in read_metrics(cfg.logger.log_dir)]
    if step < max_num_steps or not logged or max(logged) != step:
        return None  # the run checks the recipe itself
    check_config(cfg, name)  # a bad recipe is refused even when nothing is left to do
    log.info(COMPLETE, name, step, max_num_steps)
    return run_metrics(info)


def run_metrics(info: dict[str, Any]) -> dict[str, float]:
    """The latest value of each metric a checkpoint's training info records, less the machine's."""
    return {k: v for k, v in info.items() if "/" in k and not k.startswith(MACHINE_METRICS)}


def should_checkpoint(ctx: RunContext) -> bool:
    ckpt = ctx.cfg.checkpointing
    return ckpt.enabled and (ctx.step % ckpt.save_period == 0 or ctx.step == ctx.total_steps)


def should_validate(step: int, total: int, period: int, at_end: bool) -> bool:
    return (period > 0 and step % period == 0) or (at_end and step == total)


def run_loop(
    ctx: RunContext,
    name: str,
    step_fn: Callable[[], dict[str, float]],
    validate_fn: Callable[[], dict[str, float]],
    *,
    val_period: int,
    val_at_start: bool,
    val_at_end: bool,
    loader_state: Callable[[], dict[str, Any]] | None = None,
) -> dict[str, float]:
    """Drives ``step_fn`` from the resumed step to ``total_steps``: validate, checkpoint, log, plot.

    ``loader_state`` gives the dataloader position a checkpoint records (default: the loader's own; a loop
    whose loader runs ahead, as asynchronous GRPO's, gives the position before it did). Returns the metrics
    of the last step (validation included when it ran).
    """
    checkpoint_loader_state = loader_state or ctx.loader.state_dict
    with closing_run(ctx):
        if ctx.step >= ctx.total_steps:
            log.info(COMPLETE, name, ctx.step, ctx.total_steps)
            return ctx.last_metrics
        progress = Progress(ctx.total_steps, ctx.step, name, ctx.cfg.logger.progress_bar)
        if ctx.step == 0 and val_at_start:
            ctx.last_metrics = timed_validation(validate_fn)
            ctx.logger.log(0, ctx.last_metrics)
            progress.write(format_step_line(0, ctx.total_steps, ctx.last_metrics))  # the "before" line
        metrics: dict[str, float] = {}
        while ctx.step < ctx.total_steps:
            metrics = step_fn()
            metrics.update(step_memory_metrics())  # before validation: the step's own peak
            ctx.step += 1
            validated = should_validate(ctx.step, ctx.total_steps, val_period, val_at_end)
            if validated:
                metrics.update(timed_validation(validate_fn))
            ctx.last_metrics = {**ctx.last_metrics, **metrics}
            if should_checkpoint(ctx):
                start = time.perf_counter()
                save_checkpoint(ctx, dict(metrics), checkpoint_loader_state())
                metrics["timing/checkpoint"] = time.perf_counter() - start
            ctx.logger.log(ctx.step, metrics)
            progress.step_done(ctx.step, metrics, validated)
        progress.close()
        from rlfleet.logging.plot import plot_run  # matplotlib: loaded once a run ends, not on import

        plot_run(ctx.logger.log_dir)
        return metrics


def timed_validation(validate_fn: Callable[[], dict[str, float]]) -> dict[str, float]:
    """The validation metrics plus ``timing/validation`` (seconds)."""
    start = time.perf_counter()
    metrics = validate_fn()
    return {**metrics, "timing/validation": time.perf_counter() - start}


@contextmanager
def closing_run(ctx: RunContext) -> Iterator[None]:
    """Closes the environment workers, the policy and the loggers at the end, marking the run failed on an
    exception."""
    failed = True
    try:
        yield
        failed = False
    finally:
        try:
            close_runners(ctx.episodes.environments)
            ctx.policy.close()
        finally:
            ctx.logger.close(failed=failed)
