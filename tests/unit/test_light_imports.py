"""What each entry point loads is what it uses: the command line starts without torch, an environment worker
(``rlfleet.environments.runner``, one per Ray actor or forked worker) without transformers, and a training
run without matplotlib until it draws its plot."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

# Imported in this order in one fresh interpreter; after each, the heavy packages it must not have loaded.
STAGES = [
    ("rlfleet.cli", ["torch", "transformers", "matplotlib", "ray", "vllm"]),
    ("rlfleet.environments.runner", ["transformers", "matplotlib", "vllm"]),
    ("rlfleet.algorithms.grpo.loop", ["matplotlib", "vllm"]),
]

_PROBE = """
import importlib, json, sys
found = {}
for module, heavy in json.loads(sys.argv[1]):
    importlib.import_module(module)
    found[module] = [name for name in heavy if name in sys.modules]
print(json.dumps(found))
"""


def test_entry_points_load_only_what_they_use() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(STAGES)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded == {module: [] for module, _ in STAGES}
