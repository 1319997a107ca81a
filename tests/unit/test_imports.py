"""Every ``rlfleet`` module imports on its own, no two modules import each other, and packages import
only downwards (``LAYERS``).

A cycle hides until someone imports the modules in the "wrong" order (``import rlfleet.distributed.layout``
once failed while ``import rlfleet.config`` worked), so both checks look at each module alone:

* statically, the graph of ``rlfleet`` imports (lazy ones inside functions included, ``TYPE_CHECKING`` ones
  and a module's own parent packages excluded) has no cycle;
* dynamically, each module is imported first in a process of its own. A fresh interpreter per module
  would re-import torch every time (minutes on a small machine), so one fresh interpreter imports the
  third-party names the package uses at its top levels, checks that no ``rlfleet`` module is loaded, and
  forks one child per module: each child starts with no ``rlfleet`` module and imports just its own.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rlfleet

PACKAGE_DIR = Path(rlfleet.__file__).parent


def _module_files() -> dict[str, Path]:
    files = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        files[".".join(parts).removesuffix(".__init__")] = path
    return files


MODULES = _module_files()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, *, top_level_only: bool) -> list[tuple[str, str | None]]:
    """``(module, name)`` of each absolute import (``name`` None for ``import module``)."""
    found: list[tuple[str, str | None]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            nodes: list[ast.AST] = list(node.orelse)
        elif top_level_only and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            return
        else:
            nodes = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            found.extend((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.extend((node.module, alias.name) for alias in node.names)
        for child in nodes:
            visit(child)

    visit(tree)
    return found


def _owning_module(dotted: str) -> str | None:
    parts = dotted.split(".")
    while parts and ".".join(parts) not in MODULES:
        parts.pop()
    return ".".join(parts) or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the ``rlfleet`` modules importing it runs (a target's parent packages included)."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for module, imported in _imports(ast.parse(path.read_text()), top_level_only=False):
            if module.split(".")[0] != "rlfleet":
                continue
            target = f"{module}.{imported}" if f"{module}.{imported}" in MODULES else _owning_module(module)
            if target is None or target == name:
                continue
            graph[name].add(target)
            parts = target.split(".")
            for end in range(1, len(parts)):
                parent = ".".join(parts[:end])
                if not (name == parent or name.startswith(parent + ".")):  # own packages are loaded first
                    graph[name].add(parent)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_a_cycle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# rlfleet's packages, lowest first: a package imports only packages of a lower layer, or of its own layer
# where that makes no cycle (``distributed/`` is Ray only; torch parallelism is the policy's).
LAYERS = [
    {"errors", "utils", "answers"},
    {"rewards", "pools"},
    {"config", "models"},
    {"memory"},
    {"data", "generation", "checkpoint", "logging", "deploy", "environments"},
    {"policy"},
    {"distributed"},
    {"serving"},
    {"rollouts"},
    {"runtime"},
    {"algorithms"},
    {"demo", "cli", "examples"},
]


# An algorithm's folder holds pieces of two layers: its description and what it reads from the recipe alone
# (``rlfleet/algorithms/<name>/{spec,config,checks,describe}.py``) belong with the config, which builds the
# schema and the checks from them; the rest (its loop, maths, teacher) is the algorithms layer.
ALGORITHM_CONFIG_MODULES = {"spec", "config", "checks", "describe"}


def package_of(dotted: str) -> str:
    """The layer package of a module: its package below ``rlfleet``, or ``config`` for an algorithm's
    description and config modules."""
    parts = dotted.split(".")
    if parts[1:2] == ["algorithms"] and len(parts) >= 4 and parts[3] in ALGORITHM_CONFIG_MODULES:
        return "config"
    return parts[1]


def package_imports() -> set[tuple[str, str]]:
    """``(importing package, imported package)`` over every module's ``rlfleet`` imports (lazy ones included,
    ``TYPE_CHECKING`` ones excluded), within a package left out."""
    edges = set()
    for name, path in MODULES.items():
        parts = name.split(".")
        if len(parts) < 2:
            continue  # rlfleet/__init__.py
        for module, _ in _imports(ast.parse(path.read_text()), top_level_only=False):
            target = module.split(".")
            if target[0] == "rlfleet" and len(target) > 1 and package_of(module) != package_of(name):
                edges.add((package_of(name), package_of(module)))
    return edges


def test_packages_import_only_downwards() -> None:
    layer = {package: i for i, packages in enumerate(LAYERS) for package in packages}
    edges = package_imports()
    assert {p for edge in edges for p in edge} <= set(layer), "a package missing from LAYERS"
    upward = sorted(f"{a} -> {b}" for a, b in edges if layer[b] > layer[a])
    cycles = sorted(f"{a} <-> {b}" for a, b in edges if layer[a] == layer[b] and (b, a) in edges)
    assert not upward and not cycles, f"upward imports: {upward}; cycles within a layer: {cycles}"


_DRIVER = r"""
import importlib, json, os, sys, traceback

modules, warm = json.loads(sys.stdin.read())
for module, name in warm:  # third-party only: the children then import rlfleet code alone
    try:
        loaded = importlib.import_module(module)
        if name is not None:
            getattr(loaded, name, None)  # resolves lazily-loaded names (transformers)
    except Exception:
        pass
leaked = sorted(m for m in sys.modules if m.split(".")[0] == "rlfleet")
if leaked:
    sys.exit(f"warm-up imported rlfleet modules: {leaked}")
failures = {}
for module in modules:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        code, message = 0, b""
        try:
            importlib.import_module(module)
        except BaseException:
            code, message = 1, traceback.format_exc().encode()
        with os.fdopen(write_end, "wb") as out:
            out.write(message)
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as inp:
        message = inp.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if status:
        failures[module] = message or f"child exited with status {status}"
print(json.dumps(failures))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_every_module_imports_on_its_own() -> None:
    warm: set[tuple[str, str | None]] = set()
    for path in MODULES.values():
        for module, name in _imports(ast.parse(path.read_text()), top_level_only=True):
            if module.split(".")[0] not in ("rlfleet", "__future__"):
                warm.add((module, name))
    payload = json.dumps([sorted(MODULES), sorted(warm, key=lambda x: (x[0], x[1] or ""))])
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER], input=payload, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    failures = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failures, "modules that fail to import on their own:\n" + "\n".join(
        f"--- {module}\n{message}" for module, message in failures.items()
    )
