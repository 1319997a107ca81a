"""On-policy distillation: the student samples, a frozen teacher grades every token of what it sampled with
its top-k distribution, and the student is trained on the per-token KL to it (NeMo RL's
``nemo_rl/algorithms/distillation.py``, its ``distillation.*`` and ``loss_fn`` keys and ``teacher:``
block).

A step is: collect (``P`` prompts x ``G`` student samples, single- or multi-turn episodes scored by their
environment for the metrics; :mod:`rlfleet.rollouts.collect`) -> the teacher's top ``k`` logprobs and ids at
every position of those sequences (one prefill pass, never the full vocabulary per token;
:mod:`rlfleet.algorithms.distillation.teacher`) -> optimizer steps on ``DistillationLossFn`` (the student read
at the teacher's ids; :mod:`rlfleet.algorithms.distillation.loss`), a mean over the response tokens (a
multi-turn episode's own turns) -> refit the generation weights. The run around it validates (the task's
greedy accuracy), checkpoints, resumes and logs (:mod:`rlfleet.runtime.loop`).

The dense signal (a target distribution at every token instead of one reward per episode) is why a student
learns from a teacher sooner than from rewards alone."""

from __future__ import annotations

import time
from dataclasses import replace

from rlfleet.algorithms.base import Trainer
from rlfleet.algorithms.distillation.loss import DistillationLossFn
from rlfleet.algorithms.distillation.teacher_setup import TeacherHandle, start_teacher
from rlfleet.config import MasterConfig
from rlfleet.generation import SamplingParams
from rlfleet.policy.batch import collate
from rlfleet.rollouts.collect import GroupCollector
from rlfleet.rollouts.rollout import Rollout, accuracy, mean_response_length
from rlfleet.rollouts.validation import evaluate
from rlfleet.runtime.components import micro_batching
from rlfleet.runtime.loop import step_seed
from rlfleet.utils.timing import PhaseTimer


def distillation_loss_fn(cfg: MasterConfig) -> DistillationLossFn:
    loss = cfg.loss_fn
    return DistillationLossFn(loss.kl_type, loss.mixed_kl_weight, loss.zero_outside_topk)


def student_sample_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """The student's samples: their reward and accuracy by the environment, their length."""
    return {
        "train/reward": sum(r.reward for r in rollouts) / max(len(rollouts), 1),
        "train/accuracy": accuracy(rollouts),
        "train/mean_response_length": mean_response_length(rollouts),
    }


class Distillation(Trainer):
    """The on-policy distillation trainer: ``Distillation.run(cfg)`` runs (or resumes) the job."""

    algorithm = "distillation"
    teacher: TeacherHandle

    def __init__(self, cfg: MasterConfig) -> None:
        super().__init__(cfg)  # its preflight: vocabularies and top-k against the teacher's files
        d = cfg.distillation
        self.loss_fn = distillation_loss_fn(cfg)
        self.train_batching = micro_batching(cfg, "train", self.batching)
        teacher = cfg.teacher
        assert teacher is not None  # check_config refused a recipe without one
        self.teacher_batching = replace(
            micro_batching(cfg, "logprob", self.batching),
            rows=teacher.logprob_batch_size,
            logprob_chunk=teacher.logprob_chunk_size,
        )
        self.start(batch_size=d.num_prompts_per_step, max_val_samples=d.max_val_samples)
        with self.closing_on_failure():  # after the student: on Ray its actor takes what the policy's left
            self.teacher = start_teacher(cfg, self.layout)
        generation = cfg.policy.generation
        self.sampling = SamplingParams(
            generation.max_new_tokens, generation.temperature, generation.top_p, generation.top_k
        )
        self.collect = GroupCollector(
            self.ctx.episodes,
            self.ctx.loader,
            self.sampling,
            d.num_generations_per_prompt,
            lambda step, _round: step_seed(d.seed, step),
            None,
        )

    def step(self) -> dict[str, float]:
        """collect -> teacher top-k -> optimizer steps on the KL -> refit."""
        timer, start = PhaseTimer(), time.perf_counter()
        collected = self.collect(self.ctx.step)
        rollouts = collected.groups.samples
        policy = self.ctx.policy
        batch = collate(
            [r.prompt.token_ids for r in rollouts],
            [r.result.token_ids for r in rollouts],
            policy.tokenizer.pad_token_id,
            response_masks=[r.mask for r in rollouts],
        )
        with timer("teacher"):
            logprobs, ids = self.teacher.topk(
                batch, self.teacher_batching, self.cfg.distillation.topk_logits_k
            )
        batch = batch.with_(teacher_topk_logprobs=logprobs, teacher_topk_ids=ids)
        with timer("training"):  # the student read at the temperature it sampled at, as GRPO's update is
            train = policy.train(
                batch,
                self.loss_fn,
                global_batch_size=self.cfg.policy.train_global_batch_size,
                micro_batching=self.train_batching,
                temperature=self.sampling.temperature,
            )
        with timer("refit"):
            self.backend.refit()
        timing = {**{f"timing/{k}": v for k, v in collected.seconds.items()}, **timer.metrics()}
        total = time.perf_counter() - start
        return {
            **student_sample_metrics(rollouts),
            **{f"train/{k}": v for k, v in train.items()},
            "train/num_tokens": int(batch.attention_mask.sum()),
            **timing,
            "timing/teacher_share": timing["timing/teacher"] / max(total, 1e-9),
        }

    def validate(self) -> dict[str, float]:
        params = SamplingParams(self.cfg.policy.generation.max_new_tokens, greedy=True)
        seed = step_seed(self.cfg.distillation.seed, self.ctx.step, salt=1)
        return evaluate(self.ctx.episodes, self.data.val, params, seed).metrics("val")

    def close(self) -> None:
        self.teacher.close()


def distillation_train(cfg: MasterConfig) -> dict[str, float]:
    """Runs (or resumes) on-policy distillation as configured; returns the last step's metrics."""
    return Distillation.run(cfg)
