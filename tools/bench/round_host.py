"""Host time of one engine round on a CPU: what a GPU cannot hide behind its graphs.

On a GPU the target's forward (``StaticForward``), the feature head over the cache
(``StaticFeatures``) and the drafting steps (``StaticDraftSteps``) replay from CUDA graphs; everything
else in a round is Python and host launches that the GPU waits for. On a CPU the same fixed-shape
code runs uncaptured, so a round's wall time minus the time inside those graph bodies is the round's
*host time*, measured here as it would be paid on a GPU (the graph bodies themselves cost host time
on a CPU only).

For each drafter (``moa``: a paper-sized MoA drafter with random weights; ``replay``: drafts replayed
from the target's own greedy continuation, nothing computed) and each batch size, with K = 4, one
event loop and one round service (as a Router's), it prints per round: wall, graph bodies, host,
and the verify and draft calls' own times; then cProfile's top host functions.

    python tools/bench/round_host.py --toy --batch-sizes 1,8,64 [--drafters moa,replay] [--json OUT]

``--toy`` is a Llama-shaped toy target (hidden 64, 2 layers, vocab 512); without it the target is
stories260k (``MOA_MODEL_DIR``). One intra-op thread: at these sizes threads only add barriers.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moa_serve.drafter.config import DrafterConfig  # noqa: E402
from moa_serve.drafter.feature_sources import MoAFeatures  # noqa: E402
from moa_serve.drafter.moa_model import TargetParts  # noqa: E402
from moa_serve.drafter.proposer import MoAProposer  # noqa: E402
from moa_serve.drafter.static_steps import StaticDraftSteps  # noqa: E402
from moa_serve.engine.events import Tracked  # noqa: E402
from moa_serve.engine.in_process import SpeculativeEngine  # noqa: E402
from moa_serve.verifier.api import NO_FEATURES  # noqa: E402
from moa_serve.verifier.torch.runner import RunnerOptions, TorchTargetRunner  # noqa: E402
from moa_serve.verifier.torch.static_features import StaticFeatures  # noqa: E402
from moa_serve.verifier.torch.static_forward import StaticForward  # noqa: E402
from tools.gpu.harness import TOY_LLAMA, random_moa, random_target  # noqa: E402
from tools.gpu.replay import ReplayProposer, corruption_for  # noqa: E402

K = 4
CONTEXT = 64
WARMUP_ROUNDS = 12  # prefill, first features, every shape of a batch seen once
REPLAY_TAU = 3.5  # the replayed drafts' mean accepted length (accepted drafts + the target's token)


class GraphBodyClock:
    """Seconds spent inside the bodies a GPU replays from CUDA graphs (the target's fixed-shape
    forward, the drafter's feature head over the cache, the drafting steps)."""

    def __init__(self):
        self.seconds = 0.0
        self._saved = []
        for cls in (StaticForward, StaticFeatures, StaticDraftSteps):
            original = cls._body

            def timed(obj, *args, _original=original):
                t0 = time.perf_counter()
                try:
                    return _original(obj, *args)
                finally:
                    self.seconds += time.perf_counter() - t0

            self._saved.append((cls, original))
            cls._body = timed

    @property
    def body_codes(self) -> set:
        return {original.__code__ for _, original in self._saved}

    def restore(self) -> None:
        for cls, original in self._saved:
            cls._body = original


def build_target(toy: bool):
    if toy:
        return random_target(TOY_LLAMA, torch.float32, torch.device("cpu"))
    from moa_serve.model_files import resolve_model_path

    runner = TorchTargetRunner(str(resolve_model_path("stories260k")), "float32", "cpu", 1, 512)
    return runner.model


def make_runner(target, sessions: int, features) -> TorchTargetRunner:
    return TorchTargetRunner(
        target,
        torch.float32,
        "cpu",
        max_sessions=sessions,
        max_model_len=4096,
        features=features,
        options=RunnerOptions(max_num_batched_tokens=8192, prefix_caching=False, static_forward="on"),
    )


def make_engine(
    kind: str, target, sessions: int, prompts: list[list[int]], vocab: int, rounds: int
) -> SpeculativeEngine:
    """``rounds``: the most rounds a session runs (the replayed continuation covers them)."""
    if kind == "moa":
        moa = random_moa(target, torch.float32, torch.device("cpu"))
        runner = make_runner(target, sessions, MoAFeatures(moa.feature_head))
        proposer = MoAProposer(
            DrafterConfig(target=target.arch),
            moa.draft_head,
            TargetParts(target, 0),
            max_sessions=sessions,
            max_model_len=runner.max_model_len,
        )
        proposer.use_static_steps(graphs=False)  # the steps a GPU captures, uncaptured
        return SpeculativeEngine(runner, proposer, None, frozenset(), max_batch=sessions)
    runner = make_runner(target, sessions, NO_FEATURES)
    plain = SpeculativeEngine(runner, None, None, frozenset(), max_batch=sessions)
    refs = [r.token_ids for r in plain.generate(prompts, max_new_tokens=rounds * (K + 1), num_speculative_tokens=1)]
    proposer = ReplayProposer(prompts, refs, corruption_for(REPLAY_TAU, K), vocab)
    return SpeculativeEngine(runner, proposer, None, frozenset(), max_batch=sessions)


class HostCallCounter:
    """Python and C function calls made outside the graph bodies: a count of a round's host work
    that does not depend on how busy the machine is."""

    def __init__(self, bodies: set):
        self.calls, self._depth, self.bodies = 0, 0, bodies

    def __call__(self, frame, event, arg) -> None:
        body = frame.f_code in self.bodies
        if event == "call" and body:
            self._depth += 1
        elif event == "return" and body:
            self._depth -= 1
        elif event in ("call", "c_call") and not self._depth:
            self.calls += 1


async def measure(
    engine: SpeculativeEngine, prompts, rounds: int, repeats: int, clock: GraphBodyClock, sort: str = "tottime"
):
    """Rounds of ``len(prompts)`` sessions through one round service; per-round medians over
    ``repeats`` runs of ``rounds`` rounds, and a cProfile of one more run."""
    service, _ = engine._service(len(prompts))
    sessions = [engine.new_session(p, 10**6, num_speculative_tokens=K, ignore_eos=True) for p in prompts]
    batch = [Tracked(s, group=0) for s in sessions]

    async def run(n: int) -> None:
        for _ in range(n):
            await service.rounds.run(0, batch, batch)

    await run(WARMUP_ROUNDS)
    samples = []
    for _ in range(repeats):
        b0, d0, v0 = clock.seconds, service.stats.draft_s, service.stats.verify_s
        tokens0 = sum(len(s.generated) for s in sessions)
        t0 = time.perf_counter()
        await run(rounds)
        wall = time.perf_counter() - t0
        samples.append(
            {
                "wall_ms": wall / rounds * 1e3,
                "graph_ms": (clock.seconds - b0) / rounds * 1e3,
                "draft_ms": (service.stats.draft_s - d0) / rounds * 1e3,
                "verify_ms": (service.stats.verify_s - v0) / rounds * 1e3,
                "tokens_per_round": (sum(len(s.generated) for s in sessions) - tokens0) / rounds / len(sessions),
            }
        )
    row = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
    row["host_ms"] = row["wall_ms"] - row["graph_ms"]
    counter = HostCallCounter(clock.body_codes)
    sys.setprofile(counter)
    try:
        await run(rounds)
    finally:
        sys.setprofile(None)
    row["host_calls"] = counter.calls / rounds
    prof = cProfile.Profile()
    prof.enable()
    await run(rounds)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(40)
    for s in sessions:
        engine.release(s.id)
    await service.stop()
    return row, buf.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--toy", action="store_true", help="a toy Llama-shaped target (else stories260k)")
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--drafters", default="moa,replay")
    ap.add_argument("--rounds", type=int, default=20, help="rounds per timed run")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs (the median is reported)")
    ap.add_argument("--profile-rows", type=int, default=18, help="cProfile rows printed (0: none)")
    ap.add_argument("--sort", default="tottime", help="cProfile's order: tottime or cumulative")
    ap.add_argument("--json", type=Path, help="write the table here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    target = build_target(a.toy)
    vocab = target.arch.vocab_size
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    g = random.Random(0)
    prompts = [[g.randrange(3, vocab) for _ in range(CONTEXT)] for _ in range(max(sizes))]
    clock = GraphBodyClock()
    rows = []
    try:
        for kind in a.drafters.split(","):
            engine = make_engine(kind, target, max(sizes), prompts, vocab, WARMUP_ROUNDS + (a.repeats + 1) * a.rounds)
            for b in sizes:
                row, profile = asyncio.run(measure(engine, prompts[:b], a.rounds, a.repeats, clock, a.sort))
                row.update(drafter=kind, batch=b)
                rows.append(row)
                print(
                    f"{kind:>6} B={b:<3} round {row['wall_ms']:7.2f} ms  graph bodies {row['graph_ms']:7.2f}  "
                    f"host {row['host_ms']:6.2f}, {row['host_calls']:6.0f} calls  (draft call {row['draft_ms']:6.2f}, "
                    f"verify call {row['verify_ms']:6.2f})  tokens/round/session {row['tokens_per_round']:.2f}",
                    flush=True,
                )
                if a.profile_rows:
                    print("\n".join(profile.splitlines()[: 9 + a.profile_rows]), flush=True)
    finally:
        clock.restore()
    if a.json:
        a.json.write_text(json.dumps({"toy": a.toy, "k": K, "context": CONTEXT, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
