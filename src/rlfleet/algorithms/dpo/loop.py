"""DPO: direct preference optimisation (Rafailov et al. 2023) with NeMo RL's keys and loss (``dpo.*``).

A step is: pairs (``P`` = ``policy.train_global_batch_size`` (prompt, chosen, rejected) triples) -> the
batch (chosen and rejected interleaved, rows ``2i`` and ``2i + 1``) -> the reference policy's logprobs ->
one optimizer step on ``DPOLossFn`` (:mod:`rlfleet.policy.loss_functions`), micro-batched in pairs -> refit
the generation weights. The run around it validates, checkpoints and logs (:mod:`rlfleet.runtime.loop`).

Where the pairs come from (:mod:`rlfleet.rollouts.pairs`):

* **a task** (``data.dataset_name`` arithmetic, gsm8k, a ``ResponseDataset``...): the model's own samples.
  Each prompt gets ``dpo.sampled_pairs.num_generations_per_prompt`` responses from the current policy,
  scored by the row's environment; a prompt whose responses differ in reward gives its best as chosen and
  its worst as rejected (online DPO: no preference data needed). Rounds of prompts are drawn until the step
  has ``P`` pairs or ``dpo.sampled_pairs.max_rounds`` rounds ran; a step with fewer trains on what it has.
  Validation is the task's greedy accuracy, as for SFT and GRPO.
* **a preference dataset** (``PreferenceDataset``, ``BinaryPreferenceDataset``): its pairs, in order; the
  validation is the DPO loss and pair accuracy on ``dpo.val_batches`` x ``dpo.val_global_batch_size`` pairs.
"""

from __future__ import annotations

from dataclasses import replace

from rlfleet.algorithms.base import Trainer
from rlfleet.algorithms.dpo.config import DPOConfig
from rlfleet.algorithms.overlong import OverlongShaping
from rlfleet.config import MasterConfig
from rlfleet.data.preferences import PreferencePair
from rlfleet.generation import SamplingParams
from rlfleet.policy.loss_functions import DPOLossFn
from rlfleet.rollouts.collect import GroupCollector
from rlfleet.rollouts.pairs import (
    PairSource,
    best_and_worst_of_groups,
    pair_batch,
    pair_validation,
    sampled_pair,
)
from rlfleet.rollouts.rollout import Rollout, accuracy
from rlfleet.rollouts.validation import evaluate
from rlfleet.runtime.components import micro_batching
from rlfleet.runtime.loop import step_seed
from rlfleet.utils.timing import PhaseTimer


def dpo_loss_fn(dpo: DPOConfig) -> DPOLossFn:
    return DPOLossFn(
        reference_policy_kl_penalty=dpo.reference_policy_kl_penalty,
        preference_loss_weight=dpo.preference_loss_weight,
        sft_loss_weight=dpo.sft_loss_weight,
        preference_average_log_probs=dpo.preference_average_log_probs,
        sft_average_log_probs=dpo.sft_average_log_probs,
    )


