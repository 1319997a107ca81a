"""SFT: supervised fine-tuning on (prompt, worked answer) pairs, loss on response tokens only.

The warm start of the embedded default: it teaches a tiny model the answer format so that GRPO starts
from a non-zero reward. Batches hold ``policy.train_global_batch_size`` examples and take one optimizer
step each; validation generates answers and scores them with the same reward as GRPO.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from rlfleet.algorithms.base import Trainer
from rlfleet.config import MasterConfig
from rlfleet.data import Prompt
from rlfleet.data.prompts import CONTEXT_SPANS, response_target_and_mask
from rlfleet.generation import SamplingParams
from rlfleet.policy.batch import TrainBatch, collate
from rlfleet.policy.loss_functions import NLLLossFn
from rlfleet.rollouts.validation import evaluate
from rlfleet.runtime.components import micro_batching
from rlfleet.runtime.loop import step_seed
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


class SFT(Trainer):
    """Supervised fine-tuning: ``SFT.run(cfg)`` runs (or resumes) the configured job."""

    algorithm = "sft"

    def __init__(self, cfg: MasterConfig) -> None:
        super().__init__(cfg)
        self.loss_fn = NLLLossFn(token_level=cfg.loss_fn.token_level_loss)
        self.train_batching = micro_batching(cfg, "train", self.batching)  # rows, dynamic batching or packing
        self.start(batch_size=cfg.policy.train_global_batch_size, max_val_samples=cfg.sft.max_val_samples)

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


def sft_train(cfg: MasterConfig, *, release: bool = False) -> dict[str, float]:
    """Runs (or resumes) SFT as configured; returns the last step's metrics (``release``: see
    :meth:`rlfleet.algorithms.base.Trainer.run`)."""
    return SFT.run(cfg, release=release)
