"""The GPU check's ``production`` section: a Llama-3-8B-shaped target with random weights and a
paper-sized MoA drafter; verify and drafting latency, what batch invariance costs, the attention
kernels, one engine round."""

from __future__ import annotations

import random
import time

import torch

from moa_serve.drafter.config import DrafterConfig
from moa_serve.drafter.feature_sources import MoAFeatures
from moa_serve.drafter.moa_model import TargetParts
from moa_serve.drafter.proposer import MoAProposer
from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.kernels import gpu_invariant
from moa_serve.model.kv_cache import PackedBatch
from moa_serve.model.layers import use_matmul
from moa_serve.model.target import TargetArch, TargetModel
from moa_serve.protocol import DraftRequest, VerifyRequest
from moa_serve.verifier.torch.runner import RunnerOptions, TorchTargetRunner
from moa_serve.verifier.torch.static_forward import StaticForward
from tools.gpu.correctness import invariance_probe
from tools.gpu.harness import (
    GiB,
    Run,
    device_busy_ms,
    free,
    host_profile,
    memory,
    param_bytes,
    random_moa,
    random_target,
    sync,
    timed,
)


def _rows(run: Run, rows: list, cells: list[dict], min_left_s: float):
    """Yields a row per cell (each appended to ``rows``); a cell reached with less than
    ``min_left_s`` seconds left is marked skipped instead."""
    for cell in cells:
        row = dict(cell)
        rows.append(row)
        if run.left() < min_left_s:
            row["skipped"] = "out of time"
            continue
        yield row


def _add_device_busy(row: dict, fn, device: torch.device) -> None:
    """The device's busy time in one call of ``fn``, and the host's share of the row's wall time."""
    row["device_busy_ms"] = device_busy_ms(fn, device)
    if isinstance(row["device_busy_ms"], float):
        row["host_overhead_ms"] = round(row["ms"] - row["device_busy_ms"], 3)


def _build_production_models(run: Run, sec: dict, shape: dict, dtype: torch.dtype):
    """The random target and MoA drafter at ``shape``: their sizes and the memory they take."""
    d = run.device
    free(d)
    t = time.monotonic()
    target = random_target(shape, dtype, d)
    moa = random_moa(target, dtype, d)
    sync(d)
    sec["build_s"] = round(time.monotonic() - t, 2)
    sec["shape"] = {k: v for k, v in shape.items()}
    sec["dtype"] = str(dtype).removeprefix("torch.")
    sec["target_weights_gib"] = round(param_bytes(target) / GiB, 3)
    sec["moa_feature_head_gib"] = round(param_bytes(moa.feature_head) / GiB, 3)
    sec["moa_draft_head_gib"] = round(param_bytes(moa.draft_head) / GiB, 3)
    sec["memory_after_build"] = memory(d)
    run.save()
    return target, moa


def production_runner(target, moa, dtype, d, max_sessions: int, max_model_len: int, **options) -> TorchTargetRunner:
    """The verifier the check measures: the MoA feature head's features, up to 8,192 tokens a call,
    no prefix caching; ``options``: more RunnerOptions."""
    return TorchTargetRunner(
        target,
        dtype,
        str(d),
        max_sessions=max_sessions,
        max_model_len=max_model_len,
        features=MoAFeatures(moa.feature_head),
        options=RunnerOptions(max_num_batched_tokens=8192, prefix_caching=False, **options),
    )


def moa_proposer(target, moa, max_sessions: int, max_model_len: int) -> MoAProposer:
    """The random MoA drafter's draft head as the engine's proposer."""
    return MoAProposer(
        DrafterConfig(target=target.arch),
        moa.draft_head,
        TargetParts(target, 0),
        max_sessions=max_sessions,
        max_model_len=max_model_len,
    )


def random_prompts(g: random.Random, vocab: int, length: int, n: int) -> list[list[int]]:
    return [[g.randrange(vocab) for _ in range(length)] for _ in range(n)]


def static_args(runner: TorchTargetRunner, ids: list[str], t: int, ctx: int) -> tuple:
    """A fixed-shape forward's arguments: ``t`` tokens (id 1) in each session of ``ids``, after its
    ``ctx`` committed positions."""
    slots = [runner.sessions[i].slot for i in ids]
    b = len(ids)
    return (
        [1] * (b * t),
        [s for s in slots for _ in range(t)],
        [ctx + j for _ in range(b) for j in range(t)],
        [ctx + j for _ in range(b) for j in range(t)],
    )


