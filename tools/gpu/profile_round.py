"""Where the time of one engine round goes on a GPU, at the GPU check's production shape (a
Llama-3-8B-shaped target with random bfloat16 weights and a paper-sized MoA drafter).

Prints and writes to ``OUT/profile_round.txt``:

* the GPU kernels of one verify call (1 session x 1 token and 8 sessions x 5 tokens at a
  512-token context), by device time: what the forward spends its time on;
* the host functions of a few engine rounds (cProfile, by own time, then by cumulative time):
  what the host does between kernels;
* the drafter's and the verifier's share of each round (the engine's timings).

    python tools/gpu/profile_round.py --out DIR [--batch-sizes 1,8]

``--toy`` runs the same at toy size on a CPU (the fixed-shape forward uncaptured), which is how
the tests keep the script working.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_gpu  # noqa: E402, F401  (makes the project importable from the checkout)
import torch  # noqa: E402

from moa_serve.engine.in_process import SpeculativeEngine  # noqa: E402
from tools.gpu.harness import LLAMA3_8B, TOY_LLAMA, random_moa, random_target, sync  # noqa: E402
from tools.gpu.production import (  # noqa: E402
    moa_proposer,
    prefill,
    production_runner,
    random_prompts,
    static_args,
)


def kernel_table(fn, device: torch.device, rows: int = 18) -> str:
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sync(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        sync(device)
    return prof.key_averages().table(
        sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=rows, max_name_column_width=60
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--batch-sizes", default="1,8", help="sessions per round, comma-separated")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--toy", action="store_true", help="toy shapes on a CPU")
    a = ap.parse_args(argv)
    if not a.toy and not torch.cuda.is_available():
        print("profile_round: needs a CUDA device (or --toy)", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    report = io.StringIO()

    def say(text: str) -> None:
        print(text, flush=True)
        report.write(text + "\n")
        (a.out / "profile_round.txt").write_text(report.getvalue())

    if a.toy:
        d, dtype, shape, ctx = torch.device("cpu"), torch.float32, TOY_LLAMA, 64
    else:
        d, dtype, shape, ctx = torch.device("cuda"), torch.bfloat16, LLAMA3_8B, 512
    target = random_target(shape, dtype, d)
    moa = random_moa(target, dtype, d)
    bmax = max(int(b) for b in a.batch_sizes.split(","))
    room = ctx + 64 * (a.rounds + 60)
    runner = production_runner(target, moa, dtype, d, bmax, room, static_forward="on")
    prompts = random_prompts(random.Random(0), shape["vocab_size"], ctx, bmax)

    # the forward's kernels: one verify call at 1 x 1 and 8 x 5 tokens
    ids = [f"p{i}" for i in range(bmax)]
    prefill(runner, {}, ids, prompts, d)
    for b, t in ((1, 1), (min(8, bmax), 5)):
        args = static_args(runner, ids[:b], t, ctx)
        for _ in range(3):
            runner.static(*args)
        say(f"\n== kernels of one fixed-shape forward, {b} session(s) x {t} token(s), context {ctx} ==")
        say(kernel_table(lambda: runner.static(*args), d))
    for i in ids:
        runner.release(i)

    proposer = moa_proposer(target, moa, bmax, room)
    engine = SpeculativeEngine(runner, proposer, None, frozenset(), max_batch=bmax)
    for b in (int(x) for x in a.batch_sizes.split(",")):
        sessions = [
            engine.new_session(prompts[i][: ctx // 2], 10**6, num_speculative_tokens=4, ignore_eos=True)
            for i in range(b)
        ]
        for _ in range(50):  # prefill, then rounds until every session drafts with features
            engine.run_round(sessions)
            if all(len(s.generated) >= 2 for s in sessions):
                break
        for _ in range(4):  # compiles and captures of this batch's shapes happen here, not below
            engine.run_round(sessions)
        sync(d)
        d0, v0 = engine.timings["draft_s"], engine.timings["verify_s"]
        t = time.perf_counter()
        for _ in range(a.rounds):
            engine.run_round(sessions)
        sync(d)
        wall = (time.perf_counter() - t) / a.rounds * 1e3
        say(
            f"\n== engine round, {b} session(s), K = 4: {wall:.2f} ms per round; drafter "
            f"{(engine.timings['draft_s'] - d0) / a.rounds * 1e3:.2f} ms, verifier "
            f"{(engine.timings['verify_s'] - v0) / a.rounds * 1e3:.2f} ms =="
        )
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.rounds):
            engine.run_round(sessions)
        sync(d)
        prof.disable()
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(28)
            say(f"-- host functions by {key} ({a.rounds} rounds) --\n" + buf.getvalue()[-6000:])
        say(f"\n== kernels of one engine round, {b} session(s) ==")
        say(kernel_table(lambda: engine.run_round(sessions), d, rows=14))
        for s in sessions:
            engine.release(s.id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
