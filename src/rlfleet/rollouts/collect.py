"""The first stage of a GRPO step: collect a step's scored rollouts.

A collector is any callable ``collect(step) -> Collected``: the GRPO loop asks it for step ``step``'s groups
and never looks inside. :class:`GroupCollector` draws prompts and runs ``G`` episodes each
(:mod:`rlfleet.rollouts.episodes`; a single-turn task is a one-turn episode), and with DAPO's dynamic
sampling repeats until enough groups carry a signal.

A collector may run in the background thread of asynchronous GRPO, so it touches the loader, the
generation engines and the environment workers only, never the trainers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlfleet.data import ResumableLoader
from rlfleet.generation import SamplingParams
from rlfleet.rollouts.dynamic_sampling import SampledGroups, collect_informative_groups
from rlfleet.rollouts.episodes import EpisodeBatch, EpisodeRunner
from rlfleet.rollouts.rollout import Rollout


@dataclass(frozen=True)
class Collected:
    """A step's scored rollouts and what collecting them took.

    Attributes:
        groups: The groups the step trains on (all of them, or DAPO's informative ones).
        drawn: Every rollout generated, informative or not (the step's reward and accuracy metrics).
        reward_timeouts: Environment steps (rewards) that ran past their time bound.
        reward_errors: Environment steps (rewards) that failed (a bad gold, say).
        seconds: Wall time per phase (``generation``, ``env``).
        metrics: The episodes' metrics (``turns_per_episode``...), unprefixed, averaged over the rounds.
    """

    groups: SampledGroups[Rollout]
    drawn: list[Rollout]
    reward_timeouts: int
    reward_errors: int
    seconds: dict[str, float]
    metrics: dict[str, float] = field(default_factory=dict)


class GroupCollector:
    """Prompts from the loader -> ``group_size`` episodes each with the environments.

    Args:
        episodes: Runs the episodes (the generation engines and the environments).
        loader: The training prompts (each round takes one batch).
        sampling: Sampling parameters of the training rollouts.
        group_size: ``G``, episodes per prompt.
        seed_of: The sampling seed of ``(step, round)``.
        dynamic_sampling: DAPO's ``(target groups, most rounds)``; None keeps every group of one round.
        score: What makes a group informative under dynamic sampling: its rollouts' scores differ (their
            rewards unless said otherwise).
    """

    def __init__(
        self,
        episodes: EpisodeRunner,
        loader: ResumableLoader[Any],
        sampling: SamplingParams,
        group_size: int,
        seed_of: Callable[[int, int], int],
        dynamic_sampling: tuple[int, int] | None,
        score: Callable[[Rollout], float] | None = None,
    ) -> None:
        self.episodes, self.loader = episodes, loader
        self.sampling, self.group_size, self.seed_of = sampling, group_size, seed_of
        self.dynamic_sampling = dynamic_sampling
        self.score = score or (lambda r: r.reward)

    def __call__(self, step: int) -> Collected:
        batches: list[EpisodeBatch] = []

        def draw(round_index: int) -> list[Rollout]:
            prompts = self.loader.next_batch()
            batch = self.episodes.run(
                prompts, self.group_size, self.sampling, self.seed_of(step, round_index)
            )
            batches.append(batch)
            return batch.rollouts

        if self.dynamic_sampling is None:
            groups = SampledGroups.one_round(draw(0), self.group_size)
        else:
            target_groups, max_rounds = self.dynamic_sampling
            groups = collect_informative_groups(
                draw,
                self.score,
                group_size=self.group_size,
                target_groups=target_groups,
                max_rounds=max_rounds,
            )
        return Collected(
            groups,
            [r for batch in batches for r in batch.rollouts],
            sum(b.num_timeouts for b in batches),
            sum(b.num_errors for b in batches),
            {phase: sum(b.seconds.get(phase, 0.0) for b in batches) for phase in batches[0].seconds},
            mean_per_key([b.metrics for b in batches]),
        )


def mean_per_key(records: list[dict[str, float]]) -> dict[str, float]:
    """Each key's mean over the records that have it."""
    values: dict[str, list[float]] = {}
    for record in records:
        for key, value in record.items():
            values.setdefault(key, []).append(value)
    return {key: sum(v) / len(v) for key, v in values.items()}
