"""Two Ray nodes on one machine, the pools on different nodes, the verifier's node killed under load.

    python -m tools.cluster.two_nodes --users 4 --duration 60 --kill-at 20 --out runs/two-nodes

What it does:

1. Starts a Ray head node and a second (worker) node in this process's own Ray temp dir
   (``RAY_TMPDIR``: a colleague's cluster and its address file are left alone), each a raylet of its
   own with custom resources: the head ``{router_node, drafter_node, verifier_node}``, node B
   ``{verifier_node}``.
2. Serves the application with those resources in ``ray_actor_options`` (``resources``): the
   Router and the DrafterPool on the head, the VerifierPool on a ``verifier_node``. While it
   deploys, a placeholder actor holds the head's ``verifier_node``, so the verifier starts on node
   B; then the placeholder goes, and the head keeps one ``verifier_node`` free: the spare capacity
   a surviving node offers.
3. Runs closed-loop users (``POST /v1/generate``, greedy, a few prompts in turn) and, ``--kill-at``
   seconds in, kills node B (its raylet and workers, SIGKILL: a machine that vanishes).
4. Measures how long until a VerifierPool replica is alive on the head and the first request
   completes after the kill, and counts the requests completed and failed: all of them, and those
   in flight at the kill. Greedy text must not change across the move: each request's text is
   compared with the first answer to the same prompt.

Prints one JSON object (also written to ``--out``/result.json). Exit code 0 when no request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from moa_serve.deployments.config import AppConfig
from tools.prompts import STORY_PROMPTS

PROMPTS = STORY_PROMPTS[:6]
HEAD_RESOURCES = {"router_node": 1, "drafter_node": 1, "verifier_node": 1}
NODE_B_RESOURCES = {"verifier_node": 1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(msg: str) -> None:
    print(f"[two-nodes] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# the application


def app_args(target: str, drafter: str | None, dtype: str, max_tokens: int) -> dict:
    """A small application with each deployment pinned by a custom resource."""
    pool = {"torch_threads": 1, "max_sessions": 16, "autoscaling_config": {"min_replicas": 1, "max_replicas": 1}}
    ingress = {"ray_actor_options": {"num_cpus": 0, "resources": {"router_node": 0.01}}}
    gateway = {"gateway": ingress} if "gateway" in AppConfig.model_fields else {}  # an HTTP ingress before the Router
    return {
        **gateway,
        "target": target,
        "drafter": drafter,
        "dtype": dtype,
        "num_speculative_tokens": 3,
        "max_model_len": max(256, 4 * max_tokens),
        "router": {**ingress, "max_sessions_per_round": 16, "session_groups": 1},
        "verifier_pool": {**pool, "ray_actor_options": {"num_cpus": 0.5, "resources": {"verifier_node": 1}}},
        "drafter_pool": {**pool, "ray_actor_options": {"num_cpus": 0.5, "resources": {"drafter_node": 1}}},
    }


# ---------------------------------------------------------------------------------------
# where the replicas run


def replica_nodes(head_id: str) -> dict[str, list[str]]:
    """Live Serve replicas per deployment, each as 'head' or 'node-b' (from the GCS actor table)."""
    return {d: [node for node, _ in places] for d, places in replica_places(head_id).items()}


def replica_places(head_id: str) -> dict[str, list[tuple[str, int]]]:
    """Live Serve replicas per deployment: (node, PID) each."""
    from ray._private import state

    out: dict[str, list[tuple[str, int]]] = {}
    for a in state.actors().values():
        name = a.get("ActorClassName") or ""
        if a.get("State") != "ALIVE" or not name.startswith("ServeReplica:"):
            continue
        node = "head" if a.get("Address", {}).get("NodeID") == head_id else "node-b"
        out.setdefault(name.rsplit(":", 1)[-1], []).append((node, a.get("Pid")))
    return out


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def hold_head_slot(head_id: str):
    """A placeholder actor on the head holding its ``verifier_node`` while the application deploys."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    class Placeholder:
        def ready(self) -> bool:
            return True

    holder = Placeholder.options(
        resources={"verifier_node": 1}, scheduling_strategy=NodeAffinitySchedulingStrategy(head_id, soft=False)
    ).remote()
    ray.get(holder.ready.remote(), timeout=120)
    return holder


