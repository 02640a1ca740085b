"""The reports of a side-by-side run: ``results.json`` (everything) and ``results.md`` (the tables),
rewritten after every level."""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
from pathlib import Path

from tools.side_by_side.sides import safe_label


def fmt(x, nd=2) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def initial_results(a, argv, repo: Path, out: Path, started, sides: list[dict]) -> dict:
    """The results file's skeleton: the run's settings, and per side its command, log and no levels yet."""
    results = {
        "meta": {
            "started": started.isoformat(timespec="seconds"),
            "finished": None,
            "argv": sys.argv[1:] if argv is None else argv,
            "repo": str(repo),
            "out": str(out),
            "client": str(a.client),
            "questions": str(a.questions),
            "users": a.users,
            "duration_s": a.duration,
            "slices": a.slices if getattr(a, "together", False) else None,
            "max_tokens": a.max_tokens,
            "limit": a.limit,
            "cpus": os.cpu_count(),
            "loadavg_start": round(os.getloadavg()[0], 2),
            "interrupted": False,
        },
        "sides": [],
    }
    for s in sides:
        env_s = " ".join(f"{k}={shlex.quote(v)}" for k, v in s["env_shown"].items())
        results["sides"].append(
            {
                "label": s["label"],
                "kind": s["kind"],
                "drafter_off": s.get("drafter_off", False),
                "url": s["url"],
                "command": (env_s + " " if env_s else "") + shlex.join(s["cmd"]),
                "config": s.get("config"),
                "served_config": s.get("served_config"),
                "log": str(out / f"{safe_label(s['label'])}.log"),
                "ready_s": None,
                "warmup": None,
                "model": None,
                "levels": [],
                "error": None,
            }
        )
    return results


def write_reports(out: Path, results: dict) -> None:
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    tmp.replace(out / "results.json")

    m = results["meta"]
    lines = [
        f"# Side by side ({m['started']})",
        "",
        f"Client `{m['client']}`, questions `{m['questions']}`, {m['duration_s']:g} s per level, "
        f"max_tokens {m['max_tokens']}, users {','.join(map(str, m['users']))}; "
        f"{m['cpus']} CPUs; load average at start {m['loadavg_start']}.",
        "",
    ]
    any_ttft = any(lv["summary"].get("ttft") is not None for s in results["sides"] for lv in s["levels"])
    head = (
        ["side", "users", "tok/s", "tok/s/user", "p50 s", "p99 s"]
        + (["TTFT p50 s"] if any_ttft else [])
        + ["requests", "failures", "load avg", "steal %"]
    )
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in results["sides"]:
        if not s["levels"]:
            lines.append(f"| {s['label']} | " + " | ".join(["–"] * (len(head) - 1)) + " |")
        for lv in s["levels"]:
            r = lv["summary"]
            fails = fmt(r["failures"])
            if r.get("errors"):
                fails += " (" + ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) + ")"
            if lv.get("error"):
                fails += f" [{lv['error'][:60]}]"
            row = (
                [
                    s["label"],
                    fmt(r["users"]),
                    fmt(r["tok_per_s"]),
                    fmt(r["tok_per_s_per_user"]),
                    fmt(r["latency_p50_s"]),
                    fmt(r["latency_p99_s"]),
                ]
                + ([fmt(r.get("ttft"), 3)] if any_ttft else [])
                + [fmt(r["requests"]), fails, fmt(lv.get("loadavg_start")), fmt(lv.get("steal_percent"), 1)]
            )
            lines.append("| " + " | ".join(row) + " |")

    # aggregate tok/s per level, sides as columns, and the ratio to the first vLLM side
    sides = [s for s in results["sides"] if s["levels"]]
    if sides:
        ref = next((s for s in sides if s["kind"] == "vllm"), None)
        lines += ["", "Aggregate output tok/s" + (f" (× = ratio to {ref['label']})" if ref else "") + ":", ""]
        lines += ["| users | " + " | ".join(s["label"] for s in sides) + " |", "|---|" + "---|" * len(sides)]

        def tps(side, u):
            levels = [lv for lv in side["levels"] if lv["summary"]["users"] == u]
            if levels and "pass" in levels[0]:  # --together: tokens over seconds of the level's slices
                return _tokens_over_seconds(_per_pass(side, u))
            return levels[0]["summary"]["tok_per_s"] if levels else None

        for u in results["meta"]["users"]:
            cells = []
            for s in sides:
                v, r = tps(s, u), tps(ref, u) if ref else None
                cell = fmt(v)
                if ref is not None and s is not ref and v is not None and r:
                    cell += f" ({v / r:.2f}×)"
                cells.append(cell)
            lines.append(f"| {u} | " + " | ".join(cells) + " |")
    lines += together_table(results)
    notes = [
        f"- {s['label']}: ready after {fmt(s.get('ready_s'), 0)} s; `{s['command']}`"
        + (f"; ERROR: {s['error'].splitlines()[0][:200]}" if s.get("error") else "")
        for s in results["sides"]
    ]
    lines += ["", "Sides:", "", *notes, ""]
    (out / "results.md").write_text("\n".join(lines), encoding="utf-8")


