"""Tasks no one here wrote: reasoning-gym's procedurally generated problems (``data.dataset_name=
reasoning_gym``).

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ (PyPI ``reasoning-gym``, Apache-2.0)
generates reasoning tasks from a seed, offline, each with its own verifier. ``data.reasoning_gym.tasks``
names them (``basic_arithmetic``, ``chain_sum``, ``leg_counting``...; ``task_config`` passes a task's own
settings); ``train_size`` training and ``val_size`` validation items are drawn round-robin over the tasks, the
validation ones from another seed and never a question of the training split. Each row keeps its whole entry
(question, answer, metadata) for the ``reasoning_gym`` environment, which scores a reply with the task's own
``score_answer``.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from rlfleet.config.schema import ReasoningGymConfig
from rlfleet.data.errors import DataError
from rlfleet.data.types import Example

ENVIRONMENT = "reasoning_gym"


def _package() -> Any:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise DataError(
            "data.dataset_name=reasoning_gym needs the reasoning-gym package: pip install "
            "'rlfleet[reasoning-gym]' (make setup-dev installs it)"
        ) from exc
    return reasoning_gym


def check_tasks(cfg: ReasoningGymConfig) -> None:
    """Raises a :class:`DataError` naming the unknown tasks (with the closest known names)."""
    known = set(_package().factory.DATASETS)
    for name in [*cfg.tasks, *cfg.task_config]:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise DataError(
                f"data.reasoning_gym: {name!r} is not a reasoning-gym task; {hint}(known: {len(known)} "
                "tasks, listed by reasoning_gym.factory.DATASETS)"
            )
    unused = sorted(set(cfg.task_config) - set(cfg.tasks))
    if unused:
        raise DataError(
            f"data.reasoning_gym.task_config names tasks not in data.reasoning_gym.tasks: {unused}"
        )


def _entries(cfg: ReasoningGymConfig, size: int, seed: int) -> list[dict[str, Any]]:
    """``size`` entries, round-robin over the tasks (task ``i`` from ``seed + i``)."""
    package = _package()
    per_task = [size // len(cfg.tasks) + (i < size % len(cfg.tasks)) for i in range(len(cfg.tasks))]
    columns: list[list[dict[str, Any]]] = []
    for i, (name, count) in enumerate(zip(cfg.tasks, per_task, strict=True)):
        if count == 0:
            columns.append([])
            continue
        try:
            dataset = package.create_dataset(name, size=count, seed=seed + i, **cfg.task_config.get(name, {}))
            columns.append([dict(entry) for entry in dataset])
        except Exception as exc:  # a task's own validation of its settings
            raise DataError(f"data.reasoning_gym: task {name!r} cannot be generated: {exc}") from exc
    return [column[j] for j in range(max(per_task)) for column in columns if j < len(column)]


def _jsonable(entry: dict[str, Any]) -> dict[str, Any]:
    """The entry as JSON data (what a worker process or a checkpointed loader can carry)."""
    data: dict[str, Any] = json.loads(json.dumps(entry, default=str))
    return data


def _example(entry: dict[str, Any]) -> Example:
    answer = str(entry["answer"])
    return Example(
        question=str(entry["question"]),
        answer=f"<answer>{answer}</answer>",
        gold=answer,
        env=ENVIRONMENT,
        extra={"rg_entry": _jsonable(entry)},
    )


def reasoning_gym_splits(cfg: ReasoningGymConfig) -> tuple[list[Example], list[Example]]:
    """The training and validation rows (validation: seed ``cfg.seed + 1000``, its questions excluded from
    training).

    Raises:
        DataError: The package is missing, a task is unknown, or a task refuses its settings.
    """
    check_tasks(cfg)
    val = [_example(e) for e in _entries(cfg, cfg.val_size, cfg.seed + 1000)]
    held_out = {ex.question for ex in val}
    train = [_example(e) for e in _entries(cfg, cfg.train_size, cfg.seed) if e["question"] not in held_out]
    if not train:
        raise DataError("data.reasoning_gym: every training item is also a validation item; raise train_size")
    return train, val
