"""Router-side accounting of pool calls: work per replica, and where a round's time goes.

For every draft / verify call the Router knows the wall time of the call and, from the reply
(``PoolReply``), the replica that did it, the compute time on the replica's worker thread and
the time the call waited there. ``call - compute`` is Ray's transport, (de)serialisation and
queueing (at the handle and at the replica).
"""

from __future__ import annotations

from collections import defaultdict


class CallStats:
    def __init__(self):
        self.rounds: dict[str, dict[str, int]] = {"verifier": defaultdict(int), "drafter": defaultdict(int)}
        self._sum = defaultdict(float)  # (pool, "call" | "compute" | "queued") -> seconds
        self._n = defaultdict(int)  # pool -> calls

    def record(self, pool: str, replica: str, call_s: float, compute_s: float, queued_s: float) -> None:
        self.count(pool, replica)
        self._n[pool] += 1
        self._sum[pool, "call"] += call_s
        self._sum[pool, "compute"] += compute_s
        self._sum[pool, "queued"] += queued_s

    def count(self, pool: str, replica: str) -> None:
        """Work of a replica without a call to time (backend vllm: a streamed engine step)."""
        self.rounds.setdefault(pool, defaultdict(int))[replica] += 1

    def mean_ms(self, pool: str, what: str) -> float:
        n = self._n[pool]
        return round(self._sum[pool, what] / n * 1e3, 3) if n else 0.0

    def as_dict(self) -> dict:
        timing = {}
        for pool, name in (("drafter", "draft"), ("verifier", "verify")):
            call, compute = self.mean_ms(pool, "call"), self.mean_ms(pool, "compute")
            timing[f"{name}_call_ms"] = call
            timing[f"{name}_compute_ms"] = compute
            timing[f"{name}_replica_queue_ms"] = self.mean_ms(pool, "queued")
            timing[f"{name}_overhead_ms"] = round(call - compute, 3)  # Ray + (de)serialisation + queueing
            timing[f"{name}_calls"] = self._n[pool]
        return {"replicas": {pool: dict(per) for pool, per in self.rounds.items()}, "round_time_ms": timing}
