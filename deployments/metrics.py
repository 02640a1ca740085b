"""Custom Prometheus metrics (exported through Ray's metrics agent beside Ray Serve's own)."""

from __future__ import annotations

from ray.serve import metrics

from moa_serve.engine.round_stats import Observer

_LATENCY_MS = [5, 10, 20, 40, 80, 160, 320, 640, 1280, 2560, 5120]


class PrometheusObserver(Observer):
    def __init__(self):
        self.accepted_length = metrics.Histogram(
            "moa_accepted_length",
            description="tokens committed per verify round (bonus included)",
            boundaries=[1, 2, 3, 4, 5, 6, 8, 10, 12, 16],
        )
        self.draft_ms = metrics.Histogram(
            "moa_draft_latency_ms", description="draft call latency", boundaries=_LATENCY_MS, tag_keys=("group",)
        )
        self.verify_ms = metrics.Histogram(
            "moa_verify_latency_ms", description="verify call latency", boundaries=_LATENCY_MS, tag_keys=("group",)
        )
        self.round_ms = metrics.Histogram(
            "moa_round_latency_ms",
            description="draft+verify+commit latency",
            boundaries=_LATENCY_MS,
            tag_keys=("group",),
        )
        self.sessions = metrics.Histogram(
            "moa_sessions_per_round", description="sessions batched in a round", boundaries=[1, 2, 4, 8, 16, 32, 64]
        )
        self.queue = metrics.Gauge("moa_queue_depth", description="requests waiting for admission")
        self.fallbacks = metrics.Counter(
            "moa_fallbacks_total", description="rounds without drafts, verify retries", tag_keys=("reason",)
        )

    def round_done(self, group, sessions, draft_s, verify_s, round_s):
        tags = {"group": str(group)}
        self.draft_ms.observe(draft_s * 1e3, tags=tags)
        self.verify_ms.observe(verify_s * 1e3, tags=tags)
        self.round_ms.observe(round_s * 1e3, tags=tags)
        self.sessions.observe(sessions)

    def accepted(self, length):
        self.accepted_length.observe(length)

    def queue_depth(self, depth):
        self.queue.set(depth)

    def fallback(self, reason):
        self.fallbacks.inc(tags={"reason": reason})


class PoolMetrics:
    """Inside a pool replica: time a call's work ran on the replica's worker thread, and the time it
    waited there behind earlier calls (other groups' forwards, releases)."""

    def __init__(self, pool: str):
        self.pool = pool
        self.compute_ms = metrics.Histogram(
            "moa_pool_compute_ms",
            description="pool forward/release compute time",
            boundaries=_LATENCY_MS,
            tag_keys=("pool", "method"),
        )
        self.queue_ms = metrics.Histogram(
            "moa_pool_queue_ms",
            description="time a pool call waited for the replica's worker thread",
            boundaries=_LATENCY_MS,
            tag_keys=("pool", "method"),
        )
        self.sessions = metrics.Gauge(
            "moa_pool_sessions", description="sessions used by this replica recently", tag_keys=("pool",)
        )

    def call(self, method: str, compute_s: float, queued_s: float) -> None:
        tags = {"pool": self.pool, "method": method}
        self.compute_ms.observe(compute_s * 1e3, tags=tags)
        self.queue_ms.observe(queued_s * 1e3, tags=tags)

    def set_sessions(self, n: int) -> None:
        self.sessions.set(n, tags={"pool": self.pool})


class CallMetrics:
    """At the Router: per pool call, wall time minus the replica's compute = Ray transport,
    (de)serialisation and queueing."""

    def __init__(self):
        self.overhead_ms = metrics.Histogram(
            "moa_pool_call_overhead_ms",
            description="pool call wall time minus replica compute",
            boundaries=_LATENCY_MS,
            tag_keys=("pool",),
        )

    def call(self, pool: str, call_s: float, compute_s: float) -> None:
        self.overhead_ms.observe(max(0.0, call_s - compute_s) * 1e3, tags={"pool": pool})