def prefill(runner: TorchTargetRunner, sec: dict, ids: list[str], prompts: list[list[int]], d) -> None:
    t = time.monotonic()
    pending = [VerifyRequest(i, p, want_features=False) for i, p in zip(ids, prompts)]
    while pending:
        results = runner.verify(pending)
        pending = [q for q, r in zip(pending, results) if r.prefill_remaining > 0]
    sync(d)
    sec["prefill"] = {"sessions": len(ids), "tokens_each": len(prompts[0]), "s": round(time.monotonic() - t, 2)}


def _verify_rows(
    run: Run, sec: dict, runner: TorchTargetRunner, target: TargetModel, ids: list[str], g: random.Random, vocab: int
) -> None:
    """Verify latency for B sessions x K+1 tokens, and the target's forward alone at that shape."""
    d, sz, ctx, reps = run.device, run.sizes, run.sizes["context"], run.sizes["reps"]
    sec["verify"] = []
    run.save()
    cells = [{"B": b, "K+1": width} for b in sz["verify_b"] for width in sz["verify_t"]]
    for row in _rows(run, sec["verify"], cells, 10):
        b, width = row["B"], row["K+1"]
        reqs = [
            VerifyRequest(ids[i], [], drafts=[g.randrange(vocab) for _ in range(width - 1)], base=ctx) for i in range(b)
        ]

        def call(reqs=reqs):
            return runner.verify(reqs)

        row.update(timed(call, d, reps, warmup=2))
        row["tokens_per_s_verified"] = round(b * width / row["ms"] * 1e3, 1)
        # the target's forward alone (no planning, acceptance or features): what the device must do
        batch_args = ([runner.sessions[i].slot for i in ids[:b]], [ctx - 1] * b, [width] * b)
        tokens = torch.randint(0, vocab, (b * width,), device=d)

        def forward(tokens=tokens, batch_args=batch_args):
            batch = PackedBatch(runner.cache, *batch_args, d, kernel=runner.attention_kernel)
            return target.lm_head(target.forward_packed(tokens, batch)).argmax(-1)

        row["forward_only"] = timed(forward, d, reps, warmup=1)
        _add_device_busy(row, call, d)
        run.save()


def _invariance_cost_rows(run: Run, sec: dict, runner: TorchTargetRunner, target: TargetModel, ids: list[str]) -> None:
    """What batch invariance costs: the forward of B sessions x T tokens at a ``context``-token
    cache, (a) as served: the fixed-shape forward replayed from a CUDA graph, Triton matmuls and
    attention; (b) the same graphs with cuBLAS matmuls (Triton attention: the fixed shapes need it);
    (c) the planned eager forward on cuBLAS and SDPA (not batch-invariant). CUDA only."""
    d, ctx, reps = run.device, run.sizes["context"], run.sizes["reps"]
    sec["invariance_cost"] = []
    if d.type != "cuda" or runner.static is None:
        sec["invariance_cost_skipped"] = "needs CUDA, Triton and the fixed-shape forward"
        return
    invariant = runner.packing.get("batch_invariant_matmuls", 0) > 0
    cublas = StaticForward(target, runner.cache, runner.max_num_batched_tokens, graphs=True)
    cells = [{"B": b, "T": t} for b in (1, 8, 64) if b <= len(ids) for t in (1, 5)]
    for row in _rows(run, sec["invariance_cost"], cells, 10):
        b, t = row["B"], row["T"]
        slots = [runner.sessions[i].slot for i in ids[:b]]
        args = static_args(runner, ids[:b], t, ctx)
        row["served_ms"] = timed(lambda: runner.static(*args), d, reps, warmup=2)["ms"]
        use_matmul(target, None)  # captured now, these graphs keep cuBLAS
        try:
            row["graph_cublas_ms"] = timed(lambda: cublas(*args), d, reps, warmup=2)["ms"]

            def planned():
                batch = PackedBatch(runner.cache, slots, [ctx] * b, [t] * b, d, kernel=False)
                return target.forward_packed(torch.ones(b * t, dtype=torch.long, device=d), batch)

            row["eager_cublas_sdpa_ms"] = timed(planned, d, reps, warmup=1)["ms"]
        finally:
            if invariant:
                use_matmul(target, gpu_invariant.matmul)
        row["invariance_cost"] = round(row["served_ms"] / row["graph_cublas_ms"], 3)
        row["vs_eager"] = round(row["served_ms"] / row["eager_cublas_sdpa_ms"], 3)
        run.save()
    cublas = None  # frees the captured graphs


