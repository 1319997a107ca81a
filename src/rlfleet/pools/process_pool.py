"""A pool of worker processes that calls one function (a reward function, an environment's step) on each
item of a batch, each within a wall-clock bound.

Workers are started once and reused across steps. The default ``forkserver`` start method launches one
clean server process that imports the function's module, and forks every worker from it: the trainer (torch
threads and all) is never forked, and a worker starts or restarts far faster than a ``spawn`` (which
re-imports everything). As with any non-fork start method, each worker re-imports the parent's ``__main__``
module, so a script that creates a pool must guard its entry point with ``if __name__ == "__main__":`` and
should keep heavy imports (torch) out of its top level if restarts are to stay cheap.

Each worker holds up to two items (sent as one pipe message when it needs two), so it never sits idle
waiting for the parent, and answers each item with one message as soon as it is scored. The item a worker
is on has a deadline of ``timeout_s`` from the moment its previous answer arrived (or it was sent):

* inside the worker a ``SIGALRM`` budget of 80% of ``timeout_s`` interrupts slow Python code (sympy), the
  worker answers "timeout" and stays up;
* a worker still silent at the deadline (stuck in C code, signals blocked) is killed and replaced, and the
  item queued behind it goes to another worker.

Both count in :attr:`RewardBatch.num_timeouts` and give reward 0.0; an exception in the reward function
(:class:`~rlfleet.answers.InvalidGoldError` for a gold that is not an answer, say) gives 0.0, counts in
:attr:`RewardBatch.num_errors`, and the first one of each exception type is logged (once per pool, with its
message). A worker that dies on its own (the out-of-memory killer) is replaced and its unanswered items
are re-run on a fresh worker; a second death on the same item raises RuntimeError.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import pickle
import signal
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any, Generic, Literal, Self, TypeVar

from rlfleet.rewards.loading import RewardFn, load_reward_fn
from rlfleet.rewards.verify import VerificationTimeout, time_budget

Item = tuple[Any, ...]
"""The arguments of one call: ``(prompt, response, gold)`` for a reward function."""
Convert = Callable[[Any], Any]
"""Checks and converts what the function returned (``float`` for rewards); raising counts as an error."""
ErrorText = tuple[str, str]
"""``(exception type name, message)`` of a reward function that raised."""
Scored = tuple[int, Any, ErrorText | None]
"""``(status, value, error)`` of one item, as a worker sends it back."""

log = logging.getLogger(__name__)

STATUS_OK, STATUS_TIMEOUT, STATUS_ERROR = 0, 1, 2
_READY = "ready"
SOFT_FRACTION = 0.8
MAX_WAIT_S = 1.0
MAX_STARTUP_FAILURES = 3
_PIPELINE_DEPTH = 2
_PRELOAD = ["rlfleet.rewards"]
_MAX_ERROR_CHARS = 1_000


@dataclass(frozen=True)
class PoolResult:
    """The values of one batch, in input order: None for an item that timed out or failed."""

    values: list[Any]
    num_timeouts: int = 0
    num_errors: int = 0


@dataclass(frozen=True)
class RewardBatch:
    """The rewards of one batch, in input order.

    Attributes:
        rewards: One reward per item; 0.0 for a timeout or an error.
        num_timeouts: Items whose check ran past ``timeout_s``.
        num_errors: Items whose reward function raised (or returned something that is not a number).
    """

    rewards: list[float]
    num_timeouts: int = 0
    num_errors: int = 0


# ------------------------------------------------------------------------------------------- worker side


def score_one(fn: Callable[..., Any], item: Item, soft_timeout_s: float, convert: Convert = float) -> Scored:
    """Scores one item within a soft budget; any failure of the reward function is a counted 0.0."""
    try:
        with time_budget(soft_timeout_s):
            value = convert(fn(*item))
    except VerificationTimeout:
        return STATUS_TIMEOUT, 0.0, None
    except Exception as exc:  # the parent counts it and logs the first one of its type
        return STATUS_ERROR, 0.0, (type(exc).__name__, str(exc)[:_MAX_ERROR_CHARS])
    return STATUS_OK, value, None


def _worker_main(conn: Connection, reward: RewardFn | str, soft_timeout_s: float, convert: Convert) -> None:
    """Loads the reward function, says it is ready, then scores lists of ``(index, item)`` until None.

    One result message per item, sent as soon as it is known: the parent times each item from the answer
    before it.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    fn = load_reward_fn(reward) if isinstance(reward, str) else reward
    conn.send(_READY)
    while True:
        try:
            chunk = conn.recv()
        except EOFError:  # the parent is gone
            return
        if chunk is None:
            return
        for index, item in chunk:
            conn.send((index, *score_one(fn, item, soft_timeout_s, convert)))


