"""Raw rows from local ``.json``/``.jsonl``/``.parquet`` files or hub datasets, each tagged with its origin.

Every row carries ``where``: ``path:LINE`` (1-based) for JSON lines and JSON arrays (the line where the
object starts), ``path row I`` (0-based row index) for Parquet files and hub datasets. Rows that cannot be
parsed (an invalid JSON line) are yielded with ``problem`` set, so the caller decides to stop or skip.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlfleet.data.errors import DataError

if TYPE_CHECKING:
    import pyarrow.parquet as pq

LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")
_LOCAL_PREFIXES = ("./", "../", "/", "~")
_WHITESPACE = re.compile(r"[ \t\n\r]*")


def _skip_whitespace(text: str, pos: int = 0) -> int:
    """The position of the first character at or after ``pos`` that is not JSON whitespace."""
    match = _WHITESPACE.match(text, pos)
    return match.end() if match else pos


@dataclass(frozen=True)
class RawRow:
    """One row as read from its source.

    Attributes:
        where: Origin for messages: ``train.jsonl:12`` or ``train.parquet row 11``.
        value: The parsed row (any JSON value; an object when well formed). None when ``problem`` is set.
        problem: Why the row could not be parsed, or None.
    """

    where: str
    value: object = None
    problem: str | None = None


def looks_local(path: str) -> bool:
    """Whether ``path`` names a local file rather than a hub id.

    True when it exists, ends in a supported suffix, or starts with ``./``, ``../``, ``/`` or ``~``.
    """
    local = Path(path).expanduser()
    return local.exists() or local.suffix.lower() in LOCAL_SUFFIXES or path.startswith(_LOCAL_PREFIXES)


def read_rows(path: str, *, split: str, subset: str | None) -> Iterator[RawRow]:
    """Rows of a local file (by suffix) or of ``datasets.load_dataset(path, subset, split=split)``.

    A local directory is handed to ``datasets.load_dataset`` too (it reads data folders). ``split`` and
    ``subset`` only apply to hub datasets and directories.

    Raises:
        DataError: A local-looking path that does not exist, an unsupported suffix, an unreadable file, or
            a hub dataset that cannot be loaded.
    """
    local = Path(path).expanduser()
    if local.is_dir() or not looks_local(path):
        return _read_hub(path, subset, split)
    if not local.exists():
        raise DataError(
            f"data file {path!r} does not exist (resolved to {local.resolve()}); fix the path "
            f"(relative paths start from the working directory {Path.cwd()})"
        )
    suffix = local.suffix.lower()
    if suffix == ".jsonl":
        return _read_json_lines(path, _read_text(path))
    if suffix == ".json":
        return _read_json(path)
    if suffix == ".parquet":
        return _read_parquet(path)
    raise DataError(
        f"data file {path!r} has the unsupported suffix {suffix!r}; convert it to one of "
        f"{', '.join(LOCAL_SUFFIXES)}"
    )


def _read_text(path: str) -> str:
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"data file {path!r} is not UTF-8 text ({exc}); re-encode it as UTF-8") from exc
    except OSError as exc:
        raise DataError(f"data file {path!r} cannot be read ({exc}); check its permissions") from exc


def _read_json_lines(label: str, text: str) -> Iterator[RawRow]:
    """One JSON value per non-blank line."""
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{label}:{lineno}"
        try:
            yield RawRow(where, json.loads(line))
        except json.JSONDecodeError as exc:
            yield RawRow(where, problem=f"invalid JSON ({exc.msg} at column {exc.colno})")


def _read_json(label: str) -> Iterator[RawRow]:
    """A ``.json`` file: a JSON array of objects when it starts with ``[``, else JSON lines."""
    text = _read_text(label)
    start = _skip_whitespace(text)
    if text.startswith("[", start):
        return _read_json_array(label, text, start + 1)
    return _read_json_lines(label, text)


def _array_syntax_error(label: str, text: str, pos: int, what: str) -> DataError:
    err = json.JSONDecodeError(what, text, pos)
    return DataError(
        f"{label}:{err.lineno}: invalid JSON ({what} at column {err.colno}); a JSON array cannot be read "
        "past a syntax error, so data.on_bad_row=skip cannot recover it: fix the file (or convert it to "
        "JSON lines, one object per line, where bad lines can be skipped)"
    )


def _read_json_array(label: str, text: str, pos: int) -> Iterator[RawRow]:
    """Elements of the JSON array opened just before ``pos``, tagged with the line where each starts."""
    decoder = json.JSONDecoder()
    line, counted = 1, 0
    pos = _skip_whitespace(text, pos)
    closed = text.startswith("]", pos)
    while not closed:
        line += text.count("\n", counted, pos)
        counted = pos
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise _array_syntax_error(label, text, exc.pos, exc.msg) from exc
        yield RawRow(f"{label}:{line}", value)
        pos = _skip_whitespace(text, pos)
        if text.startswith(",", pos):
            pos = _skip_whitespace(text, pos + 1)
        elif text.startswith("]", pos):
            closed = True
        else:
            raise _array_syntax_error(label, text, pos, "expected ',' or ']' after an array element")
    end = _skip_whitespace(text, pos + 1)
    if end != len(text):
        raise _array_syntax_error(label, text, end, "extra data after the closing ']'")


def _read_parquet(label: str) -> Iterator[RawRow]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(Path(label).expanduser())
    except (OSError, pa.ArrowException) as exc:
        raise DataError(
            f"data file {label!r} is not a readable Parquet file ({exc}); rewrite it with pyarrow/pandas "
            "or use .jsonl"
        ) from exc
    return _parquet_rows(label, parquet)


def _parquet_rows(label: str, parquet: pq.ParquetFile) -> Iterator[RawRow]:
    index = 0
    for batch in parquet.iter_batches():
        for value in batch.to_pylist():
            yield RawRow(f"{label} row {index}", value)
            index += 1


def _read_hub(path: str, subset: str | None, split: str) -> Iterator[RawRow]:
    import datasets

    try:
        dataset = datasets.load_dataset(path, subset, split=split)
    except (OSError, ValueError) as exc:
        raise DataError(
            f"cannot load hub dataset {path!r} (subset={subset!r}, split={split!r}): {exc}; check the id, "
            "data.subset and the split (data.train_split / data.val_split), or download the rows and point "
            "data.train_data_path / data.val_data_path at local .jsonl/.json/.parquet files"
        ) from exc
    label = f"{path} (subset={subset!r}, split={split!r})"
    return (RawRow(f"{label} row {index}", value) for index, value in enumerate(dataset))
