"""The harness of ``moa fidelity``: the target alone at each ``matmul_precision``, greedy agreement
with ``highest`` and perplexity over held-out text."""

from __future__ import annotations

import math
import platform
import statistics
import time
from pathlib import Path

import torch

from moa_serve.drafter.training.data import prompt_ids
from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.kernels import cpu as cpu_kernels
from moa_serve.kernels.packed import MATMUL_PRECISIONS
from moa_serve.measure.fidelity_report import write_results
from moa_serve.measure.questions import load_questions
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
    write_results(result, Path(args.out))
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