# ------------------------------------------------------------------------------------------- parent side


def preloaded_modules(fn: RewardFn | str) -> list[str]:
    """What the forkserver imports before it forks a worker: the rewards, and the function's own module
    (an environment's step imports torch: once in the server, not once per worker)."""
    module = fn.rpartition(".")[0] if isinstance(fn, str) else getattr(fn, "__module__", "")
    return [*_PRELOAD, module] if module and module not in _PRELOAD else list(_PRELOAD)


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection
    started: float
    ready: bool = False
    in_flight: deque[int] = field(default_factory=deque)  # sent, not answered; the head is being scored
    deadline: float = math.inf  # of the head


class PendingItems:
    def __init__(self, items: Sequence[Item]) -> None:
        self.items = items
        self.values: list[Any] = [None] * len(items)
        self.pending = deque(range(len(items)))
        self.remaining = len(items)
        self.retried: set[int] = set()
        self.startup_failures = 0
        self.num_timeouts = 0
        self.num_errors = 0
        self.first_errors: dict[str, str] = {}  # exception type name -> the first message of that type

    def take(self, count: int) -> list[int]:
        return [self.pending.popleft() for _ in range(min(count, len(self.pending)))]

    def requeue(self, indices: Sequence[int]) -> None:
        self.pending.extendleft(reversed(indices))

    def record(self, index: int, status: int, value: Any, error: ErrorText | None = None) -> None:
        self.values[index] = value if status == STATUS_OK else None
        self.num_timeouts += status == STATUS_TIMEOUT
        self.num_errors += status == STATUS_ERROR
        if error is not None:
            self.first_errors.setdefault(*error)
        self.remaining -= 1


def checked_reward(reward_fn: RewardFn | str) -> RewardFn | str:
    """Fails fast, in the parent, on a reward function the workers could not load."""
    if isinstance(reward_fn, str):
        load_reward_fn(reward_fn)
        return reward_fn
    if not callable(reward_fn):
        raise ValueError(f"reward_fn must be a function or a dotted path, not {type(reward_fn).__name__}")
    try:
        pickle.dumps(reward_fn)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ValueError(
            f"reward function {reward_fn!r} cannot be sent to worker processes ({exc}); pass a top-level "
            "function (not a lambda or a nested function) or its dotted path"
        ) from exc
    return reward_fn


def _name_of(reward: RewardFn | str) -> str:
    """A reward function's dotted path, for messages."""
    if isinstance(reward, str):
        return reward
    return f"{getattr(reward, '__module__', '?')}.{getattr(reward, '__qualname__', repr(reward))}"


