"""The GPU check of MoA-Serve's torch backend, in one time-boxed run (``tools/gpu/run.sh``).

Sections (each with a deadline; results are written after every measurement, so a run cut short
still leaves what it measured):

* ``correctness``: stories260k (a real checkpoint), greedy speculative decoding (a random MoA
  drafter on the device, and a replaying drafter with corrupted drafts) against plain decoding,
  one session at a time and 16 at a time, float32 and bfloat16.
* ``invariance``: bfloat16 batch invariance of the device's ops (linear, LM head, RMSNorm, the
  packed attention, a whole forward): is a row's result bitwise the same alone and in a batch?
* ``production``: a Llama-3-8B-shaped target with random bf16 weights made on the device and a
  paper-sized MoA drafter (SA + CA layers of the target's shape, LSA feature head): verify latency
  for B sessions x K+1 tokens, drafting latency per K, one engine round's wall time against the
  device's busy time (the host overhead).
* ``fit``: peak memory of the verifier and drafter at ``deployments/configs/gpu.yaml``'s session
  shape next to ``deployments/fit.py``'s arithmetic for it.
* ``e2e``: the in-process engine with a replaying proposer at controlled acceptance
  (tau ~ 1.5 / 2.5 / 3.5 / 4.5) against the same engine without speculation, B = 1 / 8 / 32 / 64.

``--toy`` runs every section at toy size (a tiny random Llama instead of the 8B shape, short
lists of B and K) so that it runs on a CPU in about a minute (the CI test does).

Outputs under ``--out``: ``results.json`` (everything, machine-readable) and ``results.md``
(the tables).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import platform
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _import_project() -> None:
    """Makes ``moa_serve.<part>`` importable from this checkout when the project is not installed
    (the GPU machine runs the checkout as it is): the package-dir mapping of pyproject.toml."""
    try:
        importlib.import_module("moa_serve.target_model")
        return
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("moa_serve"):
            raise
    import tomllib

    sys.path.insert(0, str(ROOT))
    moa_serve = importlib.import_module("moa_serve")

    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in dirs.items():
        if name == "moa_serve" or name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(
            name, ROOT / folder / "__init__.py", submodule_search_locations=[str(ROOT / folder)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        setattr(moa_serve, name.rsplit(".", 1)[1], module)


_import_project()
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from moa_serve.deployments import fit  # noqa: E402
from moa_serve.deployments.config import AppConfig  # noqa: E402
from moa_serve.drafter.checkpoint import init_drafter  # noqa: E402
from moa_serve.drafter.config import DrafterConfig  # noqa: E402
from moa_serve.drafter.feature_sources import MoAFeatures  # noqa: E402
from moa_serve.drafter.model import MoADrafter, TargetParts  # noqa: E402
from moa_serve.drafter.proposer import MoAProposer  # noqa: E402
from moa_serve.engine.local import SpeculativeEngine  # noqa: E402
from moa_serve.kernels import gpu_invariant  # noqa: E402
from moa_serve.kv_cache import PackedBatch  # noqa: E402
from moa_serve.layers import RMSNorm, Rotary, use_matmul  # noqa: E402
from moa_serve.protocol import DraftRequest, VerifyRequest  # noqa: E402
from moa_serve.target_model import TargetArch, TargetModel, rotary_for  # noqa: E402
from moa_serve.verifier.static_forward import StaticForward  # noqa: E402
from moa_serve.verifier.torch_runner import RunnerOptions, TorchTargetRunner  # noqa: E402
from tools.gpu.anchor import anchor_row  # noqa: E402
from tools.gpu.replay import ReplayProposer, corruption_for  # noqa: E402

GiB = 2**30

LLAMA3_8B = dict(
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
)
TOY_LLAMA = dict(
    model_type="llama",
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)

STORY_PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily went to the park and",
    "One day, a boy named Tim",
    "The sun was",
    "Sam had a red ball. He",
    "There was a big tree",
    "Mom said",
    "The cat and the bird",
    "A girl found a shiny",
    "Tom was sad because",
    "They played all day",
    "The fish swam",
    "Ben wanted to",
    "It was a rainy day",
    "The princess",
]

FULL = dict(
    verify_b=[1, 8, 32, 128],
    verify_t=[1, 2, 4, 6, 8],
    draft_k=[1, 2, 3, 4, 5, 7],
    context=512,
    e2e_b=[1, 8, 32, 64],
    e2e_tau=[1.5, 2.5, 3.5, 4.5],
    e2e_k=[2, 4, 7],
    e2e_prompt=32,
    e2e_new=64,
    correct_new=48,
    correct_one=4,
    reps=5,
    invariance_b=[1, 2, 8, 16, 64],
)
TOY = dict(
    verify_b=[1, 4],
    verify_t=[1, 4],
    draft_k=[1, 4],
    context=48,
    e2e_b=[1, 4],
    e2e_tau=[1.5, 3.5],
    e2e_k=[4],
    e2e_prompt=8,
    e2e_new=12,
    correct_new=16,
    correct_one=2,
    reps=2,
    invariance_b=[1, 4, 16],
)


# ---------------------------------------------------------------------------------- plumbing
class Run:
    """Results, deadlines and the output files."""

    def __init__(self, out: Path, budget_s: float, device: torch.device, toy: bool):
        self.out = out
        self.t0 = time.monotonic()
        self.budget_s = budget_s
        self.device = device
        self.toy = toy
        self.sizes = TOY if toy else FULL
        self.results: dict = {"meta": {}, "sections": {}}
        self.deadline = self.t0 + budget_s

    def until(self, fraction: float) -> None:
        """The current section ends at this fraction of the budget."""
        self.deadline = self.t0 + fraction * self.budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def section(self, name: str) -> dict:
        return self.results["sections"].setdefault(name, {"status": "running"})

    def save(self) -> None:
        self.results["meta"]["elapsed_s"] = round(time.monotonic() - self.t0, 2)
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1, default=str))
        os.replace(tmp, self.out / "results.json")
        (self.out / "results.md").write_text(markdown(self.results))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int, warmup: int = 1) -> dict:
    """Median and min wall milliseconds of ``fn`` (the device synchronized around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return {"ms": round(times[len(times) // 2], 3), "min_ms": round(times[0], 3)}


def device_busy_ms(fn, device: torch.device) -> float | None:
    """Milliseconds the GPU spent in kernels and copies during one call of ``fn`` (torch.profiler;
    one stream, so the sum is the busy time). None off CUDA or without a working profiler."""
    if device.type != "cuda":
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            sync(device)
        total = 0.0
        for e in prof.key_averages():
            total += getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        return round(total / 1e3, 3)
    except Exception as exc:  # noqa: BLE001 - reported, the wall times still stand
        return f"profiler failed: {exc!r}"[:200]


def host_profile(fn, device: torch.device, calls: int, top: int = 25) -> list[dict]:
    """The ``top`` host functions of ``calls`` calls of ``fn`` by own time (cProfile): each with its
    calls, own and cumulative milliseconds, all per call of ``fn``."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    sync(device)
    prof.enable()
    for _ in range(calls):
        fn()
    sync(device)
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        {
            "function": f"{Path(f).name}:{line}({name})",
            "calls": round(nc / calls, 1),
            "own_ms": round(tt / calls * 1e3, 3),
            "cumulative_ms": round(ct / calls * 1e3, 3),
        }
        for (f, line, name), (cc, nc, tt, ct, _) in rows
    ]


def memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return {
        "allocated_gib": round(torch.cuda.memory_allocated(device) / GiB, 3),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated(device) / GiB, 3),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / GiB, 3),
    }


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def llama_config(shape: dict):
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in shape.items() if k != "model_type"})


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """N(0, 0.02) matrices and embeddings, zero biases, unit norms, drawn on the module's device."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
            elif isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                m.weight.normal_(0.0, 0.02)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()


def random_target(shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0) -> TargetModel:
    """A TargetModel of ``shape`` with random weights allocated and drawn on ``device`` (nothing
    crosses the bus), its rotary embedding set as a loaded model's is."""
    cfg = llama_config(shape)
    arch = TargetArch.from_hf_config(cfg)
    with torch.device("meta"):
        model = TargetModel(arch, Rotary(torch.zeros(arch.head_dim // 2)))
    model = model.to(dtype).to_empty(device=device)
    randomize_(model, seed)
    model.rotary = rotary_for(cfg, arch).to(device=device, dtype=dtype)
    return model.eval()


def random_moa(target: TargetModel, dtype: torch.dtype, device: torch.device, seed: int = 1) -> MoADrafter:
    """A paper-sized MoA drafter for ``target`` (defaults: SA and CA layers of the target's shape,
    LSA over its per-layer K/V, no TLI), random weights on ``device``."""
    cfg = DrafterConfig(target=target.arch)
    with torch.device("meta"):
        moa = MoADrafter(cfg)
    moa = moa.to(dtype).to_empty(device=device)
    randomize_(moa, seed)
    moa.feature_head.rotary = Rotary.plain(cfg.lsa_shape().head_dim, cfg.target.rope_theta).to(device, dtype)
    return moa.eval()


def param_bytes(module: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in module.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def compare(got: list[list[int]], want: list[list[int]]) -> dict:
    """Sessions whose tokens equal the reference, and the first divergence (session, position)."""
    same = sum(g == w for g, w in zip(got, want))
    first = None
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            pos = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            first = {"session": i, "position": pos}
            break
    return {"identical": same, "sessions": len(want), "all_identical": same == len(want), "first_divergence": first}


# ---------------------------------------------------------------------------------- sections
def env_section(run: Run) -> None:
    sec = run.section("env")
    d = run.device
    sec.update(
        python=platform.python_version(),
        torch=torch.__version__,
        device=str(d),
        cuda=torch.version.cuda,
        toy=run.toy,
        threads=torch.get_num_threads(),
    )
    try:
        import transformers

        sec["transformers"] = transformers.__version__
    except ImportError:
        pass
    if d.type == "cuda":
        p = torch.cuda.get_device_properties(d)
        sec.update(
            gpu=p.name,
            gpu_memory_gib=round(p.total_memory / GiB, 1),
            capability=f"{p.major}.{p.minor}",
            flash_sdp=torch.backends.cuda.flash_sdp_enabled(),
            mem_efficient_sdp=torch.backends.cuda.mem_efficient_sdp_enabled(),
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
        )
    sec["status"] = "done"


def stories_path() -> Path:
    for cand in (
        ROOT / "tools" / "gpu" / "models" / "stories260k",
        Path(os.environ.get("MOA_MODEL_DIR", "/nonexistent")) / "stories260k",
    ):
        if (cand / "config.json").is_file():
            return cand
    raise FileNotFoundError("stories260k not found: run tools/gpu/prepare.sh (or set MOA_MODEL_DIR)")


def correctness_section(run: Run, dtypes: list[str]) -> None:
    """Greedy speculative output against plain decoding on a real checkpoint."""
    sec = run.section("correctness")
    path = stories_path()
    n_new, n_one = run.sizes["correct_new"], run.sizes["correct_one"]
    with tempfile.TemporaryDirectory() as tmp:
        drafter = init_drafter(str(path), Path(tmp) / "moa", seed=0)
        for dtype in dtypes:
            if run.left() < 5:
                sec[dtype] = {"skipped": "out of time"}
                continue
            t = time.monotonic()
            spec = SpeculativeEngine.load(
                str(path), str(drafter), dtype, str(run.device), max_sessions=16, max_model_len=256
            )
            plain = SpeculativeEngine(spec.verifier, None, spec.tokenizer, spec.stop_ids, max_batch=16)
            prompts = [spec.tokenizer.encode(p) for p in STORY_PROMPTS]
            ref16 = [o.token_ids for o in plain.generate(prompts, n_new, ignore_eos=True)]
            ref1 = [plain.generate([p], n_new, ignore_eos=True)[0].token_ids for p in prompts[:n_one]]
            moa1 = [spec.generate([p], n_new, num_speculative_tokens=4, ignore_eos=True)[0] for p in prompts[:n_one]]
            moa16 = spec.generate(prompts, n_new, num_speculative_tokens=4, ignore_eos=True)
            replay = ReplayProposer(prompts, ref16, 0.3, spec.verifier.arch.vocab_size, seed=0)
            noisy = SpeculativeEngine(spec.verifier, replay, spec.tokenizer, spec.stop_ids, max_batch=16)
            rep16 = noisy.generate(prompts, n_new, num_speculative_tokens=5, ignore_eos=True)
            rep1 = [noisy.generate([p], n_new, num_speculative_tokens=5, ignore_eos=True)[0] for p in prompts[:n_one]]
            sec[dtype] = {
                "packing": {k: v for k, v in spec.verifier.packing.items() if k != "kept"},
                "attention_kernel": spec.verifier.attention_kernel,
                "plain_1_vs_plain_16": compare(ref1, ref16[:n_one]),
                "moa_1_vs_plain_1": compare([o.token_ids for o in moa1], ref1),
                "moa_16_vs_plain_16": compare([o.token_ids for o in moa16], ref16),
                "replay_16_vs_plain_16": compare([o.token_ids for o in rep16], ref16),
                "replay_1_vs_plain_1": compare([o.token_ids for o in rep1], ref1),
                "tau_moa_random": round(sum(o.mean_accepted_length for o in moa16) / len(moa16), 3),
                "tau_replay": round(sum(o.mean_accepted_length for o in rep16) / len(rep16), 3),
                "new_tokens": n_new,
                "seconds": round(time.monotonic() - t, 2),
            }
            run.save()
            if dtype == "bfloat16":
                run.results["sections"].setdefault("invariance", {})["stories260k_bf16"] = invariance_probe(
                    spec.verifier, run.sizes["invariance_b"], run.device
                )
            del spec, plain, noisy
            free(run.device)
    sec["status"] = "done"


def _row_invariance(fn, x: torch.Tensor, sizes: list[int]) -> dict:
    """fn over the first m rows of x against fn over all rows: bitwise equal, max |diff|."""
    full = fn(x)
    out = {}
    for m in sizes:
        part = fn(x[:m])
        diff = (part.float() - full[:m].float()).abs().max().item()
        out[str(m)] = {"bitwise": bool(torch.equal(part, full[:m])), "max_abs_diff": diff}
    return out


def _session_invariance(fn, sizes: list[int], slots: int, width: int, argmax: bool = False) -> dict:
    """``fn(n)`` computes ``width`` rows for each of the first ``n`` sessions: are the first ``m``
    sessions' rows the same computed alone as beside all ``slots`` sessions?"""
    full = fn(slots)
    out = {}
    for m in sizes:
        if m > slots:
            continue
        part = fn(m)
        r = m * width
        out[str(m)] = {
            "bitwise": bool(torch.equal(part, full[:r])),
            "max_abs_diff": (part.float() - full[:r].float()).abs().max().item(),
        }
        if argmax:
            out[str(m)]["argmax_equal"] = bool(torch.equal(part.argmax(-1), full[:r].argmax(-1)))
    return out


@torch.inference_mode()
def invariance_probe(runner: TorchTargetRunner, sizes: list[int], device: torch.device) -> dict:
    """Is a row's result the same alone and in a batch, op by op (bfloat16 or whatever the
    runner's dtype)? ``sizes``: rows computed alone (the rest of the largest batch beside)."""
    model, arch = runner.model, runner.arch
    dtype = runner.dtype
    big = max(sizes)
    g = torch.Generator(device="cpu").manual_seed(0)
    layer = model.model.layers[0]
    x = torch.randn(big, arch.hidden_size, generator=g).to(device, dtype)
    res = {"dtype": str(dtype).removeprefix("torch."), "rows": sizes, "batch": big}
    res["linear_down_proj"] = _row_invariance(
        layer.mlp.down_proj, torch.randn(big, arch.intermediate_size, generator=g).to(device, dtype), sizes
    )
    res["linear_q_proj"] = _row_invariance(layer.self_attn.q_proj, x, sizes)
    res["lm_head"] = _row_invariance(model.lm_head, x, sizes)
    res["rmsnorm"] = _row_invariance(layer.input_layernorm, x, sizes)
    # attention over the cache and a whole forward: the first session decoding 1 (and 5) tokens at position
    # 32, alone against beside big - 1 others
    slots = min(big, runner.cache.num_slots)
    cache = model.new_cache(slots, 64, runner.cache.k.dtype)
    cache.k.normal_()
    cache.v.normal_()
    kernel = runner.attention_kernel
    for width in (1, 5):
        q = torch.randn(slots * width, arch.num_heads, arch.head_dim, generator=g).to(device, dtype)
        kv = torch.randn(slots * width, arch.num_kv_heads, arch.head_dim, generator=g).to(device, dtype)

        def attn(n, q=q, kv=kv, width=width):
            batch = PackedBatch(cache, list(range(n)), [32] * n, [width] * n, device, kernel=kernel)
            return batch.attention(0)(q[: n * width], kv[: n * width], kv[: n * width])

        res[f"attention_{width}_token"] = _session_invariance(attn, sizes, slots, width)
        tokens = torch.randint(0, arch.vocab_size, (slots * width,), generator=g).to(device)

        def forward(n, tokens=tokens, width=width):
            batch = PackedBatch(cache, list(range(n)), [32] * n, [width] * n, device, kernel=kernel)
            return model.lm_head(model.forward_packed(tokens[: n * width], batch))

        res[f"forward_logits_{width}_token"] = _session_invariance(forward, sizes, slots, width, argmax=True)
    cache = None  # frees the cache (the closures above hold the name, not the tensor)
    breaking = [op for op, v in res.items() if isinstance(v, dict) and any(not r["bitwise"] for r in v.values())]
    res["not_batch_invariant"] = breaking
    return res


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


def _prefill(runner: TorchTargetRunner, sec: dict, ids: list[str], prompts: list[list[int]], d) -> None:
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
        args = (
            [1] * (b * t),
            [s for s in slots for _ in range(t)],
            [ctx + j for _ in range(b) for j in range(t)],
            [ctx + j for _ in range(b) for j in range(t)],
        )
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


def _attention_rows(run: Run, sec: dict, arch: TargetArch, dtype: torch.dtype) -> None:
    """The two batch-invariant attention kernels side by side at long contexts: B sessions x 1 token
    at context L over a cache of 8,192 positions (GPU microseconds from a CUDA graph), whether the
    chunked kernel's rows are bitwise the same alone as in the batch, and how far the two differ."""
    d = run.device
    sec["attention"] = []
    if d.type != "cuda":
        sec["attention_skipped"] = "needs CUDA"
        return
    import triton.testing

    kvh, hd, heads, length = arch.num_kv_heads, arch.head_dim, arch.num_heads, 8193
    gen = torch.Generator(device=d).manual_seed(3)
    k = torch.randn(64, kvh, length, hd, device=d, dtype=dtype, generator=gen)
    v = torch.randn(64, kvh, length, hd, device=d, dtype=dtype, generator=gen)
    q = torch.randn(64, heads, hd, device=d, dtype=dtype, generator=gen)
    for row in _rows(run, sec["attention"], [{"B": b, "context": c} for c in (512, 2048, 8192) for b in (1, 8, 64)], 8):
        b, c = row["B"], row["context"]
        slots = torch.arange(b, device=d)
        pos = torch.full((b,), c - 1, device=d, dtype=torch.long)
        for name, fn in (
            ("per_token_us", gpu_invariant.slot_attention),
            ("chunked_us", gpu_invariant.chunked_slot_attention),
        ):
            row[name] = round(
                1e3 * triton.testing.do_bench_cudagraph(lambda fn=fn: fn(q[:b], k, v, slots, pos), rep=20), 1
            )
        row["chunked_speedup"] = round(row["per_token_us"] / row["chunked_us"], 2)
        full = gpu_invariant.chunked_slot_attention(q[:b], k, v, slots, pos)
        row["chunked_row_alone_bitwise"] = bool(
            torch.equal(gpu_invariant.chunked_slot_attention(q[:1], k, v, slots[:1], pos[:1]), full[:1])
        )
        row["max_abs_diff"] = float(
            (full.float() - gpu_invariant.slot_attention(q[:b], k, v, slots, pos).float()).abs().max()
        )
        run.save()
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
    runner = TorchTargetRunner(
        "",
        dtype,
        str(d),
        max_sessions=bmax,
        max_model_len=room,
        features=MoAFeatures(moa.feature_head),
        model=target,
        options=RunnerOptions(max_num_batched_tokens=8192, prefix_caching=False),
    )
    sec["verifier_fused_projections"] = runner.packing.get("fused_projections", 0)
    sec["verifier_attention_kernel"] = runner.attention_kernel
    sec["verifier_batch_invariant_matmuls"] = runner.packing.get("batch_invariant_matmuls", 0)
    sec["verifier_batch_invariant_norms"] = runner.packing.get("batch_invariant_norms", 0)
    sec["verifier_static_forward"] = runner.static is not None
    g = random.Random(0)
    vocab = shape["vocab_size"]
    prompts = [[g.randrange(vocab) for _ in range(ctx)] for _ in range(bmax)]
    ids = [f"v{i}" for i in range(bmax)]
    _prefill(runner, sec, ids, prompts, d)
    _verify_rows(run, sec, runner, target, ids, g, vocab)
    _invariance_cost_rows(run, sec, runner, target, ids)
    _attention_rows(run, sec, target.arch, dtype)
    for i in ids:
        runner.release(i)
    proposer = MoAProposer(
        DrafterConfig(target=target.arch), moa.draft_head, TargetParts(target, 0), max_sessions=bmax, max_model_len=room
    )
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


def fit_section(run: Run, models: dict) -> None:
    """deployments/fit.py's arithmetic for gpu.yaml next to what the torch backend holds at that
    session shape (measured on CUDA only)."""
    sec = run.section("fit")
    try:
        import yaml

        args = yaml.safe_load((ROOT / "deployments" / "configs" / "gpu.yaml").read_text())["applications"][0]["args"]
        cfg = AppConfig.model_validate(args)
        tshape = fit.ModelShape.from_hf(llama_config(LLAMA3_8B))
        dshape = fit.drafter_shape(cfg.drafter, tshape)
        arithmetic = fit.fits(cfg, tshape, dshape)
        sec["fit_py"] = [
            {
                "pool": f.pool,
                "weights_gib": round(f.weights / GiB, 3),
                "kv_gib": round(f.kv / GiB, 3),
                "activations_gib": round(f.activations / GiB, 3),
                "total_gib": round(f.total / GiB, 3),
                "capacity_gib": round(f.capacity / GiB, 3),
                "describe": f.describe(),
            }
            for f in arithmetic
        ]
        sec["session_shape"] = {
            "max_sessions": cfg.verifier_pool.max_sessions,
            "max_model_len": cfg.max_model_len,
            "kv_cache_gib": cfg.verifier_pool.kv_cache_gib,
            "max_num_batched_tokens": cfg.verifier_pool.max_num_batched_tokens,
            "num_speculative_tokens": cfg.num_speculative_tokens,
            "drafter_max_sessions": cfg.drafter_pool.max_sessions,
        }
    except Exception as exc:  # noqa: BLE001 - a failure here (e.g. no PyYAML) must not cost the other sections
        sec["fit_py_error"] = f"{type(exc).__name__}: {exc}"
        cfg = None
    run.save()
    d = run.device
    if d.type != "cuda" or cfg is None or run.toy:
        sec["measured"] = "needs CUDA and the 8B shape (not measured in this run)"
        sec["status"] = "done"
        run.save()
        return
    target, moa = models["target"], models["moa"]
    vp = cfg.verifier_pool
    arch = target.arch
    per_token = arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * 2
    # the torch backend preallocates whole slots: as many full slots as the paged cache's tokens
    tokens = int(vp.kv_cache_gib * GiB) // per_token
    slots = min(vp.max_sessions, tokens // cfg.max_model_len)
    max_len = tokens // slots - 1
    free(d)
    base = torch.cuda.memory_allocated(d)
    cache = target.new_cache(slots, max_len)
    cache_bytes = torch.cuda.memory_allocated(d) - base
    m = {
        "slots": slots,
        "max_len": max_len,
        "weights_gib": round(param_bytes(target) / GiB, 3),
        "kv_cache_gib": round(cache_bytes / GiB, 3),
        "allocated_before_forwards_gib": round(torch.cuda.memory_allocated(d) / GiB, 3),
    }
    sec["measured_verifier"] = m
    run.save()
    with torch.inference_mode():
        torch.cuda.reset_peak_memory_stats(d)
        chunk = vp.max_num_batched_tokens
        batch = PackedBatch(cache, [0], [0], [chunk], d)
        hidden = target.forward_packed(torch.randint(0, arch.vocab_size, (chunk,), device=d), batch)
        logits = target.lm_head(hidden).float()  # fit.py's logits bound: every token of the chunk
        del hidden, logits
        sync(d)
        m["prefill_chunk_peak_gib"] = round(torch.cuda.max_memory_allocated(d) / GiB, 3)
        torch.cuda.reset_peak_memory_stats(d)
        k1 = cfg.num_speculative_tokens + 1
        batch = PackedBatch(cache, list(range(slots)), [max_len - k1 - 1] * slots, [k1] * slots, d)
        hidden = target.forward_packed(torch.randint(0, arch.vocab_size, (slots * k1,), device=d), batch)
        target.lm_head(hidden).float().argmax(-1)
        sync(d)
        m["decode_all_sessions_peak_gib"] = round(torch.cuda.max_memory_allocated(d) / GiB, 3)
        m["activations_peak_gib"] = round(
            max(m["prefill_chunk_peak_gib"], m["decode_all_sessions_peak_gib"]) - m["allocated_before_forwards_gib"], 3
        )
    del cache, batch, hidden
    free(d)
    run.save()
    # drafter replica: its caches for gpu.yaml's drafter max_sessions at full context
    if run.left() > 20:
        base = torch.cuda.memory_allocated(d)
        n = cfg.drafter_pool.max_sessions
        proposer = MoAProposer(
            DrafterConfig(target=arch),
            moa.draft_head,
            TargetParts(target, 0),
            max_sessions=n,
            max_model_len=cfg.max_model_len,
        )
        caches = torch.cuda.memory_allocated(d) - base
        parts = TargetParts(target, 0)
        md = {
            "max_sessions": n,
            "caches_gib": round(caches / GiB, 3),
            "borrowed_gib": round((param_bytes(parts.embed_tokens) + param_bytes(parts.lm_head)) / GiB, 3),
            "draft_head_gib": round(param_bytes(moa.draft_head) / GiB, 3),
        }
        torch.cuda.reset_peak_memory_stats(d)
        before = torch.cuda.memory_allocated(d)
        g = random.Random(1)
        proposer.propose(
            [
                DraftRequest(
                    f"f{i}",
                    [g.randrange(arch.vocab_size) for _ in range(16)],
                    cfg.num_speculative_tokens,
                    0,
                    torch.randn(16, arch.hidden_size).to(target.lm_head.weight.dtype),
                )
                for i in range(n)
            ]
        )
        sync(d)
        md["draft_call_activations_gib"] = round((torch.cuda.max_memory_allocated(d) - before) / GiB, 3)
        sec["measured_drafter"] = md
        del proposer
        free(d)
    sec["status"] = "done"
    run.save()


def e2e_section(run: Run, models: dict, dtype: torch.dtype) -> None:
    """The engine with a replaying proposer at controlled acceptance against plain decoding."""
    sec = run.section("e2e")
    d, sz = run.device, run.sizes
    target = models["target"]
    vocab = target.arch.vocab_size
    n_new, plen = sz["e2e_new"], sz["e2e_prompt"]
    bmax = max(sz["e2e_b"])
    runner = TorchTargetRunner(
        "",
        dtype,
        str(d),
        max_sessions=bmax,
        max_model_len=plen + n_new + 16,
        model=target,
        options=RunnerOptions(max_num_batched_tokens=8192, prefix_caching=False),
    )
    g = random.Random(2)
    prompts_all = [[g.randrange(vocab) for _ in range(plen)] for _ in range(bmax)]
    draft_ms = {
        (r["B"], r["K"]): r["ms"] for r in run.results["sections"].get("production", {}).get("draft", []) if "ms" in r
    }
    sec["rows"] = []
    sec["new_tokens"], sec["prompt_tokens"] = n_new, plen
    sec["note"] = (
        "the replaying proposer drafts for free; est_moa_tok_s adds the measured MoA drafting "
        "latency (production section) per round"
    )
    plain = SpeculativeEngine(runner, None, None, frozenset(), max_batch=bmax)
    plain.generate(prompts_all[:1], 4, ignore_eos=True)  # warm-up
    for b in sz["e2e_b"]:
        if run.left() < 15:
            sec["rows"].append({"B": b, "skipped": "out of time"})
            continue
        prompts = prompts_all[:b]
        plain.max_batch = b
        sync(d)
        t = time.perf_counter()
        base = plain.generate(prompts, n_new, ignore_eos=True)
        sync(d)
        base_s = time.perf_counter() - t
        refs = [o.token_ids for o in base]
        base_tps = b * n_new / base_s
        row = {
            "B": b,
            "K": 0,
            "tau_target": None,
            "tokens_per_s": round(base_tps, 1),
            "s": round(base_s, 3),
            "speedup": 1.0,
        }
        sec["rows"].append(row)
        # the graphed plain-PyTorch step over the same weights, at the generation's mean context
        anchor = anchor_row(target, b, plen + n_new // 2, reps=sz["reps"] * 4)
        row.update(anchor_tokens_per_s=anchor["tokens_per_s"], vs_anchor=round(base_tps / anchor["tokens_per_s"], 3))
        sec.setdefault("anchor", []).append(anchor)
        run.save()
        diverged: dict[int, list[int]] = {}  # session -> a speculative output that is not the plain one
        for tau in sz["e2e_tau"]:
            for k in sz["e2e_k"]:
                p = corruption_for(tau, k)
                if p is None:
                    continue
                row = {"B": b, "K": k, "tau_target": tau, "corruption": round(p, 4)}
                sec["rows"].append(row)
                if run.left() < 5:
                    row["skipped"] = "out of time"
                    continue
                proposer = ReplayProposer(prompts, refs, p, vocab, seed=int(tau * 10) + k)
                engine = SpeculativeEngine(runner, proposer, None, frozenset(), max_batch=b)
                sync(d)
                t = time.perf_counter()
                outs = engine.generate(prompts, n_new, num_speculative_tokens=k, ignore_eos=True)
                sync(d)
                s = time.perf_counter() - t
                tps = b * n_new / s
                row.update(
                    tau=round(sum(o.mean_accepted_length for o in outs) / b, 3),
                    rounds=engine.last_stats.rounds,
                    tokens_per_s=round(tps, 1),
                    s=round(s, 3),
                    speedup=round(tps / base_tps, 3),
                    identical_to_plain=compare([o.token_ids for o in outs], refs)["identical"],
                )
                for i, o in enumerate(outs):
                    if o.token_ids != refs[i]:
                        diverged.setdefault(i, o.token_ids)
                dm = draft_ms.get((b, k))
                if dm is not None:
                    est = s + engine.last_stats.rounds * dm / 1e3
                    row["est_moa_tok_s"] = round(b * n_new / est, 1)
                    row["est_moa_speedup"] = round(b * n_new / est / base_tps, 3)
                run.save()
        if diverged:  # which side is off: each diverging session decoded alone, plainly
            for i in sorted(diverged)[:4]:
                alone = plain.generate([prompts[i]], n_new, ignore_eos=True)[0].token_ids
                sec.setdefault("divergence", []).append(
                    {
                        "B": b,
                        "session": i,
                        "plain_batch_vs_alone": compare([refs[i]], [alone])["first_divergence"],
                        "speculative_vs_alone": compare([diverged[i]], [alone])["first_divergence"],
                    }
                )
            run.save()
    sec["status"] = "done"
    del runner
    free(d)


# ---------------------------------------------------------------------------------- report
def _table(rows: list[dict], cols: list[str]) -> str:
    if not rows:
        return "(none)\n"
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append(
            "| "
            + " | ".join(
                _cell(r.get(c, r.get("skipped", "")) if c in r or "skipped" not in r else r["skipped"]) for c in cols
            )
            + " |"
        )
    return "\n".join(out) + "\n"


def _cell(v) -> str:
    if isinstance(v, dict):
        return str(v.get("ms", v))
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def markdown(results: dict) -> str:
    s = results["sections"]
    lines = ["# MoA-Serve GPU check", ""]
    env = s.get("env", {})
    lines.append(
        "Device: "
        + ", ".join(f"{k} {env[k]}" for k in ("gpu", "device", "torch", "cuda", "transformers") if env.get(k))
        + f"; toy: {env.get('toy')}; elapsed {results['meta'].get('elapsed_s')} s"
    )
    lines.append("")
    c = s.get("correctness", {})
    if c:
        lines += ["## Correctness: greedy speculative vs plain decoding (stories260k)", ""]
        rows = []
        for dt, v in c.items():
            if not isinstance(v, dict):
                continue
            if "skipped" in v:
                rows.append({"dtype": dt, "check": v["skipped"]})
                continue
            for key in (
                "plain_1_vs_plain_16",
                "moa_1_vs_plain_1",
                "moa_16_vs_plain_16",
                "replay_1_vs_plain_1",
                "replay_16_vs_plain_16",
            ):
                r = v[key]
                rows.append(
                    {
                        "dtype": dt,
                        "check": key,
                        "identical": f"{r['identical']}/{r['sessions']}",
                        "first divergence": r["first_divergence"],
                    }
                )
        lines.append(_table(rows, ["dtype", "check", "identical", "first divergence"]))
    inv = s.get("invariance", {})
    for name, v in inv.items():
        if not isinstance(v, dict) or "rows" not in v:
            continue
        lines += [f"## Batch invariance ({name}, {v['dtype']}): row results alone vs in a batch of {v['batch']}", ""]
        rows = []
        for op, r in v.items():
            if isinstance(r, dict):
                rows.append(
                    {
                        "op": op,
                        **{
                            f"{m} rows": ("bitwise" if x["bitwise"] else f"diff {x['max_abs_diff']:.3g}")
                            for m, x in r.items()
                        },
                    }
                )
        lines.append(_table(rows, ["op"] + [f"{m} rows" for m in v["rows"]]))
        lines.append(f"Not batch-invariant: {', '.join(v['not_batch_invariant']) or 'none'}\n")
    p = s.get("production", {})
    if p:
        lines += ["## Production shape: verify latency (ms, one call, MoA features included)", ""]
        lines.append(
            _table(
                p.get("verify", []),
                ["B", "K+1", "ms", "forward_only", "device_busy_ms", "host_overhead_ms", "tokens_per_s_verified"],
            )
        )
        lines += ["## What batch invariance costs: one forward, ms (served: graphs + Triton matmuls and attention)", ""]
        lines.append(
            _table(
                p.get("invariance_cost", []),
                ["B", "T", "served_ms", "graph_cublas_ms", "eager_cublas_sdpa_ms", "invariance_cost", "vs_eager"],
            )
        )
        if "invariance_cost_skipped" in p:
            lines.append(f"Not measured: {p['invariance_cost_skipped']}\n")
        lines.append(f"Runner statistics: {p.get('runner_stats', {})}\n")
        lines += ["## Attention kernels: per token vs chunked (GPU us, B sessions x 1 token, 8,192-position cache)", ""]
        lines.append(
            _table(
                p.get("attention", []),
                [
                    "B",
                    "context",
                    "per_token_us",
                    "chunked_us",
                    "chunked_speedup",
                    "chunked_row_alone_bitwise",
                    "max_abs_diff",
                ],
            )
        )
        if "attention_skipped" in p:
            lines.append(f"Not measured: {p['attention_skipped']}\n")
        lines += ["## Drafting latency per K (paper-sized MoA draft head)", ""]
        lines.append(_table(p.get("draft", []), ["B", "K", "ms", "ms_per_step", "device_busy_ms", "host_overhead_ms"]))
        lines.append(f"Static draft steps (CUDA graphs): {p.get('draft_static_steps')}\n")
        lines += ["## One engine round (draft + verify + commit), K = 4", ""]
        lines.append(
            _table(p.get("round", []), ["B", "ms", "draft_ms", "verify_ms", "device_busy_ms", "host_overhead_ms"])
        )
        if p.get("round_profile"):
            rp = p["round_profile"]
            lines += [f"Host functions of a round at B = {rp['B']} by own time (cProfile, ms per round):", ""]
            lines.append(_table(rp["top"], ["function", "calls", "own_ms", "cumulative_ms"]))
    f = s.get("fit", {})
    if f:
        lines += ["## Memory: deployments/fit.py for gpu.yaml vs measured", ""]
        for r in f.get("fit_py", []):
            lines.append(f"- fit.py {r['describe']}")
        if "fit_py_error" in f:
            lines.append(f"- fit.py not run: {f['fit_py_error']}")
        for key in ("measured_verifier", "measured_drafter"):
            if key in f:
                lines.append(f"- {key}: " + ", ".join(f"{k} {v}" for k, v in f[key].items()))
        if isinstance(f.get("measured"), str):
            lines.append(f"- measured: {f['measured']}")
        lines.append("")
    e = s.get("e2e", {})
    if e:
        lines += [
            f"## End to end: engine at controlled acceptance vs no speculation "
            f"({e.get('new_tokens')} new tokens, {e.get('prompt_tokens')}-token prompts)",
            "",
        ]
        lines.append(
            _table(
                e.get("rows", []),
                [
                    "B",
                    "K",
                    "tau_target",
                    "tau",
                    "tokens_per_s",
                    "speedup",
                    "anchor_tokens_per_s",
                    "vs_anchor",
                    "est_moa_tok_s",
                    "est_moa_speedup",
                    "identical_to_plain",
                ],
            )
        )
        lines.append(e.get("note", "") + "\n")
    errs = {k: v["error"] for k, v in s.items() if isinstance(v, dict) and "error" in v}
    for k, v in errs.items():
        lines.append(f"**{k} failed**: `{v.splitlines()[-1] if v else v}`\n")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--toy", action="store_true", help="tiny shapes and lists (runs on a CPU in about a minute)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--budget-s", type=float, default=None, help="whole run (default 540, toy 150)")
    ap.add_argument("--sections", default="correctness,production,fit,e2e")
    a = ap.parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    a.out.mkdir(parents=True, exist_ok=True)
    run = Run(a.out, a.budget_s or (150 if a.toy else 540), device, a.toy)
    run.results["meta"].update(argv=sys.argv[1:], budget_s=run.budget_s)
    if device.type == "cpu" and a.toy:
        # a toy run on a shared CI CPU: one thread (OpenMP workers spinning against other processes
        # made a 16-session decode of stories260k 8x slower with 2 threads than with 1)
        torch.set_num_threads(1)
    torch.manual_seed(0)
    env_section(run)
    run.save()
    wanted = a.sections.split(",")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = TOY_LLAMA if a.toy else LLAMA3_8B
    models = None
    plan = [
        ("correctness", 0.13, lambda: correctness_section(run, ["float32", "bfloat16"])),
        ("production", 0.52, None),
        ("fit", 0.62, None),
        ("e2e", 0.97, None),
    ]
    for name, until, fn in plan:
        if name not in wanted:
            continue
        run.until(until)
        try:
            if name == "correctness":
                fn()
            elif name == "production":
                models = production_section(run, shape, dtype)
            else:
                if models is None:
                    models = {"target": random_target(shape, dtype, device)}
                    models["moa"] = random_moa(models["target"], dtype, device)
                (fit_section(run, models) if name == "fit" else e2e_section(run, models, dtype))
        except Exception:  # noqa: BLE001 - one section's failure is a result; the others still run
            sec = run.section(name)
            sec["status"] = "failed"
            sec["error"] = traceback.format_exc()[-4000:]
            print(sec["error"], file=sys.stderr)
            free(device)
        run.save()
        print(f"[{time.monotonic() - run.t0:6.1f}s] {name}: {run.section(name).get('status')}", flush=True)
    run.results["meta"]["finished"] = True
    run.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
