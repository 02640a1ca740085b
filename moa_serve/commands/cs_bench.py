"""``moa cs-bench`` — client-server mode across emulated networks, and on disconnection.

One in-process server (the Router's stack without Ray: ``RoundService`` over a float32
``TorchTargetRunner`` + ``ClientSessions`` + the FastAPI app, served by uvicorn on 127.0.0.1),
reached by the device through ``moa_serve.commands.netem`` proxies (``local``, ``wan``, ``5g``, ``4g``).
The target's weights are loaded once; the verifier's *feature head* is the one of the drafter
under test (the server computes MoA's K/V features with MoA's head, EAGLE-style's hidden states
for EAGLE; independent and API-only need none), so the server's state is switched between
drafters — one server, one HTTP listener, one set of target weights.

Methods: each ``--drafter`` checkpoint (MoA, EAGLE-style, independent) as a device drafter, and
**API-only**: no drafter, the device asks the server for the next token every round (K = 0).
For every profile, prompt and method (methods interleaved prompt by prompt): tokens/s, ms per
token, server calls per 100 tokens, bytes up/down per token (HTTP bytes as the client counts
them), τ (tokens committed per answered round, prefill round included) and whether the greedy
output equals plain target decoding (computed once per prompt in the same process).

Device/server compute ratio (the paper: the server has 3x the client's FLOPS): on this machine
both sides share the same CPU, so the device is slowed in wall time: every ``propose`` call of
the device drafter is followed by a sleep of ``(device_slowdown - 1)`` times its measured
duration (``--device-slowdown``, default 3). Sleeping burns no CPU, so the server is not slowed.

Disconnection: per prompt and method, over ``--cut-profile``, the link is cut (``reset``: every
connection RST, new ones refused) as soon as ``--cut-after-tokens`` tokens are verified; the
client runs ``--offline degrade`` and writes the rest with its drafter alone. Reported: tokens
until the first divergence from the target's own continuation, whether the whole continuation
matched, and on math prompts whether the final answer (last number in the text) equals the
target's own and the dataset's reference.

Writes ``--out``/results.json and ``--out``/results.md.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from moa_serve.app import state
from moa_serve.app.http import create_app
from moa_serve.cli_args import DEFAULT_TARGET, add_kernel_args
from moa_serve.client import DeviceDrafter, LinkPolicy, RemoteGenerator, Transport
from moa_serve.client.generate import AUTO
from moa_serve.client_server.fingerprint import model_fingerprint, tokenizer_fingerprint
from moa_serve.commands.bench import DEFAULT_QUESTIONS, load_questions
from moa_serve.commands.cs_local_stack import LocalStack, UvicornThread
from moa_serve.commands.netem import PROFILES, netem_proxy
from moa_serve.drafter.checkpoint import load_draft_vocab
from moa_serve.drafter.registry import load_feature_source
from moa_serve.drafter.spec import DrafterSpec, parse_branchings
from moa_serve.drafter.training.data import prompt_ids
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
from moa_serve.protocol import DraftResult
from moa_serve.sampling import GREEDY
from moa_serve.verifier.torch.runner import RunnerOptions, TorchTargetRunner

REPO_ROOT = Path(__file__).resolve().parents[2]
CKPT = REPO_ROOT / "drafter" / "checkpoints" / "smollm2-135m-instruct"
DEFAULT_DRAFTERS = ",".join(f"{CKPT}-{k}" for k in ("moa", "eagle", "independent"))
DEFAULT_PROFILES = "local,wan,5g,4g"
DEFAULT_CATEGORIES = "writing,math_reasoning,coding,qa"
API_ONLY = "api-only"
# the method-name prefix of a drafter alone and of its hybrids, and the key of their targets
HYBRID_KEYS = (("", "4g_moa"), ("lookup + ", "4g_lookup_moa"), ("lookup + outputs + ", "4g_outputs_moa"))
MATH_CATEGORIES = ("math", "math_reasoning")
PORTS = (8300, 8400)


# ---------------------------------------------------------------------- the device side
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


# ---------------------------------------------------------------------- the server side
def server_stack(path, tm, dtype, tokenizer, stops, drafter: str | None, max_model_len: int, model_name: str):
    """The Router's client-server stack for one drafter's feature head (None: no features), over
    the already loaded target ``tm``."""
    # no prefix caching: methods sharing a stack run the same prompts one after the other, and a
    # later one must not find the prompt already prefilled by an earlier one
    runner = TorchTargetRunner(
        tm,
        dtype,
        "cpu",
        max_sessions=16,
        max_model_len=max_model_len,
        features=load_feature_source(drafter),
        draft_vocab=load_draft_vocab(drafter) if drafter else None,
        options=RunnerOptions(prefix_caching=False),
    )
    return LocalStack(runner, tokenizer, stops, model_name=model_name, drafter=drafter)


# ---------------------------------------------------------------------- helpers
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


def _summ(runs: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in runs)
    elapsed = sum(r["elapsed_s"] for r in runs)
    rounds = sum(r["rounds"] for r in runs)
    verified = sum(r["verified_tokens"] for r in runs)
    calls = sum(r["server_calls"] for r in runs)
    up, down = sum(r["bytes_up"] for r in runs), sum(r["bytes_down"] for r in runs)
    drafted, accepted = sum(r["drafted_tokens"] for r in runs), sum(r["accepted_tokens"] for r in runs)
    same = [r["identical"] for r in runs]
    n = max(1, tokens)
    tau = verified / rounds if rounds else 0.0
    return {
        "prompts": len(runs),
        "tokens": tokens,
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(tokens / elapsed, 3) if elapsed else 0.0,
        "ms_per_token": round(1000 * elapsed / n, 2),
        "server_calls": calls,
        "calls_per_100_tokens": round(100 * calls / n, 2),
        "calls_per_token": round(calls / n, 4),
        "rounds": rounds,
        "mean_accepted_length": round(tau, 4),
        "inverse_tau": round(1 / tau, 4) if tau else None,
        "draft_acceptance": round(accepted / drafted, 4) if drafted else None,
        "lookup_draft_share": round(sum(r.get("lookup_drafted_tokens", 0) for r in runs) / drafted, 4)
        if drafted
        else None,
        "bytes_up": up,
        "bytes_down": down,
        "bytes_up_per_token": round(up / n, 1),
        "bytes_down_per_token": round(down / n, 1),
        "bytes_per_token": round((up + down) / n, 1),
        "identical": sum(same),
        "identical_all": all(same) if same else None,
        "device_draft_s": round(sum(r["device_draft_s"] for r in runs), 3),
    }


@dataclass
class _ServerTarget:
    """The server's target, loaded once: every stack and the plain-decoding reference share it."""

    path: Path
    model: TargetModel
    dtype: torch.dtype
    tokenizer: object
    stops: list[int]
    packing: dict
    plain: SpeculativeEngine  # plain target decoding: the reference outputs

    @classmethod
    def load(cls, args) -> "_ServerTarget":
        path = resolve_model_path(args.target)
        dt = parse_dtype(args.dtype, "cpu", path)
        tm = TargetModel.from_state_dict(read_config(path), load_state_dict(path), dt, "cpu")
        # the server's target as a verifier replica runs it (packed GGUF / bf16 kernels); every stack shares it
        packing = (
            pack_target(tm, path, args.matmul_precision)
            if args.packed_weights == "auto"
            else {"packed": 0, "reason": "--packed-weights off"}
        )
        tok = load_tokenizer(path)
        stops = stop_token_ids(path, tok)
        plain = SpeculativeEngine(TorchTargetRunner(tm, dt, "cpu", 1, args.max_model_len, None), None, tok, stops, 1)
        return cls(path, tm, dt, tok, stops, packing, plain)

    def stack(self, drafter: str | None, args):
        return server_stack(
            self.path, self.model, self.dtype, self.tokenizer, self.stops, drafter, args.max_model_len, args.target
        )


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


