"""Preference pairs, the unit DPO and reward models train on: from the model's own scored samples, or from
a dataset.

A pair is a prompt's tokens and two responses' tokens, the chosen (preferred) one and the rejected one. The
training batch interleaves them (rows ``2i`` chosen, ``2i + 1`` rejected), as NeMo RL's DPO and RM do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from rlfleet.config.preferences import PREFERENCE_DATASETS
from rlfleet.config.schema import DataConfig, MasterConfig
from rlfleet.data import resolve_system_prompt
from rlfleet.data.errors import DataError
from rlfleet.data.preferences import (
    PreferenceExample,
    PreferenceKeys,
    PreferencePair,
    load_preference_split,
    tokenize_pairs,
)
from rlfleet.data.response_dataset import resolve_sources
from rlfleet.policy.batch import TrainBatch, collate
from rlfleet.policy.interface import LossFn, Policy
from rlfleet.policy.loss_math import Normalizer
from rlfleet.rollouts.rollout import Rollout

log = logging.getLogger("rlfleet")


Score = Callable[[Rollout], float]
"""How a rollout ranks within its group: its reward, or a shaped reward (DPO's overlong penalty)."""


def reward_of(rollout: Rollout) -> float:
    return rollout.reward


def best_and_worst(group: Sequence[Rollout], score: Score = reward_of) -> tuple[Rollout, Rollout] | None:
    """The group's highest-scored and lowest-scored rollouts (the first of each among ties), or None when
    every score is equal (no preference)."""
    scores = [score(r) for r in group]
    best = max(range(len(group)), key=lambda i: (scores[i], -i))
    worst = min(range(len(group)), key=lambda i: (scores[i], i))
    if scores[best] == scores[worst]:
        return None
    return group[best], group[worst]


def best_and_worst_of_groups(
    rollouts: Sequence[Rollout], group_size: int, score: Score = reward_of
) -> list[tuple[Rollout, Rollout]]:
    """``(best, worst)`` of each group of ``group_size`` contiguous rollouts whose scores differ."""
    if len(rollouts) % group_size:
        raise ValueError(f"{len(rollouts)} rollouts do not split into groups of {group_size}")
    found = (best_and_worst(rollouts[i : i + group_size], score) for i in range(0, len(rollouts), group_size))
    return [pair for pair in found if pair is not None]


def sampled_pair(chosen: Rollout, rejected: Rollout) -> PreferencePair:
    """Two samples of one prompt as a pair, in the tokens the model sampled."""
    return PreferencePair(
        chosen.prompt.token_ids,
        chosen.result.token_ids,
        rejected.result.token_ids,
        f"sampled for {chosen.prompt.example.question[:60]!r}",
        chosen.mask,
        rejected.mask,
    )


def pair_batch(pairs: Sequence[PreferencePair], pad_token_id: int) -> TrainBatch:
    """The training batch of ``pairs``: rows ``2i`` (chosen) and ``2i + 1`` (rejected) of pair ``i``."""
    prompts = [p.prompt_ids for p in pairs for _ in range(2)]
    responses = [ids for p in pairs for ids in (p.chosen_ids, p.rejected_ids)]
    masks = [mask for p in pairs for mask in (p.chosen_mask, p.rejected_mask)]
    return collate(
        prompts, responses, pad_token_id, response_masks=masks if any(m is not None for m in masks) else None
    )


def whole_batch(batch: TrainBatch) -> Normalizer:
    """The normaliser of ``batch`` taken as one global batch (validation's loss over all its pairs)."""
    return Normalizer(float(batch.response_mask.sum()), float(len(batch)))


def pair_validation(
    policy: Policy,
    loss_fn: LossFn,
    pairs: Sequence[PreferencePair],
    *,
    batch_size: int,
    micro_batch_size: int,
    reference: bool,
) -> dict[str, float]:
    """NeMo RL's validation of a model trained on pairs (DPO, reward models): ``loss_fn`` and its metrics
    over ``pairs``, ``batch_size`` pairs at a time (``micro_batch_size`` per forward pass), no update; each
    metric the mean over the batches weighted by their pairs, plus ``num_valid_samples`` (pairs), under
    ``val/``.

    ``reference``: the batches carry the frozen reference policy's logprobs (DPO's implicit reward).
    """
    if not pairs:
        raise ValueError("no validation pairs to score")
    totals: dict[str, float] = {}
    rows = 2 * micro_batch_size
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        batch = pair_batch(chunk, policy.tokenizer.pad_token_id)
        outputs = policy.logprobs(batch, rows)  # a reward model's per-token scores
        if reference:
            batch = batch.with_(ref_logprobs=policy.logprobs(batch, rows, reference=True))
        with torch.no_grad():
            _, metrics = loss_fn(outputs, batch, whole_batch(batch))
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + value * len(chunk) / len(pairs)
    totals["num_valid_samples"] = float(len(pairs))
    return {f"val/{key}": value for key, value in totals.items()}


@dataclass(frozen=True)
class PairSource:
    """Where a DPO or reward-model run's pairs come from: the model's own samples (``sampled``: ``data``
    is a task; DPO only), or a preference dataset, whose rows :meth:`of` reads and checks before anything
    expensive starts.

    Attributes:
        sampled: Pairs are sampled (no rows here).
        train: The dataset's training rows.
        val: Its validation rows.
    """

    sampled: bool
    train: tuple[PreferenceExample, ...] = ()
    val: tuple[PreferenceExample, ...] = ()

    @classmethod
    def of(cls, data: DataConfig) -> PairSource:
        """The source ``data`` configures; a preference dataset's every row is read and checked here
        (``data.on_bad_row``: a bad row stops with its ``file:line``, or is skipped and counted)."""
        if data.dataset_name not in PREFERENCE_DATASETS:
            return cls(sampled=True)
        keys = PreferenceKeys(data.prompt_key, data.chosen_key, data.rejected_key)
        splits = []
        for source in resolve_sources(data):
            examples, report = load_preference_split(
                source.path,
                split=source.split,
                subset=source.subset,
                keys=keys,
                on_bad_row=data.on_bad_row,
                name=source.name,
            )
            if report.total:
                log.warning(
                    "skipped %d bad %s preference rows (data.on_bad_row=skip): %s; first: %s",
                    report.total,
                    source.name,
                    ", ".join(f"{k}={n}" for k, n in report.by_reason.items() if n),
                    "; ".join(report.samples),
                )
            splits.append(tuple(examples))
        return cls(sampled=False, train=splits[0], val=splits[1])

    def tokenize(
        self, tokenizer: PreTrainedTokenizerBase, cfg: MasterConfig, *, val: bool = False
    ) -> list[PreferencePair]:
        """The training (or validation) rows as token pairs; pairs over ``policy.max_total_sequence_length``
        or tokenising the same are dropped and counted in the log, and a split left empty is an error."""
        name, examples = ("val", self.val) if val else ("train", self.train)
        pairs, dropped = tokenize_pairs(
            examples,
            tokenizer,
            max_total_length=cfg.policy.max_total_sequence_length,
            system_prompt=resolve_system_prompt(cfg.data),
        )
        if any(dropped.values()):
            log.warning(
                "dropped %s %s preference pairs: %s",
                sum(dropped.values()),
                name,
                ", ".join(f"{k}={n}" for k, n in dropped.items() if n),
            )
        if not pairs:
            raise DataError(
                f"no {name} preference pair is left of {len(examples)} row(s) once tokenised (dropped: "
                f"{dropped}); fix: raise policy.max_total_sequence_length or check the data"
            )
        return pairs
