"""Scaling that is real: sticky load-aware group affinity, one worker thread per pool replica,
autoscaling on sessions, per-replica work in /v1/stats.

Fast unit tests (no Ray cluster) first; then two slow ones on a real local Ray cluster: with
2 verifier + 2 drafter replicas all four carry rounds, and a verifier pool autoscales 1 -> 2
under load and back to 1 when the load stops."""

import asyncio
import socket
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

ray = pytest.importorskip("ray")

from moa_serve.deployments.affinity import SessionGroupRouter  # noqa: E402
from moa_serve.deployments.assignment import GroupAssignment  # noqa: E402
from moa_serve.deployments.autoscaling import SessionsPolicy  # noqa: E402
from moa_serve.deployments.config import AppConfig  # noqa: E402
from moa_serve.deployments.pools import _Pool  # noqa: E402
from moa_serve.deployments.stats import CallStats  # noqa: E402
from moa_serve.protocol import PoolReply  # noqa: E402

# --------------------------------------------------------------------------- affinity


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_new_groups_go_to_the_least_loaded_replica_and_stay():
    a = GroupAssignment()
    assert a.pick("r1/0", ["A", "B"]) == "A"
    assert a.pick("r1/1", ["A", "B"]) == "B"  # A has one group already
    # ties between replicas with equal group counts: Ray's view of load (sessions, queue length)
    assert a.pick("r1/2", ["A", "B"], {"A": (9, 0), "B": (1, 0)}) == "B"
    # sticky: a group keeps its replica whatever the hints say
    for _ in range(3):
        assert a.pick("r1/0", ["A", "B"], {"A": (99, 9), "B": (0, 0)}) == "A"
    assert a.moves == 0 and a.reassignments == 0


def test_a_group_moves_when_its_replica_disappears():
    a = GroupAssignment()
    assert a.pick("g", ["A", "B"]) == "A"
    assert a.pick("g", ["B", "C"]) == "B"  # A is gone: reassigned to the least loaded
    assert a.reassignments == 1
    assert a.pick("g", ["A", "B", "C"]) == "B"  # stays on B while B lives


def test_scale_up_rebalances_one_group_at_a_time():
    a = GroupAssignment()
    groups = [f"r/{i}" for i in range(4)]
    for g in groups:
        assert a.pick(g, ["A"]) == "A"
    placed = {g: a.pick(g, ["A", "B"]) for g in groups}  # B appears: groups move until balanced
    assert sorted(placed.values()) == ["A", "A", "B", "B"] and a.moves == 2
    again = {g: a.pick(g, ["A", "B"]) for g in groups}
    assert again == placed and a.moves == 2  # balanced: nothing moves any more


def test_idle_groups_do_not_count_as_load():
    clock = Clock()
    a = GroupAssignment(idle_s=30, clock=clock)
    a.pick("old", ["A", "B"])  # -> A
    clock.t += 60  # "old" made no call for a minute (its Router died, or it has no sessions)
    assert a.pick("new", ["A", "B"]) == "A"  # A's only group is idle: A counts as empty
    # coming back it would make A hold two groups to B's none: it moves (idle, it holds no sessions)
    assert a.pick("old", ["A", "B"]) == "B" and a.moves == 1


def _fake_replica(uid, sessions=0):
    from ray.serve._private.common import DeploymentID, ReplicaID

    rid = ReplicaID(unique_id=uid, deployment_id=DeploymentID(name="VerifierPool", app_name="unit-test"))
    return SimpleNamespace(replica_id=rid, routing_stats={"sessions": sessions}, max_ongoing_requests=16)


def test_request_router_pins_groups_and_leaves_the_rest_to_ray():
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    router = SessionGroupRouter(
        deployment_id=DeploymentID(name="VerifierPool", app_name="unit-test"),
        handle_source=DeploymentHandleSource.REPLICA,
    )
    reps = [_fake_replica("aaa", sessions=5), _fake_replica("bbb", sessions=0)]

    def choose(**kwargs):
        pr = SimpleNamespace(kwargs=kwargs)
        return asyncio.run(router.choose_replicas(reps, pr))

    first = choose(group="r/0")
    assert len(first) == 1 and [r.replica_id.unique_id for r in first[0]] == ["bbb"]  # fewer sessions
    assert choose(group="r/0")[0][0].replica_id.unique_id == "bbb"
    assert choose(group="r/1")[0][0].replica_id.unique_id == "aaa"  # bbb holds a group now
    assert choose() == [reps]  # no group (info): Ray's own choice among all
    assert asyncio.run(router.choose_replicas(reps, None)) == [reps]


# --------------------------------------------------------------------------- autoscaling policy


