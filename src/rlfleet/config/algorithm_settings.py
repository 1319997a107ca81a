"""What code shared by the algorithms needs from the algorithm it serves, read from that algorithm's own
section: one table, one function per algorithm.

A recipe carries every section (``grpo``, ``sft``, ``dpo``, ``rm``, ``distillation``); an algorithm ignores
the sections it does not use. Code below the loops (the config checks, the memory plan, the run loop) serves
every algorithm, so it must not read a section by name: a helper that reads ``grpo.max_rollout_turns`` for an
SFT run would silently follow a key that run ignores. It asks :func:`algorithm_settings` instead, which reads
only the section of the algorithm it is given. This module sits in ``config`` because it is config arithmetic
that the checks (``config``) and the memory plan (``memory``) both need, and it answers from the config
alone, as every module of this package does.

What a loop does with its own section stays in its loop (``GRPOSettings`` in ``rlfleet.algorithms.grpo`` is
what a GRPO run does); this table holds only what shared code needs, so that it and the loops agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from rlfleet.config.distillation import DistillationConfig
from rlfleet.config.schema import GRPOConfig, MasterConfig

Algorithm = Literal["grpo", "sft", "dpo", "rm", "distillation"]


@dataclass(frozen=True)
class AlgorithmSettings:
    """What shared code needs of one algorithm, as the recipe sets it.

    Attributes:
        seed: The run's seed (the policy's initialisation, the data order, the sampling seeds).
        rollout_turns: Model turns per episode, in training and in validation on a task; None where the
            algorithm samples nothing (a reward model: no generation engine, no environment).
        turns_key: The dotted key that sets ``rollout_turns``; None where the algorithm has no such key.
        step_rows: Sequences one step trains on.
        update_rows: Sequences of one optimizer step (a pair is two: chosen and rejected).
        logprob_rows: Sequences a step's logprob pass scores (the previous and reference policy's, or the
            teacher's top k); None where the algorithm has no logprob pass.
        keeps_reference: A frozen reference copy of the policy is kept beside it.
        has_teacher: A teacher model is loaded beside the policy.
    """

    seed: int
    rollout_turns: int | None
    turns_key: str | None
    step_rows: int
    update_rows: int
    logprob_rows: int | None
    keeps_reference: bool
    has_teacher: bool = False

    @property
    def samples(self) -> bool:
        """The algorithm samples from the policy (a generation engine, environments)."""
        return self.rollout_turns is not None


def _sampled_groups(
    cfg: MasterConfig, section: GRPOConfig | DistillationConfig, name: str, **kinds: bool
) -> AlgorithmSettings:
    """An algorithm that samples ``num_prompts_per_step x num_generations_per_prompt`` sequences a step and
    scores every one of them in its logprob pass (GRPO, distillation), from its own ``section``."""
    samples = section.num_prompts_per_step * section.num_generations_per_prompt
    return AlgorithmSettings(
        seed=section.seed,
        rollout_turns=section.max_rollout_turns,
        turns_key=f"{name}.max_rollout_turns",
        step_rows=samples,
        update_rows=cfg.policy.train_global_batch_size,
        logprob_rows=samples,
        **kinds,
    )


def _grpo(cfg: MasterConfig) -> AlgorithmSettings:
    # the logprob pass: the previous policy's (and the reference's) logprobs of every sample; the
    # reference is kept only for the KL term
    return _sampled_groups(cfg, cfg.grpo, "grpo", keeps_reference=cfg.loss_fn.reference_policy_kl_penalty > 0)


def _sft(cfg: MasterConfig) -> AlgorithmSettings:
    s, batch = cfg.sft, cfg.policy.train_global_batch_size
    return AlgorithmSettings(
        seed=s.seed,
        rollout_turns=s.max_rollout_turns,  # its validation's episodes
        turns_key="sft.max_rollout_turns",
        step_rows=batch,
        update_rows=batch,
        logprob_rows=None,
        keeps_reference=False,
    )


def _dpo(cfg: MasterConfig) -> AlgorithmSettings:
    rows = 2 * cfg.policy.train_global_batch_size  # the pairs of one step, chosen and rejected
    return AlgorithmSettings(
        seed=cfg.dpo.seed,
        rollout_turns=cfg.dpo.max_rollout_turns,  # its sampled pairs' and its task validation's episodes
        turns_key="dpo.max_rollout_turns",
        step_rows=rows,
        update_rows=rows,
        logprob_rows=rows,  # the reference's logprobs of the pairs (sampled pairs: of those kept, not drawn)
        keeps_reference=True,  # the implicit reward is the policy's logprobs against the reference's
    )


def _rm(cfg: MasterConfig) -> AlgorithmSettings:
    rows = 2 * cfg.policy.train_global_batch_size
    return AlgorithmSettings(
        seed=cfg.rm.seed,
        rollout_turns=None,  # a reward model samples nothing
        turns_key=None,
        step_rows=rows,
        update_rows=rows,
        logprob_rows=None,
        keeps_reference=False,
    )


def _distillation(cfg: MasterConfig) -> AlgorithmSettings:
    # the logprob pass: the teacher's top k at every position of every sample
    return _sampled_groups(cfg, cfg.distillation, "distillation", keeps_reference=False, has_teacher=True)


ALGORITHM_SETTINGS: dict[Algorithm, Callable[[MasterConfig], AlgorithmSettings]] = {
    "grpo": _grpo,
    "sft": _sft,
    "dpo": _dpo,
    "rm": _rm,
    "distillation": _distillation,
}
"""Each algorithm's reading of its own sections (``grpo`` with ``loss_fn``, ``sft``, ``dpo``, ``rm``,
``distillation``) and of ``policy``; none reads another algorithm's."""


def algorithm_settings(cfg: MasterConfig, algorithm: Algorithm) -> AlgorithmSettings:
    """What shared code needs of ``algorithm`` in ``cfg``, read from that algorithm's section alone."""
    return ALGORITHM_SETTINGS[algorithm](cfg)