def attention_section(run: Run, arch: TargetArch, dtype: torch.dtype) -> None:
    """The two batch-invariant attention kernels side by side at long contexts: B sessions x 1 token
    at context L over a cache of 8,192 positions (GPU microseconds from a CUDA graph), whether the
    chunked kernel's rows are bitwise the same alone as in the batch, and how far the two differ.
    The last section of a run: a kernel fault ends the process, and ``running`` then names the
    kernel and cell it happened in."""
    sec = run.section("attention")
    d = run.device
    sec["rows"] = []
    if d.type != "cuda":
        sec["skipped"] = sec["status"] = "needs CUDA"
        return
    import triton.testing

    kvh, hd, heads, length = arch.num_kv_heads, arch.head_dim, arch.num_heads, 8193
    gen = torch.Generator(device=d).manual_seed(3)
    k = torch.randn(64, kvh, length, hd, device=d, dtype=dtype, generator=gen)
    v = torch.randn(64, kvh, length, hd, device=d, dtype=dtype, generator=gen)
    q = torch.randn(64, heads, hd, device=d, dtype=dtype, generator=gen)
    for row in _rows(run, sec["rows"], [{"B": b, "context": c} for c in (512, 2048, 8192) for b in (1, 8, 64)], 8):
        b, c = row["B"], row["context"]
        slots = torch.arange(b, device=d)
        pos = torch.full((b,), c - 1, device=d, dtype=torch.long)
        for name, fn in (
            ("per_token_us", gpu_invariant.slot_attention),
            ("chunked_us", gpu_invariant.chunked_slot_attention),
        ):
            sec["running"] = f"{fn.__name__} B={b} context={c}"
            run.save()
            fn(q[:b], k, v, slots, pos)
            torch.cuda.synchronize(d)  # a fault surfaces here, with ``running`` saved
            row[name] = round(
                1e3 * triton.testing.do_bench_cudagraph(lambda fn=fn: fn(q[:b], k, v, slots, pos), rep=20), 1
            )
        sec.pop("running")
        row["chunked_speedup"] = round(row["per_token_us"] / row["chunked_us"], 2)
        full = gpu_invariant.chunked_slot_attention(q[:b], k, v, slots, pos)
        row["chunked_row_alone_bitwise"] = bool(
            torch.equal(gpu_invariant.chunked_slot_attention(q[:1], k, v, slots[:1], pos[:1]), full[:1])
        )
        row["max_abs_diff"] = float(
            (full.float() - gpu_invariant.slot_attention(q[:b], k, v, slots, pos).float()).abs().max()
        )
        run.save()
    sec["status"] = "done"
    k = v = None  # frees the cache tensors


def _draft_rows(
    run: Run, sec: dict, proposer: MoAProposer, prompts: list[list[int]], hidden: int, dtype: torch.dtype
) -> None:
    """Drafting latency per K: a paper-sized MoA draft head over the target's embeddings and LM head."""
    d, sz, ctx = run.device, run.sizes, run.sizes["context"]
    bmax = len(prompts)
    sec["draft"] = []
    t = time.monotonic()
    feats = torch.randn(ctx, hidden).to(dtype)
    proposer.propose([DraftRequest(f"d{i}", prompts[i], 1, 0, feats) for i in range(bmax)])
    sync(d)
    sec["draft_setup_s"] = round(time.monotonic() - t, 2)
    cells = [{"B": b, "K": k} for b in sz["verify_b"] for k in sz["draft_k"]]
    for row in _rows(run, sec["draft"], cells, 8):
        b, k = row["B"], row["K"]
        reqs = [DraftRequest(f"d{i}", [], k, feature_start=ctx, base=ctx) for i in range(b)]

        def call(reqs=reqs):
            return proposer.propose(reqs)

        row.update(timed(call, d, sz["reps"], warmup=1))
        row["ms_per_step"] = round(row["ms"] / k, 3)
        _add_device_busy(row, call, d)
        run.save()
    for i in range(bmax):
        proposer.release(f"d{i}")


