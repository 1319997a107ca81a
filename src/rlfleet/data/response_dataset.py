"""NeMo RL's ``ResponseDataset`` and the ``gsm8k`` shortcut: question/answer rows from files or the hub.

Each row is an object with an input column (the question) and an output column (the worked answer). The
output is kept whole as ``Example.answer`` (the SFT target); ``Example.gold`` is the final answer extracted
from it: the number after the last ``####`` (thousands commas removed), else the content of the last
``\\boxed{...}``, else the whole stripped output. Every row is validated when the split is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from rlfleet.answers import InvalidGoldError, gold_answer
from rlfleet.config.schema import DataConfig
from rlfleet.data.errors import DataError
from rlfleet.data.sources import read_rows
from rlfleet.data.types import Example

RESPONSE_DEFAULTS: dict[str, str] = {
    "train_split": "train",
    "val_split": "test",
    "input_key": "question",
    "output_key": "answer",
}
GSM8K_DEFAULTS: dict[str, str] = {
    **RESPONSE_DEFAULTS,
    "train_data_path": "openai/gsm8k",
    "val_data_path": "openai/gsm8k",
    "subset": "main",
}
MAX_BAD_ROW_SAMPLES = 5


class _BadRow(Exception):
    """A row that cannot become an ``Example``; the message says why."""


@dataclass(frozen=True)
class SplitSource:
    """Where one split's rows come from, with every default applied.

    Attributes:
        name: ``train`` or ``val`` (for messages and report keys).
        path: Hub id or local file.
        split: Hub split (ignored for local files).
        subset: Hub configuration name, passed to ``datasets.load_dataset`` as ``name``.
        input_key: Column holding the question.
        output_key: Column holding the worked answer.
    """

    name: str
    path: str
    split: str
    subset: str | None
    input_key: str
    output_key: str


@dataclass
class SplitRows:
    """The examples of one split and the rows skipped as bad (``on_bad_row: skip``)."""

    examples: list[Example]
    bad_rows: int = 0
    bad_row_samples: list[str] = field(default_factory=list)


def resolve_sources(data: DataConfig) -> tuple[SplitSource, SplitSource]:
    """Train and validation sources of a ``gsm8k`` or ``ResponseDataset`` config, defaults filled in.

    A default applies only where the key is null, so ``gsm8k`` with local ``train_data_path`` and
    ``val_data_path`` reads those files.

    Raises:
        DataError: ``train_data_path`` or ``val_data_path`` is unset and has no default.
    """
    defaults = GSM8K_DEFAULTS if data.dataset_name == "gsm8k" else RESPONSE_DEFAULTS

    def pick(key: str) -> str | None:
        value = getattr(data, key)
        return value if value is not None else defaults.get(key)

    sources = []
    for name in ("train", "val"):
        path = pick(f"{name}_data_path")
        if path is None:
            raise DataError(
                f"data.{name}_data_path is not set (data.dataset_name={data.dataset_name}); set it to a hub "
                "id or a local .jsonl/.json/.parquet file (validation rows are never split off the "
                "training rows silently)"
            )
        sources.append(
            SplitSource(
                name=name,
                path=path,
                split=pick(f"{name}_split") or "",
                subset=pick("subset"),
                input_key=pick("input_key") or "",
                output_key=pick("output_key") or "",
            )
        )
    return sources[0], sources[1]


def load_split(source: SplitSource, *, on_bad_row: Literal["error", "skip"]) -> SplitRows:
    """Reads and validates every row of ``source``.

    Raises:
        DataError: A bad row with ``on_bad_row="error"`` (naming ``file:line`` or ``row I``, the problem
            and the fix), an unreadable source, or a split left with no usable row.
    """
    result = SplitRows(examples=[])
    for raw in read_rows(source.path, split=source.split, subset=source.subset):
        try:
            if raw.problem is not None:
                raise _BadRow(raw.problem)
            result.examples.append(_parse_row(raw.value, source.input_key, source.output_key))
        except _BadRow as bad:
            message = f"{raw.where}: {bad}"
            if on_bad_row == "error":
                raise bad_row_error(source.name, message) from None
            result.bad_rows += 1
            if len(result.bad_row_samples) < MAX_BAD_ROW_SAMPLES:
                result.bad_row_samples.append(message)
    if not result.examples:
        raise DataError(
            f"{source.name} data {source.path!r} has no usable rows ({result.bad_rows} bad rows skipped); "
            f"check the file and data.input_key={source.input_key!r} / data.output_key={source.output_key!r}"
        )
    return result


def bad_row_error(split_name: str, message: str) -> DataError:
    """The error for a bad row under ``on_bad_row="error"``; ``message`` is ``"file:line: problem"``."""
    return DataError(
        f"bad {split_name} row at {message}; fix or remove the row, or set "
        "data.on_bad_row=skip to skip bad rows (they are counted and logged)"
    )


def json_type(value: object) -> str:
    """The JSON name of ``value``'s type (``object``, ``array``, ``string``...), for row messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    return "object" if isinstance(value, Mapping) else type(value).__name__


TASK_NAME = "task_name"  # NeMo RL's key: the environment that scores a row (else data.env_name)


def _parse_row(value: object, input_key: str, output_key: str) -> Example:
    """The ``Example`` of one raw row.

    Raises:
        _BadRow: Not an object, a missing key, an empty or non-text question, or no extractable gold.
    """
    if not isinstance(value, Mapping):
        raise _BadRow(f"the row is a JSON {json_type(value)}, not an object")
    missing = [key for key in (input_key, output_key) if key not in value]
    if missing:
        raise _BadRow(
            f"missing key(s) {missing} (keys present: {sorted(map(str, value))}); set data.input_key / "
            "data.output_key to the question and answer columns"
        )
    question = value[input_key]
    if not isinstance(question, str):
        raise _BadRow(f"the question {input_key!r} is a JSON {json_type(question)}, not text")
    if not question.strip():
        raise _BadRow(f"empty question in {input_key!r}")
    output = value[output_key]
    if isinstance(output, int | float) and not isinstance(output, bool):
        output = str(output)
    if not isinstance(output, str):
        raise _BadRow(f"the output {output_key!r} is a JSON {json_type(output)}, not text")
    if not output.strip():
        raise _BadRow(f"empty output in {output_key!r}")
    try:
        gold = gold_answer(output)
    except InvalidGoldError as exc:
        raise _BadRow(f"no gold answer in the output {output_key!r} (ends {output[-60:]!r}): {exc}") from None
    env = value.get(TASK_NAME)
    if env is not None and (not isinstance(env, str) or not env):
        raise _BadRow(
            f"{TASK_NAME!r} (the environment that scores the row) must be a non-empty string, got {env!r}"
        )
    return Example(question=question, answer=output, gold=gold, env=env)