# ---------------------------------------------------------------------- the benchmark
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
            _report(args, methods, profiles, prompts, plain_runs, per_run, [], partial=True, packing=target.packing)

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
        return _report(
            args, methods, profiles, prompts, plain_runs, per_run, cut_runs, partial=False, packing=target.packing
        )
    finally:
        http.stop()
        state.install(cs=None, frontend=None)


def _report(
    args, methods, profiles, prompts, plain_runs, per_run, cut_runs, partial: bool, packing: dict | None = None
) -> dict:
    ptok = sum(r["tokens"] for r in plain_runs)
    pel = sum(r["elapsed_s"] for r in plain_runs)
    table = []
    for prof in profiles:
        for m in methods:
            rows = [r for r in per_run if r["profile"] == prof and r["method"] == m.name]
            if rows:
                table.append({"profile": prof, "method": m.name, "kind": m.kind, **_summ(rows)})
    disc = []
    for m in methods:
        ran = [r for r in cut_runs if r["method"] == m.name]
        # a target that stopped before the cut leaves nothing to continue: not counted
        rows = [r for r in ran if r["cut"] and r["target_continuation_tokens"] > 0]
        if not rows:
            continue
        maths = [r for r in rows if "answer" in r]
        disc.append(
            {
                "method": m.name,
                "prompts": len(rows),
                "not_cut": len(ran) - len(rows),
                "cut": len(rows),
                "verified_before_cut": round(sum(r["verified_tokens"] for r in rows) / len(rows), 2),
                "offline_tokens": round(sum(r["offline_tokens"] for r in rows) / len(rows), 2),
                "mean_tokens_until_divergence": round(sum(r["tokens_until_divergence"] for r in rows) / len(rows), 2),
                "tokens_until_divergence": [r["tokens_until_divergence"] for r in rows],
                "full_match": sum(r["full_match"] for r in rows),
                "verified_identical": all(r["verified_identical"] for r in rows),
                "math_prompts": len(maths),
                "math_answer_matches_target": sum(r["answer_matches_target"] for r in maths),
                "math_answer_matches_reference": sum(r["answer_matches_reference"] for r in maths),
            }
        )
    targets = _targets(table, disc)
    result = {
        "partial": partial,
        "target": args.target,
        "dtype": args.dtype,
        "drafters": args.drafter,
        "profiles": profiles,
        "max_new_tokens": args.max_new_tokens,
        "num_speculative_tokens": args.num_speculative_tokens,
        "adaptive_k": not args.fixed_k,
        "feature_codec": args.feature_codec,
        "device_slowdown": args.device_slowdown,
        "threads": args.threads,
        "prompt_format": args.prompt_format,
        "branching": getattr(args, "branching", "chain"),
        "server_packed_layers": (packing or {}).get("packed", 0),
        "server_matmul_precision": (packing or {}).get("matmul_precision", "highest"),
        "prompts": [
            {
                "question_id": p["question_id"],
                "category": p["category"],
                "prompt_tokens": len(p["ids"]),
                "target_tokens": len(p.get("target_ids", [])),
            }
            for p in prompts
        ],
        "plain_target": {
            "tokens": ptok,
            "elapsed_s": round(pel, 3),
            "tokens_per_s": round(ptok / pel, 3) if pel else 0.0,
        },
        "cut_profile": args.cut_profile,
        "cut_after_tokens": args.cut_after_tokens,
        "offline_chunk": args.offline_chunk,
        "runs": table,
        "disconnection": disc,
        "targets": targets,
        "per_run": per_run,
        "per_cut_run": cut_runs,
    }
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (out / "results.md").write_text(markdown(result), encoding="utf-8")
    return result


