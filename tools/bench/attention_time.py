"""Time the attention kernel over a bfloat16 KV cache at SmolLM2's shape (9 query heads over 3 KV
heads of 64 dims), as one layer of a batched decode step sees it.

    python -m tools.bench.attention_time                          # 1, 16, 64 sessions x 128, 256, 512 keys
    python -m tools.bench.attention_time --batch 64 --keys 256 --threads 2

Each of the ``batch`` tokens sits in its own cache slot and attends to ``keys`` positions (its
context so far). Prints a markdown table of the median milliseconds per call (one layer; a forward
of SmolLM2 makes 30 such calls) and the K/V bytes read per second."""

from __future__ import annotations

import argparse

import torch

from moa_serve.kernels import cpu as cpu_kernels
from tools.bench.matmul_precisions import time_call

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="attention_time", description=__doc__.split("\n")[0])
    p.add_argument("--batch", default="1,16,64", help="tokens per call (sessions, one per slot), comma-separated")
    p.add_argument("--keys", default="128,256,512", help="context lengths, comma-separated")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if cpu_kernels.library() is None:
        raise SystemExit(f"packed kernels unavailable here: {cpu_kernels.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    sessions = [int(x) for x in args.batch.split(",")]
    keys = [int(x) for x in args.keys.split(",")]
    g = torch.Generator().manual_seed(0)
    print("| sessions | keys | ms per layer | K/V GB/s |")
    print("| ---: | ---: | ---: | ---: |")
    for n in sessions:
        for length in keys:
            k = torch.randn(n, KV_HEADS, length, HEAD_DIM, generator=g).to(torch.bfloat16)
            v = torch.randn(n, KV_HEADS, length, HEAD_DIM, generator=g).to(torch.bfloat16)
            q = torch.randn(n, HEADS, HEAD_DIM, generator=g)
            slots, positions = torch.arange(n), torch.full((n,), length - 1)
            ms = time_call(lambda: cpu_kernels.attention(q, k, v, slots, positions))
            gbps = (k.numel() + v.numel()) * 2 / (ms * 1e-3) / 1e9
            print(f"| {n} | {length} | {ms:.3f} | {gbps:.1f} |", flush=True)


if __name__ == "__main__":
    main()
