"""GRPO: group-relative policy optimisation, one loop that reads like the algorithm.

Per step: take ``P`` prompts -> sample ``G`` responses each -> score them -> leave-one-out advantages within
each group -> logprobs of the current (``prev``) and reference policies -> clipped policy-gradient updates
with a k3 KL penalty -> refit the generation weights -> validate / checkpoint / log.

No pass is computed twice: when the step's ``P x G`` rows make exactly one optimizer step
(``policy.train_global_batch_size``), ``prev`` is the training forward's own logprobs, detached, instead of a
separate pass (as TRL does); the reference pass runs only with a KL penalty (the reference is not even kept
without one).

Departures from the DeepSeekMath paper, as in NeMo RL: the baseline leaves the sample itself out, the
advantage is divided by the group std only where it is non-zero, and the loss is a token-level mean over
the whole global batch (``loss_fn.token_level_loss``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from rlfleet.algorithms.advantages import group_advantages, zero_variance_fraction
from rlfleet.algorithms.builders import micro_batching
from rlfleet.algorithms.evaluation import evaluate
from rlfleet.algorithms.rollouts import Rollout, accuracy, generate_rollouts, mean_response_length, score
from rlfleet.algorithms.run import RunContext, run_loop, start_run, step_seed
from rlfleet.config import MasterConfig, check_config, ensure_runnable
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
    return ClippedPGLossFn(
        eps_low=lf.ratio_clip_min,
        eps_high=lf.ratio_clip_max,
        dual_clip_c=lf.ratio_clip_c,
        kl_penalty=lf.reference_policy_kl_penalty,
        kl_type=lf.reference_policy_kl_type,
        kl_input_clamp=lf.kl_input_clamp_value,
        kl_output_clamp=lf.kl_output_clamp_value,
        token_level=lf.token_level_loss,
        importance_sampling_correction=lf.use_importance_sampling_correction,
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
        rows_per_step = g.num_prompts_per_step * g.num_generations_per_prompt
        self.prev_from_training_forward = (
            rows_per_step == cfg.policy.train_global_batch_size and not always_compute_prev
        )
        self.train_batching = micro_batching(cfg, "train")  # rows, dynamic batching or packing
        self.logprob_batching = micro_batching(cfg, "logprob")
        self.sampling = SamplingParams(gen.max_new_tokens, gen.temperature, gen.top_p, gen.top_k)
        self.ctx, self.backend, self.data = start_run(
            cfg,
            seed=g.seed,
            keep_reference=cfg.loss_fn.reference_policy_kl_penalty > 0,
            max_val_samples=g.max_val_samples,
            batch_size=g.num_prompts_per_step,
            max_num_steps=g.max_num_steps,
            max_num_epochs=g.max_num_epochs,
        )

    def step(self) -> dict[str, float]:
        cfg, ctx, worker, timer = self.cfg, self.ctx, self.ctx.worker, PhaseTimer()
        g, p = cfg.grpo, cfg.policy
        prompts = ctx.loader.next_batch()
        with timer("generation"):
            pairs = generate_rollouts(
                self.backend,
                prompts,
                g.num_generations_per_prompt,
                self.sampling,
                step_seed(g.seed, ctx.step),
            )
        with timer("reward"):
            rollouts, scored = score(pairs, self.ctx.verifier)
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
        advantages = group_advantages(
            rewards,
            g.num_generations_per_prompt,
            leave_one_out=g.use_leave_one_out_baseline,
            normalize=g.normalize_rewards,
        )
        batch = rollout_batch(rollouts, advantages, worker.tokenizer.pad_token_id)
        temperature = p.generation.temperature
        with timer("logprobs"):
            prev = ref = None
            if not self.prev_from_training_forward:
                prev = worker.logprobs(batch, self.logprob_batching, temperature=temperature)
            if worker.has_reference:
                ref = worker.logprobs(batch, self.logprob_batching, reference=True, temperature=temperature)
        batch = batch.with_(prev_logprobs=prev, ref_logprobs=ref)
        loss_fn = replace(self.loss_fn, prev_from_training_forward=prev is None)
        with timer("training"):
            train = worker.train(
                batch,
                loss_fn,
                global_batch_size=p.train_global_batch_size,
                micro_batch_size=self.train_batching,
                temperature=temperature,
            )
        with timer("refit"):
            self.backend.refit()
        metrics = rollout_metrics(rollouts, rewards, g.num_generations_per_prompt)
        metrics.update({f"train/{k}": v for k, v in train.items()})
        metrics["train/reward_timeouts"] = scored.num_timeouts
        metrics["train/reward_errors"] = scored.num_errors
        metrics.update(self._throughput(batch, timer.metrics()))
        self._log_samples(rollouts)
        return {**metrics, **timer.metrics()}

    def _throughput(self, batch: TrainBatch, timing: dict[str, float]) -> dict[str, float]:
        """Tokens per second of each phase, and per worker with its imbalance on Ray."""
        response_tokens = float(batch.response_mask.sum())
        all_tokens = float(batch.attention_mask.sum())
        out = {
            "perf/generation_tokens_per_s": response_tokens / max(timing["timing/generation"], 1e-9),
            "perf/training_tokens_per_s": all_tokens / max(timing["timing/training"], 1e-9),
        }
        out.update(self.backend.take_metrics())
        # the training pass, plus the prev and the reference logprob passes where they run
        passes = 1 + (not self.prev_from_training_forward) + self.ctx.worker.has_reference
        out.update(self.ctx.worker.take_metrics(int(all_tokens * passes)))
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
        return run_loop(
            self.ctx,
            "grpo",
            self.step,
            self.validate,
            val_period=g.val_period,
            val_at_start=g.val_at_start,
            val_at_end=g.val_at_end,
        )


def grpo_train(cfg: MasterConfig) -> dict[str, float]:
    """Runs (or resumes) GRPO as configured; returns the last step's metrics."""
    return GRPO(cfg).train()
