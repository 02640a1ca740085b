"""A ``moa`` command run in-process on a questions file, and the JSON results it writes to --out."""

from __future__ import annotations

import json
from pathlib import Path

from moa_serve.cli import main


def write_questions(path: Path, rows: list[dict]) -> Path:
    """Writes the question rows as JSON lines to path and returns it."""
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def run_for_json(args: list[str], out: Path) -> dict:
    """Runs ``moa <args> --out <out>``, asserts it exits 0 and returns the JSON it wrote there."""
    assert main([*args, "--out", str(out)]) == 0
    return json.loads(out.read_text())
