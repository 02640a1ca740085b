"""The verifier's own step, without the cluster: prefill of a fresh prompt and one-token decode
steps, per matmul precision — the numbers to set beside ``llama-bench -p 64 -n 64`` (llama.cpp's
pp64 / tg64 for the same GGUF).

    python -m tools.bench.step_time                            # low, medium, highest; 64-token prompts
    MOA_VNNI=off python -m tools.bench.step_time --precisions low   # the AVX2 tiles

Each repetition prefills a new random 64-token prompt through the verifier runner (the path a
``verify`` call takes, Python included) and decodes ``--steps`` tokens one call each; the medians
over repetitions (the first prompt is a warm-up) are printed as a markdown table."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.model_files import resolve_model_path
from moa_serve.protocol import VerifyRequest


def measure(path: str, precision: str, prompt_len: int, steps: int, reps: int, seed: int = 0) -> tuple[float, float]:
    """(median prefill seconds, median decode-step seconds) of a float32 GGUF target at ``precision``."""
    runner = SpeculativeEngine.load(
        path, None, "float32", matmul_precision=precision, kv_cache_dtype="bfloat16"
    ).verifier
    g = torch.Generator().manual_seed(seed)
    prefill, step = [], []
    for rep in range(reps + 1):
        sid, tokens = f"bench{rep}", torch.randint(100, 40000, (prompt_len,), generator=g).tolist()
        t = time.perf_counter()
        out = runner.verify([VerifyRequest(sid, tokens=tokens, want_features=False)])
        if rep:
            prefill.append(time.perf_counter() - t)
        tokens = tokens + out[0].tokens
        for i in range(steps):
            t = time.perf_counter()
            out = runner.verify([VerifyRequest(sid, tokens=tokens[-1:], base=len(tokens) - 1, want_features=False)])
            if rep:
                step.append(time.perf_counter() - t)
            tokens = tokens + out[0].tokens
    return statistics.median(prefill), statistics.median(step)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="step_time", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="HuggingFaceTB/SmolLM2-135M-Instruct", help="a model folder with a GGUF")
    p.add_argument("--precisions", default="low,medium,highest")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = str(resolve_model_path(args.target))
    print(
        f"| matmul precision | prefill {args.prompt_len} tokens (ms) | prefill tok/s "
        "| decode step (ms) | decode tok/s |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for precision in args.precisions.split(","):
        pre, step = measure(path, precision, args.prompt_len, args.steps, args.reps)
        print(
            f"| {precision} | {1e3 * pre:.1f} | {args.prompt_len / pre:.0f} | {1e3 * step:.2f} | {1 / step:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
