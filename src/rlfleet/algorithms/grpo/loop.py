"""GRPO: group-relative policy optimisation, one loop that reads like the algorithm.

A step is a pipeline of named stages (:meth:`GRPO.step`): collect (``P`` prompts, ``G`` scored episodes
each, single- or multi-turn alike; :mod:`rlfleet.rollouts.collect`) -> shape rewards ->
advantages (leave-one-out, within each group) -> masks (the training batch: overlong filtering, whole
global batches) -> update (logprobs of the current (``prev``) and reference policies, then clipped
policy-gradient steps with a KL penalty) -> refit the generation weights; the run around it validates,
checkpoints and logs (:mod:`rlfleet.runtime.loop`).

No pass is computed twice: when the step's ``P x G`` rows make exactly one optimizer step
(``policy.train_global_batch_size``), ``prev`` is the training forward's own logprobs, detached, instead of a
separate pass (as TRL does); the reference pass runs only with a KL penalty (the reference is not even kept
without one).

Departures from the DeepSeekMath paper, as in NeMo RL: the baseline leaves the sample itself out, the
advantage is divided by the std of the same other samples only where it is non-zero
(``grpo.advantage_std=group`` takes the paper's whole-group std), and the loss is a token-level mean over
the whole global batch (``loss_fn.token_level_loss``).

Variants, switched by config: DAPO's dynamic sampling (``grpo.use_dynamic_sampling``, see
:mod:`rlfleet.rollouts.dynamic_sampling`), overlong reward shaping and filtering (``grpo.reward_shaping``,
``grpo.overlong_filtering``, see :mod:`rlfleet.algorithms.overlong`), clip-higher
(``loss_fn.ratio_clip_max``), GSPO (``loss_fn.sequence_level_importance_ratios``), Dr.GRPO
(``grpo.normalize_rewards=false`` + ``loss_fn.max_length_normalization``) and the bounded
importance-sampling corrections (``loss_fn.truncated_importance_sampling_*``). A step with fewer rows than
``P x G`` (dynamic sampling that could not fill) trains on whole global batches of what it has, or on all
of it in one optimizer step when that is less than a global batch.

Asynchronous GRPO (``grpo.async_grpo.enabled``, dedicated generation workers): the next step's rollouts are
collected in a background thread while this step trains, and the engines are refitted once both are done;
each batch is then one policy version old (``train/trajectory_age``), which the importance-sampling
correction accounts for (see :mod:`rlfleet.rollouts.prefetch`, also for what a resume regenerates).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from rlfleet.algorithms.base import Trainer
from rlfleet.algorithms.grpo.advantages import group_advantages, signal_metrics, zero_variance_fraction
from rlfleet.algorithms.overlong import OverlongShaping, mask_truncated
from rlfleet.config import MasterConfig
from rlfleet.config.batching import ResolvedBatching
from rlfleet.config.layout import ResourceLayout
from rlfleet.config.resolved import truncation_type
from rlfleet.generation import SamplingParams
from rlfleet.policy.batch import TrainBatch, collate
from rlfleet.policy.loss_functions import ClippedPGLossFn
from rlfleet.policy.microbatch import MicroBatching, computed_rows
from rlfleet.rollouts.collect import Collected, GroupCollector
from rlfleet.rollouts.dynamic_sampling import trainable_rows
from rlfleet.rollouts.prefetch import RolloutPrefetcher
from rlfleet.rollouts.rollout import Rollout, accuracy, mean_response_length
from rlfleet.rollouts.validation import evaluate
from rlfleet.runtime.components import flop_meter, micro_batching
from rlfleet.runtime.loop import step_seed
from rlfleet.utils.timing import PhaseTimer


def rollout_batch(rollouts: Sequence[Rollout], advantages: torch.Tensor, pad_token_id: int) -> TrainBatch:
    batch = collate(
        [r.prompt.token_ids for r in rollouts],
        [r.result.token_ids for r in rollouts],
        pad_token_id,
        [r.result.logprobs for r in rollouts],
        [r.mask for r in rollouts],
    )
    return batch.with_(advantages=advantages)


def rollout_metrics(rollouts: Sequence[Rollout], rewards: torch.Tensor, group_size: int) -> dict[str, float]:
    return {
        "train/reward": float(rewards.mean()),
        "train/accuracy": accuracy(rollouts),
        "train/zero_variance_groups": zero_variance_fraction(rewards, group_size),
        "train/mean_response_length": mean_response_length(rollouts),
        "train/truncated_fraction": sum(not r.result.finished for r in rollouts) / len(rollouts),
        "train/num_tokens": int(sum(len(r.prompt.token_ids) + len(r.result.token_ids) for r in rollouts)),
    }


def raw_rewards(rollouts: Sequence[Rollout]) -> torch.Tensor:
    """``[N]`` the verifier's rewards."""
    return torch.tensor([r.reward for r in rollouts], dtype=torch.float32)


