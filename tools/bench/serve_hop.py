"""What one Ray Serve call between two replicas costs on this machine, back to back and after a
pause (the first token of a request crosses five such hops: HTTP -> Gateway -> Router ->
verifier -> Router -> Gateway).

One deployment calls another's no-op method ``--calls`` times through a ``DeploymentHandle``
(with and without the pools' session-group request router) and reads one streamed item per call
of a streaming method (a lane's path), first back to back, then with ``--gaps-ms`` of idle time
before each call: on a VM an idle vCPU is halted, and waking the processes of a hop costs more
than the hop itself. Prints one JSON line per gap: median round trip (ms) of a call, and the
median one-way time of a streamed item (ms). Run it in the mode you serve in:

    RAY_SERVE_THROUGHPUT_OPTIMIZED=1 python -m tools.bench.serve_hop --calls 200 --gaps-ms 0,5,50
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import ray
from ray import serve

from moa_serve.deployments.affinity import AFFINITY  # the pools' session-group request router, as deployed


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Callee:
    async def ping(self, x: int, group: str | None = None) -> int:
        return x

    async def items(self, n: int, gap_s: float):
        for _ in range(n):
            await asyncio.sleep(gap_s or 0.002)
            yield time.time()


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Caller:
    def __init__(self, plain, affine):
        self.plain, self.affine = plain, affine

    async def measure(self, calls: int, gap_s: float) -> dict:
        out = {"gap_ms": round(gap_s * 1e3, 1)}
        for name, handle, kwargs in (
            ("call_rtt_ms", self.plain, {}),
            ("call_rtt_affinity_ms", self.affine, {"group": "g/0"}),
        ):
            for _ in range(10):  # warm the handle
                await handle.ping.remote(0, **kwargs)
            times = []
            for _ in range(calls):
                if gap_s:
                    await asyncio.sleep(gap_s)
                t = time.perf_counter()
                await handle.ping.remote(0, **kwargs)
                times.append(time.perf_counter() - t)
            out[name] = round(statistics.median(times) * 1e3, 3)
        one_way = [time.time() - sent async for sent in self.plain.options(stream=True).items.remote(calls, gap_s)]
        out["stream_item_ms"] = round(statistics.median(one_way) * 1e3, 3)
        return out


async def _run(handle, calls: int, gaps: list[float]) -> None:
    """Prints a row per gap, then shuts Serve down on this loop (in the high-throughput mode the
    handle's router lives on it, and a shutdown after the loop closed fails)."""
    try:
        for g in gaps:
            print(json.dumps(await handle.measure.remote(calls, g)), flush=True)
    finally:
        await serve.shutdown_async()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200, help="calls per measurement")
    ap.add_argument("--gaps-ms", default="0,5,50", help="idle time before each call, comma-separated")
    args = ap.parse_args(argv)
    gaps = [float(g) / 1e3 for g in args.gaps_ms.split(",")]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        app = Caller.bind(Callee.bind(), Callee.options(name="AffineCallee", request_router_config=AFFINITY).bind())
        asyncio.run(_run(serve.run(app, name="serve-hop", route_prefix=None), args.calls, gaps))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
