"""The report of ``moa bench``: τ, tokens/s, speed-up over vanilla and greedy identity per method and
category, written as JSON, a Markdown table and a bar chart."""

from __future__ import annotations

import json
import time
from pathlib import Path


def _summ(turns: list[dict], vanilla: list[dict] | None) -> dict:
    tokens = sum(t["tokens"] for t in turns)
    rounds = sum(t["rounds"] for t in turns)
    elapsed = sum(t["elapsed_s"] for t in turns)
    out = {
        "turns": len(turns),
        "tokens": tokens,
        "rounds": rounds,
        "elapsed_s": round(elapsed, 3),
        "mean_accepted_length": round(tokens / rounds, 4) if rounds else 0.0,
        "tokens_per_s": round(tokens / elapsed, 3) if elapsed else 0.0,
        # where a round's time goes: the drafter's K steps vs the target's verify (+ features)
        "draft_ms_per_round": round(1000 * sum(t.get("draft_s", 0.0) for t in turns) / rounds, 2) if rounds else 0.0,
        "verify_ms_per_round": round(1000 * sum(t.get("verify_s", 0.0) for t in turns) / rounds, 2) if rounds else 0.0,
    }
    if vanilla is not None:
        vt = sum(t["tokens"] for t in vanilla) / max(1e-9, sum(t["elapsed_s"] for t in vanilla))
        out["speedup"] = round(out["tokens_per_s"] / vt, 4) if vt else 0.0
        same = [t["identical"] for t in turns if t["identical"] is not None]
        out["greedy_identical_fraction"] = round(sum(same) / len(same), 4) if same else None
    return out


def write_results(args, methods, questions, partial: bool) -> dict:
    """Writes ``--out`` (JSON), its ``.md`` table and, once the run is whole, its ``.png`` chart."""
    van = methods[0]
    cats = list(dict.fromkeys(t["category"] for t in van.per_turn))
    runs = []
    for m in methods:
        ref = van.per_turn if m is not van else None
        entry = {"method": m.name, "num_speculative_tokens": m.k, **_summ(m.per_turn, ref)}
        entry["per_category"] = {
            c: _summ(
                [t for t in m.per_turn if t["category"] == c],
                [t for t in ref if t["category"] == c] if ref is not None else None,
            )
            for c in cats
        }
        runs.append(entry)
    main = runs[1] if len(runs) > 1 else runs[0]
    result = {
        "mean_accepted_length": main["mean_accepted_length"],
        "speedup": main.get("speedup", 1.0),
        "greedy_identical_fraction": main.get("greedy_identical_fraction", 1.0),
        "tokens_per_s": main["tokens_per_s"],
        "vanilla_tokens_per_s": runs[0]["tokens_per_s"],
        "per_category": main["per_category"],
        "method": main["method"],
        "runs": runs,
        "config": {
            "target": args.target,
            "drafter": args.drafter,
            "questions": args.questions,
            "num_questions": len(questions),
            "limit": args.limit,
            "per_category": args.per_category,
            "max_new_tokens": args.max_new_tokens,
            "num_speculative_tokens": str(args.num_speculative_tokens),
            "branching": str(getattr(args, "branching", "") or ""),
            "temperature": args.temperature,
            "dtype": args.dtype,
            "device": args.device,
            "system_prompt": getattr(args, "system_prompt", "none"),
            "backend": getattr(args, "backend", "torch"),
            "threads": args.threads,
            "packed_weights": getattr(args, "packed_weights", "auto"),
            "matmul_precision": getattr(args, "matmul_precision", "highest"),
            "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto"),
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "questions_done": len({t["question_id"] for t in van.per_turn}),
            "partial": partial,
        },
        "per_turn": {m.name: m.per_turn for m in methods},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    if not partial:
        plot(result, out.with_suffix(".png"))
    return result


def markdown(result: dict) -> str:
    runs = result["runs"]
    cats = list(runs[0]["per_category"])
    cfg = result["config"]
    lines = [
        f"Target `{cfg['target']}`, {cfg['questions_done']} of {cfg['num_questions']} questions, "
        f"max {cfg['max_new_tokens']} new tokens, "
        f"temperature {cfg['temperature']}, {cfg['dtype']} on {cfg['device']}, "
        f"backend {cfg.get('backend', 'torch')}.",
        "",
        "| method | K | τ | tok/s | speed-up | greedy identical | draft / verify ms per round |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in runs:
        ident = r.get("greedy_identical_fraction")
        lines.append(
            f"| {r['method']} | {r['num_speculative_tokens']} | {r['mean_accepted_length']:.2f} | "
            f"{r['tokens_per_s']:.1f} | {r.get('speedup', 1.0):.2f}× | "
            f"{'–' if ident is None else f'{ident:.2f}'} | "
            f"{r.get('draft_ms_per_round', 0):.1f} / {r.get('verify_ms_per_round', 0):.1f} |"
        )
    lines += [
        "",
        "τ / speed-up per category:",
        "",
        "| category | " + " | ".join(r["method"] for r in runs[1:]) + " |",
        "| --- |" + " ---: |" * (len(runs) - 1),
    ]
    for c in cats:
        cells = [
            f"{r['per_category'][c]['mean_accepted_length']:.2f} / {r['per_category'][c].get('speedup', 1):.2f}×"
            for r in runs[1:]
        ]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    runs = result["runs"][1:] or result["runs"]
    cats = list(runs[0]["per_category"]) + ["overall"]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, len(cats) * 0.9), 8), sharex=True)
    width = 0.8 / len(runs)
    x = np.arange(len(cats))
    for i, r in enumerate(runs):
        tau = [r["per_category"][c]["mean_accepted_length"] for c in cats[:-1]] + [r["mean_accepted_length"]]
        sp = [r["per_category"][c].get("speedup", 1.0) for c in cats[:-1]] + [r.get("speedup", 1.0)]
        axes[0].bar(x + i * width, tau, width, label=r["method"])
        axes[1].bar(x + i * width, sp, width, label=r["method"])
    axes[0].set_ylabel("τ (tokens / verify round)")
    axes[1].set_ylabel("speed-up vs vanilla")
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[1].set_xticks(x + 0.4 - width / 2, cats, rotation=45, ha="right")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
