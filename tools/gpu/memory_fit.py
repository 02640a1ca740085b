"""The GPU check's ``fit`` section: deployments/fit.py's arithmetic for gpu.yaml next to the memory
the torch backend holds at that session shape."""

from __future__ import annotations

import random

import torch

from moa_serve.deployments import fit
from moa_serve.deployments.config import AppConfig
from moa_serve.drafter.moa_model import TargetParts
from moa_serve.model.kv_cache import PackedBatch
from moa_serve.protocol import DraftRequest
from tools.gpu.harness import (
    LLAMA3_8B,
    ROOT,
    GiB,
    Run,
    free,
    llama_config,
    param_bytes,
    sync,
)
from tools.gpu.production import moa_proposer


def fit_section(run: Run, models: dict) -> None:
    """deployments/fit.py's arithmetic for gpu.yaml next to what the torch backend holds at that
    session shape (measured on CUDA only)."""
    sec = run.section("fit")
    cfg = _fit_py(sec)
    run.save()
    d = run.device
    if d.type != "cuda" or cfg is None or run.toy:
        sec["measured"] = "needs CUDA and the 8B shape (not measured in this run)"
        sec["status"] = "done"
        run.save()
        return
    _measure_verifier(run, sec, cfg, models["target"])
    # drafter replica: its caches for gpu.yaml's drafter max_sessions at full context
    if run.left() > 20:
        _measure_drafter(run, sec, cfg, models["target"], models["moa"])
    sec["status"] = "done"
    run.save()


def _fit_py(sec: dict) -> AppConfig | None:
    """fit.py's arithmetic for gpu.yaml at the Llama-3-8B shape; the config, or None where it failed."""
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
        return None
    return cfg


def _measure_verifier(run: Run, sec: dict, cfg: AppConfig, target) -> None:
    """The verifier's weights, KV cache and forward peaks at gpu.yaml's session shape."""
    d = run.device
    vp = cfg.verifier_pool
    arch = target.arch
    per_token = arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * 2
    if vp.kv_cache_gib is None:  # backend torch: max_sessions full contexts, as the config's runner holds them
        slots, max_len = vp.max_sessions, cfg.max_model_len
    else:  # whole slots: as many full slots as the paged cache's tokens
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


def _measure_drafter(run: Run, sec: dict, cfg: AppConfig, target, moa) -> None:
    """A drafter replica's caches for gpu.yaml's drafter max_sessions at full context, and one draft
    call's activations."""
    d, arch = run.device, target.arch
    base = torch.cuda.memory_allocated(d)
    n = cfg.drafter_pool.max_sessions
    proposer = moa_proposer(target, moa, n, cfg.max_model_len)
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
