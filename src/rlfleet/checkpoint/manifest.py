"""Checkpoint manifests: every file's size and SHA-256, written last, checked before a checkpoint is used.

On a filesystem whose rename is a copy (a GCS FUSE mount), a node that dies while a checkpoint is saved or
renamed can leave a ``step_N`` with a weight shard cut short; loading it fails deep inside torch
(``PytorchStreamReader failed reading zip archive``), on every retry. ``CheckpointManager.save`` therefore
writes ``manifest.json`` as the last file of a checkpoint, after every rank's DCP shard is on disk and before
the directory is renamed into place; :func:`verify_manifest` compares the files with it (sizes first, which
costs one ``stat`` per file, then checksums).

Format (``format`` 1)::

    {"format": 1, "algorithm": "sha256",
     "files": {"config.yaml": {"size": 1234, "sha256": "ab12..."}, "policy/weights/__0_0.distcp": {...}}}

Paths are relative to the step directory, ``/``-separated; the manifest does not list itself.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rlfleet.errors import UserError

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
_ALGORITHM = "sha256"
# hashlib releases the GIL while hashing, so threads hash several shards at once.
_HASH_THREADS = min(8, os.cpu_count() or 1)


class CheckpointError(UserError):
    """A checkpoint that cannot be used (corrupt or incomplete), or a directory with no usable one.

    Attributes:
        path: The checkpoint step directory (or checkpoint root) concerned.
        problems: One line per bad file or checkpoint, each naming it and the reason.
    """

    def __init__(self, path: Path, problems: list[str], header: str, *, fix: str | None = None) -> None:
        self.path = Path(path)
        self.problems = list(problems)
        lines = [header, *(f"  - {p}" for p in self.problems)]
        super().__init__("\n".join(lines if fix is None else [*lines, fix]))

    @property
    def reason(self) -> str:
        """The problems on one line (for a log message)."""
        return "; ".join(self.problems)


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in large chunks (streaming; constant memory)."""
    with Path(path).open("rb") as handle:
        return hashlib.file_digest(handle, _ALGORITHM).hexdigest()


def _hash_files(root: Path, names: list[str]) -> dict[str, str]:
    with ThreadPoolExecutor(max_workers=_HASH_THREADS) as pool:
        return dict(zip(names, pool.map(lambda name: file_sha256(root / name), names), strict=True))


def checkpoint_files(step_dir: Path) -> list[str]:
    """Sorted ``/``-separated paths, relative to ``step_dir``, of its files other than the manifest."""
    step_dir = Path(step_dir)
    found = [p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file()]
    return sorted(name for name in found if name != MANIFEST_FILE)


def write_manifest(step_dir: Path) -> Path:
    """Hash every file under ``step_dir`` and write ``manifest.json`` there (flushed to disk).

    Call it once every other file of the checkpoint is written (by every rank).

    Returns:
        The manifest path.
    """
    step_dir = Path(step_dir)
    names = checkpoint_files(step_dir)
    sizes = {name: (step_dir / name).stat().st_size for name in names}
    digests = _hash_files(step_dir, names)
    manifest = {
        "format": MANIFEST_FORMAT,
        "algorithm": _ALGORITHM,
        "files": {name: {"size": sizes[name], "sha256": digests[name]} for name in names},
    }
    path = step_dir / MANIFEST_FILE
    with path.open("w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    return path


def _read_manifest(step_dir: Path) -> dict[str, tuple[int, str]]:
    """``{relative path: (size, sha256)}`` from ``manifest.json``; CheckpointError when it is malformed."""
    path = step_dir / MANIFEST_FILE
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _corrupt(step_dir, [f"{MANIFEST_FILE}: unreadable ({exc})"]) from exc
    files = data.get("files") if isinstance(data, Mapping) else None
    if (
        not isinstance(data, Mapping)
        or data.get("format") != MANIFEST_FORMAT
        or data.get("algorithm") != _ALGORITHM
        or not isinstance(files, Mapping)
    ):
        raise _corrupt(
            step_dir,
            [f"{MANIFEST_FILE}: not a format-{MANIFEST_FORMAT} {_ALGORITHM} manifest (damaged or foreign)"],
        )
    entries: dict[str, tuple[int, str]] = {}
    for name, entry in files.items():
        size = entry.get("size") if isinstance(entry, Mapping) else None
        digest = entry.get("sha256") if isinstance(entry, Mapping) else None
        if not isinstance(size, int) or not isinstance(digest, str):
            raise _corrupt(step_dir, [f"{MANIFEST_FILE}: malformed entry for {name!r}"])
        entries[str(name)] = (size, digest)
    return entries


def _corrupt(step_dir: Path, problems: list[str]) -> CheckpointError:
    return CheckpointError(step_dir, problems, f"checkpoint {step_dir} is corrupt:")


def verify_manifest(step_dir: Path) -> bool:
    """Check the files of a checkpoint against its ``manifest.json``: presence and size, then SHA-256.

    Files that are not in the manifest are ignored (they were added after the save).

    Returns:
        True when every listed file matches; False when the checkpoint has no manifest.

    Raises:
        CheckpointError: The manifest is unreadable, or a listed file is missing, has another size, or
            another checksum; the message names every such file and why.
    """
    step_dir = Path(step_dir)
    if not (step_dir / MANIFEST_FILE).is_file():
        return False
    entries = _read_manifest(step_dir)
    problems: list[str] = []
    for name, (size, _) in entries.items():
        file = step_dir / name
        if not file.is_file():
            problems.append(f"{name}: missing (the manifest lists {size} bytes)")
        elif (actual := file.stat().st_size) != size:
            problems.append(f"{name}: {actual} bytes, the manifest says {size} (truncated or partly copied)")
    if problems:
        raise _corrupt(step_dir, problems)
    digests = _hash_files(step_dir, list(entries))
    problems = [
        f"{name}: SHA-256 differs from the manifest (same size, other bytes: changed after the save)"
        for name, (_, digest) in entries.items()
        if digests[name] != digest
    ]
    if problems:
        raise _corrupt(step_dir, problems)
    return True
