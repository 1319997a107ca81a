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

import sys
from dataclasses import replace

from rlfleet.config import MasterConfig, check_config, ensure_runnable
from rlfleet.config.layout import resource_layout
from rlfleet.data.preferences import PreferencePair
from rlfleet.memory.planner import ensure_fits, resolve_batching
from rlfleet.policy.loss_functions import PreferenceLossFn
from rlfleet.rollouts.pairs import PairSource, pair_batch, pair_validation
from rlfleet.runtime.components import micro_batching
from rlfleet.runtime.loop import RunContext, closing_run, finished_run, run_loop, start_run
from rlfleet.utils.timing import PhaseTimer


def step_limit(max_num_steps: int) -> int:
    """``rm.max_num_steps`` as a bound on the steps: -1 (NeMo RL's "no limit") leaves ``max_num_epochs``
    to decide."""
    return sys.maxsize if max_num_steps < 0 else max_num_steps


class RM:
    """The reward-model trainer: ``RM(cfg).train()`` runs (or resumes) the configured job."""

    ctx: RunContext  # the reward model, the pairs' loader, logger and checkpoints

    def __init__(self, cfg: MasterConfig) -> None:
        layout = resource_layout(cfg)  # computed once for the checks and the run
        check_config(cfg, "rm", layout=layout)
        ensure_runnable(cfg, layout=layout)
        batching = resolve_batching(cfg, layout, "rm")  # token budgets: the recipe's, or fitted here
        ensure_fits(cfg, layout, batching, "rm")  # before any model is loaded
        self.cfg, rm = cfg, cfg.rm
        train = micro_batching(cfg, "train", batching)  # policy.train_micro_batch_size counts pairs
        self.train_batching = replace(train, rows=2 * train.rows, pairs=True)
        self.data_parallel = layout.train_dp
        source = PairSource.of(cfg.data)  # every row read and checked (the checks refuse a task)
        self.ctx, _, _ = start_run(
            cfg,
            layout,
            seed=rm.seed,
            keep_reference=False,
            max_val_samples=1,  # no task prompts: the validation is on pairs
            batch_size=cfg.policy.train_global_batch_size,
            max_num_steps=step_limit(rm.max_num_steps),
            max_num_epochs=rm.max_num_epochs,
            pairs=source,
            generation=False,
        )
        try:
            val = source.tokenize(self.ctx.policy.tokenizer, cfg, val=True)
        except BaseException:
            with closing_run(self.ctx):  # releases what start_run started, then re-raises
                raise
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

    def train(self) -> dict[str, float]:
        rm = self.cfg.rm
        return run_loop(
            self.ctx,
            "rm",
            self.step,
            self.validate,
            val_period=rm.val_period,
            val_at_start=rm.val_at_start,
            val_at_end=rm.val_at_end,
        )


def rm_train(cfg: MasterConfig) -> dict[str, float]:
    """Runs (or resumes) reward-model training as configured; returns the last step's metrics."""
    done = finished_run(cfg, "rm", step_limit(cfg.rm.max_num_steps))  # a finished run starts nothing
    return done if done is not None else RM(cfg).train()
