"""The report of ``moa vllm-bench``: one row per (users, config) against the reference's cells,
written as JSON and a Markdown table."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def write_results(args, rows: list[dict]) -> dict:
    """Writes ``--out`` (JSON) and its ``.md`` table."""
    result = {
        "target": args.target,
        "configs": args.configs,
        "num_speculative_tokens": args.num_speculative_tokens,
        "duration_s": args.duration,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "interleave": args.interleave,
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(markdown(result))
    return result


def markdown(result: dict) -> str:
    """One row per (users, config), each against the reference in the same run: stock vLLM alone
    (``vllm``) when measured, else ``none``. Repeated cells: the median tok/s, and the geometric
    mean (min–max) of each repeat's ratio to the reference's cell of that repeat; the same net of
    steal (each engine's tokens per second the hypervisor left the machine during its own steps)
    and the steal share of those steps (median over repeats)."""
    rows = result["rows"]
    ref = "vllm" if any(r["config"] == "vllm" for r in rows) else "none"
    lines = [
        f"| users | config | async scheduling | tok/s | vs {ref} | τ | p50 latency s | requests | "
        f"drafting/governed steps | drafts per drafting step | vs {ref}, net of steal | steal % |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for users, name in dict.fromkeys((r["users"], r["config"]) for r in rows):
        cells = [r for r in rows if r["users"] == users and r["config"] == name]
        vs = _versus(rows, ref, users, cells, "tokens_per_s")
        net = _versus(rows, ref, users, cells, "tokens_per_s_net")
        steals = [c["steal_percent"] for c in cells if c.get("steal_percent") is not None]
        steal = f"{statistics.median(steals):.1f}" if steals else ""
        taus = [c["tau"] for c in cells if c["tau"] is not None]
        lats = [c["latency_p50_s"] for c in cells if c["latency_p50_s"] is not None]
        steps = per_step = ""
        if all("governed_steps" in c for c in cells):
            drafting = sum(c["drafting_steps"] for c in cells)
            steps = f"{drafting}/{sum(c['governed_steps'] for c in cells)}"
            if drafting and all("drafts" in c for c in cells):
                per_step = f"{sum(c['drafts'] for c in cells) / drafting:.2f}"
        sched = {True: "on", False: "off"}.get(cells[0].get("async_scheduling"), "")
        tps = statistics.median(c["tokens_per_s"] for c in cells)
        lines.append(
            f"| {users} | {name} | {sched} | {round(tps, 2)} | {vs} | "
            f"{round(statistics.median(taus), 3) if taus else None} | "
            f"{round(statistics.median(lats), 3) if lats else None} | {sum(c['requests'] for c in cells)} | "
            f"{steps} | {per_step} | {net} | {steal} |"
        )
    return "\n".join(lines) + "\n"


def _versus(rows: list[dict], ref: str, users: int, cells: list[dict], key: str) -> str:
    """The geometric mean (min–max) of each cell's ``key`` over the reference's of its repeat."""
    base = {r.get("repeat", 0): r[key] for r in rows if r["config"] == ref and r["users"] == users and key in r}
    ratios = [c[key] / base[c.get("repeat", 0)] for c in cells if key in c and base.get(c.get("repeat", 0))]
    if not ratios:
        return ""
    vs = f"{statistics.geometric_mean(ratios):.2f}×"
    return vs + (f" ({min(ratios):.2f}–{max(ratios):.2f})" if len(ratios) > 1 else "")
