"""Throwaway folders for a benchmark's own intermediate files (models it builds, runs whose table it prints):
removed when the script exits, so repeated runs leave nothing behind in the temporary directory. A folder the
user names (``--out``, ``--work``) is theirs and is never made here."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path


def scratch_dir(prefix: str) -> Path:
    """A new temporary folder, removed with everything in it when the process exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
