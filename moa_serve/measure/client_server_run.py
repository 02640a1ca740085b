"""The harness of ``moa cs-bench``: one in-process server (``client_server_stack``) reached through
``netem`` proxies, device drafters and API-only run prompt by prompt over each profile, then over a
link cut mid-answer."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from moa_serve.app import state
from moa_serve.app.http import create_app
from moa_serve.client import DeviceDrafter, LinkPolicy, RemoteGenerator, Transport
from moa_serve.client.generate import AUTO
from moa_serve.client_server.fingerprint import model_fingerprint, tokenizer_fingerprint
from moa_serve.drafter.checkpoint import load_draft_vocab
from moa_serve.drafter.registry import load_feature_source
from moa_serve.drafter.spec import DrafterSpec, parse_branchings
from moa_serve.drafter.training.data import prompt_ids
from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.measure.client_server_report import write_report
from moa_serve.measure.client_server_stack import LocalStack, UvicornThread
from moa_serve.measure.netem import PROFILES, netem_proxy
from moa_serve.measure.questions import load_questions
from moa_serve.measure.target import LoadedTarget, load_target
from moa_serve.protocol import DraftResult
from moa_serve.sampling import GREEDY
from moa_serve.verifier.torch.runner import RunnerOptions, TorchTargetRunner

REPO_ROOT = Path(__file__).resolve().parents[2]
CKPT = REPO_ROOT / "drafter" / "checkpoints" / "smollm2-135m-instruct"
DEFAULT_DRAFTERS = ",".join(f"{CKPT}-{k}" for k in ("moa", "eagle", "independent"))
DEFAULT_PROFILES = "local,wan,5g,4g"
DEFAULT_CATEGORIES = "writing,math_reasoning,coding,qa"
API_ONLY = "api-only"
MATH_CATEGORIES = ("math", "math_reasoning")
PORTS = (8300, 8400)


class SlowedProposer:
    """A device proposer whose every ``propose`` takes ``factor`` times its measured time (the
    extra as a sleep): the device has 1/factor of the server's compute."""

    def __init__(self, inner, factor: float):
        self.inner, self.factor = inner, float(factor)
        self.busy_s = 0.0  # drafting compute, before the stretch

    def __getattr__(self, name):  # set_tree, stats, sessions...: the inner proposer's
        return getattr(self.inner, name)

    def propose(self, reqs):
        t0 = time.perf_counter()
        out = self.inner.propose(reqs)
        dt = time.perf_counter() - t0
        self.busy_s += dt
        if self.factor > 1.0:
            time.sleep((self.factor - 1.0) * dt)
        return out


class NoDrafter:
    """API-only: proposes nothing, so every round asks the server for its next token (K = 0);
    offline it can write nothing."""

    needs_features = False

    def propose(self, reqs):
        return [DraftResult(r.session_id, []) for r in reqs]

    def release(self, session_id: str) -> None:
        pass


def server_stack(target: LoadedTarget, drafter: str | None, max_model_len: int, model_name: str) -> LocalStack:
    """The Router's client-server stack for one drafter's feature head (None: no features), over
    the already loaded ``target``."""
    # no prefix caching: methods sharing a stack run the same prompts one after the other, and a
    # later one must not find the prompt already prefilled by an earlier one
    runner = TorchTargetRunner(
        target.model,
        target.dtype,
        "cpu",
        max_sessions=16,
        max_model_len=max_model_len,
        features=load_feature_source(drafter),
        draft_vocab=load_draft_vocab(drafter) if drafter else None,
        options=RunnerOptions(prefix_caching=False),
    )
    return LocalStack(runner, target.tokenizer, target.stops, model_name=model_name, drafter=drafter)


def plain_engine(target: LoadedTarget, max_model_len: int) -> SpeculativeEngine:
    """Plain decoding of the loaded ``target`` on the CPU, one session: the reference outputs."""
    runner = TorchTargetRunner(target.model, target.dtype, "cpu", 1, max_model_len, None)
    return SpeculativeEngine(runner, None, target.tokenizer, target.stops, 1)


