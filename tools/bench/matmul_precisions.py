"""Time the packed matmul kernels at each matmul precision on a GGUF target's own matrices.

    python -m tools.bench.matmul_precisions                    # SmolLM2-135M-Instruct's Q4_1 GGUF
    python -m tools.bench.matmul_precisions --rows 1,5,16,64 --out benchmarks/kernels/matmul-precisions.md

For each matrix (one decoder layer's projections and the LM head) and each number of rows of x (the
tokens of one forward), the median of repeated calls per precision: float32 products (``highest``),
bfloat16 products (``medium``, where the CPU has AVX512-BF16) and 8-bit activations (``low``).
Prints a markdown table (and writes it with ``--out``)."""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from moa_serve.kernels import cpu as cpu_kernels
from moa_serve.kernels.packed import PRECISION_PRODUCTS, PackedMatrix, gguf_file
from moa_serve.model_files import resolve_model_path

MATRICES = ("blk.0.attn_q.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "token_embd.weight")


def time_call(fn, min_seconds: float = 0.3) -> float:
    """Median milliseconds of ``fn()`` over calls spanning about ``min_seconds`` (after 5 warm-up calls)."""
    for _ in range(5):
        fn()
    samples, spent = [], 0.0
    while spent < min_seconds or len(samples) < 5:
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
        spent += samples[-1]
    return 1e3 * statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="matmul_precisions", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="HuggingFaceTB/SmolLM2-135M-Instruct", help="a model folder with a GGUF")
    p.add_argument("--rows", default="1,2,5,16,64", help="rows of x (tokens per forward), comma-separated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, help="also write the table here")
    args = p.parse_args(argv)
    if cpu_kernels.library() is None:
        raise SystemExit(f"packed kernels unavailable here: {cpu_kernels.unavailable_reason()}")
    import gguf

    torch.set_num_threads(args.threads)
    path = gguf_file(resolve_model_path(args.target))
    if path is None:
        raise SystemExit(f"{args.target}: no GGUF file")
    reader = gguf.GGUFReader(path)
    matrices = {t.name: PackedMatrix.from_gguf(t) for t in reader.tensors if t.name in MATRICES}
    precisions = [prec for prec in PRECISION_PRODUCTS if prec != "medium" or cpu_kernels.bf16_dot_available()]
    rows = [int(r) for r in args.rows.split(",")]
    lines = [
        f"Milliseconds per matmul (median), {args.threads} threads, {platform.processor() or platform.machine()}, "
        f"{date.today()}; {Path(path).name}.",
        "",
        "| matrix | N x K | rows of x | " + " | ".join(precisions) + " | low vs highest |",
        "| --- | --- | ---: | " + " | ".join("---:" for _ in precisions) + " | ---: |",
    ]
    print("\n".join(lines), flush=True)
    for name, pm in matrices.items():
        n, k = pm.shape
        variants = {prec: PackedMatrix(pm.kind, pm.qs, pm.d, pm.m, PRECISION_PRODUCTS[prec]) for prec in precisions}
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            ms = {prec: time_call(lambda v=v: v.matmul_t(x)) for prec, v in variants.items()}
            line = (
                f"| {name} ({pm.kind}) | {n} x {k} | {m} | "
                + " | ".join(f"{ms[prec]:.3f}" for prec in precisions)
                + f" | {ms['highest'] / ms['low']:.2f}x |"
            )
            lines.append(line)
            print(line, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
