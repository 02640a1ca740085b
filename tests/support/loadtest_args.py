"""The command line of ``moa loadtest`` (loadtest/runner.py) as the tests run it: a host, its users,
the new tokens per request and the output folder, failing on any failed request."""

from __future__ import annotations

from pathlib import Path


def loadtest_args(host: str, users: str, max_tokens: int, out: Path, *more: str) -> list[str]:
    return [
        "--host",
        host,
        "--users",
        users,
        "--max-tokens",
        str(max_tokens),
        "--out",
        str(out),
        "--fail-on-failures",
        *more,
    ]