class _Method:
    def __init__(self, name: str, kind: str, checkpoint: str | None, device, server, branching=None):
        self.name, self.kind, self.checkpoint, self.device, self.server = name, kind, checkpoint, device, server
        self.branching = branching  # tree drafts: a TreeShape (None or empty: chains)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The final answer of a text: the first number after the last "####" (GSM8K), else the last
    number; normalised ("1,000.50" -> "1000.5")."""
    found = _NUM.findall(text.rsplit("####", 1)[1])[:1] if "####" in text else _NUM.findall(text)[-1:]
    if not found:
        return None
    s = found[0].replace(",", "")
    neg, s = s.startswith("-"), s.lstrip("-")
    whole, _, frac = s.partition(".")
    whole, frac = whole.lstrip("0") or "0", frac.rstrip("0")
    s = f"{whole}.{frac}" if frac else whole
    return f"-{s}" if neg and s != "0" else s


def _generator(method: _Method, url: str, args):
    t = Transport(url, timeout_s=args.timeout, backoff_s=0.05)
    gen = RemoteGenerator(
        method.device,
        t,
        num_speculative_tokens=args.num_speculative_tokens,
        adaptive_k=not args.fixed_k,
        feature_codec=args.feature_codec,
        branching=method.branching,
        link=LinkPolicy(
            offline="degrade",
            reconnect_backoff_s=0.05,
            max_backoff_s=0.2,
            final_reconnects=2,
            offline_chunk=args.offline_chunk,
        ),
    )
    return gen, t


def _lookup_drafts(method: _Method) -> int:
    """Draft tokens a hybrid device has taken from prompt lookup so far (0: no lookup)."""
    return method.device.proposer.stats.get("lookup_drafts", 0) if method.device.uses_lookup else 0


@dataclass
class _ServerTarget(LoadedTarget):
    """The server's target, loaded once: every stack and the plain-decoding reference share it."""

    plain: SpeculativeEngine  # plain target decoding: the reference outputs

    @classmethod
    def load(cls, args) -> "_ServerTarget":
        t = load_target(args.target, args.dtype, "cpu", "auto", args.packed_weights, args.matmul_precision)
        return cls(t.path, t.model, t.dtype, t.tokenizer, t.stops, t.packing, plain_engine(t, args.max_model_len))

    def stack(self, drafter: str | None, args):
        return server_stack(self, drafter, args.max_model_len, args.target)


def _check_args(args) -> list[str]:
    """The profiles to run; a ValueError naming the option that is out of range."""
    profiles = [p for p in args.profiles.split(",") if p]
    for p in profiles + [args.cut_profile]:
        if p not in PROFILES:
            raise ValueError(f"--profiles: unknown profile {p!r}; choose from {', '.join(PROFILES)}")
    if args.max_new_tokens < 2:
        raise ValueError("--max-new-tokens must be >= 2")
    if not 0 < args.cut_after_tokens < args.max_new_tokens:
        raise ValueError("--cut-after-tokens must be in [1, --max-new-tokens)")
    if args.offline_chunk < 1:
        raise ValueError("--offline-chunk must be >= 1")
    if args.device_slowdown < 1.0:
        raise ValueError("--device-slowdown must be >= 1")
    return profiles


def _method_name(spec: DrafterSpec, shape, device, methods: list[_Method]) -> str:
    name = {"moa": "MoA", "eagle": "EAGLE-style", "independent": "independent"}.get(spec.kind, spec.kind)
    if device.uses_lookup:
        name = f"lookup + {'outputs + ' if spec.outputs else ''}{name}"
    if any(m.name == name and m.branching == shape for m in methods):  # the same kind twice: say which checkpoint
        name = f"{name} ({'/'.join(Path(spec.checkpoint).parts[-2:])})"
    if shape:
        name = f"{name}, tree {shape if shape == AUTO else shape.label}"
    return name


