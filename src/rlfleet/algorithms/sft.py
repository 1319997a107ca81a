"""SFT: supervised fine-tuning on (prompt, worked answer) pairs, loss on response tokens only.

The warm start of the embedded default: it teaches a tiny model the answer format so that GRPO starts
from a non-zero reward. Batches hold ``policy.train_global_batch_size`` examples and take one optimizer
step each; validation generates answers and scores them with the same reward as GRPO.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from rlfleet.config import MasterConfig, check_config, ensure_runnable
from rlfleet.config.layout import resource_layout
from rlfleet.data import Prompt
from rlfleet.data.prompts import CONTEXT_SPANS, response_target_and_mask
from rlfleet.generation import GenerationBackend, SamplingParams
from rlfleet.memory.planner import ensure_fits, resolve_batching
from rlfleet.policy.batch import TrainBatch, collate
from rlfleet.policy.loss_functions import NLLLossFn
from rlfleet.policy.worker import PolicyWorker
from rlfleet.rollouts.evaluate import evaluate
from rlfleet.runtime.components import micro_batching
from rlfleet.runtime.loop import RunContext, finished_run, run_loop, start_run, step_seed
from rlfleet.utils.timing import PhaseTimer


def sft_batch(prompts: Sequence[Prompt], tokenizer: PreTrainedTokenizerBase, pad_token_id: int) -> TrainBatch:
    """Prompt tokens followed by the worked answer and EOS; only the answer is trained on, less the parts
    an example marks as context (an episode's tool messages, ``extra["context_spans"]``)."""
    pairs = [
        response_target_and_mask(tokenizer, p.example.answer, (p.example.extra or {}).get(CONTEXT_SPANS, ()))
        for p in prompts
    ]
    masks = [mask for _, mask in pairs]
    return collate(
        [p.token_ids for p in prompts],
        [ids for ids, _ in pairs],
        pad_token_id,
        response_masks=masks if any(m is not None for m in masks) else None,
    )


class SFT:
    """Supervised fine-tuning: ``SFT(cfg).train()`` runs (or resumes) the configured job."""

    backend: GenerationBackend
    ctx: RunContext  # the policy (``ctx.policy``), the episodes, the loader, logger and checkpoints

    def __init__(self, cfg: MasterConfig) -> None:
        layout = resource_layout(cfg)  # computed once for the checks and the run
        check_config(cfg, "sft", layout=layout)
        ensure_runnable(cfg, layout=layout)
        batching = resolve_batching(cfg, layout, "sft")  # token budgets: the recipe's, or fitted here
        ensure_fits(cfg, layout, batching, "sft")  # before any model is loaded
        self.cfg, sft = cfg, cfg.sft
        self.loss_fn = NLLLossFn(token_level=cfg.loss_fn.token_level_loss)
        self.train_batching = micro_batching(cfg, "train", batching)  # rows, dynamic batching or packing
        self.ctx, self.backend, self.data = start_run(
            cfg,
            layout,
            seed=sft.seed,
            keep_reference=False,
            max_val_samples=sft.max_val_samples,
            batch_size=cfg.policy.train_global_batch_size,
            max_num_steps=sft.max_num_steps,
            max_num_epochs=sft.max_num_epochs,
            max_turns=sft.max_rollout_turns,  # the validation's episodes
        )

    def step(self) -> dict[str, float]:
        policy, timer = self.ctx.policy, PhaseTimer()
        batch = sft_batch(self.ctx.loader.next_batch(), policy.tokenizer, policy.tokenizer.pad_token_id)
        with timer("training"):
            train = policy.train(
                batch, self.loss_fn, global_batch_size=len(batch), micro_batching=self.train_batching
            )
        metrics = {f"train/{k}": v for k, v in train.items()}
        metrics["train/num_tokens"] = int(batch.attention_mask.sum())
        return {**metrics, **timer.metrics()}

    def validate(self) -> dict[str, float]:
        params = SamplingParams(self.cfg.policy.generation.max_new_tokens, greedy=True)
        seed = step_seed(self.cfg.sft.seed, self.ctx.step, salt=1)
        self.backend.refit()  # engines holding their own copy see the trained weights
        return evaluate(self.ctx.episodes, self.data.val, params, seed).metrics("val")

    def train(self) -> dict[str, float]:
        sft = self.cfg.sft
        return run_loop(
            self.ctx,
            "sft",
            self.step,
            self.validate,
            val_period=sft.val_period,
            val_at_start=sft.val_at_start,
            val_at_end=sft.val_at_end,
        )


def sft_train(cfg: MasterConfig, *, release: bool = False) -> dict[str, float]:
    """Runs (or resumes) SFT as configured; returns the last step's metrics. With ``release`` an in-process
    worker's weights are freed at the end too (``PolicyWorker.release``): another stage runs in this
    process next (``rlfleet demo``)."""
    done = finished_run(cfg, "sft", cfg.sft.max_num_steps)  # a finished run starts nothing
    if done is not None:
        return done
    trainer = SFT(cfg)
    metrics = trainer.train()
    if release and isinstance(trainer.ctx.policy, PolicyWorker):
        trainer.ctx.policy.release()
    return metrics
