"""The README and the documentation site cannot drift from the tree: the runnable blocks of the
getting-started page run, every path the pages name exists, the layout on the architecture page matches
``src/rlfleet/``, the README stays a front door, every page is in the site's nav, and (where MkDocs is
installed) the site builds in strict mode."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "src" / "rlfleet"
README = ROOT / "README.md"
PAGES = sorted(DOCS.rglob("*.md"))
RUN_MARKER = "<!-- run -->"
LAYOUT_MARKER = "<!-- layout -->"

# A repository path in prose or code: not part of a URL or of a longer path (docs/lustre-... in a GCP URL).
PATH = re.compile(r"(?<![\w/.:-])((?:src/rlfleet|recipes|benchmarks|tests|docs)/[\w.*/-]*[\w/])")
RECIPE = re.compile(r"`((?:grpo|sft|dpo|rm|distillation)-[\w.-]+-(?:cpu|\d+n\d+g(?:-[\w.-]+)?))`")
MODULE = re.compile(r"(?<![\w.])rlfleet((?:\.\w+)+)")


def _texts() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in [README, *PAGES]}


def _runnable_blocks(text: str) -> list[str]:
    return re.findall(re.escape(RUN_MARKER) + r"\n```bash\n(.*?)```", text, flags=re.S)


def test_the_getting_started_page_runs_its_marked_blocks() -> None:
    """Each ``<!-- run -->`` block runs as written, from the repository root with the venv's ``bin`` first
    on PATH, and exits 0 (the blocks are cheap: ``--help``, ``validate``, ``plan``)."""
    blocks = _runnable_blocks((DOCS / "getting-started.md").read_text(encoding="utf-8"))
    assert blocks, f"getting-started.md has no {RUN_MARKER} block"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env["HF_HUB_OFFLINE"] = "1"
    for block in blocks:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, (
            f"{block}\nexit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )


def _resolves(parts: list[str]) -> bool:
    """``rlfleet.<parts>`` names a package or module of the tree, or a name its module or package defines."""
    path = PACKAGE
    for i, part in enumerate(parts):
        if (path / part).is_dir():
            path = path / part
        elif (path / f"{part}.py").is_file():
            rest = parts[i + 1 :]
            return not rest or re.search(rf"\b{rest[0]}\b", (path / f"{part}.py").read_text()) is not None
        else:
            init = path / "__init__.py"
            return (
                path != PACKAGE and init.is_file() and re.search(rf"\b{part}\b", init.read_text()) is not None
            )
    return True


def test_every_path_the_readme_and_the_docs_name_exists() -> None:
    missing = []
    for name, text in _texts().items():
        for path in PATH.findall(text):
            if "*" in path:
                if not list(ROOT.glob(path)):
                    missing.append(f"{name}: {path}")
            elif not (ROOT / path).exists():
                missing.append(f"{name}: {path}")
        for recipe in RECIPE.findall(text):
            if not (ROOT / "recipes" / f"{recipe}.yaml").is_file():
                missing.append(f"{name}: recipe {recipe}")
        for dotted in MODULE.findall(text):
            if not _resolves(dotted.split(".")[1:]):
                missing.append(f"{name}: rlfleet{dotted}")
    assert not missing, "named but not in the tree:\n" + "\n".join(missing)


def _layout_entries(text: str) -> list[tuple[str, str]]:
    """(package under src/rlfleet, its text) for each entry of the architecture page's layout block."""
    block = text.split(LAYOUT_MARKER + "\n```text\n", 1)[1].split("```", 1)[0]
    entries: list[tuple[str, str]] = []
    top = ""
    for line in block.splitlines()[1:]:  # the first line is src/rlfleet/
        sub = re.match(r"^    (\w+)/\s", line)
        pkg = re.match(r"^  (\w+)/\s", line)
        if pkg:
            top = pkg.group(1)
            entries.append((top, line))
        elif sub:
            entries.append((f"{top}/{sub.group(1)}", line))
        elif re.match(r"^  \w+\.py", line):
            entries.append(("", line))
        elif line.startswith("      ") and entries:
            entries[-1] = (entries[-1][0], entries[-1][1] + "\n" + line)
        elif not line.startswith(" "):
            top = ""  # recipes/, benchmarks/, tests/, docs/: outside the package
            assert (ROOT / line.split()[0]).is_dir(), line
    return entries


def test_the_architecture_layout_matches_the_package() -> None:
    entries = _layout_entries((DOCS / "architecture.md").read_text(encoding="utf-8"))
    listed = {package for package, _ in entries}
    packages = {
        str(d.relative_to(PACKAGE))
        for d in PACKAGE.rglob("*")
        if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))
    }
    assert packages - listed == set(), f"packages missing from the layout: {sorted(packages - listed)}"
    assert listed - packages - {""} == set(), (
        f"layout names packages that are gone: {sorted(listed - packages)}"
    )
    top_modules = {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    named_top = {m for package, entry in entries if package == "" for m in re.findall(r"\w+\.py", entry)}
    assert top_modules - named_top == set(), f"top-level modules missing: {sorted(top_modules - named_top)}"
    missing = [
        f"{package}/{module}"
        for package, entry in entries
        for module in re.findall(r"\b[\w/]*\w\.py\b", entry)
        if not (PACKAGE / package / module).is_file() and not (PACKAGE / module).is_file()
    ]
    assert not missing, f"modules the layout names that do not exist: {missing}"


def test_the_readme_is_a_front_door() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the reference belongs in docs/"


def test_the_docs_copies_of_the_readme_examples_are_the_readme_s() -> None:
    """The environment and agent examples appear in the README (whose blocks the functional tests run) and
    on their docs pages: the same code."""
    readme = README.read_text(encoding="utf-8")
    for marker, page in [
        ("<!-- environment-example -->", "environments.md"),
        ("<!-- agent-example -->", "agents.md"),
    ]:
        text = (DOCS / page).read_text(encoding="utf-8")

        def block(source: str, marker: str = marker) -> str:
            return source.split(marker + "\n```python\n", 1)[1].split("```", 1)[0]

        assert block(text) == block(readme), f"docs/{page}'s {marker} block differs from the README's"


def _nav_pages(nav: object) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*(_nav_pages(item) for item in nav)) if nav else set()
    if isinstance(nav, dict):
        return set().union(*(_nav_pages(value) for value in nav.values())) if nav else set()
    return set()


def test_every_docs_page_is_in_the_nav() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = _nav_pages(config["nav"])
    pages = {str(p.relative_to(DOCS)) for p in PAGES}
    assert pages - nav == set(), f"pages missing from mkdocs.yml's nav: {sorted(pages - nav)}"
    assert nav - pages == set(), f"nav entries without a page: {sorted(nav - pages)}"


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    site = tmp_path / "site"
    done = subprocess.run(  # not --quiet: it hides the warnings --strict fails on
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reference = (site / "config-reference.html").read_text(encoding="utf-8")
    assert "grpo.num_prompts_per_step" in reference and "policy.generation.vllm_cfg" in reference
