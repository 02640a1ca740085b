"""Prompts for load tests: Spec-Bench-format JSONL (or chat/prompt records) to chat messages.
Kept apart from the locustfile so that importing it never pulls in Locust (whose gevent
monkey-patching breaks ``ssl`` in a process that imported it first, such as pytest's)."""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = (
    Path(os.environ.get("MOA_SHARED_DIR", REPO_ROOT.parent / "shared")) / "data" / "specbench" / "question.jsonl"
)


def _prompt_of(rec: dict) -> list[dict] | None:
    """The chat messages of one JSONL record (None if it holds no prompt)."""
    if isinstance(rec.get("messages"), list) and rec["messages"]:
        msgs = [m for m in rec["messages"] if isinstance(m, dict) and "content" in m]
        # a training-style conversation: keep everything up to the last user turn
        while msgs and msgs[-1].get("role") == "assistant":
            msgs.pop()
        return msgs or None
    for key in ("turns", "prompt", "question", "instruction", "text", "input"):
        v = rec.get(key)
        if isinstance(v, list) and v and isinstance(v[0], str):
            return [{"role": "user", "content": v[0]}]
        if isinstance(v, str) and v.strip():
            return [{"role": "user", "content": v}]
    return None


def load_prompts(path: str | os.PathLike, categories: set[str] | None = None) -> list[dict]:
    """[{"category": str, "messages": [...]}, ...] from a JSONL file."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            cat = str(rec.get("category", "default"))
            if categories and cat not in categories:
                continue
            msgs = _prompt_of(rec)
            if msgs:
                out.append({"category": cat, "messages": msgs})
    if not out:
        raise ValueError(f"no prompts in {path}" + (f" for categories {sorted(categories)}" if categories else ""))
    return out


def messages_to_prompt(messages: list[dict]) -> str:
    """Plain-text prompt for /v1/completions (no chat template: the server's raw completion)."""
    return "\n\n".join(m["content"] for m in messages)


# ---------------------------------------------------------------------------------------
# shared state, set up once per Locust process