def _targets(table: list[dict], disc: list[dict]) -> dict:
    """The issue's targets, checked on what was measured (None: not measurable in this run)."""

    def get(prof, kind_name):
        return next((r for r in table if r["profile"] == prof and r["method"] == kind_name), None)

    out: dict = {}
    api = get("4g", "API-only")
    # tree variants ("MoA, tree 4-2") are compared with API-only and with EAGLE-style of the same shape
    suffixes = [""] + sorted({r["method"].partition(", tree ")[2] for r in table if ", tree " in r["method"]})
    for tree in suffixes:
        for prefix, key in HYBRID_KEYS:  # the drafters alone, and hybrids
            sfx, ksfx = (f", tree {tree}", f"_tree{tree}") if tree else ("", "")
            moa, eagle = get("4g", f"{prefix}MoA{sfx}"), get("4g", f"{prefix}EAGLE-style{sfx}")
            if moa and api and api["tokens_per_s"]:
                r = moa["tokens_per_s"] / api["tokens_per_s"]
                out[f"{key}{ksfx}_vs_api_only"] = {"ratio": round(r, 3), "target": 1.5, "met": r >= 1.5}
            if moa and eagle and eagle["tokens_per_s"]:
                r = moa["tokens_per_s"] / eagle["tokens_per_s"]
                out[f"{key}{ksfx}_vs_{key[3:].removesuffix('moa')}eagle"] = {
                    "ratio": round(r, 3),
                    "target": 1.2,
                    "met": r >= 1.2,
                }
    out["calls_per_token_le_inverse_tau"] = {
        f"{r['profile']}/{r['method']}": {
            "calls_per_token": r["calls_per_token"],
            "inverse_tau": r["inverse_tau"],
            "met": r["inverse_tau"] is not None and r["calls_per_token"] <= r["inverse_tau"] + 1e-9,
        }
        for r in table
    }
    out["bytes_per_token_le_2KiB"] = {
        f"{r['profile']}/{r['method']}": {"bytes_per_token": r["bytes_per_token"], "met": r["bytes_per_token"] <= 2048}
        for r in table
    }
    d = {x["method"]: x["mean_tokens_until_divergence"] for x in disc}
    for prefix, key in ((p, k.replace("4g_", "disconnection_") + "_longest") for p, k in HYBRID_KEYS):
        others = [f"{prefix}{o}" for o in ("EAGLE-style", "independent") if f"{prefix}{o}" in d]
        if f"{prefix}MoA" in d and others:  # (with nothing to compare against, nothing is claimed)
            out[key] = {"mean_tokens_until_divergence": d, "met": all(d[f"{prefix}MoA"] > d[o] for o in others)}
    return out


