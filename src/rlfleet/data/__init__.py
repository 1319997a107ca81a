"""Datasets, prompts and the resumable loader."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from rlfleet.config.schema import DataConfig
from rlfleet.data.arithmetic import arithmetic_splits, multiplication_problems
from rlfleet.data.errors import DataError
from rlfleet.data.loader import ResumableLoader
from rlfleet.data.prompts import (
    apply_prompt_template,
    build_prompts,
    load_prompt_template,
    render_prompt,
    resolve_system_prompt,
    response_target,
)
from rlfleet.data.reasoning_gym import reasoning_gym_splits
from rlfleet.data.response_dataset import load_split, resolve_sources
from rlfleet.data.sources import looks_local
from rlfleet.data.types import Example, Prompt
from rlfleet.environments.code import CodeProblem, load_humaneval

__all__ = [
    "DataError",
    "Example",
    "Prompt",
    "ResumableLoader",
    "TaskSplits",
    "apply_prompt_template",
    "build_prompts",
    "load_prompt_template",
    "load_task",
    "load_task_with_report",
    "render_prompt",
    "resolve_system_prompt",
    "response_target",
]

log = logging.getLogger("rlfleet")

HUMANEVAL_VAL = 32  # the last tasks of HumanEval: its validation split


def humaneval_examples(problems: Sequence[CodeProblem]) -> list[Example]:
    """HumanEval tasks as rows of the ``code`` environment: the question asks for the function, the metadata
    carries the tests (``problem``), the gold is the task id."""
    return [
        Example(
            question="Complete this Python function. Reply with the whole function in a ```python block.\n\n"
            f"```python\n{problem['prompt']}```",
            answer=problem["prompt"] + problem["canonical_solution"],
            gold=problem["task_id"],
            env="code",
            extra={"problem": dict(problem)},
        )
        for problem in problems
    ]


@dataclass
class TaskSplits:
    """The loaded task.

    Attributes:
        train: Training examples, in source order.
        val: Validation examples, in source order.
        report: Counts to log, ``{"train/bad_rows": 3, "val/bad_rows": 0}`` (rows skipped as bad).
        bad_row_samples: The first few skipped rows as ``"file:line: problem"``, for the log.
    """

    train: list[Example]
    val: list[Example]
    report: dict[str, int]
    bad_row_samples: list[str] = field(default_factory=list)


GENERATED_TASKS = ("arithmetic", "multiplication", "humaneval", "reasoning_gym")
"""Tasks built in rlfleet (their rows come from code or a package, never from a data file or the hub)."""


def load_task_with_report(data: DataConfig) -> TaskSplits:
    """Loads and validates every row of the configured dataset, and checks the prompt files.

    Raises:
        DataError: A missing file, an unloadable dataset, a bad row with ``data.on_bad_row=error``, a split
            with no usable row, or an invalid ``prompt_file`` / ``system_prompt_file``.
    """
    resolve_system_prompt(data)  # fail before a long download when a prompt file is wrong
    load_prompt_template(data)
    if data.dataset_name == "arithmetic":
        a = data.arithmetic
        train, val = arithmetic_splits(
            num_train=a.num_train,
            num_val=a.num_val,
            seed=a.seed,
            min_ops=a.min_ops,
            max_ops=a.max_ops,
            max_operand=a.max_operand,
            operations=a.operations,
        )
        return TaskSplits(train=train, val=val, report={"train/bad_rows": 0, "val/bad_rows": 0})
    if data.dataset_name == "multiplication":
        m = data.multiplication
        val = multiplication_problems(
            m.num_val,
            seed=m.seed + 1,
            min_digits=m.min_digits,
            max_digits=m.max_digits,
            sft_target=m.sft_target,
        )
        train = multiplication_problems(
            m.num_train,
            seed=m.seed,
            min_digits=m.min_digits,
            max_digits=m.max_digits,
            sft_target=m.sft_target,
            exclude={ex.question for ex in val},
        )
        return TaskSplits(train=train, val=val, report={"train/bad_rows": 0, "val/bad_rows": 0})
    if data.dataset_name == "reasoning_gym":
        train, val = reasoning_gym_splits(data.reasoning_gym)
        return TaskSplits(train=train, val=val, report={"train/bad_rows": 0, "val/bad_rows": 0})
    if data.dataset_name == "humaneval":
        tasks = humaneval_examples(load_humaneval())
        return TaskSplits(
            train=tasks[:-HUMANEVAL_VAL],
            val=tasks[-HUMANEVAL_VAL:],
            report={"train/bad_rows": 0, "val/bad_rows": 0},
        )
    train_source, val_source = resolve_sources(data)
    train_rows = load_split(train_source, on_bad_row=data.on_bad_row)
    val_rows = load_split(val_source, on_bad_row=data.on_bad_row)
    return TaskSplits(
        train=train_rows.examples,
        val=val_rows.examples,
        report={"train/bad_rows": train_rows.bad_rows, "val/bad_rows": val_rows.bad_rows},
        bad_row_samples=train_rows.bad_row_samples + val_rows.bad_row_samples,
    )


def hub_sources(data: DataConfig) -> list[str]:
    """The hub datasets the configured task reads (none for the built-in tasks and local files): what
    ``rlfleet validate`` cannot read without downloading.

    Raises:
        DataError: A data path is unset and has no default.
    """
    if data.dataset_name in GENERATED_TASKS:
        return []
    return [s.path for s in resolve_sources(data) if not looks_local(s.path)]


def load_task(data: DataConfig) -> tuple[list[Example], list[Example]]:
    """Train and validation examples of the configured dataset; skipped bad rows are logged as a warning."""
    task = load_task_with_report(data)
    if any(task.report.values()):
        log.warning(
            "skipped bad rows (data.on_bad_row=skip): %s; first: %s",
            ", ".join(f"{key}={count}" for key, count in task.report.items()),
            "; ".join(task.bad_row_samples),
        )
    return task.train, task.val