def skipped_update() -> dict[str, float]:
    """The metrics of a step that trains on nothing (no informative group, or every row masked)."""
    return {"train/update_skipped": 1.0, "train/num_tokens": 0}


@dataclass(frozen=True)
class UpdateBatch:
    """The masks stage's output: the rows one update trains on and how its optimizer steps split them."""

    batch: TrainBatch
    global_batch_size: int  # rows per optimizer step
    prev_from_forward: bool  # one optimizer step on it all: prev = the training forward's own logprobs


@dataclass(frozen=True)
class Update:
    """The update stage's output: the worker's metrics and the batch trained on."""

    metrics: dict[str, float]
    trained: UpdateBatch


class GRPO(Trainer):
    """The GRPO trainer: ``GRPO.run(cfg)`` runs (or resumes) the configured job."""

    algorithm = "grpo"
    settings: GRPOSettings

    def __init__(self, cfg: MasterConfig, *, always_compute_prev: bool = False) -> None:
        """Builds (or resumes) the run.

        Args:
            cfg: The validated recipe.
            always_compute_prev: Compute the previous-policy logprobs in a separate pass even when the
                training forward's own would do (to check that the two give the same update).
        """
        super().__init__(cfg)
        self.settings = grpo_settings(cfg, self.layout, self.batching)
        self.always_compute_prev = always_compute_prev
        age = self.settings.max_trajectory_age
        self.prefetcher = RolloutPrefetcher[Collected](age) if age is not None else None
        self.start(batch_size=self.settings.prompts_per_round, max_val_samples=cfg.grpo.max_val_samples)
        self.collect = GroupCollector(
            self.ctx.episodes,
            self.ctx.loader,
            self.settings.sampling,
            self.settings.group_size,
            self._round_seed,
            self.settings.dynamic_sampling,
        )
        with self.closing_on_failure():
            self.flops = flop_meter(cfg, self.ctx.policy, self.layout)  # MFU on GPUs with a known peak

    def _round_seed(self, step: int, round_index: int) -> int:
        """Round 0 keeps the step's seed; DAPO's later rounds get their own (salt 1 is validation's)."""
        return step_seed(self.cfg.grpo.seed, step, salt=0 if round_index == 0 else 1 + round_index)

    def step(self) -> dict[str, float]:
        """collect -> shape rewards -> advantages -> masks -> update -> refit.

        Asynchronous GRPO takes this step's rollouts from the previous step's prefetch and starts the next
        step's collection before the update, so the two overlap; the refit waits for both."""
        timer = PhaseTimer()
        collected, age = self._this_steps_rollouts()
        self._prefetch_next_step()
        try:
            metrics = self._rollout_metrics(collected, age)
            update = None
            rollouts = collected.groups.samples
            if rollouts:
                rewards = self._shaped_rewards(rollouts, metrics)
                advantages = group_advantages(
                    rewards,
                    self.settings.group_size,
                    leave_one_out=self.cfg.grpo.use_leave_one_out_baseline,
                    normalize=self.cfg.grpo.normalize_rewards,
                    std_over=self.cfg.grpo.advantage_std,
                )
                correct = torch.tensor([r.correct for r in rollouts])
                signal = signal_metrics(correct, advantages, self.settings.group_size)
                metrics.update({f"train/{key}": value for key, value in signal.items()})
                trainable = self._masked_batch(rollouts, advantages)
                update = self._update(trainable, timer) if trainable is not None else None
            self._finish_prefetch(timer)
        except BaseException:
            if self.prefetcher is not None:
                self.prefetcher.drain()
            raise
        if update is None:
            return {**metrics, **skipped_update(), **collected_timing(collected), **timer.metrics()}
        with timer("refit"):
            self.backend.refit()
        timing = {**collected_timing(collected), **timer.metrics()}
        return {**metrics, **update.metrics, **timing, **self._throughput(update.trained, timing)}

    # ------------------------------------------------------------------------------------------ stages

    def _this_steps_rollouts(self) -> tuple[Collected, int]:
        """(this step's rollouts, their age in policy updates): the prefetched batch (age-checked), or one
        collected now (the first step, or the first after a resume: the same prompts and seeds the prefetch
        would have used, current weights)."""
        ctx = self.ctx
        if self.prefetcher is not None and self.prefetcher.has_batch:
            return self.prefetcher.take(ctx.step, trainer_version=ctx.step)
        return self.collect(ctx.step), 0

    def _prefetch_next_step(self) -> None:
        ctx = self.ctx
        if self.prefetcher is None or ctx.step + 1 >= ctx.total_steps:
            return
        next_step = ctx.step + 1
        # the engines hold the weights of `ctx.step` updates until the refit at the end of this step
        self.prefetcher.submit(
            lambda: self.collect(next_step),
            version=ctx.step,
            for_step=next_step,
            resume_state=ctx.loader.state_dict(),
        )

    def _finish_prefetch(self, timer: PhaseTimer) -> None:
        if self.prefetcher is not None and self.prefetcher.pending:
            with timer("generation_wait"):
                self.prefetcher.finish()

    def _rollout_metrics(self, collected: Collected, age: int) -> dict[str, float]:
        """Every drawn rollout's rewards and lengths (informative or not); samples go to samples.jsonl."""
        self._log_samples(collected.drawn)
        drawn = collected.drawn
        metrics = rollout_metrics(drawn, raw_rewards(drawn), self.settings.group_size)
        metrics["train/reward_timeouts"] = collected.reward_timeouts
        metrics["train/reward_errors"] = collected.reward_errors
        metrics.update({f"train/{key}": value for key, value in collected.metrics.items()})
        if self.settings.dynamic_sampling is not None:
            metrics.update(collected.groups.metrics())
        if self.prefetcher is not None:
            metrics["train/trajectory_age"] = float(age)
        return metrics

    def _shaped_rewards(self, rollouts: Sequence[Rollout], metrics: dict[str, float]) -> torch.Tensor:
        """``[N]`` rewards with DAPO's overlong penalty when configured (``train/shaped_reward``)."""
        rewards = raw_rewards(rollouts)
        if self.settings.shaping is None:
            return rewards
        lengths = torch.tensor([r.num_response_tokens for r in rollouts])
        shaped = self.settings.shaping.apply(rewards, lengths)
        metrics["train/shaped_reward"] = float(shaped.mean())
        return shaped

    def _masked_batch(self, rollouts: Sequence[Rollout], advantages: torch.Tensor) -> UpdateBatch | None:
        """The training batch: truncated responses masked (overlong filtering), whole global batches of
        rows (or one optimizer step on all rows that split over the ranks); None when nothing is left."""
        pad = self.ctx.policy.tokenizer.pad_token_id
        batch = rollout_batch(rollouts, advantages, pad)
        if self.cfg.grpo.overlong_filtering:
            truncated = torch.tensor([not r.result.finished for r in rollouts])
            batch = batch.with_(response_mask=mask_truncated(batch.response_mask, truncated))
        global_batch = self.cfg.policy.train_global_batch_size
        rows, global_batch = trainable_rows(len(rollouts), global_batch, self.settings.data_parallel)
        if rows == 0 or float(batch.response_mask[:rows].sum()) == 0:  # nothing trainable (or all masked)
            return None
        batch = batch.select(0, rows) if rows < len(batch) else batch
        if self.cfg.grpo.skip_zero_advantage_rows:
            batch = batch.with_(inert=inert_rows(batch, self.cfg.loss_fn.reference_policy_kl_penalty))
        return UpdateBatch(batch, global_batch, rows == global_batch and not self.always_compute_prev)

    def _update(self, trainable: UpdateBatch, timer: PhaseTimer) -> Update:
        """The logprob passes, then the optimizer steps; the worker's metrics as ``train/*``."""
        policy, settings = self.ctx.policy, self.settings
        temperature = self.cfg.policy.generation.temperature
        batch = trainable.batch

        def pass_over(reference: bool) -> torch.Tensor:  # inert rows skipped
            return trained_logprobs(
                batch,
                settings.data_parallel,
                lambda rows: policy.logprobs(
                    rows, settings.logprob_batching, reference=reference, temperature=temperature
                ),
            )

        with timer("logprobs"):
            prev = None if trainable.prev_from_forward else pass_over(reference=False)
            ref = pass_over(reference=True) if policy.has_reference else None
        batch = batch.with_(prev_logprobs=prev, ref_logprobs=ref)
        loss_fn = replace(settings.loss_fn, prev_from_training_forward=prev is None)
        with timer("training"):
            train = policy.train(
                batch,
                loss_fn,
                global_batch_size=trainable.global_batch_size,
                micro_batching=settings.train_batching,
                temperature=temperature,
            )
        metrics = {f"train/{k}": v for k, v in train.items()}
        metrics["train/update_skipped"] = 0.0
        metrics["train/num_tokens"] = int(trainable.batch.attention_mask.sum())
        inert = batch.inert
        metrics["train/skipped_rows"] = 0.0 if inert is None else float(inert.float().mean())
        return Update(metrics, trainable)

    # --------------------------------------------------------------------------------- around the step

    def _throughput(self, trained: UpdateBatch, timing: dict[str, float]) -> dict[str, float]:
        """Tokens per second of each phase, and per worker with its imbalance on Ray."""
        policy = self.ctx.policy
        batch = trained.batch
        response_tokens = float(batch.response_mask.sum())  # all generated
        computed = batch.attention_mask if batch.inert is None else batch.attention_mask[~batch.inert]
        all_tokens = float(computed.sum())  # of the rows the passes computed
        out = {
            "perf/generation_tokens_per_s": response_tokens / max(timing["timing/generation"], 1e-9),
            "perf/training_tokens_per_s": all_tokens / max(timing["timing/training"], 1e-9),
        }
        out.update(self.backend.take_metrics())
        # the training pass, plus the prev and the reference logprob passes where they run
        extra_passes = int(not trained.prev_from_forward) + int(policy.has_reference)
        out.update(policy.take_metrics(int(all_tokens * (1 + extra_passes))))
        if self.flops is not None:
            lengths = [int(n) for n in computed.sum(dim=1).tolist()]
            seconds = timing["timing/training"] + timing.get("timing/logprobs", 0.0)
            out["perf/training_mfu"] = self.flops.step_mfu(lengths, extra_passes, seconds)
        return out

    def _log_samples(self, rollouts: Sequence[Rollout]) -> None:
        samples = [r.sample() for r in rollouts[: self.cfg.logger.num_samples_to_log]]
        if samples:
            self.ctx.logger.log_samples(self.ctx.step + 1, samples)

    def checkpoint_loader_state(self) -> dict[str, Any]:
        """The loader position a checkpoint records: from before a prefetched batch was drawn, if any."""
        pending = self.prefetcher.resume_state if self.prefetcher is not None else None
        return pending if pending is not None else self.ctx.loader.state_dict()

    def validate(self) -> dict[str, float]:
        seed = step_seed(self.cfg.grpo.seed, self.ctx.step, salt=1)
        result = evaluate(self.ctx.episodes, self.data.val, self.settings.validation_sampling, seed)
        return result.metrics("val")

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()


