"""How fast the batch-invariant matmul is at each tile configuration, beside cuBLAS, on the
weights of a Llama-3-8B-shaped target (one GPU; random bfloat16 weights drawn on the device).

``moa_serve.kernels.gpu_invariant.tile_config`` picks one configuration per weight shape, never
per number of rows M (that is what keeps a row's result independent of its batch), so one
configuration has to serve a decode step of one row and a prefill chunk of 512. This sweep
measures every candidate at several M (CUDA-graph timing, ``triton.testing.do_bench_cudagraph``)
and checks that each is batch-invariant (a row alone = the same row among 64 and among 512).

    python tools/gpu/tile_sweep.py --out DIR [--budget-s 120]

Writes DIR/tile_sweep.json (every measurement) and prints, per weight and M, cuBLAS, the shipped
``tile_config`` and the fastest candidate.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moa_serve.kernels import gpu_invariant  # noqa: E402
from moa_serve.kernels.gpu_invariant import Tiles  # noqa: E402

# (N, K) of Llama-3-8B's weights: fused q/k/v, o, fused gate/up, down, LM head
SHAPES = {
    "down": (4096, 14336),
    "o_proj": (4096, 4096),
    "qkv": (6144, 4096),
    "gate_up": (28672, 4096),
    "lm_head": (128256, 4096),
}
ROWS = (1, 8, 64, 256, 512)
# (block_m, block_n, block_k, num_warps, num_stages)
BASES = [
    (16, 64, 128, 4, 4),
    (16, 128, 128, 4, 4),
    (32, 64, 64, 4, 3),
    (32, 64, 128, 4, 4),
    (64, 64, 64, 4, 4),
    (64, 128, 64, 4, 3),
    (64, 128, 64, 8, 4),
    (128, 128, 64, 8, 3),
]
SPLITS = (1, 2, 4, 8)


def bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=15))


def invariant(x: torch.Tensor, w: torch.Tensor, tiles: Tiles) -> bool:
    big = gpu_invariant.matmul(x, w, tiles=tiles)
    mid = gpu_invariant.matmul(x[:64], w, tiles=tiles)
    return (
        torch.equal(gpu_invariant.matmul(x[:1], w, tiles=tiles), big[:1])
        and torch.equal(mid, big[:64])
        and torch.equal(gpu_invariant.matmul(x[:8], w, tiles=tiles), big[:8])
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--budget-s", type=float, default=120.0)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tile_sweep: needs a CUDA device", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + a.budget_s
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    res = {
        "device": torch.cuda.get_device_name(dev),
        "sms": torch.cuda.get_device_properties(dev).multi_processor_count,
        "rows": ROWS,
        "shapes": {},
        "rms_norm": {},
    }
    out_file = a.out / "tile_sweep.json"

    # torch's RMSNorm arithmetic vs the Triton one: a row alone vs among 64 / 512 (hidden 4096)
    from moa_serve.model.layers import RMSNorm

    norm = RMSNorm(4096, 1e-5).to(dev, torch.bfloat16)
    xs = torch.randn(512, 4096, device=dev, dtype=torch.bfloat16, generator=g)
    for name, fn in (("torch", norm), ("triton", lambda x: gpu_invariant.rms_norm(x, norm.weight, norm.eps))):
        full = fn(xs)
        res["rms_norm"][name] = {str(m): bool(torch.equal(fn(xs[:m]), full[:m])) for m in (1, 2, 8, 64)}
    print("rms_norm row invariance (rows alone vs among 512):", res["rms_norm"], flush=True)

    for label, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        x = torch.randn(max(ROWS), k, device=dev, dtype=torch.bfloat16, generator=g)
        shipped = gpu_invariant.tile_config(n, k)
        entry = res["shapes"][label] = {
            "N": n,
            "K": k,
            "cublas_ms": {},
            "shipped": vars(shipped).copy(),
            "candidates": [],
        }
        for m in ROWS:
            entry["cublas_ms"][str(m)] = round(bench(lambda m=m: F.linear(x[:m], w)), 4)
        entry["shipped_ms"] = {
            str(m): round(bench(lambda m=m: gpu_invariant.matmul(x[:m], w, tiles=shipped)), 4) for m in ROWS
        }
        entry["shipped_invariant"] = invariant(x, w, shipped)
        for (bm, bn, bk, warps, stages), split in itertools.product(BASES, SPLITS):
            if time.monotonic() > deadline:
                entry["cut"] = "out of time"
                break
            if k // bk // split < 4:
                continue
            tiles = Tiles(bm, bn, bk, split, warps, stages)
            row = {"tiles": vars(tiles).copy()}
            try:
                row["ms"] = {
                    str(m): round(bench(lambda m=m: gpu_invariant.matmul(x[:m], w, tiles=tiles)), 4) for m in ROWS
                }
                row["invariant"] = invariant(x, w, tiles)
            except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is a result
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            entry["candidates"].append(row)
        ok = [c for c in entry["candidates"] if "ms" in c and c["invariant"]]
        for m in ROWS:
            best = min(ok, key=lambda c: c["ms"][str(m)]) if ok else None
            print(
                f"{label:8s} M={m:4d} cublas {entry['cublas_ms'][str(m)]:8.4f} ms  "
                f"shipped {entry['shipped_ms'][str(m)]:8.4f}"
                + (f"  best {best['ms'][str(m)]:8.4f} {tuple(best['tiles'].values())}" if best else ""),
                flush=True,
            )
        out_file.write_text(json.dumps(res, indent=1))
        w = x = None  # frees the operands before the next shape
        torch.cuda.empty_cache()
    out_file.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
