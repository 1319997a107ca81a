"""Bradley-Terry reward-model training (``rlfleet rm``) with NeMo RL's keys and loss (``rm.*``).

The model is the policy checkpoint loaded as a sequence classifier with one label
(``policy.reward_model_cfg``): the causal LM's backbone and a new score head whose output at a sequence's
last token is its reward ``r`` (:mod:`rlfleet.models.loading`). A step is: pairs (``P`` =
``policy.train_global_batch_size`` (prompt, chosen, rejected) triples of a preference dataset) -> the batch
(chosen and rejected interleaved, rows ``2i`` and ``2i + 1``) -> one optimizer step on
``-log sigmoid(r_chosen - r_rejected)`` (``PreferenceLossFn``, :mod:`rlfleet.policy.loss_functions`),
micro-batched in pairs. Validation is the same loss and the pair accuracy (``val/accuracy``: the share of
pairs whose chosen reply scores higher) on ``rm.val_batches`` x ``rm.val_global_batch_size`` validation
pairs. The run around it checkpoints, resumes and logs as every loop does (:mod:`rlfleet.runtime.loop`);
no generation engine, environment or reference model is built.

How it departs from NeMo RL: the score head reads the last token of each row where transformers' sequence
classifier reads it (the last token that is not padding), in training as in the exported model
(``rlfleet export`` writes a ``*ForSequenceClassification`` directory that the ``reward_model`` environment
loads); sequence packing and dynamic batching work as for DPO (NeMo RL refuses packing for reward models).
"""

from __future__ import annotations

from dataclasses import replace

from rlfleet.algorithms.base import Trainer
from rlfleet.config import MasterConfig
from rlfleet.data.preferences import PreferencePair
from rlfleet.policy.loss_functions import PreferenceLossFn
from rlfleet.rollouts.pairs import PairSource, pair_batch, pair_validation
from rlfleet.runtime.components import micro_batching
from rlfleet.utils.timing import PhaseTimer


class RM(Trainer):
    """The reward-model trainer: ``RM.run(cfg)`` runs (or resumes) the configured job."""

    algorithm = "rm"

    def __init__(self, cfg: MasterConfig) -> None:
        super().__init__(cfg)
        train = micro_batching(cfg, "train", self.batching)  # policy.train_micro_batch_size counts pairs
        self.train_batching = replace(train, rows=2 * train.rows, pairs=True)
        self.data_parallel = self.layout.train_dp
        source = PairSource.of(cfg.data)  # every row read and checked (the checks refuse a task)
        # no task prompts: the validation is on pairs
        self.start(batch_size=cfg.policy.train_global_batch_size, pairs=source, generation=False)
        with self.closing_on_failure():
            val = source.tokenize(self.ctx.policy.tokenizer, cfg, val=True)
        rm = cfg.rm
        limit = rm.val_batches * rm.val_global_batch_size if rm.val_batches > 0 else len(val)
        self.val_pairs: list[PreferencePair] = val[:limit]
        self.loss_fn = PreferenceLossFn(pad_token_id=self.ctx.policy.tokenizer.pad_token_id)

    def step(self) -> dict[str, float]:
        """pairs -> batch -> one optimizer step on the Bradley-Terry loss."""
        timer = PhaseTimer()
        pairs: list[PreferencePair] = list(self.ctx.loader.next_batch())
        pairs = pairs[: len(pairs) - len(pairs) % self.data_parallel]  # whole pairs on every rank
        if not pairs:
            return {"train/update_skipped": 1.0, "train/num_pairs": 0.0, **timer.metrics()}
        batch = pair_batch(pairs, self.ctx.policy.tokenizer.pad_token_id)
        with timer("training"):
            train = self.ctx.policy.train(
                batch, self.loss_fn, global_batch_size=len(batch), micro_batching=self.train_batching
            )
        return {
            **{f"train/{k}": v for k, v in train.items()},
            "train/update_skipped": 0.0,
            "train/num_pairs": float(len(pairs)),
            "train/num_tokens": int(batch.attention_mask.sum()),
            **timer.metrics(),
        }

    def validate(self) -> dict[str, float]:
        """NeMo RL's RM validation: loss, pair accuracy and mean rewards over the validation pairs."""
        rm = self.cfg.rm
        return pair_validation(
            self.ctx.policy,
            self.loss_fn,
            self.val_pairs,
            batch_size=rm.val_global_batch_size,
            micro_batch_size=rm.val_micro_batch_size,
            reference=False,
        )


def rm_train(cfg: MasterConfig) -> dict[str, float]:
    """Runs (or resumes) reward-model training as configured; returns the last step's metrics."""
    return RM.run(cfg)
