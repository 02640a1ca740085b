"""The GPU check's ``env`` and ``correctness`` sections, and the batch-invariance probe: greedy
speculative decoding against plain decoding on a real checkpoint, and whether a row's result is
the same alone and in a batch, op by op."""

from __future__ import annotations

import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from moa_serve.drafter.checkpoint import init_drafter
from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.model.kv_cache import PackedBatch
from moa_serve.verifier.torch.runner import TorchTargetRunner
from tools.gpu.harness import (
    ROOT,
    STORY_PROMPTS,
    GiB,
    Run,
    compare,
    free,
)
from tools.gpu.replay import ReplayProposer


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
