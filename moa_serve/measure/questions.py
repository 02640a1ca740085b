"""Spec-Bench-format questions (one JSON object a line: ``question_id``, ``category``, ``turns``), as
the benchmarks read them."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

DEFAULT_QUESTIONS = "../shared/data/specbench/question.jsonl"


def load_questions(path: str, limit: int = 0, per_category: int = 0, categories: list[str] | None = None) -> list[dict]:
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").split("\n") if line.strip()]
    if categories:
        rows = [r for r in rows if r.get("category") in categories]
    if per_category:
        seen: dict[str, int] = defaultdict(int)
        keep = []
        for r in rows:
            c = r.get("category", "all")
            if seen[c] < per_category:
                keep.append(r)
                seen[c] += 1
        rows = keep
    return rows[:limit] if limit else rows