# ---------------------------------------------------------------------------------------
# load


@dataclass
class Request:
    user: int
    prompt: str
    t_start: float
    t_end: float | None = None
    ok: bool = False
    error: str | None = None
    text: str | None = None
    tokens: int = 0


@dataclass
class Load:
    """Closed-loop users sending ``POST /v1/generate`` until ``stop`` is set."""

    url: str
    users: int
    max_tokens: int
    timeout_s: float
    requests: list[Request] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def user(self, i: int, client: httpx.AsyncClient) -> None:
        n = i
        while not self.stop.is_set():
            r = Request(i, PROMPTS[n % len(PROMPTS)], time.time())
            n += 1
            self.requests.append(r)
            try:
                resp = await client.post("/v1/generate", json={"prompt": r.prompt, "max_tokens": self.max_tokens})
                body = resp.json()
                r.ok = resp.status_code == 200 and bool(body.get("token_ids"))
                r.text, r.tokens = body.get("text"), len(body.get("token_ids") or [])
                r.error = None if r.ok else f"HTTP {resp.status_code}: {str(body)[:160]}"
            except (httpx.HTTPError, ValueError) as exc:
                r.error = f"{type(exc).__name__}: {exc}"[:200]
            r.t_end = time.time()

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s) as client:
            await asyncio.gather(*(self.user(i, client) for i in range(self.users)))


# ---------------------------------------------------------------------------------------
# the experiment


def start_cluster(cpus: float):
    """The head node (cluster_utils: a raylet with its own ports) and this driver connected to it;
    returns (cluster, head node id)."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": cpus, "resources": HEAD_RESOURCES, "include_dashboard": False}
    )
    ray.init(address=cluster.address, log_to_driver=False)
    head_id = ray.get_runtime_context().get_node_id()
    return cluster, head_id


def serve_app(args, port: int, head_id: str, add_node_b):
    """Deploys the application with the head's verifier slot held, so the verifier lands on node B."""
    import ray
    from ray import serve

    from moa_serve.deployments.app import build_app

    holder = hold_head_slot(head_id)
    node_b = add_node_b()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    serve.run(
        build_app(app_args(args.target, args.drafter, args.dtype, args.max_tokens)),
        name="moa",
        route_prefix="/",
        blocking=False,
    )
    wait_ready(f"http://127.0.0.1:{port}", args.ready_timeout)
    ray.kill(holder)  # the head's spare verifier slot: where the verifier goes when node B dies
    return node_b


def wait_ready(url: str, timeout_s: float) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        try:
            if httpx.get(url + "/readyz", timeout=10).status_code == 200:
                return time.time() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/readyz not ready after {timeout_s:.0f} s")


async def watch_reschedule(head_id: str, t_kill: float, timeout_s: float) -> float | None:
    """Seconds from the kill until a VerifierPool replica is alive on the head."""
    while time.time() - t_kill < timeout_s:
        if "head" in replica_nodes(head_id).get("VerifierPool", []):
            return time.time() - t_kill
        await asyncio.sleep(0.25)
    return None


async def experiment(args, url: str, cluster, node_b, head_id: str) -> dict:
    load = Load(url, args.users, args.max_tokens, args.request_timeout)
    runner = asyncio.ensure_future(load.run())
    await asyncio.sleep(args.kill_at)
    before = replica_nodes(head_id)
    old_verifiers = [pid for _, pid in replica_places(head_id).get("VerifierPool", [])]
    in_flight = [r for r in load.requests if r.t_end is None]
    t_kill = time.time()
    log(f"killing node B ({len(in_flight)} requests in flight); replicas: {before}")
    await asyncio.to_thread(cluster.remove_node, node_b, False)
    kill_s = time.time() - t_kill
    await asyncio.sleep(1.0)
    survivors = [pid for pid in old_verifiers if pid_alive(pid)]
    log(f"old verifier PIDs {old_verifiers}, still running 1 s after the kill: {survivors}")
    rescheduled_s = await watch_reschedule(head_id, t_kill, args.duration)
    log(f"VerifierPool alive on the head {rescheduled_s} s after the kill")
    await asyncio.sleep(max(0.0, args.duration - (time.time() - t_kill + args.kill_at)))
    load.stop.set()
    await asyncio.wait_for(runner, args.request_timeout + 30)
    stats = httpx.get(url + "/v1/stats", timeout=30).json()
    out = results(load.requests, in_flight, t_kill, kill_s, rescheduled_s, before, replica_nodes(head_id), stats)
    out["old_verifier_running_1s_after_kill"] = bool(survivors)
    return out


