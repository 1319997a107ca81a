"""The first stage of a GRPO step: collect a step's scored rollouts.

A collector is any callable ``collect(step) -> Collected``: the GRPO loop asks it for step ``step``'s groups
and never looks inside. :class:`GroupCollector` draws prompts, samples ``G`` responses each and scores them
(or, with environments, runs ``G`` multi-turn episodes each: :mod:`rlfleet.algorithms.episodes`), and with
DAPO's dynamic sampling repeats until enough groups carry a signal.

A collector may run in the background thread of asynchronous GRPO, so it touches the loader, the
generation engines and the reward workers only, never the trainers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlfleet.algorithms.dynamic_sampling import SampledGroups, collect_informative_groups
from rlfleet.algorithms.episodes import EpisodeRunner
from rlfleet.algorithms.rollouts import Rollout, generate_rollouts, score
from rlfleet.data import ResumableLoader
from rlfleet.generation import GenerationBackend, SamplingParams
from rlfleet.rewards import ScoringPool
from rlfleet.utils.timing import PhaseTimer


@dataclass(frozen=True)
class Collected:
    """A step's scored rollouts and what collecting them took.

    Attributes:
        groups: The groups the step trains on (all of them, or DAPO's informative ones).
        drawn: Every rollout generated, informative or not (the step's reward and accuracy metrics).
        reward_timeouts: Responses whose verification (or environment step) ran past its time bound.
        reward_errors: Responses whose verification (or environment step) failed (a bad gold, say).
        seconds: Wall time per phase (``generation``, ``reward``; ``env`` with environments).
        metrics: The episodes' metrics (``turns_per_episode``...; none for single responses), unprefixed.
    """

    groups: SampledGroups[Rollout]
    drawn: list[Rollout]
    reward_timeouts: int
    reward_errors: int
    seconds: dict[str, float]
    metrics: dict[str, float] = field(default_factory=dict)


class RolloutCollector(Protocol):
    """Collects step ``step``'s scored groups (a stage of the GRPO step that an environment may replace)."""

    def __call__(self, step: int) -> Collected: ...


class GroupCollector:
    """Prompts from the loader -> ``group_size`` sampled responses each -> rewards from the verifier; or, with
    ``episodes``, ``group_size`` episodes each with the environments.

    Args:
        backend: The generation engines.
        verifier: The reward workers.
        loader: The training prompts (each round takes one batch).
        sampling: Sampling parameters of the training rollouts.
        group_size: ``G``, responses per prompt.
        seed_of: The sampling seed of ``(step, round)``.
        dynamic_sampling: DAPO's ``(target groups, most rounds)``; None keeps every group of one round.
        episodes: Runs multi-turn episodes with the environments instead (``verifier`` is then unused).
    """

    def __init__(
        self,
        backend: GenerationBackend,
        verifier: ScoringPool,
        loader: ResumableLoader[Any],
        sampling: SamplingParams,
        group_size: int,
        seed_of: Callable[[int, int], int],
        dynamic_sampling: tuple[int, int] | None,
        episodes: EpisodeRunner | None = None,
    ) -> None:
        self.backend, self.verifier, self.loader = backend, verifier, loader
        self.sampling, self.group_size, self.seed_of = sampling, group_size, seed_of
        self.dynamic_sampling = dynamic_sampling
        self.episodes = episodes

    def __call__(self, step: int) -> Collected:
        timer = PhaseTimer()
        drawn: list[Rollout] = []
        problems = [0, 0]
        metrics: dict[str, list[float]] = {}

        def draw(round_index: int) -> list[Rollout]:
            prompts = self.loader.next_batch()
            if self.episodes is not None:
                batch = self.episodes.run(
                    prompts, self.group_size, self.sampling, self.seed_of(step, round_index)
                )
                for phase, seconds in batch.seconds.items():
                    timer.seconds[phase] = timer.seconds.get(phase, 0.0) + seconds
                for key, value in batch.metrics.items():
                    metrics.setdefault(key, []).append(value)
                problems[0] += batch.num_timeouts
                problems[1] += batch.num_errors
                drawn.extend(batch.rollouts)
                return batch.rollouts
            with timer("generation"):
                pairs = generate_rollouts(
                    self.backend, prompts, self.group_size, self.sampling, self.seed_of(step, round_index)
                )
            with timer("reward"):
                rollouts, scored = score(pairs, self.verifier)
            problems[0] += scored.num_timeouts
            problems[1] += scored.num_errors
            drawn.extend(rollouts)
            return rollouts

        if self.dynamic_sampling is None:
            groups = SampledGroups.one_round(draw(0), self.group_size)
        else:
            target_groups, max_rounds = self.dynamic_sampling
            groups = collect_informative_groups(
                draw,
                lambda r: r.reward,
                group_size=self.group_size,
                target_groups=target_groups,
                max_rounds=max_rounds,
            )
        means = {key: sum(values) / len(values) for key, values in metrics.items()}
        return Collected(groups, drawn, problems[0], problems[1], dict(timer.seconds), means)