def inert_rows(batch: TrainBatch, kl_penalty: float) -> torch.Tensor:
    """``[B]`` rows whose loss and gradient are exactly zero: no response token, or (without a KL term) an
    advantage of exactly 0 (every row of a group with equal rewards), whatever the ratio, clipping or
    importance weights (each multiplies the advantage)."""
    if batch.advantages is None:
        raise ValueError("inert rows are decided by the advantages; set them first")
    empty = batch.response_mask.sum(dim=1) == 0
    return empty | (batch.advantages == 0) if kl_penalty == 0 else empty


def trained_logprobs(
    batch: TrainBatch, dp_size: int, logprobs: Callable[[TrainBatch], torch.Tensor]
) -> torch.Tensor:
    """``[B, T]`` ``logprobs(rows)`` over the rows the training pass computes (``computed_rows``), zero on
    inert rows, whose loss does not read them."""
    rows = computed_rows(batch, dp_size)
    if len(rows) == len(batch):
        return logprobs(batch)
    part = logprobs(batch.take(rows))
    out = torch.zeros(batch.input_ids.shape, dtype=part.dtype)
    out[torch.tensor(rows), : part.shape[1]] = part
    return out


def collected_timing(collected: Collected) -> dict[str, float]:
    """``timing/generation`` and ``timing/env`` of the collection (in the background when asynchronous)."""
    return {f"timing/{k}": v for k, v in collected.seconds.items()}