def markdown(result: dict) -> str:
    lines = [
        f"# moa cs-bench — {result['target']} ({result['dtype']}), {len(result['prompts'])} prompts, "
        f"≤ {result['max_new_tokens']} new tokens, greedy" + (" (partial)" if result["partial"] else ""),
        "",
        f"K ≤ {result['num_speculative_tokens']} ({'adaptive' if result['adaptive_k'] else 'fixed'}), "
        f"features {result['feature_codec']}, device slowdown {result['device_slowdown']:g}× "
        f"(server/device compute ratio), plain target decoding in-process: "
        f"{result['plain_target']['tokens_per_s']:.2f} tok/s"
        + (
            f" (packed kernels, {result['server_packed_layers']} layers, matmul precision "
            f"{result.get('server_matmul_precision', 'highest')})"
            if result.get("server_packed_layers")
            else ""
        )
        + ".",
        "",
        "| profile | method | tok/s | ms/token | calls/100 tok | B up/tok | B down/tok | τ | identical to target |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in result["runs"]:
        lines.append(
            f"| {r['profile']} | {r['method']} | {r['tokens_per_s']:.2f} | {r['ms_per_token']:.1f} | "
            f"{r['calls_per_100_tokens']:.1f} | {r['bytes_up_per_token']:.0f} | "
            f"{r['bytes_down_per_token']:.0f} | {r['mean_accepted_length']:.2f} | "
            f"{r['identical']}/{r['prompts']} |"
        )
    if result["disconnection"]:
        lines += [
            "",
            f"Disconnection over {result['cut_profile']}: link cut (reset) after "
            f"{result['cut_after_tokens']} verified tokens, `--offline degrade`, "
            f"{result.get('offline_chunk', 4)} drafts per offline drafter call"
            + (
                f"; {result['disconnection'][0]['not_cut']} prompt(s) left out: the target stopped before the cut"
                if result["disconnection"][0].get("not_cut")
                else ""
            )
            + ".",
            "",
            "| method | verified before cut | offline tokens | tokens until divergence (mean) | per prompt | "
            "whole continuation matched | math answers = target's | math answers = reference |",
            "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
        ]
        for d in result["disconnection"]:
            mp = d["math_prompts"]
            lines.append(
                f"| {d['method']} | {d['verified_before_cut']:.1f} | {d['offline_tokens']:.1f} | "
                f"{d['mean_tokens_until_divergence']:.2f} | {d['tokens_until_divergence']} | "
                f"{d['full_match']}/{d['prompts']} | "
                + (
                    f"{d['math_answer_matches_target']}/{mp} | {d['math_answer_matches_reference']}/{mp} |"
                    if mp
                    else "no math prompt | no math prompt |"
                )
            )
    t = result["targets"]
    if t:
        lines += ["", "Targets:"]
        for key, v in t.items():  # the speed ratios, as _targets put them
            if "ratio" in v:
                lines.append(
                    f"- {key}: {v['ratio']:.2f}× (target ≥ {v['target']}×) — {'met' if v['met'] else 'NOT met'}"
                )
        c = t["calls_per_token_le_inverse_tau"]
        lines.append(f"- server calls per token ≤ 1/τ: {sum(v['met'] for v in c.values())}/{len(c)} rows")
        b = t["bytes_per_token_le_2KiB"]
        lines.append(f"- ≤ 2 KiB per token: {sum(v['met'] for v in b.values())}/{len(b)} rows")
        for key, who in ((k.replace("4g_", "disconnection_") + "_longest", p + "MoA") for p, k in HYBRID_KEYS):
            if key in t:
                lines.append(
                    f"- on disconnection {who} matches the target longest: {'met' if t[key]['met'] else 'NOT met'}"
                )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- command line
def add_arguments(p) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="the server's target LLM")
    p.add_argument(
        "--drafter",
        default=DEFAULT_DRAFTERS,
        help="comma-separated device drafter checkpoints (MoA, EAGLE-style, independent), each also as "
        "hybrid:<checkpoint> (prompt lookup first, online and greedy) or hybrid+outputs:<checkpoint> "
        "(then the target's earlier replies); 'none': only API-only",
    )
    p.add_argument("--no-api-only", action="store_true", help="skip the API-only client (no drafter, K = 0)")
    p.add_argument("--profiles", default=DEFAULT_PROFILES, help="netem profiles, comma-separated")
    p.add_argument("--questions", default=DEFAULT_QUESTIONS, help="Spec-Bench-format JSONL (held-out prompts)")
    p.add_argument("--categories", default=DEFAULT_CATEGORIES, help="categories to take prompts from ('' = all)")
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--limit", type=int, default=0, help="at most this many prompts (0: no limit)")
    p.add_argument(
        "--prompt-format",
        choices=["chat", "plain"],
        default="chat",
        help="chat: the first turn in the chat template; plain: its text only",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=8, help="the most drafts per round")
    p.add_argument("--fixed-k", action="store_true", help="always draft -k tokens (default: the client's adaptive K)")
    p.add_argument(
        "--branching",
        default="chain",
        help="tree drafts: candidates per draft depth (e.g. 4-2, or 8-3-2@0.05: dynamic); "
        "comma-separated shapes run every drafter once per shape ('chain' = none; 'auto' = the "
        "client's default: 8-3-2@0.03 while the round trip is >= 50 ms)",
    )
    p.add_argument("--feature-codec", choices=["float16", "int8"], default="float16")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="server and device (float32: greedy identity is exact)",
    )
    p.add_argument("--max-model-len", type=int, default=1024)
    add_kernel_args(
        p,
        "auto: the server's target runs on the packed kernels, as a verifier replica does",
        "the server's packed matmuls (the config's matmul_precision): medium multiplies bf16-rounded "
        "values with float32 sums on AVX512-BF16 CPUs; plain decoding, the reference, runs the same",
    )
    p.add_argument(
        "--device-slowdown",
        type=float,
        default=3.0,
        help="the device's drafting takes this many times its measured time (the server has this many "
        "times the device's compute; the paper: 3)",
    )
    p.add_argument("--cut-profile", default="4g", help="the link the disconnection runs go through")
    p.add_argument("--cut-after-tokens", type=int, default=16, help="cut the link after this many verified tokens")
    p.add_argument(
        "--offline-chunk",
        type=int,
        default=4,
        help="drafts per drafter call while offline (the client's default: 4); EAGLE-style drafts only "
        "one call past the last target feature, so this bounds its offline continuation",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per HTTP call (default: follow the measured round trips, as the client does)",
    )
    p.add_argument("--seed", type=int, default=0, help="netem seed (+ the prompt's index)")
    p.add_argument("--out", required=True, help="folder for results.json and results.md")


def register(sub) -> None:
    p = sub.add_parser(
        "cs-bench",
        help="client-server mode benchmark: drafters vs API-only across emulated networks, and on disconnection",
    )
    add_arguments(p)

    def cmd(args) -> int:
        result = run_cs_bench(args)
        print(markdown(result))
        return 0

    p.set_defaults(func=cmd)
