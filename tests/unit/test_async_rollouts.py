"""The rollout prefetcher of asynchronous GRPO: overlap, age bound, errors."""

from __future__ import annotations

import threading

import pytest

from rlfleet.rollouts.prefetch import RolloutPrefetcher, StaleTrajectoryError, trajectory_age


def test_collection_runs_beside_the_caller() -> None:
    started, release = threading.Event(), threading.Event()

    def collect() -> str:
        started.set()
        assert release.wait(10), "the caller never released the collection: it did not run concurrently"
        return "batch"

    prefetcher: RolloutPrefetcher[str] = RolloutPrefetcher(max_age=1)
    prefetcher.submit(collect, version=3, for_step=4, resume_state={"position": 4})
    assert started.wait(10) and prefetcher.pending  # collecting while this thread goes on ("training")
    release.set()
    prefetcher.finish()
    assert not prefetcher.pending and prefetcher.has_batch
    assert prefetcher.resume_state == {"position": 4}  # what a checkpoint records while the batch waits
    assert prefetcher.take(step=4, trainer_version=4) == ("batch", 1)
    assert not prefetcher.has_batch and prefetcher.resume_state is None
    prefetcher.close()


def test_stale_and_misplaced_batches_are_refused() -> None:
    prefetcher: RolloutPrefetcher[int] = RolloutPrefetcher(max_age=1)
    prefetcher.submit(lambda: 1, version=2, for_step=5, resume_state={"position": 5})
    with pytest.raises(
        StaleTrajectoryError, match=r"2 updates old; grpo\.async_grpo\.max_trajectory_age_steps=1"
    ):
        prefetcher.take(step=5, trainer_version=4)
    prefetcher.submit(lambda: 1, version=2, for_step=5, resume_state={"position": 5})
    with pytest.raises(RuntimeError, match="for step 5, not step 6"):
        prefetcher.take(step=6, trainer_version=3)
    with pytest.raises(RuntimeError, match="no prefetched batch"):
        prefetcher.take(step=6, trainer_version=3)
    prefetcher.close()


def test_errors_surface_on_take_and_one_batch_at_a_time() -> None:
    def boom() -> int:
        raise ValueError("engine lost")

    prefetcher: RolloutPrefetcher[int] = RolloutPrefetcher(max_age=2)
    prefetcher.submit(boom, version=0, for_step=1, resume_state={"position": 1})
    with pytest.raises(RuntimeError, match="still pending"):
        prefetcher.submit(lambda: 0, version=0, for_step=1, resume_state={"position": 1})
    with pytest.raises(ValueError, match="engine lost"):
        prefetcher.take(step=1, trainer_version=1)
    prefetcher.submit(boom, version=0, for_step=1, resume_state={"position": 1})
    prefetcher.drain()  # a failed step drops the pending batch and its error
    assert not prefetcher.has_batch
    prefetcher.close()


def test_trajectory_age() -> None:
    assert trajectory_age(5, 4) == 1
    assert trajectory_age(5, 5) == 0
    with pytest.raises(ValueError):
        trajectory_age(4, 5)
    with pytest.raises(ValueError, match="max_age >= 1"):
        RolloutPrefetcher(max_age=0)