def grpo_train(cfg: MasterConfig) -> dict[str, float]:
    """Runs (or resumes) GRPO as configured; returns the last step's metrics."""
    return GRPO.run(cfg)


def loss_fn_from_config(cfg: MasterConfig) -> ClippedPGLossFn:
    """GRPO's loss as ``loss_fn`` configures it (the truncation type resolved as ``validate`` prints it)."""
    loss = cfg.loss_fn
    return ClippedPGLossFn(
        eps_low=loss.ratio_clip_min,
        eps_high=loss.ratio_clip_max,
        dual_clip_c=loss.ratio_clip_c,
        kl_penalty=loss.reference_policy_kl_penalty,
        kl_type=loss.reference_policy_kl_type,
        use_on_policy_kl_approximation=loss.use_on_policy_kl_approximation,
        kl_input_clamp=loss.kl_input_clamp_value,
        kl_output_clamp=loss.kl_output_clamp_value,
        token_level=loss.token_level_loss,
        importance_sampling_correction=loss.use_importance_sampling_correction,
        truncation=truncation_type(loss),
        truncation_ratio_max=loss.truncated_importance_sampling_ratio,
        truncation_ratio_min=loss.truncated_importance_sampling_ratio_min,
        sequence_level_ratios=loss.sequence_level_importance_ratios,
        max_length=cfg.policy.generation.max_new_tokens if loss.max_length_normalization else None,
    )