def _build_methods(args, target: _ServerTarget) -> list[_Method]:
    """A device drafter per ``--drafter`` checkpoint and ``--branching`` shape, each with the server
    stack of its feature head, then API-only."""
    no_features = target.stack(None, args)
    dtype_name = str(target.dtype).removeprefix("torch.")
    methods: list[_Method] = []
    checkpoints = [d for d in (args.drafter or "").split(",") if d and d.lower() != "none"]
    stacks: dict[str, object] = {}  # one per feature head: a hybrid shares its checkpoint's
    shapes = parse_branchings(args.branching, keywords=(AUTO,))
    for ck, shape in ((ck, shape) for ck in checkpoints for shape in shapes):
        spec = DrafterSpec.parse(ck)
        dev = DeviceDrafter.load(ck, args.target, dtype_name, args.max_model_len)
        model = SlowedProposer(dev.model, args.device_slowdown)
        dev.proposer = SlowedProposer(dev.proposer, args.device_slowdown) if dev.uses_lookup else model
        dev.model = model
        fp = dev.fingerprints["drafter"]
        if dev.needs_features and fp not in stacks:
            stacks[fp] = target.stack(spec.checkpoint, args)
        srv = stacks[fp] if dev.needs_features else no_features
        methods.append(_Method(_method_name(spec, shape, dev, methods), spec.kind, ck, dev, srv, shape))
    if not args.no_api_only:
        ref_dev = methods[0].device if methods else None
        prints = dict(ref_dev.fingerprints) if ref_dev is not None else None
        if prints is None:  # no drafter at all: the device's target fingerprints from a borrowed-parts load
            prints = {"target": model_fingerprint(target.model), "tokenizer": tokenizer_fingerprint(target.tokenizer)}
        prints["drafter"] = None
        methods.append(
            _Method(
                "API-only", API_ONLY, None, DeviceDrafter(NoDrafter(), target.tokenizer, prints, API_ONLY), no_features
            )
        )
    if not methods:
        raise ValueError("nothing to run: no --drafter and --no-api-only")
    return methods


def _prompts(args, questions: list[dict], tok) -> list[dict]:
    prompts = []
    for q in questions:
        ids = (
            prompt_ids(tok, [{"role": "user", "content": q["turns"][0]}])
            if args.prompt_format == "chat"
            else tok.encode(q["turns"][0])
        )
        ids = ids[-(args.max_model_len - args.max_new_tokens - 1) :]
        ref = q.get("reference")  # a math answer's text; other categories' may be lists (RAG: names)
        ref = ref[0] if isinstance(ref, list) and ref and isinstance(ref[0], str) else None
        prompts.append(
            {
                "question_id": q.get("question_id"),
                "category": q.get("category", "all"),
                "ids": ids,
                "reference_answer": final_number(ref) if ref else None,
            }
        )
    return prompts


def _warm_up(target: _ServerTarget, methods: list[_Method], prompts: list[dict], port: int, args) -> None:
    """Allocator, kernels, the first connection: outside the measurement."""
    target.plain.generate([prompts[0]["ids"]], 4, GREEDY, 1)
    for m in methods:
        m.server.install()
        gen, t = _generator(m, f"http://127.0.0.1:{port}", args)
        gen.generate(prompts[0]["ids"], 4)
        t.close()


def _plain_runs(target: _ServerTarget, prompts: list[dict], args) -> list[dict]:
    """Plain target decoding: the reference outputs (kept in ``prompts``) and its in-process speed."""
    runs = []
    for p in prompts:
        res = target.plain.generate([p["ids"]], args.max_new_tokens, GREEDY, 1)[0]
        p["target_ids"] = list(res.token_ids)
        p["target_text"] = target.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        runs.append({"tokens": res.num_tokens, "elapsed_s": res.elapsed_s})
    return runs


def _profile_run(m: _Method, prof: str, pi: int, p: dict, upstream, args):
    """One prompt of one method over the link ``prof``: (result, its row)."""
    m.server.install()
    slowed = m.device.proposer if isinstance(m.device.proposer, SlowedProposer) else None
    busy0 = slowed.busy_s if slowed else 0.0
    lookup0 = _lookup_drafts(m)
    with netem_proxy(prof, upstream, seed=args.seed + pi) as px:
        gen, t = _generator(m, f"http://{px.host}:{px.port}", args)
        try:
            res = gen.generate(p["ids"], args.max_new_tokens)
        finally:
            t.close()
    row = {
        "profile": prof,
        "method": m.name,
        "question_id": p["question_id"],
        "category": p["category"],
        "tokens": res.num_tokens,
        "elapsed_s": res.elapsed_s,
        "rounds": res.rounds,
        "verified_tokens": res.verified_tokens,
        "server_calls": res.server_calls,
        "retries": res.retries,
        "bytes_up": res.bytes_up,
        "bytes_down": res.bytes_down,
        "drafted_tokens": res.drafted_tokens,
        "accepted_tokens": res.accepted_tokens,
        "finish_reason": res.finish_reason,
        "identical": res.token_ids == p["target_ids"],
        "k": res.k,
        "device_draft_s": (slowed.busy_s - busy0) if slowed else 0.0,
        "lookup_drafted_tokens": _lookup_drafts(m) - lookup0,
    }
    return res, row