def test_sessions_policy():
    p = SessionsPolicy(target_sessions_per_replica=8)
    ctx = SimpleNamespace(
        aggregated_metrics={"sessions": {"r1": 10.0, "r2": 7.0}}, target_num_replicas=2, policy_state={}
    )
    desired, state = p(ctx)
    assert desired == 3 and state["moa_sessions"] == 17.0
    assert (
        p(SimpleNamespace(aggregated_metrics={"sessions": {"r1": 8.0}}, target_num_replicas=1, policy_state={}))[0] == 1
    )
    assert (
        p(SimpleNamespace(aggregated_metrics={"sessions": {"r1": 0.0}}, target_num_replicas=2, policy_state={}))[0] == 0
    )  # Ray's bounds lift it to min_replicas
    assert p(SimpleNamespace(aggregated_metrics={}, target_num_replicas=2, policy_state={}))[0] == 2  # no data: hold


def test_pool_autoscaling_options_are_valid_for_ray():
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.config import AutoscalingConfig

    from moa_serve.deployments.app import _options
    from moa_serve.deployments.config import PoolConfig

    opts = _options(PoolConfig(max_sessions=16))["autoscaling_config"]
    ray_cfg = AutoscalingConfig(**opts)
    policy = _resolve_policy_callable(ray_cfg.policy)
    assert isinstance(policy, SessionsPolicy) and policy.target == 12.0


# --------------------------------------------------------------------------- pool worker thread


class Backend:
    def __init__(self):
        self.log = []
        self.running = 0
        self.max_running = 0
        self.lock = threading.Lock()

    def forward(self, tag, seconds):
        with self.lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        self.log.append(("start", tag))
        time.sleep(seconds)
        self.log.append(("end", tag))
        with self.lock:
            self.running -= 1
        return tag

    def release(self, sid):
        self.log.append(("release", sid))


class Pool(_Pool):
    pool_name = "unit"

    def __init__(self, backend):
        cfg = AppConfig.model_validate(
            {
                "target": "stories260k",
                "drafter": "lookup",
                "router": {"session_groups": 1},
                "verifier_pool": {"torch_threads": torch.get_num_threads()},
            }
        )
        super().__init__(cfg, cfg.verifier_pool)
        self.engine = backend

    async def forward(self, requests, tag, seconds=0.0):
        self._touch(requests)
        return await self._run("verify", self.engine.forward, tag, seconds)


@dataclass
class Req:
    session_id: str


def test_a_timed_out_call_never_overlaps_the_next_and_release_waits_its_turn():
    b = Backend()

    async def main():
        p = Pool(b)
        with pytest.raises(asyncio.TimeoutError):  # the Router's draft timeout
            await asyncio.wait_for(p.forward([Req("s1")], "slow", 0.4), 0.05)
        nxt = asyncio.ensure_future(p.forward([Req("s1"), Req("s2")], "next", 0.01))
        rel = asyncio.ensure_future(p.release(["s1"]))
        reply = await nxt
        await rel
        return p, reply

    p, reply = asyncio.run(main())
    assert b.log == [("start", "slow"), ("end", "slow"), ("start", "next"), ("end", "next"), ("release", "s1")]
    assert b.max_running == 1
    assert isinstance(reply, PoolReply) and reply.results == "next" and reply.replica
    assert reply.queued_s > 0.25 and 0 < reply.compute_s < 0.2  # it waited behind the slow call
    assert asyncio.run(p.record_autoscaling_stats()) == {"sessions": 1.0}  # s1 released, s2 active


def test_a_call_cancelled_while_queued_never_runs():
    b = Backend()

    async def main():
        p = Pool(b)
        slow = asyncio.ensure_future(p.forward([], "slow", 0.3))
        await asyncio.sleep(0.05)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(p.forward([], "skipped", 0.0), 0.05)
        await slow
        await p.forward([], "last", 0.0)

    asyncio.run(main())
    assert [t for e, t in b.log if e == "start"] == ["slow", "last"]


def test_call_stats_breakdown():
    s = CallStats()
    s.record("verifier", "v1", call_s=0.030, compute_s=0.020, queued_s=0.001)
    s.record("verifier", "v2", call_s=0.050, compute_s=0.040, queued_s=0.003)
    s.record("drafter", "d1", call_s=0.010, compute_s=0.004, queued_s=0.0)
    d = s.as_dict()
    assert d["replicas"] == {"verifier": {"v1": 1, "v2": 1}, "drafter": {"d1": 1}}
    t = d["round_time_ms"]
    assert t["verify_call_ms"] == 40.0 and t["verify_compute_ms"] == 30.0 and t["verify_overhead_ms"] == 10.0
    assert t["draft_call_ms"] == 10.0 and t["draft_compute_ms"] == 4.0 and t["verify_calls"] == 2


# --------------------------------------------------------------------------- real Ray


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_serve():
    from ray import serve

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def pool_args(*, replicas, max_sessions=8, autoscaling=None, env=None):
    actor = {"num_cpus": 0.25}
    if env:
        actor["runtime_env"] = {"env_vars": env}
    auto = autoscaling or {"min_replicas": replicas, "max_replicas": replicas}
    return {"ray_actor_options": actor, "torch_threads": 1, "max_sessions": max_sessions, "autoscaling_config": auto}


