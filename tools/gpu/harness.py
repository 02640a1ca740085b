"""What the GPU check's sections share: the run (results, deadlines, output files), timing on the
device, memory, the shapes and sizes of a run, and random models drawn on the device."""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

import torch

from moa_serve import synthetic
from moa_serve.drafter.config import DrafterConfig
from moa_serve.drafter.moa_model import MoADrafter
from moa_serve.model.layers import Rotary
from moa_serve.model.target import TargetModel
from moa_serve.synthetic import randomize_
from tools import prompts
from tools.gpu.report import markdown

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30

# Meta-Llama-3-8B-Instruct's config.json, the shape moa_serve/shapes ships
LLAMA3_8B = json.loads((synthetic.SHAPES / "llama-3-8b-shape" / "config.json").read_text())
TOY_LLAMA = dict(  # Llama-3-8B's config at toy size
    LLAMA3_8B,
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=192,
    max_position_embeddings=2048,
)

STORY_PROMPTS = prompts.STORY_PROMPTS[:16]

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


class ResultFiles:
    """A run's results (``meta`` and ``sections``) under ``out`` as ``<name>.json`` and, rendered by
    ``render``, ``<name>.md``: both rewritten whole after every step."""

    def __init__(self, out: Path, name: str, render, digits: int):
        self.out, self.name, self.render, self.digits = out, name, render, digits
        self.t0 = time.monotonic()
        self.results: dict = {"meta": {}, "sections": {}}

    def section(self, name: str) -> dict:
        return self.results["sections"].setdefault(name, {"status": "running"})

    def save(self) -> None:
        self.results["meta"]["elapsed_s"] = round(time.monotonic() - self.t0, self.digits)
        tmp = self.out / f"{self.name}.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1, default=str))
        os.replace(tmp, self.out / f"{self.name}.json")
        (self.out / f"{self.name}.md").write_text(self.render(self.results))


class Run(ResultFiles):
    """Results, deadlines and the output files."""

    def __init__(self, out: Path, budget_s: float, device: torch.device, toy: bool):
        super().__init__(out, "results", markdown, 2)
        self.budget_s = budget_s
        self.device = device
        self.toy = toy
        self.sizes = TOY if toy else FULL
        self.deadline = self.t0 + budget_s

    def until(self, fraction: float) -> None:
        """The current section ends at this fraction of the budget."""
        self.deadline = self.t0 + fraction * self.budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()


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


def random_target(shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0) -> TargetModel:
    """A TargetModel of ``shape`` with random weights drawn on ``device``: the product's synthetic
    target (``moa_serve/synthetic.py``, ``load_format: dummy``)."""
    return synthetic.random_target(llama_config(shape), dtype, device, seed)


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
