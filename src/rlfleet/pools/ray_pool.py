"""Workers as a pool of Ray actors, with the interface and result semantics of :class:`ProcessWorkerPool`.

Items go out in chunks, one chunk per actor at a time (a work queue), and come back in input order. Inside
an actor each response has the soft ``SIGALRM`` budget of a :class:`ProcessWorkerPool` worker (a timeout that
leaves the actor up); a chunk has a hard deadline of ``timeout_s * len(chunk) + slack_s`` from dispatch.
An actor that dies (killed, crashed, lost its node) or misses a deadline is killed and replaced, and its
chunk is re-run: a chunk of several items is split into single items first, free of charge (the culprit is
unknown), then a single item that fails again is retried up to ``max_retries`` times and then recorded as a
timeout (deadline) or an error (death), with reward 0.0. Every wait on Ray is bounded: the pool never hangs.
An exception in the reward function is a counted error with reward 0.0, logged once per type, as in a
:class:`ProcessWorkerPool`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import ray.exceptions

from rlfleet.pools.process_pool import (
    MAX_STARTUP_FAILURES,
    MAX_WAIT_S,
    SOFT_FRACTION,
    STATUS_ERROR,
    STATUS_TIMEOUT,
    Convert,
    Item,
    PendingItems,
    PoolLoop,
    Scored,
    score_one,
)
from rlfleet.rewards.loading import RewardFn, load_reward_fn


class _WorkerActor:
    """Runs in one Ray actor (on its main thread, where ``SIGALRM`` budgets work)."""

    def __init__(self, reward: RewardFn | str, soft_timeout_s: float, convert: Convert = float) -> None:
        self._reward = reward
        self._convert = convert
        self._soft_timeout_s = soft_timeout_s
        self._fn: RewardFn | None = None

    def ready(self) -> int:
        """Loads the reward function; returns this actor's process id."""
        if self._fn is None:
            self._fn = load_reward_fn(self._reward) if isinstance(self._reward, str) else self._reward
        return os.getpid()

    def score(self, items: list[Item]) -> list[Scored]:
        """``(status, reward, error)`` per item, as a :class:`ProcessWorkerPool` worker scores them."""
        self.ready()
        assert self._fn is not None
        return [score_one(self._fn, item, self._soft_timeout_s, self._convert) for item in items]


class _RetryBatch(PendingItems):
    def __init__(self, items: Sequence[Item], chunk_size: int) -> None:
        super().__init__(items)
        self.chunk_size = chunk_size
        self.attempts: dict[int, int] = {}  # failed runs of an item sent alone
        self.alone: set[int] = set()  # items of a failed chunk: from now on sent one at a time


@dataclass
class _Slot:
    actor: Any  # ray.actor.ActorHandle
    ready_ref: Any = None  # ray.ObjectRef of ready(); None once the actor is ready
    ref: Any = None  # ray.ObjectRef of the chunk in flight
    chunk: list[int] = field(default_factory=list)
    deadline: float = math.inf  # of the startup, then of the chunk in flight

    @property
    def starting(self) -> bool:
        return self.ready_ref is not None


