"""Pieces both loops (SFT and GRPO) wire together: building components, validation, checkpoints.

Everything here takes explicit arguments; the loops read the config and pass the values in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlfleet.checkpoint import CheckpointManager
from rlfleet.config import MasterConfig, config_to_yaml
from rlfleet.config.capabilities import uses_ray
from rlfleet.data import (
    Prompt,
    ResumableLoader,
    build_prompts,
    load_prompt_template,
    load_task,
    resolve_system_prompt,
)
from rlfleet.distributed.layout import compute_layout
from rlfleet.distributed.sharded_worker import ShardingSettings
from rlfleet.generation import GenerationBackend, HFGenerationBackend, SamplingParams
from rlfleet.logging import MetricsLogger, Progress, format_step_line, plot_run, read_metrics
from rlfleet.models.loading import ModelSource
from rlfleet.policy.worker import OptimizerSettings, PolicyWorker
from rlfleet.rewards import ScoringPool, VerifierPool

log = logging.getLogger("rlfleet")
STEP_RECORD = "step_record"  # training_info.json key holding the step's metrics.jsonl record
# Metrics that measure the machine, not the run: not carried across a resume nor used to rank checkpoints.
MACHINE_METRICS = ("timing/", "perf/")


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """A distinct, reproducible RNG seed for each step (and purpose ``salt``)."""
    return (seed * 1_000_003 + step * 7_919 + salt) % (2**31 - 1)


def model_source(cfg: MasterConfig) -> ModelSource:
    """Where every worker loads the policy from."""
    p = cfg.policy
    return ModelSource(p.model_name, p.precision, p.gguf_file, p.tokenizer.name)


def optimizer_settings(cfg: MasterConfig) -> OptimizerSettings:
    p = cfg.policy
    if p.optimizer.name not in ("torch.optim.AdamW", "AdamW"):  # the schema admits AdamW only
        raise ValueError(
            f"policy.optimizer.name={p.optimizer.name!r} is not supported; use torch.optim.AdamW"
        )
    o = p.optimizer.kwargs
    return OptimizerSettings(
        lr=o.lr,
        weight_decay=o.weight_decay,
        betas=o.betas,
        eps=o.eps,
        warmup_steps=p.scheduler.warmup_steps,
        warmup_start_factor=p.scheduler.warmup_start_factor,
        max_grad_norm=p.max_grad_norm,
    )


def build_worker(cfg: MasterConfig, *, seed: int, keep_reference: bool) -> PolicyWorker:
    """Loads the policy named by ``policy.model_name`` into an in-process worker with its optimizer."""
    settings = optimizer_settings(cfg)
    torch.manual_seed(seed)
    # float32 master weights computing in policy.precision; on the GPU when there is one (the Ray layer
    # places multi-GPU workers)
    return PolicyWorker(
        model_source(cfg),
        settings,
        keep_reference=keep_reference,
        activation_checkpointing=cfg.policy.dtensor_cfg.activation_checkpointing,
    )


def build_backend(cfg: MasterConfig, worker: PolicyWorker) -> GenerationBackend:
    """The configured generation backend, colocated with ``worker``."""
    return HFGenerationBackend(
        worker.model,
        worker.tokenizer,
        cfg.policy.generation.batch_size,
        compute_dtype=worker.autocast_dtype,
    )


def build_policy(cfg: MasterConfig, *, seed: int, keep_reference: bool) -> tuple[Any, GenerationBackend]:
    """The policy worker and generation backend: in this process, or on Ray when the layout asks for it.

    Both kinds answer the same calls (``logprobs``, ``train``, ``save``, ``load``, ``generate``,
    ``refit``), so the loops do not know which one they drive.
    """
    if not uses_ray(cfg):
        worker = build_worker(cfg, seed=seed, keep_reference=keep_reference)
        return worker, build_backend(cfg, worker)
    from rlfleet.distributed.ray_policy import RayGeneration, RayPolicy, RayRuntime  # the ray extra

    layout, _ = compute_layout(cfg)
    p, c = cfg.policy, cfg.cluster
    source = model_source(cfg)
    runtime = RayRuntime(
        layout,
        source,
        optimizer_settings(cfg),
        ShardingSettings(p.dtensor_cfg.tensor_parallel_size, p.dtensor_cfg.activation_checkpointing),
        generation_batch_size=p.generation.batch_size,
        keep_reference=keep_reference,
        seed=seed,
        call_timeout_s=c.call_timeout_s,
        placement_timeout_s=c.placement_timeout_s,
    )
    try:
        backend = RayGeneration(runtime, c.generation_retries)
    except BaseException:
        runtime.close()
        raise
    return RayPolicy(runtime, source.load_tokenizer(), keep_reference), backend


def prompt_budget(cfg: MasterConfig) -> int:
    """Longest prompt (tokens) that still leaves room for ``max_new_tokens`` in the sequence limit."""
    limit = cfg.policy.max_total_sequence_length - cfg.policy.generation.max_new_tokens
    return min(limit, cfg.data.max_input_seq_length or limit)


@dataclass
class TaskData:
    train: list[Prompt]
    val: list[Prompt]
    dropped: int


def load_prompts(cfg: MasterConfig, tokenizer: Any, max_val_samples: int) -> TaskData:
    """Loads the task and renders its prompts; too-long prompts are dropped and counted."""
    train_ex, val_ex = load_task(cfg.data)
    system_prompt = resolve_system_prompt(cfg.data)
    template = load_prompt_template(cfg.data)
    budget = prompt_budget(cfg)
    kwargs = {"system_prompt": system_prompt, "max_prompt_tokens": budget, "prompt_template": template}
    train, dropped_train = build_prompts(tokenizer, train_ex, **kwargs)
    val, dropped_val = build_prompts(tokenizer, val_ex[:max_val_samples], **kwargs)
    if dropped_train or dropped_val:
        log.warning(
            "dropped %d train and %d val prompts longer than %d tokens", dropped_train, dropped_val, budget
        )
    return TaskData(train=train, val=val, dropped=dropped_train + dropped_val)


@dataclass
class EvalResult:
    accuracy: float
    mean_response_length: float
    samples: list[dict[str, Any]] = field(default_factory=list)

    def metrics(self, prefix: str = "val") -> dict[str, float]:
        return {
            f"{prefix}/accuracy": self.accuracy,
            f"{prefix}/mean_response_length": self.mean_response_length,
        }


def build_verifier(cfg: MasterConfig) -> ScoringPool:
    """The reward workers, ``env.math.num_workers`` of them, each response bounded by ``timeout_s``.

    Ray actors (restarted when they die) when the run is on Ray, else local processes.
    """
    m = cfg.env.math
    if uses_ray(cfg):
        from rlfleet.rewards.ray_pool import RayVerifierPool  # the ray extra

        # Reward checks are short CPU bursts between the model phases: they reserve no CPU, so they never
        # wait behind the bundles the training and generation workers hold.
        return RayVerifierPool(m.reward_fn, m.num_workers, m.timeout_s, num_cpus=0)
    return VerifierPool(m.reward_fn, m.num_workers, m.timeout_s)


def evaluate(
    backend: GenerationBackend,
    prompts: Sequence[Prompt],
    verifier: ScoringPool,
    params: SamplingParams,
    seed: int,
    num_samples_to_keep: int = 4,
) -> EvalResult:
    """Generates one response per prompt and scores it: accuracy = mean reward."""
    results = backend.generate([p.token_ids for p in prompts], params, seed)
    batch = verifier.score([(p.text, r.text, p.example.gold) for p, r in zip(prompts, results, strict=True)])
    rewards = batch.rewards
    samples = [
        {"prompt": p.example.question, "response": r.text, "gold": p.example.gold, "reward": s}
        for p, r, s in list(zip(prompts, results, rewards, strict=True))[:num_samples_to_keep]
    ]
    return EvalResult(
        accuracy=sum(rewards) / max(len(rewards), 1),
        mean_response_length=sum(len(r.token_ids) for r in results) / max(len(results), 1),
        samples=samples,
    )


@dataclass
class RunContext:
    """The live objects of a run, shared by the SFT and GRPO loops."""

    cfg: MasterConfig
    worker: PolicyWorker
    loader: ResumableLoader[Any]
    logger: MetricsLogger
    checkpoints: CheckpointManager | None
    verifier: ScoringPool
    total_steps: int
    step: int = 0
    last_metrics: dict[str, float] = field(default_factory=dict)

    def training_info(self, step_metrics: dict[str, float]) -> dict[str, Any]:
        """Counters, the latest value of every metric (ranks checkpoints), and this step's log record.

        ``step_metrics`` is the exact record for this step, so a run killed between writing the checkpoint
        and appending to ``metrics.jsonl`` gets the line back on resume.
        """
        kept = {k: v for k, v in self.last_metrics.items() if not k.startswith(MACHINE_METRICS)}
        return {"step": self.step, "epoch": self.loader.epoch, **kept, STEP_RECORD: step_metrics}


def make_context(
    cfg: MasterConfig,
    worker: PolicyWorker,
    verifier: ScoringPool,
    items: Sequence[Any],
    batch_size: int,
    *,
    seed: int,
    max_num_steps: int,
    max_num_epochs: int,
) -> RunContext:
    """Creates the loader, logger and checkpoint manager, then resumes from the newest checkpoint."""
    loader = ResumableLoader(items, batch_size, shuffle=cfg.data.shuffle, seed=seed)
    total = min(max_num_steps, max_num_epochs * loader.batches_per_epoch)
    c, lg = cfg.checkpointing, cfg.logger
    checkpoints = (
        CheckpointManager(Path(c.checkpoint_dir), c.metric_name, c.higher_is_better, c.keep_top_k)
        if c.enabled
        else None
    )
    logger = MetricsLogger.from_config(lg, run_config=cfg.model_dump(mode="json"))
    ctx = RunContext(cfg, worker, loader, logger, checkpoints, verifier, total_steps=total)
    resume(ctx)
    return ctx


def resume(ctx: RunContext) -> None:
    """Restores weights, optimizer, scheduler, RNG, dataloader and counters from the newest checkpoint."""
    if ctx.checkpoints is None:
        return
    path = ctx.checkpoints.latest()
    if path is None:
        ctx.logger.truncate_after(-1)  # a run killed before its first checkpoint starts over cleanly
        return
    info = ctx.checkpoints.load_training_info(path)
    ctx.worker.load(path)
    ctx.loader.load_state_dict(ctx.checkpoints.load_dataloader_state(path))
    ctx.checkpoints.restore_rng(path)
    ctx.step = int(info["step"])
    ctx.last_metrics = {k: v for k, v in info.items() if "/" in k and not k.startswith(MACHINE_METRICS)}
    ctx.logger.truncate_after(ctx.step)
    if ctx.step not in {r["step"] for r in read_metrics(ctx.logger.log_dir)} and info.get(STEP_RECORD):
        ctx.logger.log(ctx.step, info[STEP_RECORD])  # killed after the checkpoint, before the log line
    log.info("resumed from %s (step %d)", path, ctx.step)


def save_checkpoint(ctx: RunContext, step_metrics: dict[str, float]) -> Path | None:
    """Writes ``step_N`` for the current step (no-op when checkpointing is disabled)."""
    if ctx.checkpoints is None:
        return None
    return ctx.checkpoints.save(
        ctx.step,
        config_yaml=config_to_yaml(ctx.cfg),
        training_info=ctx.training_info(step_metrics),
        dataloader_state=ctx.loader.state_dict(),
        write_policy=ctx.worker.save,
    )


def should_checkpoint(ctx: RunContext) -> bool:
    c = ctx.cfg.checkpointing
    return c.enabled and (ctx.step % c.save_period == 0 or ctx.step == ctx.total_steps)


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
) -> dict[str, float]:
    """Drives ``step_fn`` from the resumed step to ``total_steps``: validate, checkpoint, log, plot.

    Returns the metrics of the last step (validation included when it ran).
    """
    with closing_run(ctx):
        if ctx.step >= ctx.total_steps:
            log.info("%s: already complete at step %d/%d; nothing to do", name, ctx.step, ctx.total_steps)
            return ctx.last_metrics
        if ctx.step == 0 and val_at_start:
            ctx.last_metrics = validate_fn()
            ctx.logger.log(0, ctx.last_metrics)
        progress = Progress(ctx.total_steps, ctx.step, name, ctx.cfg.logger.progress_bar)
        metrics: dict[str, float] = {}
        while ctx.step < ctx.total_steps:
            metrics = step_fn()
            ctx.step += 1
            if should_validate(ctx.step, ctx.total_steps, val_period, val_at_end):
                metrics.update(validate_fn())
            ctx.last_metrics = {**ctx.last_metrics, **metrics}
            if should_checkpoint(ctx):
                start = time.perf_counter()
                save_checkpoint(ctx, dict(metrics))
                metrics["timing/checkpoint"] = time.perf_counter() - start
            ctx.logger.log(ctx.step, metrics)
            progress.update()
            progress.write(format_step_line(ctx.step, ctx.total_steps, metrics))
        progress.close()
        plot_run(ctx.logger.log_dir)
        return metrics


@contextmanager
def closing_run(ctx: RunContext) -> Iterator[None]:
    """Closes the reward workers and the loggers at the end, marking the run failed on an exception."""
    failed = True
    try:
        yield
        failed = False
    finally:
        try:
            ctx.verifier.close()
            ctx.worker.close()
        finally:
            ctx.logger.close(failed=failed)
