"""GRPO: group-relative policy optimisation, one loop that reads like the algorithm.

Per step: take ``P`` prompts -> sample ``G`` responses each -> score them -> leave-one-out advantages within
each group -> logprobs of the current (``prev``) and reference policies -> clipped policy-gradient updates
with a k3 KL penalty -> refit the generation weights -> validate / checkpoint / log.

No pass is computed twice: when the step's ``P x G`` rows make exactly one optimizer step
(``policy.train_global_batch_size``), ``prev`` is the training forward's own logprobs, detached, instead of a
separate pass (as TRL does); the reference pass runs only with a KL penalty (the reference is not even kept
without one).

Departures from the DeepSeekMath paper, as in NeMo RL: the baseline leaves the sample itself out, the
advantage is divided by the std of the same other samples only where it is non-zero
(``grpo.advantage_std=group`` takes the paper's whole-group std), and the loss is a token-level mean over
the whole global batch (``loss_fn.token_level_loss``).

Variants, switched by config: DAPO's dynamic sampling (``grpo.use_dynamic_sampling``, see
:mod:`rlfleet.algorithms.dynamic_sampling`), overlong reward shaping and filtering (``grpo.reward_shaping``,
``grpo.overlong_filtering``, see :mod:`rlfleet.algorithms.overlong`), clip-higher
(``loss_fn.ratio_clip_max``), GSPO (``loss_fn.sequence_level_importance_ratios``), Dr.GRPO
(``grpo.normalize_rewards=false`` + ``loss_fn.max_length_normalization``) and the bounded
importance-sampling corrections (``loss_fn.truncated_importance_sampling_*``). A step with fewer rows than
``P x G`` (dynamic sampling that could not fill) trains on whole global batches of what it has, or on all
of it in one optimizer step when that is less than a global batch.

Asynchronous GRPO (``grpo.async_grpo.enabled``, dedicated generation workers): the next step's rollouts are
collected in a background thread while this step trains, and the engines are refitted once both are done;
each batch is then one policy version old (``train/trajectory_age``), which the importance-sampling
correction accounts for (see :mod:`rlfleet.algorithms.async_rollouts`, also for what a resume regenerates).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from rlfleet.algorithms.advantages import group_advantages, zero_variance_fraction
from rlfleet.algorithms.async_rollouts import RolloutPrefetcher
from rlfleet.algorithms.builders import flop_meter, micro_batching
from rlfleet.algorithms.dynamic_sampling import SampledGroups, collect_informative_groups, trainable_rows
from rlfleet.algorithms.evaluation import evaluate
from rlfleet.algorithms.overlong import OverlongShaping, mask_truncated
from rlfleet.algorithms.rollouts import Rollout, accuracy, generate_rollouts, mean_response_length, score
from rlfleet.algorithms.run import RunContext, closing_run, run_loop, start_run, step_seed
from rlfleet.config import MasterConfig, check_config, ensure_runnable
from rlfleet.config.layout import compute_layout
from rlfleet.generation import GenerationBackend, SamplingParams
from rlfleet.policy.batch import TrainBatch, collate
from rlfleet.policy.loss_functions import ClippedPGLossFn
from rlfleet.utils.timing import PhaseTimer


def rollout_batch(rollouts: Sequence[Rollout], advantages: torch.Tensor, pad_token_id: int) -> TrainBatch:
    batch = collate(
        [r.prompt.token_ids for r in rollouts],
        [r.result.token_ids for r in rollouts],
        pad_token_id,
        [r.result.logprobs for r in rollouts],
    )
    return batch.with_(advantages=advantages)


def loss_from_config(cfg: MasterConfig) -> ClippedPGLossFn:
    lf = cfg.loss_fn
    truncation, cap = lf.truncated_importance_sampling_type, lf.truncated_importance_sampling_ratio
    return ClippedPGLossFn(
        eps_low=lf.ratio_clip_min,
        eps_high=lf.ratio_clip_max,
        dual_clip_c=lf.ratio_clip_c,
        kl_penalty=lf.reference_policy_kl_penalty,
        kl_type=lf.reference_policy_kl_type,
        use_on_policy_kl_approximation=lf.use_on_policy_kl_approximation,
        kl_input_clamp=lf.kl_input_clamp_value,
        kl_output_clamp=lf.kl_output_clamp_value,
        token_level=lf.token_level_loss,
        importance_sampling_correction=lf.use_importance_sampling_correction,
        truncation="tis" if truncation is None and cap is not None else truncation,
        truncation_ratio_max=cap,
        truncation_ratio_min=lf.truncated_importance_sampling_ratio_min,
        sequence_level_ratios=lf.sequence_level_importance_ratios,
        max_length=cfg.policy.generation.max_new_tokens if lf.max_length_normalization else None,
    )


def rollout_metrics(rollouts: Sequence[Rollout], rewards: torch.Tensor, group_size: int) -> dict[str, float]:
    return {
        "train/reward": float(rewards.mean()),
        "train/accuracy": accuracy(rollouts),
        "train/zero_variance_groups": zero_variance_fraction(rewards, group_size),
        "train/mean_response_length": mean_response_length(rollouts),
        "train/truncated_fraction": sum(not r.result.finished for r in rollouts) / len(rollouts),
        "train/num_tokens": int(sum(len(r.prompt.token_ids) + len(r.result.token_ids) for r in rollouts)),
    }


@dataclass
class Collected:
    """A step's scored rollouts and what collecting them took (seconds per phase)."""

    sampled: SampledGroups[Rollout]
    drawn: list[Rollout]  # every rollout generated, informative or not
    reward_problems: tuple[int, int]  # (timeouts, errors) of the verifier
    seconds: dict[str, float]
    age: int = 0  # policy updates between the sampler and the trainer
    trained_batch: TrainBatch | None = None
    prev_from_forward: bool = False