@dataclass(frozen=True)
class GRPOSettings:
    """What a GRPO run does, resolved once from the config (the loop reads these, never ``cfg`` sections).

    Attributes:
        loss_fn: The clipped policy-gradient loss.
        group_size: ``G``, responses per prompt.
        prompts_per_round: Prompts each generation round draws (DAPO's ``batch_multiplier`` applied).
        dynamic_sampling: DAPO's ``(target groups, most rounds)``, or None.
        shaping: DAPO's overlong reward shaping, or None.
        sampling: Sampling of the training rollouts.
        validation_sampling: Sampling of validation (greedy unless ``grpo.val_greedy=false``).
        train_batching: How the training pass splits its rows.
        logprob_batching: How the logprob passes split their rows.
        data_parallel: Training ranks that split a global batch.
        max_trajectory_age: Asynchronous GRPO's age bound, or None when synchronous.
    """

    loss_fn: ClippedPGLossFn
    group_size: int
    prompts_per_round: int
    dynamic_sampling: tuple[int, int] | None
    shaping: OverlongShaping | None
    sampling: SamplingParams
    validation_sampling: SamplingParams
    train_batching: MicroBatching
    logprob_batching: MicroBatching
    data_parallel: int
    max_trajectory_age: int | None


def overlong_shaping(cfg: MasterConfig) -> OverlongShaping | None:
    """The overlong penalty ``grpo.reward_shaping`` configures, or None when it is off."""
    return OverlongShaping.of(cfg.grpo.reward_shaping, cfg.policy.generation.max_new_tokens)


def grpo_settings(cfg: MasterConfig, layout: ResourceLayout, batching: ResolvedBatching) -> GRPOSettings:
    # every key is read whether or not its feature is on (a key nothing reads would be silently ignored)
    grpo, generation = cfg.grpo, cfg.policy.generation
    dynamic = grpo.use_dynamic_sampling
    per_round = int(grpo.num_prompts_per_step * grpo.batch_multiplier)
    rounds = grpo.dynamic_sampling_max_gen_batches
    max_age = grpo.async_grpo.max_trajectory_age_steps
    return GRPOSettings(
        loss_fn=loss_fn_from_config(cfg),
        group_size=grpo.num_generations_per_prompt,
        prompts_per_round=per_round if dynamic else grpo.num_prompts_per_step,
        dynamic_sampling=(grpo.num_prompts_per_step, rounds) if dynamic else None,
        shaping=overlong_shaping(cfg),
        sampling=SamplingParams(
            generation.max_new_tokens, generation.temperature, generation.top_p, generation.top_k
        ),
        validation_sampling=SamplingParams(
            generation.max_new_tokens,
            generation.temperature,
            generation.top_p,
            generation.top_k,
            greedy=grpo.val_greedy,
        ),
        train_batching=micro_batching(cfg, "train", batching),
        logprob_batching=micro_batching(cfg, "logprob", batching),
        data_parallel=layout.train_dp,
        max_trajectory_age=max_age if grpo.async_grpo.enabled else None,
    )
