"""benchmarks/scratch.py: a benchmark's own throwaway folder is gone when its process exits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_scratch_folder_and_its_files_are_removed_when_the_process_exits(tmp_path: Path) -> None:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from benchmarks.scratch import scratch_dir;"
        "d = scratch_dir('rlfleet-scratch-test-'); (d / 'model').mkdir();"
        "(d / 'model' / 'w.bin').write_bytes(b'1');"
        "print(d)"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, check=True, env=env
    )
    made = Path(done.stdout.strip())
    assert made.parent == tmp_path and made.name.startswith("rlfleet-scratch-test-")
    assert not made.exists()
    assert list(tmp_path.iterdir()) == []