class WorkerPool(ABC):
    """What both worker pools offer: run batches, each item within ``timeout_s``, in workers.

    The loop they share (dispatch items to workers, collect, expire the late ones) is ``PoolLoop``.

    Args:
        reward_fn: A top-level reward function or its dotted path (``env.math.reward_fn``).
        num_workers: Workers (>= 1).
        timeout_s: Wall-clock bound on one response.
        convert: Applied to each value the function returns, in the worker (``float`` for rewards; a
            top-level function, so that it can be sent to the workers).

    Raises:
        ValueError: A bad argument, or a reward function that cannot be imported or sent to a worker.
    """

    def __init__(
        self, reward_fn: RewardFn | str, num_workers: int, timeout_s: float, convert: Convert = float
    ) -> None:
        if num_workers < 1:
            raise ValueError(
                f"num_workers must be >= 1, got {num_workers}: responses are checked in workers so that a "
                "stuck check can be killed"
            )
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._reward = checked_reward(reward_fn)
        self._convert = convert
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self._closed = False
        self._logged_errors: set[str] = set()  # exception types already logged by this pool

    def _log_new_errors(self, first_errors: dict[str, str]) -> None:
        """Logs the first error of each exception type this pool has not logged before."""
        for name, message in first_errors.items():
            if name in self._logged_errors:
                continue
            self._logged_errors.add(name)
            log.error(
                "reward function %s raised %s: %s -- such items score 0.0 and count in num_errors "
                "(train/reward_errors); further %s errors of this pool are counted, not logged",
                _name_of(self._reward),
                name,
                message,
                name,
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def score(self, items: Sequence[Item]) -> RewardBatch:
        """Scores ``(prompt, response, gold)`` items; rewards come back in input order (0.0 for a failure).

        Raises:
            RuntimeError: The pool is closed, or its workers keep failing (see the subclass).
        """
        result = self.run(items)
        rewards = [0.0 if value is None else float(value) for value in result.values]
        return RewardBatch(rewards, result.num_timeouts, result.num_errors)

    @abstractmethod
    def run(self, items: Sequence[Item]) -> PoolResult:
        """Calls the function on each item (its arguments); values come back in input order.

        Raises:
            RuntimeError: The pool is closed, or its workers keep failing (see the subclass).
        """

    @abstractmethod
    def wait_ready(self) -> None:
        """Blocks until every worker has loaded the reward function (:meth:`score` does not need this)."""

    @abstractmethod
    def close(self) -> None:
        """Stops the workers (idempotent)."""


BatchT = TypeVar("BatchT", bound=PendingItems)


class PoolLoop(WorkerPool, Generic[BatchT]):
    """The loop both worker pools share, over their own bookkeeping ``BatchT`` of one ``score`` call.

    A subclass supplies the workers (processes or Ray actors) through the abstract methods.
    """

    def run(self, items: Sequence[Item]) -> PoolResult:
        """Calls the function on each item (its arguments); values come back in input order, None for an
        item that timed out or failed.

        Raises:
            RuntimeError: The pool is closed, or its workers keep failing (see the subclass).
        """
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} is closed; create a new one")
        batch = self._new_batch(items)
        try:
            while batch.remaining:
                self._dispatch(batch)
                self._wait(batch)
                self._expire(batch)
        except BaseException:
            self._abandon_in_flight()  # no stale result or busy worker may reach the next batch
            raise
        self._log_new_errors(batch.first_errors)
        return PoolResult(batch.values, batch.num_timeouts, batch.num_errors)

    def wait_ready(self) -> None:
        """Blocks until every worker has loaded the reward function (:meth:`score` does not need this)."""
        batch = self._new_batch([])
        while not self._all_ready():
            self._wait(batch)
            self._expire(batch)

    @abstractmethod
    def _new_batch(self, items: Sequence[Item]) -> BatchT:
        """The bookkeeping of one ``score`` call."""

    @abstractmethod
    def _all_ready(self) -> bool:
        """Whether every worker has started."""

    @abstractmethod
    def _dispatch(self, batch: BatchT) -> None:
        """Hands pending items to idle workers."""

    @abstractmethod
    def _wait(self, batch: BatchT) -> None:
        """Waits (briefly) for results and records them."""

    @abstractmethod
    def _expire(self, batch: BatchT) -> None:
        """Replaces workers past their deadline, recording or requeueing their items."""

    @abstractmethod
    def _abandon_in_flight(self) -> None:
        """After an error inside ``score``: drops what is in flight so the next call starts clean."""


