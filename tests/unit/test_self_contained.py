"""The tests and benchmarks run from a fresh clone: the data and schemas they read are in the repository."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# ``shared/data``, ``"shared" / "schemas"``, ...: the folder beside the checkout that a fresh clone lacks.
OUTSIDE_PATH = re.compile(r"shared\W{0,6}(?:data|schemas)\b")
TEXT_SUFFIXES = {".py", ".yaml", ".yml", ".json", ".md", ".txt", ".toml", ".cfg", ".ini", ".sh"}


def test_nothing_under_tests_or_benchmarks_reads_a_folder_beside_the_repository() -> None:
    offenders = [
        f"{path.relative_to(REPO)}: {found.group()!r}"
        for folder in ("tests", "benchmarks")
        for path in sorted((REPO / folder).rglob("*"))
        if path.is_file() and path.suffix in TEXT_SUFFIXES and path != Path(__file__).resolve()
        for found in OUTSIDE_PATH.finditer(path.read_text(encoding="utf-8", errors="replace"))
    ]
    assert not offenders, (
        "read these from the repository (tests/data, rlfleet/deploy/schemas):\n" + "\n".join(offenders)
    )


def test_the_gsm8k_test_split_is_in_the_repository() -> None:
    folder = REPO / "tests" / "data" / "gsm8k"
    assert "MIT License" in (folder / "LICENSE").read_text(encoding="utf-8")
    assert "1,319" in (folder / "README.md").read_text(encoding="utf-8")
    with (folder / "test.jsonl").open(encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle]
    assert len(rows) == 1319
    assert all(set(row) == {"question", "answer"} and "\n#### " in row["answer"] for row in rows)
