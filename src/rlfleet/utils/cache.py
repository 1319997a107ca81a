"""rlfleet's cache on disk: assembled model files, converted checkpoints, compiled code."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$RLFLEET_CACHE_DIR``, else ``$XDG_CACHE_HOME/rlfleet``, else ``~/.cache/rlfleet``."""
    if os.environ.get("RLFLEET_CACHE_DIR"):
        return Path(os.environ["RLFLEET_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlfleet"
