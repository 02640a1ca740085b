"""The report of ``moa fidelity``: per precision the greedy agreement and perplexity against the
reference, written as JSON and a Markdown table."""

from __future__ import annotations

import json
from pathlib import Path


def markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"Target `{cfg['target']}` alone, greedy, against `matmul_precision: {cfg['reference']}`: "
        f"{len(cfg['greedy_prompts'])} prompts x {cfg['max_new_tokens']} new tokens; perplexity over "
        f"{len(cfg['ppl_texts'])} held-out texts ({cfg['ppl_categories']}, first {cfg['ppl_tokens']} tokens "
        f"each). bf16 products on this CPU: {'yes' if cfg['bf16_products'] else 'no (medium = highest)'}.",
        "",
        "| matmul_precision | prompts identical | first different token: mean / median (differing prompts) | "
        "agreeing prefix, mean (all prompts) | perplexity | ÷ highest | top-1 same as highest |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["runs"]:
        g = r["greedy"]
        first = (
            "–"
            if g["mean_first_divergence"] is None
            else f"{g['mean_first_divergence']:g} / {g['median_first_divergence']:g}"
        )
        lines.append(
            f"| `{r['matmul_precision']}` | {g['identical']} / {g['prompts']} | {first} | "
            f"{g['mean_agreeing_prefix']:g} | {r['perplexity']:.3f} | {r['perplexity_vs_reference']:.4f} | "
            f"{100 * r['top1_same_as_reference']:.2f} % |"
        )
    others = result["runs"][1:]
    lines += [
        "",
        "First token that differs from `highest`'s, per prompt (– = identical):",
        "",
        "| question | " + " | ".join(f"`{r['matmul_precision']}`" for r in others) + " |",
        "| ---: |" + " ---: |" * len(others),
    ]
    for i, qid in enumerate(cfg["greedy_prompts"]):
        cells = [
            "–" if r["greedy"]["first_divergence"][i] is None else str(r["greedy"]["first_divergence"][i])
            for r in others
        ]
        lines.append(f"| {qid} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_results(result: dict, out: Path) -> None:
    """Writes ``out`` (JSON, every prompt's result) and its ``.md`` table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