def _cut_run(m: _Method, pi: int, p: dict, upstream, port: int, tok, args) -> dict:
    """One prompt of one method over ``--cut-profile``, the link cut after ``--cut-after-tokens``
    verified tokens: how long the offline continuation matches the target's own."""
    m.server.install()
    with netem_proxy(args.cut_profile, upstream, seed=args.seed + pi) as px:
        gen, t = _generator(m, f"http://{px.host}:{px.port}", args)
        run = gen.start(p["ids"], args.max_new_tokens)
        cut = False
        try:
            for _ in run:
                if not cut and run.generated >= args.cut_after_tokens:
                    px.cut("reset")
                    cut = True
        finally:
            t.close()
        res = run.result()
    if run.sid and not run.server_finished:
        # the cut link never carried the client's DELETE: free the session out of band, as
        # its idle TTL would (else cut sessions pile up in the verifier's slots)
        direct = Transport(f"http://127.0.0.1:{port}", timeout_s=args.timeout)
        try:
            direct.delete(run.sid)
        finally:
            direct.close()
    ref, v = p["target_ids"], res.verified_tokens
    offline = res.token_ids[v:]
    target_cont = ref[v:]
    match = common_prefix(offline, target_cont)
    row = {
        "method": m.name,
        "question_id": p["question_id"],
        "category": p["category"],
        "cut": cut,
        "verified_tokens": v,
        "verified_identical": res.token_ids[:v] == ref[:v],
        "offline_tokens": len(offline),
        "target_continuation_tokens": len(target_cont),
        "tokens_until_divergence": match,
        "full_match": bool(offline) and offline == target_cont,
        "finish_reason": res.finish_reason,
        "disconnections": res.disconnections,
        "offline_text": tok.decode(offline, skip_special_tokens=True)[:300],
        "target_continuation_text": tok.decode(target_cont, skip_special_tokens=True)[:300],
    }
    if p["category"] in MATH_CATEGORIES:
        ans = final_number(res.text)
        tgt = final_number(p["target_text"])
        row.update(
            {
                "answer": ans,
                "target_answer": tgt,
                "reference_answer": p["reference_answer"],
                "answer_matches_target": ans is not None and ans == tgt,
                "answer_matches_reference": ans is not None and ans == p["reference_answer"],
            }
        )
    return row


def run_cs_bench(args) -> dict:
    profiles = _check_args(args)
    cats = [c for c in args.categories.split(",") if c] if args.categories else None
    questions = load_questions(args.questions, args.limit, per_category=args.per_category, categories=cats)
    if not questions:
        raise ValueError(f"--questions: no questions in {args.questions} for categories {cats}")
    if args.threads:
        torch.set_num_threads(args.threads)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    # the server: the target once, a stack per feature head
    target = _ServerTarget.load(args)
    tok = target.tokenizer
    methods = _build_methods(args, target)
    prompts = _prompts(args, questions, tok)

    http = UvicornThread(create_app(), PORTS)
    upstream = ("127.0.0.1", http.port)
    try:
        _warm_up(target, methods, prompts, http.port, args)
        plain_runs = _plain_runs(target, prompts, args)
        n_runs = len(profiles) * len(prompts) * len(methods) + (
            len(prompts) * len(methods) if args.cut_after_tokens else 0
        )
        bar = tqdm(total=n_runs, desc="cs-bench", dynamic_ncols=True)
        per_run: list[dict] = []
        for prof in profiles:
            for pi, p in enumerate(prompts):
                for m in methods:
                    res, row = _profile_run(m, prof, pi, p, upstream, args)
                    per_run.append(row)
                    bar.update(1)
                    bar.set_postfix_str(
                        f"{prof} {m.name} {res.tokens_per_s:.1f}tok/s tau={res.mean_accepted_length:.2f}"
                    )
            write_report(
                args, methods, profiles, prompts, plain_runs, per_run, [], partial=True, packing=target.packing
            )

        cut_runs: list[dict] = []
        for pi, p in enumerate(prompts):
            for m in methods:
                row = _cut_run(m, pi, p, upstream, http.port, tok, args)
                cut_runs.append(row)
                bar.update(1)
                bar.set_postfix_str(
                    f"cut {m.name} {row['tokens_until_divergence']}/{row['target_continuation_tokens']} tokens match"
                )
        bar.close()
        return write_report(
            args, methods, profiles, prompts, plain_runs, per_run, cut_runs, partial=False, packing=target.packing
        )
    finally:
        http.stop()
        state.install(cs=None, frontend=None)
