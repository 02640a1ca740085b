"""``moa fidelity`` — what a ``matmul_precision`` costs in fidelity, against ``highest``.

For each precision (``low``: 8-bit activations times the GGUF's integers; ``medium``: bfloat16
products; ``highest``: float32 products of the same de-quantized weights), the target alone (the
engine of ``moa generate --drafter none``) is run on

* **greedy agreement**: held-out Spec-Bench questions (first turns, chat template, no system
  prompt), ``--max-new-tokens`` each; per prompt the index of the first token that differs from
  ``highest``'s greedy output (None: identical);
* **perplexity**: held-out text (by default the source passages of Spec-Bench's ``summarization``
  and ``rag`` questions, none of them among the greedy prompts), raw text without a template, the
  first ``--ppl-tokens`` tokens of each; each token scored given the ones before it in one
  teacher-forced forward of the verifier's model (its KV cache, its packed kernels). Also the share
  of positions whose top-1 token is ``highest``'s.

Writes ``--out`` (JSON, every prompt's result) and the same name with ``.md`` (the table).
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

from moa_serve.cli_args import DEFAULT_TARGET
from moa_serve.commands.bench import DEFAULT_QUESTIONS, load_questions, printing_command
from moa_serve.drafter.training.data import prompt_ids
from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.kernels import cpu as cpu_kernels
from moa_serve.kernels.packed import MATMUL_PRECISIONS
from moa_serve.model.kv_cache import PackedBatch
from moa_serve.sampling import GREEDY

REFERENCE = "highest"


def first_divergence(ref: list[int], other: list[int]) -> int | None:
    """The index of the first token where ``other`` differs from ``ref`` (one ending where the
    other goes on counts as differing there); None when they are identical."""
    for i, (a, b) in enumerate(zip(ref, other)):
        if a != b:
            return i
    return None if len(ref) == len(other) else min(len(ref), len(other))


def agreement(refs: list[list[int]], outs: list[list[int]]) -> dict:
    """Greedy agreement of ``outs`` with ``refs``, prompt by prompt."""
    firsts = [first_divergence(r, o) for r, o in zip(refs, outs)]
    diverged = [f for f in firsts if f is not None]
    # identical prompts count with their whole length: tokens that agree before the first difference
    prefix = [len(r) if f is None else f for r, f in zip(refs, firsts)]
    return {
        "prompts": len(refs),
        "identical": len(refs) - len(diverged),
        "first_divergence": firsts,
        "mean_first_divergence": round(statistics.fmean(diverged), 2) if diverged else None,
        "median_first_divergence": statistics.median(diverged) if diverged else None,
        "mean_agreeing_prefix": round(statistics.fmean(prefix), 2) if prefix else None,
    }


@torch.inference_mode()
def score_text(engine: SpeculativeEngine, tokens: list[int]) -> tuple[float, list[int]]:
    """Summed negative log-likelihood of ``tokens[1:]``, each given the tokens before it, and the
    top-1 token at each of those positions: one forward of the verifier's model over the whole
    text in its KV-cache slot 0 (the engine's runner must hold no session; it is left unusable for
    prefix reuse, so score after generating)."""
    runner = engine.verifier
    if runner.sessions:
        raise ValueError("score_text: the engine's verifier still holds sessions")
    if len(tokens) < 2 or len(tokens) > runner.max_model_len:
        raise ValueError(f"a scored text needs 2..{runner.max_model_len} tokens, got {len(tokens)}")
    runner.retained.clear()  # slot 0's K/V is overwritten below
    batch = PackedBatch(runner.cache, [0], [0], [len(tokens)], runner.device, kernel=runner.attention_kernel)
    ids = torch.tensor(tokens, device=runner.device)
    hidden = runner.model.forward_packed(ids, batch)[:-1]
    logits = runner.model.lm_head(hidden).float()
    logp = torch.log_softmax(logits, dim=-1)
    nll = -logp.gather(1, ids[1:, None]).sum().item()
    return nll, logits.argmax(-1).tolist()


def held_out_texts(path: str, categories: list[str], n: int, skip: set) -> list[dict]:
    """First turns of ``categories`` questions not in ``skip`` (question ids), ``n`` of them spread
    over the categories in turn."""
    per = {c: [q for q in load_questions(path, categories=[c]) if q.get("question_id") not in skip] for c in categories}
    out = []
    while len(out) < n and any(per.values()):
        for c in categories:
            if per[c] and len(out) < n:
                out.append(per[c].pop(0))
    return out


def run_fidelity(args) -> dict:
    precisions = [p for p in args.precisions.split(",") if p]
    unknown = set(precisions) - set(MATMUL_PRECISIONS)
    if unknown or REFERENCE not in precisions:
        raise ValueError(
            f"--precisions: a comma-separated subset of {','.join(MATMUL_PRECISIONS)} that "
            f"includes {REFERENCE} (the reference); got {args.precisions!r}"
        )
    precisions = [REFERENCE] + [p for p in precisions if p != REFERENCE]
    if args.threads:
        torch.set_num_threads(args.threads)
    questions = load_questions(args.questions, args.limit, args.per_category)
    if not questions:
        raise ValueError(f"no questions in {args.questions}")
    texts = held_out_texts(
        args.questions,
        [c for c in args.ppl_categories.split(",") if c],
        args.ppl_texts,
        {q.get("question_id") for q in questions},
    )
    if not texts:
        raise ValueError(f"--ppl-categories {args.ppl_categories!r}: no questions left to score in {args.questions}")
    runs, ref_tokens, ref_top1 = {}, None, None
    for prec in precisions:
        t0 = time.perf_counter()
        engine = SpeculativeEngine.load(
            args.target, None, "float32", "cpu", max_sessions=1, max_model_len=args.max_model_len, matmul_precision=prec
        )
        tok = engine.tokenizer
        keep = args.max_model_len - args.max_new_tokens - 1
        outs = [
            engine.generate(
                [prompt_ids(tok, [{"role": "user", "content": q["turns"][0]}])[-keep:]], args.max_new_tokens, GREEDY, 1
            )[0].token_ids
            for q in questions
        ]
        nll, n_scored, top1 = 0.0, 0, []
        for t in texts:
            ids = tok.encode(t["turns"][0])[: args.ppl_tokens]
            s, best = score_text(engine, ids)
            nll, n_scored, top1 = nll + s, n_scored + len(ids) - 1, top1 + best
        if prec == REFERENCE:
            ref_tokens, ref_top1 = outs, top1
        same_top1 = sum(a == b for a, b in zip(ref_top1, top1))
        runs[prec] = {
            "matmul_precision": prec,
            "packing": _plain(engine.verifier.packing),
            "greedy": agreement(ref_tokens, outs),
            "tokens": outs,
            "perplexity": round(math.exp(nll / n_scored), 4) if n_scored else None,
            "scored_tokens": n_scored,
            "top1_same_as_reference": round(same_top1 / len(top1), 4) if top1 else None,
            "elapsed_s": round(time.perf_counter() - t0, 1),
        }
        del engine
    ref_ppl = runs[REFERENCE]["perplexity"]
    for r in runs.values():
        r["perplexity_vs_reference"] = round(r["perplexity"] / ref_ppl, 4) if ref_ppl and r["perplexity"] else None
    result = {
        "runs": [runs[p] for p in precisions],
        "config": {
            "target": args.target,
            "reference": REFERENCE,
            "questions": args.questions,
            "greedy_prompts": [q.get("question_id") for q in questions],
            "max_new_tokens": args.max_new_tokens,
            "ppl_texts": [t.get("question_id") for t in texts],
            "ppl_categories": args.ppl_categories,
            "ppl_tokens": args.ppl_tokens,
            "dtype": "float32",
            "threads": torch.get_num_threads(),
            "bf16_products": cpu_kernels.bf16_dot_available(),
            "machine": cpu_name(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    return result


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _plain(packing: dict) -> dict:
    return {k: v for k, v in packing.items() if isinstance(v, (str, int, float, bool)) or v is None}


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


cmd_fidelity = printing_command(run_fidelity, markdown)


def register(sub) -> None:
    p = sub.add_parser("fidelity", help="greedy agreement and perplexity of each matmul_precision against highest")
    p.add_argument("--target", default=DEFAULT_TARGET, help="a target with a GGUF (the packed CPU kernels)")
    p.add_argument(
        "--precisions",
        default="low,medium,highest",
        help="comma-separated matmul precisions; highest is the reference and must be among them",
    )
    p.add_argument("--questions", default=DEFAULT_QUESTIONS, help="Spec-Bench-format JSONL (held-out prompts)")
    p.add_argument("--limit", type=int, default=0, help="at most N greedy prompts (0 = all)")
    p.add_argument("--per-category", type=int, default=1, help="at most N greedy prompts per category (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--ppl-categories",
        default="summarization,rag",
        help="categories whose first turns (not used as greedy prompts) are the perplexity texts",
    )
    p.add_argument("--ppl-texts", type=int, default=10, help="perplexity texts")
    p.add_argument("--ppl-tokens", type=int, default=512, help="tokens scored per text (its first ones)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--out", default="fidelity.json")
    p.set_defaults(func=cmd_fidelity)