def _round_rows(run: Run, sec: dict, engine: SpeculativeEngine, prompts: list[list[int]]) -> None:
    """One engine round (draft + verify with features + commit), K = 4 as gpu.yaml."""
    d, sz, ctx, reps = run.device, run.sizes, run.sizes["context"], run.sizes["reps"]
    sec["round"] = []
    for row in _rows(run, sec["round"], [{"B": b, "K": 4} for b in sz["verify_b"]], 10):
        b = row["B"]
        sessions = [
            engine.new_session(prompts[i][: ctx // 2], 10**6, num_speculative_tokens=4, ignore_eos=True)
            for i in range(b)
        ]
        for _ in range(50):  # prefill (chunked), then rounds until every session drafts with features
            engine.run_round(sessions)
            if all(len(s.generated) >= 2 for s in sessions):
                break
        engine.run_round(sessions)  # compiles and captures of this batch's shapes happen here
        d0, v0 = engine.timings["draft_s"], engine.timings["verify_s"]
        row.update(timed(lambda: engine.run_round(sessions), d, reps, warmup=0))
        row["draft_ms"] = round((engine.timings["draft_s"] - d0) / reps * 1e3, 3)
        row["verify_ms"] = round((engine.timings["verify_s"] - v0) / reps * 1e3, 3)
        _add_device_busy(row, lambda: engine.run_round(sessions), d)
        if "round_profile" not in sec:  # where the smallest batch's round spends its host time
            sec["round_profile"] = {"B": b, "rounds": 3, "top": host_profile(lambda: engine.run_round(sessions), d, 3)}
        for s in sessions:
            engine.release(s.id)
        run.save()


def production_section(run: Run, shape: dict, dtype: torch.dtype) -> dict:
    """Verify and drafting latency at production shape; returns the models for later sections."""
    sec = run.section("production")
    d, sz = run.device, run.sizes
    target, moa = _build_production_models(run, sec, shape, dtype)
    bmax, ctx = max(sz["verify_b"]), sz["context"]
    room = ctx + 8 * (sz["reps"] + 3) + 16
    runner = production_runner(target, moa, dtype, d, bmax, room)
    sec["verifier_fused_projections"] = runner.packing.get("fused_projections", 0)
    sec["verifier_attention_kernel"] = runner.attention_kernel
    sec["verifier_batch_invariant_matmuls"] = runner.packing.get("batch_invariant_matmuls", 0)
    sec["verifier_batch_invariant_norms"] = runner.packing.get("batch_invariant_norms", 0)
    sec["verifier_static_forward"] = runner.static is not None
    g = random.Random(0)
    vocab = shape["vocab_size"]
    prompts = random_prompts(g, vocab, ctx, bmax)
    ids = [f"v{i}" for i in range(bmax)]
    prefill(runner, sec, ids, prompts, d)
    _verify_rows(run, sec, runner, target, ids, g, vocab)
    _invariance_cost_rows(run, sec, runner, target, ids)
    for i in ids:
        runner.release(i)
    proposer = moa_proposer(target, moa, bmax, room)
    _draft_rows(run, sec, proposer, prompts, shape["hidden_size"], dtype)
    sec["draft_static_steps"] = dict(proposer.static_steps.stats) if proposer.static_steps is not None else None
    engine = SpeculativeEngine(runner, proposer, None, frozenset(), max_batch=bmax)
    _round_rows(run, sec, engine, prompts)
    sec["memory"] = memory(d)
    sec["runner_stats"] = {
        k: v
        for k, v in runner.stats.items()
        if k in ("static_calls", "graph_captures", "eager_calls", "graph_capture_failed")
    }
    if dtype == torch.bfloat16 or run.toy:
        run.results["sections"].setdefault("invariance", {})["production_shape"] = invariance_probe(
            runner, sz["invariance_b"], d
        )
    sec["status"] = "done"
    run.save()
    del runner, proposer, engine
    free(d)
    return {"target": target, "moa": moa}
