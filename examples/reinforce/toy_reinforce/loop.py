"""The loop: sample groups, score them, one policy-gradient step, refit the generation weights. The set-up,
the clean-up, checkpoints, resume, validation schedule and logging come from ``Trainer``."""

from __future__ import annotations

import torch
from toy_reinforce.loss import ReinforceLossFn

from rlfleet.algorithms.base import Trainer
from rlfleet.config.schema import MasterConfig
from rlfleet.generation import SamplingParams
from rlfleet.policy.batch import collate
from rlfleet.rollouts.collect import GroupCollector
from rlfleet.rollouts.validation import evaluate
from rlfleet.runtime.components import micro_batching
from rlfleet.runtime.loop import step_seed


class Reinforce(Trainer):
    algorithm = "reinforce"

    def __init__(self, cfg: MasterConfig) -> None:
        super().__init__(cfg)
        self.section = cfg.reinforce  # type: ignore[attr-defined]
        self.start(batch_size=self.section.num_prompts_per_step, max_val_samples=self.section.max_val_samples)
        g = cfg.policy.generation
        sampling = SamplingParams(g.max_new_tokens, g.temperature, g.top_p, g.top_k)
        self.group = self.section.num_generations_per_prompt
        seed = self.section.seed
        self.collect = GroupCollector(
            self.ctx.episodes,
            self.ctx.loader,
            sampling,
            self.group,
            lambda step, _: step_seed(seed, step),
            None,
        )
        self.train_batching = micro_batching(cfg, "train", self.batching)

    def step(self) -> dict[str, float]:
        rollouts = self.collect(self.ctx.step).groups.samples
        rewards = torch.tensor([r.reward for r in rollouts]).view(-1, self.group)
        advantages = rewards - rewards.mean(dim=1, keepdim=True) if self.section.baseline else rewards
        policy = self.ctx.policy
        batch = collate(
            [r.prompt.token_ids for r in rollouts],
            [r.result.token_ids for r in rollouts],
            policy.tokenizer.pad_token_id,
            [r.result.logprobs for r in rollouts],
            [r.mask for r in rollouts],
        ).with_(advantages=advantages.flatten())
        train = policy.train(
            batch, ReinforceLossFn(), global_batch_size=len(batch), micro_batching=self.train_batching
        )
        self.backend.refit()
        return {"train/reward": float(rewards.mean()), **{f"train/{k}": v for k, v in train.items()}}

    def validate(self) -> dict[str, float]:
        params = SamplingParams(self.cfg.policy.generation.max_new_tokens, greedy=True)
        seed = step_seed(self.section.seed, self.ctx.step, salt=1)
        return evaluate(self.ctx.episodes, self.data.val, params, seed).metrics("val")