class ProcessWorkerPool(PoolLoop[PendingItems]):
    """Scores ``(prompt, response, gold)`` batches in worker processes, each response within ``timeout_s``.

    Example:
        >>> with ProcessWorkerPool("rlfleet.rewards.math_reward", num_workers=4, timeout_s=5.0) as pool:
        ...     batch = pool.score([("q", "... #### 72", "72"), ("q", "\\\\boxed{71}", "72")])
        >>> batch.rewards, batch.num_timeouts
        ([1.0, 0.0], 0)

    Args:
        reward_fn: A top-level reward function or its dotted path (``env.math.reward_fn``).
        num_workers: Worker processes (>= 1); also the number of responses scored at once.
        timeout_s: Wall-clock bound on one response, from when a worker receives it.
        start_method: ``"forkserver"`` (default; fast worker starts and restarts) or ``"spawn"``. ``"fork"``
            is refused: forking a process that runs torch threads can deadlock.
        startup_timeout_s: How long a new worker may take to import the reward function.

    Raises:
        ValueError: A bad argument, or a reward function that cannot be imported or sent to a worker.
    """

    def __init__(
        self,
        reward_fn: RewardFn | str,
        num_workers: int,
        timeout_s: float,
        *,
        start_method: Literal["forkserver", "spawn"] = "forkserver",
        startup_timeout_s: float = 60.0,
        convert: Convert = float,
    ) -> None:
        super().__init__(reward_fn, num_workers, timeout_s, convert)
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
        self._ctx: ForkServerContext | SpawnContext
        if start_method == "forkserver":
            self._ctx = multiprocessing.get_context("forkserver")
            self._ctx.set_forkserver_preload(preloaded_modules(reward_fn))
        else:
            self._ctx = multiprocessing.get_context("spawn")
        self._startup_timeout_s = startup_timeout_s
        self._workers = [self._start_worker() for _ in range(num_workers)]

    # -------------------------------------------------------------------------------------------- public

    @property
    def worker_pids(self) -> list[int | None]:
        """Process ids of the current workers (they change when a worker is replaced)."""
        return [worker.process.pid for worker in self._workers]

    def _new_batch(self, items: Sequence[Item]) -> PendingItems:
        return PendingItems(items)

    def _all_ready(self) -> bool:
        return all(worker.ready for worker in self._workers)

    def close(self) -> None:
        """Stops the workers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            with contextlib.suppress(OSError):
                worker.conn.send(None)
        deadline = time.monotonic() + 2.0
        for worker in self._workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            self._stop(worker)
        self._workers = []

    # ------------------------------------------------------------------------------------------- workers

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=_worker_main,
            args=(child_conn, self._reward, self.timeout_s * SOFT_FRACTION, self._convert),
            name="rlfleet-worker",
            daemon=True,
        )
        process.start()
        child_conn.close()
        return _Worker(process, parent_conn, time.monotonic())

    @staticmethod
    def _stop(worker: _Worker) -> None:
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join(5.0)
        worker.conn.close()
        with contextlib.suppress(ValueError):  # still running after SIGKILL + 5 s: leave it to the OS
            worker.process.close()

    def _replace(self, worker: _Worker) -> None:
        self._stop(worker)
        self._workers[self._workers.index(worker)] = self._start_worker()

    def _abandon_in_flight(self) -> None:
        for worker in list(self._workers):
            if worker.in_flight:
                self._replace(worker)

    # ----------------------------------------------------------------------------------------- the loop

    def _dispatch(self, batch: PendingItems) -> None:
        for worker in self._workers:
            if not batch.pending:
                return
            if not worker.ready or len(worker.in_flight) >= _PIPELINE_DEPTH:
                continue
            chunk = batch.take(_PIPELINE_DEPTH - len(worker.in_flight))
            try:
                worker.conn.send([(index, batch.items[index]) for index in chunk])
            except OSError:  # it died: _wait sees its sentinel and replaces it
                batch.requeue(chunk)
                continue
            if not worker.in_flight:
                worker.deadline = time.monotonic() + self.timeout_s
            worker.in_flight.extend(chunk)

    def _wait(self, batch: PendingItems) -> None:
        deadlines = [w.deadline for w in self._workers if w.in_flight]
        deadlines += [w.started + self._startup_timeout_s for w in self._workers if not w.ready]
        timeout = min(max(min(deadlines, default=math.inf) - time.monotonic(), 0.0), MAX_WAIT_S)
        sentinels = [w.process.sentinel for w in self._workers]
        ready = wait([*(w.conn for w in self._workers), *sentinels], timeout)
        workers = list(self._workers)
        for worker in workers:  # read the pipes first: a worker may answer, then die
            if worker.conn in ready:
                self._receive(worker, batch)
        for worker in workers:
            if worker in self._workers and worker.process.sentinel in ready:
                self._on_death(worker, batch)

    def _receive(self, worker: _Worker, batch: PendingItems) -> None:
        """Takes every message waiting on ``worker``'s pipe."""
        try:
            while worker.conn.poll():
                message = worker.conn.recv()
                if message == _READY:
                    worker.ready = True
                    continue
                index, status, value, error = message
                if worker.in_flight and index == worker.in_flight[0]:
                    batch.record(worker.in_flight.popleft(), status, value, error)
                    worker.deadline = time.monotonic() + self.timeout_s if worker.in_flight else math.inf
        except (EOFError, OSError):
            self._on_death(worker, batch)

    def _on_death(self, worker: _Worker, batch: PendingItems) -> None:
        in_flight, was_ready = list(worker.in_flight), worker.ready
        worker.process.join(1.0)
        code = worker.process.exitcode
        self._replace(worker)
        if not was_ready:
            batch.startup_failures += 1
            if batch.startup_failures >= MAX_STARTUP_FAILURES:
                raise RuntimeError(
                    f"pool workers keep exiting while starting (exit code {code}); check that the reward "
                    f"function {self._reward!r} imports and runs in a fresh Python process"
                )
        if not in_flight:
            return
        if in_flight[0] in batch.retried:
            raise RuntimeError(
                f"a pool worker died twice on item {in_flight[0]} of the batch (exit code {code}; -9 "
                "is SIGKILL, often the out-of-memory killer), the second time on a fresh worker; lower "
                "env.math.num_workers or check the reward function on this response"
            )
        batch.retried.add(in_flight[0])
        batch.requeue(in_flight)

    def _expire(self, batch: PendingItems) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.in_flight and now >= worker.deadline:
                index, *rest = worker.in_flight
                self._replace(worker)  # stuck where no signal reaches it: kill it
                batch.record(index, STATUS_TIMEOUT, 0.0)
                batch.requeue(rest)
            elif not worker.ready and now - worker.started > self._startup_timeout_s:
                self._replace(worker)
                raise RuntimeError(
                    f"a pool worker did not start within {self._startup_timeout_s:.0f} s; the machine "
                    "may be overloaded (lower env.math.num_workers) or the reward function slow to import"
                )