def together_table(results: dict) -> list[str]:
    """Markdown (``--together``): per level, each side's tok/s over its slices and its ratio to the
    first ``--ours-off`` side, else to the first side (geometric mean over passes, range); then
    the same per second the hypervisor left the machine (a slice's seconds times 1 - its steal)."""
    sides = [s for s in results["sides"] if any("pass" in lv for lv in s["levels"])]
    if not sides:
        return []
    ref = next((s for s in sides if s.get("drafter_off")), sides[0])  # an --ours-off side, else the first
    m = results["meta"]
    lines = [
        "",
        f"Served together, the load moved between them in slices of {m['duration_s']:g} s ({m.get('slices')} "
        f"passes per level, the order reversed every other pass); tok/s = tokens ÷ seconds over a side's "
        f"slices; × = ratio to {ref['label']}, geometric mean over passes (range). Second table: seconds "
        "counted net of the CPU time the hypervisor took (steal).",
    ]
    for net in (False, True):
        lines += ["", "| users | " + " | ".join(s["label"] for s in sides) + " |", "|---|" + "---|" * len(sides)]
        for u in m["users"]:
            ref_by_pass = _per_pass(ref, u, net)
            cells = []
            for s in sides:
                by_pass = _per_pass(s, u, net)
                cell = fmt(_tokens_over_seconds(by_pass))
                ratios = [
                    (by_pass[k][0] / by_pass[k][1]) / (ref_by_pass[k][0] / ref_by_pass[k][1])
                    for k in by_pass
                    if k in ref_by_pass and by_pass[k][1] and ref_by_pass[k][0]
                ]
                if s is not ref and ratios:
                    gm = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
                    cell += f" ({gm:.2f}×, {min(ratios):.2f}–{max(ratios):.2f})"
                cells.append(cell)
            lines.append(f"| {u} | " + " | ".join(cells) + " |")
    return lines


def _per_pass(side: dict, users: int, net_of_steal: bool = False) -> dict[int, tuple[float, float]]:
    """pass -> (completion tokens, client seconds) of a side's slices at one level; the seconds
    times (1 - the slice's steal) with ``net_of_steal``."""
    out = {}
    for lv in side["levels"]:
        raw = lv.get("raw") or {}
        if lv.get("users") == users and "pass" in lv and not lv.get("error"):
            wall = float(raw.get("wall_s") or 0)
            if net_of_steal:
                wall *= 1 - (lv.get("steal_percent") or 0) / 100
            out[lv["pass"]] = (float(raw.get("completion_tokens") or 0), wall)
    return out


def _tokens_over_seconds(by_pass: dict[int, tuple[float, float]]) -> float | None:
    wall = sum(w for _, w in by_pass.values())
    return sum(t for t, _ in by_pass.values()) / wall if wall else None