class RayWorkerPool(PoolLoop[_RetryBatch]):
    """Scores ``(prompt, response, gold)`` batches in Ray actors, each response within ``timeout_s``.

    A drop-in for :class:`ProcessWorkerPool` where Ray is already initialised (the caller connects).

    Args:
        reward_fn: A top-level reward function or its dotted path (resolved inside the actors).
        num_workers: Actors (>= 1).
        timeout_s: Wall-clock bound on one response.
        max_retries: Re-runs of a single item whose actor died or missed its deadline.
        num_cpus: CPUs each actor reserves (small, to fit beside training actors).
        chunk_size: Items sent to an actor at once; None: about a quarter of an even share, at most 16.
        slack_s: Added to a chunk's hard deadline for Ray's own overhead.
        startup_timeout_s: How long a new actor may take to be scheduled and load the reward function.

    Raises:
        RuntimeError: Ray is not initialised.
        ValueError: A bad argument, or a reward function that cannot be imported or sent to a worker.
    """

    def __init__(
        self,
        reward_fn: RewardFn | str,
        num_workers: int,
        timeout_s: float,
        *,
        max_retries: int = 2,
        num_cpus: float = 0.25,
        chunk_size: int | None = None,
        slack_s: float = 2.0,
        startup_timeout_s: float = 60.0,
        convert: Convert = float,
    ) -> None:
        if not ray.is_initialized():
            raise RuntimeError("RayWorkerPool needs Ray initialised first (connect_or_start or ray.init)")
        if max_retries < 0 or (chunk_size is not None and chunk_size < 1):
            raise ValueError(f"need max_retries >= 0 and chunk_size >= 1, got {max_retries}, {chunk_size}")
        super().__init__(reward_fn, num_workers, timeout_s, convert)
        self.max_retries = max_retries
        self.num_restarts = 0
        self._chunk_size = chunk_size
        self._slack_s = slack_s
        self._startup_timeout_s = startup_timeout_s
        options = {"num_cpus": num_cpus, "max_restarts": 0, "max_task_retries": 0}
        self._remote = ray.remote(_WorkerActor).options(**options)
        self._slots = [self._start() for _ in range(num_workers)]

    # -------------------------------------------------------------------------------------------- public

    @property
    def actors(self) -> list[Any]:
        """Handles of the current actors (they change when an actor is replaced)."""
        return [slot.actor for slot in self._slots]

    def actor_ids(self) -> list[str]:
        """Ray ids (hex) of the current actors."""
        return [slot.actor._actor_id.hex() for slot in self._slots]

    def _new_batch(self, items: Sequence[Item]) -> _RetryBatch:
        size = self._chunk_size or max(1, min(16, math.ceil(len(items) / (4 * self.num_workers))))
        return _RetryBatch(items, size)

    def _all_ready(self) -> bool:
        return not any(slot.starting for slot in self._slots)

    def _abandon_in_flight(self) -> None:
        for slot in list(self._slots):  # a busy actor would delay (and time out) the next batch
            if slot.chunk:
                self._replace(slot)

    def close(self) -> None:
        """Kills the actors (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if ray.is_initialized():  # after ray.shutdown() the actors are gone already
            for slot in self._slots:
                ray.kill(slot.actor, no_restart=True)
        self._slots = []

    # -------------------------------------------------------------------------------------------- actors

    def _start(self) -> _Slot:
        actor = self._remote.remote(self._reward, self.timeout_s * SOFT_FRACTION, self._convert)
        return _Slot(actor, actor.ready.remote(), deadline=time.monotonic() + self._startup_timeout_s)

    def _replace(self, slot: _Slot) -> None:
        ray.kill(slot.actor, no_restart=True)
        self._slots[self._slots.index(slot)] = self._start()
        self.num_restarts += 1

    # ------------------------------------------------------------------------------------------ the loop

    def _dispatch(self, batch: _RetryBatch) -> None:
        for slot in self._slots:
            if not batch.pending:
                return
            if slot.starting or slot.chunk:
                continue
            chunk = [batch.pending.popleft()]
            if chunk[0] not in batch.alone:
                while batch.pending and len(chunk) < batch.chunk_size and batch.pending[0] not in batch.alone:
                    chunk.append(batch.pending.popleft())
            slot.chunk = chunk
            slot.ref = slot.actor.score.remote([batch.items[index] for index in chunk])
            slot.deadline = time.monotonic() + self.timeout_s * len(chunk) + self._slack_s

    def _wait(self, batch: _RetryBatch) -> None:
        owners = {slot.ready_ref if slot.starting else slot.ref: slot for slot in self._slots}
        owners.pop(None, None)  # idle actors
        if not owners:  # items neither pending nor in flight: never spin on that
            raise RuntimeError(f"RayWorkerPool lost track of {batch.remaining} item(s); this is a bug")
        deadline = min(slot.deadline for slot in owners.values())
        timeout = min(max(deadline - time.monotonic(), 0.0), MAX_WAIT_S)
        done, rest = ray.wait(list(owners), num_returns=1, timeout=timeout)
        if done and rest:
            done += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        for ref in done:
            slot = owners[ref]
            if slot.starting:
                self._on_ready(slot, batch)
            else:
                self._on_result(slot, batch)

    def _on_ready(self, slot: _Slot, batch: _RetryBatch) -> None:
        try:
            ray.get(slot.ready_ref, timeout=MAX_WAIT_S)
        except Exception as exc:
            self._replace(slot)
            batch.startup_failures += 1
            if batch.startup_failures >= MAX_STARTUP_FAILURES:
                raise RuntimeError(
                    f"reward actors keep failing to start ({type(exc).__name__}: {exc}); check that the "
                    f"reward function {self._reward!r} imports on the Ray workers"
                ) from exc
            return
        slot.ready_ref, slot.deadline = None, math.inf

    def _on_result(self, slot: _Slot, batch: _RetryBatch) -> None:
        try:
            results = ray.get(slot.ref, timeout=MAX_WAIT_S)
        except Exception:  # the actor died (or the task broke): replace it and re-run its chunk
            self._fail(slot, STATUS_ERROR, batch)
            return
        for index, (status, value, error) in zip(slot.chunk, results, strict=True):
            batch.record(index, status, value, error)
        slot.chunk, slot.ref, slot.deadline = [], None, math.inf

    def _fail(self, slot: _Slot, status: int, batch: _RetryBatch) -> None:
        """Replaces ``slot``'s actor; re-runs its chunk, or records a single item out of retries."""
        chunk = slot.chunk
        self._replace(slot)
        if len(chunk) > 1:
            batch.alone.update(chunk)
            batch.requeue(chunk)
            return
        index = chunk[0]
        batch.alone.add(index)
        batch.attempts[index] = batch.attempts.get(index, 0) + 1
        if batch.attempts[index] > self.max_retries:
            batch.record(index, status, 0.0)
        else:
            batch.requeue(chunk)

    def _expire(self, batch: _RetryBatch) -> None:
        now = time.monotonic()
        for slot in list(self._slots):
            if now < slot.deadline:
                continue
            if slot.chunk:
                self._fail(slot, STATUS_TIMEOUT, batch)
            else:
                self._replace(slot)
                raise RuntimeError(
                    f"a reward actor did not start within {self._startup_timeout_s:.0f} s; the cluster may "
                    "lack free CPUs for it (lower num_workers or num_cpus) or the reward function be slow "
                    "to import"
                )