def wait_ready(base, prefix, timeout=180):
    import httpx

    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(f"{base}{prefix}/readyz", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, "application never became ready"
        time.sleep(0.5)


def load(base, prefix, n, max_tokens, stop: threading.Event | None = None, rounds=1):
    """n concurrent users; each sends `rounds` requests (or until `stop` is set)."""
    import httpx

    codes = []

    async def user(i, c):
        k = 0
        while (stop is None and k < rounds) or (stop is not None and not stop.is_set()):
            r = await c.post(
                f"{prefix}/v1/generate",
                json={"prompt": f"Once upon a time {i}", "max_tokens": max_tokens, "ignore_eos": True},
            )
            codes.append(r.status_code)
            k += 1

    async def main():
        async with httpx.AsyncClient(base_url=base, timeout=300) as c:
            await asyncio.gather(*(user(i, c) for i in range(n)))

    asyncio.run(main())
    return codes


def replica_states(app, deployment):
    from ray import serve

    st = serve.status().applications[app].deployments[deployment]
    return {str(getattr(k, "value", k)): v for k, v in st.replica_states.items() if v}


def test_two_replicas_per_pool_all_carry_rounds(ray_serve, stories_path, stories_drafter):
    import httpx
    from ray import serve

    from moa_serve.deployments.app import build_app

    args = {
        "target": str(stories_path),
        "drafter": str(stories_drafter),
        "dtype": "float32",
        "num_speculative_tokens": 3,
        "max_model_len": 512,
        "router": {"ray_actor_options": {"num_cpus": 0}, "session_groups": 2, "max_sessions_per_round": 8},
        "verifier_pool": pool_args(replicas=2),
        "drafter_pool": pool_args(replicas=2),
    }
    serve.run(build_app(args), name="twox", route_prefix="/twox")
    wait_ready(ray_serve, "/twox")
    codes = load(ray_serve, "/twox", n=8, max_tokens=48, rounds=2)
    assert codes and all(c == 200 for c in codes), codes
    stats = httpx.get(f"{ray_serve}/twox/v1/stats", timeout=30).json()
    per = stats["replicas"]
    assert len(per["verifier"]) == 2 and all(n > 0 for n in per["verifier"].values()), stats
    assert len(per["drafter"]) == 2 and all(n > 0 for n in per["drafter"].values()), stats
    t = stats["round_time_ms"]
    assert t["verify_call_ms"] >= t["verify_compute_ms"] > 0 and t["draft_call_ms"] >= t["draft_compute_ms"] > 0
    serve.delete("twox")


def test_verifier_pool_autoscales_on_sessions_up_and_back_down(ray_serve, stories_path):
    import httpx
    from ray import serve

    from moa_serve.deployments.app import build_app

    # metrics pushed every 0.5 s instead of 10 s, averaged over 2 s, no upscale delay: a quick test
    env = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5"}
    auto = {
        "min_replicas": 1,
        "max_replicas": 2,
        "target_sessions_per_replica": 2,
        "upscale_delay_s": 0,
        "downscale_delay_s": 3,
        "look_back_period_s": 2,
    }
    args = {
        "target": str(stories_path),
        "drafter": None,
        "dtype": "float32",
        "max_model_len": 512,
        "router": {"ray_actor_options": {"num_cpus": 0}, "session_groups": 2, "max_sessions_per_round": 4},
        "verifier_pool": pool_args(replicas=1, autoscaling=auto, env=env),
    }
    serve.run(build_app(args), name="auto", route_prefix="/auto")
    wait_ready(ray_serve, "/auto")
    assert replica_states("auto", "VerifierPool").get("RUNNING") == 1

    stop = threading.Event()
    result = {}
    client = threading.Thread(
        target=lambda: result.setdefault("codes", load(ray_serve, "/auto", n=6, max_tokens=200, stop=stop))
    )
    client.start()
    try:
        deadline = time.time() + 120
        while replica_states("auto", "VerifierPool").get("RUNNING", 0) < 2:
            assert time.time() < deadline, f"never scaled up: {replica_states('auto', 'VerifierPool')}"
            time.sleep(0.5)
        # the new replica takes one of the two groups and carries rounds
        deadline = time.time() + 60
        while True:
            per = httpx.get(f"{ray_serve}/auto/v1/stats", timeout=30).json()["replicas"]["verifier"]
            if len(per) == 2 and all(n > 0 for n in per.values()):
                break
            assert time.time() < deadline, per
            time.sleep(0.5)
    finally:
        stop.set()
        client.join(300)
    assert result["codes"] and all(c == 200 for c in result["codes"]), result
    deadline = time.time() + 120
    while replica_states("auto", "VerifierPool") != {"RUNNING": 1}:  # and nothing starting or stopping
        assert time.time() < deadline, f"never scaled down: {replica_states('auto', 'VerifierPool')}"
        time.sleep(1)
    serve.delete("auto")