class DPO(Trainer):
    """The DPO trainer: ``DPO.run(cfg)`` runs (or resumes) the configured job."""

    algorithm = "dpo"

    def __init__(self, cfg: MasterConfig) -> None:
        super().__init__(cfg)
        dpo = cfg.dpo
        self.loss_fn = dpo_loss_fn(dpo)
        train = micro_batching(cfg, "train", self.batching)  # policy.train_micro_batch_size counts pairs
        self.train_batching = replace(train, rows=2 * train.rows, pairs=True)
        self.logprob_batching = micro_batching(cfg, "logprob", self.batching)
        self.data_parallel = self.layout.train_dp
        self.source = PairSource.of(cfg.data)
        self.start(
            batch_size=cfg.policy.train_global_batch_size,
            max_val_samples=dpo.max_val_samples,
            pairs=self.source,
        )
        self.val_pairs: list[PreferencePair] = []
        if not self.source.sampled:
            with self.closing_on_failure():
                val = self.source.tokenize(self.ctx.policy.tokenizer, cfg, val=True)
            self.val_pairs = val[: dpo.val_batches * dpo.val_global_batch_size]
        generation, sampled = cfg.policy.generation, dpo.sampled_pairs
        self.sampling = SamplingParams(
            generation.max_new_tokens, generation.temperature, generation.top_p, generation.top_k
        )
        self.shaping = OverlongShaping.of(sampled.reward_shaping, generation.max_new_tokens)
        self.collect = GroupCollector(
            self.ctx.episodes,
            self.ctx.loader,
            self.sampling,
            sampled.num_generations_per_prompt,
            self._round_seed,
            (cfg.policy.train_global_batch_size, sampled.max_rounds),
            self._score,
        )

    def _score(self, rollout: Rollout) -> float:
        """What ranks a sample within its group: its reward, shaped when the overlong penalty is on."""
        if self.shaping is None:
            return rollout.reward
        return self.shaping.score(rollout.reward, rollout.num_response_tokens)

    def _round_seed(self, step: int, round_index: int) -> int:
        return step_seed(self.cfg.dpo.seed, step, salt=0 if round_index == 0 else 1 + round_index)

    def step(self) -> dict[str, float]:
        """pairs -> batch -> reference logprobs -> one optimizer step -> refit."""
        timer = PhaseTimer()
        pairs, metrics = self._pairs()
        pairs = pairs[: len(pairs) - len(pairs) % self.data_parallel]  # whole pairs on every rank
        if not pairs:
            return {**metrics, "train/update_skipped": 1.0, "train/num_pairs": 0.0, **timer.metrics()}
        policy = self.ctx.policy
        batch = pair_batch(pairs, policy.tokenizer.pad_token_id)
        with timer("logprobs"):
            ref = policy.logprobs(batch, self.logprob_batching, reference=True)
        with timer("training"):
            train = policy.train(
                batch.with_(ref_logprobs=ref),
                self.loss_fn,
                global_batch_size=len(batch),
                micro_batching=self.train_batching,
            )
        metrics.update({f"train/{k}": v for k, v in train.items()})
        metrics |= {
            "train/update_skipped": 0.0,
            "train/num_pairs": float(len(pairs)),
            "train/num_tokens": int(batch.attention_mask.sum()),
        }
        if self.source.sampled:
            with timer("refit"):
                self.backend.refit()
        return {**metrics, **timer.metrics()}

    def _pairs(self) -> tuple[list[PreferencePair], dict[str, float]]:
        """This step's pairs: the dataset's next batch, or the best and worst of the model's own samples."""
        if not self.source.sampled:
            return list(self.ctx.loader.next_batch()), {}
        collected = self.collect(self.ctx.step)
        drawn = collected.drawn
        metrics = {
            "train/sample_reward": sum(r.reward for r in drawn) / max(len(drawn), 1),
            "train/sample_accuracy": accuracy(drawn),
            "train/sampled_rounds": float(collected.groups.rounds),
        }
        metrics.update({f"timing/{k}": v for k, v in collected.seconds.items()})
        group = self.cfg.dpo.sampled_pairs.num_generations_per_prompt
        found = best_and_worst_of_groups(collected.groups.samples, group, self._score)
        if self.shaping is not None:  # pairs whose rewards tie, ranked by the overlong penalty alone
            metrics["train/length_only_pairs"] = float(sum(c.reward == r.reward for c, r in found))
        return [sampled_pair(*pair) for pair in found], metrics

    def validate(self) -> dict[str, float]:
        if self.source.sampled:
            params = SamplingParams(self.cfg.policy.generation.max_new_tokens, greedy=True)
            seed = step_seed(self.cfg.dpo.seed, self.ctx.step, salt=1)
            return evaluate(self.ctx.episodes, self.data.val, params, seed).metrics("val")
        dpo = self.cfg.dpo
        return pair_validation(
            self.ctx.policy,
            self.loss_fn,
            self.val_pairs,
            batch_size=dpo.val_global_batch_size,
            micro_batch_size=dpo.val_micro_batch_size,
            reference=True,
        )


def dpo_train(cfg: MasterConfig) -> dict[str, float]:
    """Runs (or resumes) DPO as configured; returns the last step's metrics."""
    return DPO.run(cfg)
