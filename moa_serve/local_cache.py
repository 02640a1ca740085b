"""Where MoA-Serve keeps what it builds on a machine (converted checkpoints, compiled kernels):
``$MOA_CACHE_DIR``, else ``~/.cache/moa-serve``. A module of its own, so that the model files and
the kernels both find it without importing each other."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("MOA_CACHE_DIR", Path.home() / ".cache" / "moa-serve"))