def results(
    requests: list[Request],
    in_flight: list[Request],
    t_kill: float,
    kill_s: float,
    rescheduled_s: float | None,
    before: dict,
    after: dict,
    stats: dict,
) -> dict:
    reference: dict[str, str] = {}
    for r in sorted((r for r in requests if r.ok), key=lambda r: r.t_end):
        reference.setdefault(r.prompt, r.text)
    ok = [r for r in requests if r.ok]
    after_kill = [r for r in ok if r.t_end > t_kill]
    first_after = min((r.t_end for r in after_kill), default=None)
    back = t_kill + rescheduled_s if rescheduled_s is not None else float("inf")
    return {
        "requests": len(requests),
        "completed": len(ok),
        "failed": len(requests) - len(ok),
        "in_flight_at_kill": len(in_flight),
        "in_flight_completed": sum(r.ok for r in in_flight),
        "in_flight_failed": sum(not r.ok for r in in_flight),
        "completed_after_kill": len(after_kill),
        "completed_before_verifier_back": sum(r.t_end <= back for r in after_kill),
        "text_differs_from_first_answer": sum(r.text != reference[r.prompt] for r in ok),
        "node_kill_s": round(kill_s, 2),
        "verifier_rescheduled_s": None if rescheduled_s is None else round(rescheduled_s, 2),
        "first_completion_after_kill_s": None if first_after is None else round(first_after - t_kill, 2),
        "replicas_before": before,
        "replicas_after": after,
        # the Router's counters: verify calls retried, sessions a verifier replica re-prefilled from
        # the committed tokens, replicas that lacked a session's token base
        "verify_retries": stats.get("verify_retries"),
        "reprefills": stats.get("reprefills"),
        "resyncs": stats.get("resyncs"),
        "errors": sorted({r.error for r in requests if r.error})[:10],
    }


def run(args) -> dict:
    """Starts the two nodes, serves, kills node B under load, tears everything down."""
    import ray
    from ray import serve

    port = free_port()
    cluster, head_id = start_cluster(args.cpus)
    try:
        node_b = serve_app(
            args, port, head_id, lambda: cluster.add_node(num_cpus=args.cpus, resources=NODE_B_RESOURCES)
        )
        placed = replica_nodes(head_id)
        log(f"ready; replicas: {placed}")
        if placed.get("VerifierPool") != ["node-b"]:
            raise RuntimeError(f"the verifier did not start on node B: {placed}")
        return asyncio.run(experiment(args, f"http://127.0.0.1:{port}", cluster, node_b, head_id))
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.cluster.two_nodes", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument(
        "--drafter",
        default="smollm2-135m-instruct-moa",
        help="a trained checkpoint, so that the drafter pool is deployed ('none': no drafter pool)",
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load in all")
    p.add_argument("--kill-at", type=float, default=20.0, help="seconds of load before node B is killed")
    p.add_argument("--cpus", type=float, default=2.0, help="logical CPUs of each node")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--out", default=None, help="folder for result.json")
    args = p.parse_args(argv)
    args.drafter = None if str(args.drafter).lower() == "none" else args.drafter
    if args.kill_at >= args.duration:
        p.error("--kill-at must be less than --duration")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="moa2n-", dir="/tmp"))  # short: Ray's socket paths must fit
    os.environ["RAY_TMPDIR"] = str(tmp)
    try:
        t0 = time.time()
        result = {
            "command": " ".join(["python -m tools.cluster.two_nodes", *(argv or sys.argv[1:])]),
            "users": args.users,
            "max_tokens": args.max_tokens,
            "duration_s": args.duration,
            "kill_at_s": args.kill_at,
            "target": args.target,
            "drafter": args.drafter,
            **run(args),
            "wall_s": None,
        }
        result["wall_s"] = round(time.time() - t0, 1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "result.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