def skipped_update() -> dict[str, float]:
    """The metrics of a step that trains on nothing (no informative group, or every row masked)."""
    return {"train/update_skipped": 1.0, "train/num_tokens": 0}


class GRPO:
    """The GRPO trainer: ``GRPO(cfg).train()`` runs (or resumes) the configured job."""

    backend: GenerationBackend
    ctx: RunContext  # the policy (``ctx.worker``), the reward workers, the loader, logger and checkpoints

    def __init__(self, cfg: MasterConfig, *, always_compute_prev: bool = False) -> None:
        """Builds (or resumes) the run.

        Args:
            cfg: The validated recipe.
            always_compute_prev: Compute the previous-policy logprobs in a separate pass even when the
                training forward's own would do (to check that the two give the same update).
        """
        check_config(cfg, "grpo")
        ensure_runnable(cfg)
        self.cfg, g, gen = cfg, cfg.grpo, cfg.policy.generation
        self.loss_fn = loss_from_config(cfg)
        self.always_compute_prev = always_compute_prev
        # a full step (P x G rows in one optimizer step) takes prev from the training forward
        rows_per_step = g.num_prompts_per_step * g.num_generations_per_prompt
        self.prev_from_training_forward = (
            rows_per_step == cfg.policy.train_global_batch_size and not always_compute_prev
        )
        self.dp_size = compute_layout(cfg)[0].train_dp
        rs = g.reward_shaping
        shaping = OverlongShaping(
            rs.max_response_length or gen.max_new_tokens,
            rs.overlong_buffer_length,
            rs.overlong_buffer_penalty,
        )
        self.shaping = shaping if rs.enabled else None
        max_rounds = g.dynamic_sampling_max_gen_batches
        self.max_rounds = max_rounds if g.use_dynamic_sampling else 1
        prompts_per_round = int(g.num_prompts_per_step * g.batch_multiplier)
        self.train_batching = micro_batching(cfg, "train")  # rows, dynamic batching or packing
        self.logprob_batching = micro_batching(cfg, "logprob")
        self.sampling = SamplingParams(gen.max_new_tokens, gen.temperature, gen.top_p, gen.top_k)
        enabled, max_age = g.async_grpo.enabled, g.async_grpo.max_trajectory_age_steps
        self.prefetcher = RolloutPrefetcher[Collected](max_age) if enabled else None
        self.ctx, self.backend, self.data = start_run(
            cfg,
            seed=g.seed,
            keep_reference=cfg.loss_fn.reference_policy_kl_penalty > 0,
            max_val_samples=g.max_val_samples,
            batch_size=prompts_per_round if g.use_dynamic_sampling else g.num_prompts_per_step,
            max_num_steps=g.max_num_steps,
            max_num_epochs=g.max_num_epochs,
        )
        try:
            self.flops = flop_meter(cfg, self.ctx.worker)  # MFU on GPUs with a known peak
        except BaseException:
            with closing_run(self.ctx):  # releases the workers started above, then re-raises
                raise

    def step(self) -> dict[str, float]:
        """One GRPO step: this step's rollouts (collected now, or prefetched during the previous step when
        asynchronous), the update, the next step's prefetch overlapping it, then the refit."""
        ctx, timer = self.ctx, PhaseTimer()
        collected = self._this_steps_rollouts()
        if self.prefetcher is not None and ctx.step + 1 < ctx.total_steps:
            ctx.loader_state_before_prefetch = ctx.loader.state_dict()
            next_step = ctx.step + 1
            # the engines hold the weights of `ctx.step` updates until the refit at the end of this step
            self.prefetcher.submit(lambda: self._collect(next_step), version=ctx.step, for_step=next_step)
        try:
            metrics, updated = self._train_on(collected, timer)
            if self.prefetcher is not None and self.prefetcher.pending:
                with timer("generation_wait"):
                    self.prefetcher.finish()
        except BaseException:
            if self.prefetcher is not None:
                self.prefetcher.drain()
            raise
        if updated:
            with timer("refit"):
                self.backend.refit()
        timing = {**{f"timing/{k}": v for k, v in collected.seconds.items()}, **timer.metrics()}
        if updated and collected.trained_batch is not None:  # _train_on sets it when it updates
            metrics.update(self._throughput(collected.trained_batch, timing, collected.prev_from_forward))
        return {**metrics, **timing}

    def _this_steps_rollouts(self) -> Collected:
        """The prefetched batch for this step (age-checked), or one collected now (the first step, or the
        first after a resume: the same prompts and seeds the prefetch would have used, current weights)."""
        ctx = self.ctx
        if self.prefetcher is not None and self.prefetcher.has_batch:
            collected, age = self.prefetcher.take(ctx.step, trainer_version=ctx.step)
            collected.age = age
            ctx.loader_state_before_prefetch = None
            return collected
        return self._collect(ctx.step)

    def _train_on(self, collected: Collected, timer: PhaseTimer) -> tuple[dict[str, float], bool]:
        """Advantages and the update on a collected batch; (metrics, whether the weights changed)."""
        cfg, worker = self.cfg, self.ctx.worker
        g, p = cfg.grpo, cfg.policy
        drawn, sampled = collected.drawn, collected.sampled
        self._log_samples(drawn)
        metrics = rollout_metrics(drawn, self._rewards(drawn, raw=True), g.num_generations_per_prompt)
        metrics["train/reward_timeouts"], metrics["train/reward_errors"] = collected.reward_problems
        if g.use_dynamic_sampling:
            metrics.update(sampled.metrics())
        if self.prefetcher is not None:
            metrics["train/trajectory_age"] = float(collected.age)
        rollouts = sampled.samples
        if not rollouts:  # no group carried a signal: nothing to train on
            return {**metrics, **skipped_update()}, False
        rewards = self._rewards(rollouts)
        if self.shaping is not None:
            metrics["train/shaped_reward"] = float(rewards.mean())
        advantages = group_advantages(
            rewards,
            g.num_generations_per_prompt,
            leave_one_out=g.use_leave_one_out_baseline,
            normalize=g.normalize_rewards,
            std_over=g.advantage_std,
        )
        batch = rollout_batch(rollouts, advantages, worker.tokenizer.pad_token_id)
        if g.overlong_filtering:
            truncated = torch.tensor([not r.result.finished for r in rollouts])
            batch = batch.with_(response_mask=mask_truncated(batch.response_mask, truncated))
        rows, global_batch = trainable_rows(len(rollouts), p.train_global_batch_size, self.dp_size)
        if rows == 0 or float(batch.response_mask[:rows].sum()) == 0:  # nothing trainable (or all masked)
            return {**metrics, **skipped_update()}, False
        batch = batch.select(0, rows) if rows < len(batch) else batch
        prev_from_forward = rows == global_batch and not self.always_compute_prev
        train = self._update(batch, timer, global_batch, prev_from_forward)
        collected.trained_batch, collected.prev_from_forward = batch, prev_from_forward
        metrics.update({f"train/{k}": v for k, v in train.items()})
        metrics["train/update_skipped"] = 0.0
        metrics["train/num_tokens"] = int(batch.attention_mask.sum())
        return metrics, True

    def _collect(self, step: int) -> Collected:
        """Step ``step``'s scored groups: one round of ``P`` prompts, or DAPO's rounds until ``P``
        informative groups. Runs in the background thread when asynchronous (it touches the loader, the
        generation engines and the reward workers only, never the trainers)."""
        g, ctx, timer = self.cfg.grpo, self.ctx, PhaseTimer()
        drawn: list[Rollout] = []
        problems = [0, 0]

        def draw(round_index: int) -> list[Rollout]:
            prompts = ctx.loader.next_batch()
            # round 0 keeps the step's seed of plain GRPO; later rounds get their own (salt 1 is validation)
            seed = step_seed(g.seed, step, salt=0 if round_index == 0 else 1 + round_index)
            with timer("generation"):
                pairs = generate_rollouts(
                    self.backend, prompts, g.num_generations_per_prompt, self.sampling, seed
                )
            with timer("reward"):
                rollouts, scored = score(pairs, ctx.verifier)
            problems[0] += scored.num_timeouts
            problems[1] += scored.num_errors
            drawn.extend(rollouts)
            return rollouts

        if not g.use_dynamic_sampling:
            rollouts = draw(0)
            groups = len(rollouts) // g.num_generations_per_prompt
            sampled = SampledGroups(rollouts, 1, groups, groups, 0, True)
        else:
            sampled = collect_informative_groups(
                draw,
                lambda r: r.reward,
                group_size=g.num_generations_per_prompt,
                target_groups=g.num_prompts_per_step,
                max_rounds=self.max_rounds,
            )
        return Collected(sampled, drawn, (problems[0], problems[1]), dict(timer.seconds))

    def _rewards(self, rollouts: Sequence[Rollout], *, raw: bool = False) -> torch.Tensor:
        """``[N]`` rewards, with DAPO's overlong penalty when configured (unless ``raw``)."""
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
        if raw or self.shaping is None:
            return rewards
        return self.shaping.apply(rewards, torch.tensor([len(r.result.token_ids) for r in rollouts]))

    def _update(
        self, batch: TrainBatch, timer: PhaseTimer, global_batch: int, prev_from_forward: bool
    ) -> dict[str, float]:
        """The logprob passes, then the optimizer steps over ``batch``; the worker's metrics."""
        p, worker = self.cfg.policy, self.ctx.worker
        temperature = p.generation.temperature
        with timer("logprobs"):
            prev = ref = None
            if not prev_from_forward:
                prev = worker.logprobs(batch, self.logprob_batching, temperature=temperature)
            if worker.has_reference:
                ref = worker.logprobs(batch, self.logprob_batching, reference=True, temperature=temperature)
        batch = batch.with_(prev_logprobs=prev, ref_logprobs=ref)
        loss_fn = replace(self.loss_fn, prev_from_training_forward=prev is None)
        with timer("training"):
            train = worker.train(
                batch,
                loss_fn,
                global_batch_size=global_batch,
                micro_batching=self.train_batching,
                temperature=temperature,
            )
        return train

    def _throughput(
        self, batch: TrainBatch, timing: dict[str, float], prev_from_forward: bool
    ) -> dict[str, float]:
        """Tokens per second of each phase, and per worker with its imbalance on Ray."""
        response_tokens = float(batch.response_mask.sum())
        all_tokens = float(batch.attention_mask.sum())
        out = {
            "perf/generation_tokens_per_s": response_tokens / max(timing["timing/generation"], 1e-9),
            "perf/training_tokens_per_s": all_tokens / max(timing["timing/training"], 1e-9),
        }
        out.update(self.backend.take_metrics())
        # the training pass, plus the prev and the reference logprob passes where they run
        extra_passes = int(not prev_from_forward) + int(self.ctx.worker.has_reference)
        out.update(self.ctx.worker.take_metrics(int(all_tokens * (1 + extra_passes))))
        if self.flops is not None:
            lengths = [int(n) for n in batch.attention_mask.sum(dim=1).tolist()]
            seconds = timing["timing/training"] + timing.get("timing/logprobs", 0.0)
            out["perf/training_mfu"] = self.flops.step_mfu(lengths, extra_passes, seconds)
        return out

    def _log_samples(self, rollouts: Sequence[Rollout]) -> None:
        samples = [r.sample() for r in rollouts[: self.cfg.logger.num_samples_to_log]]
        if samples:
            self.ctx.logger.log_samples(self.ctx.step + 1, samples)

    def validate(self) -> dict[str, float]:
        g, gen = self.cfg.grpo, self.cfg.policy.generation
        params = SamplingParams(
            gen.max_new_tokens, gen.temperature, gen.top_p, gen.top_k, greedy=g.val_greedy
        )
        result = evaluate(
            self.backend, self.data.val, self.ctx.verifier, params, step_seed(g.seed, self.ctx.step, salt=1)
        )
        return result.metrics("val")

    def train(self) -> dict[str, float]:
        g = self.cfg.grpo
        try:
            return run_loop(
                self.ctx,
                "grpo",
                self.step,
                self.validate,
                val_period=g.val_period,
                val_at_start=g.val_at_start,
                val_at_end=g.val_at_end,
            )
        finally:
            if self.prefetcher is not None:
                self.prefetcher.close()


def grpo_train(cfg: MasterConfig) -> dict[str, float]:
    """Runs (or resumes) GRPO as configured; returns the last step's metrics."""
    return GRPO(cfg).train()
