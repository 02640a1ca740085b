"""Session-group affinity for the pools: a sticky, load-aware group -> replica assignment.

A session's KV cache (verifier) and drafter state live on one replica, so every pool call
carries ``group=<key>`` (the Router's session group; keys are unique per Router replica,
e.g. ``"<router replica id>/0"``). This request router sends all calls of a group to the
replica the group is assigned to:

* a group seen for the first time goes to the least-loaded live replica: fewest groups
  assigned from this process, ties broken by the sessions the replica reports through
  ``record_routing_stats`` (cluster-wide load), then by Ray's cached queue length;
* it stays there while that replica is live (its caches are warm), except that when a
  replica holds at least two groups more than the least-loaded one (a replica was added),
  one group moves over: scale-up takes load at the cost of one re-prefill per moved session;
* when its replica disappears (died, downscaled), the group is reassigned the same way.

Calls without a group (``info``) fall back to Ray's own choice (lowest queue length among
the candidates). Requests are matched to the replica chosen for *them* (no ``FIFOMixin``:
FIFO matching would hand a group's replica to whichever request waits longest, breaking
affinity whenever two groups route at once).

Affinity is a performance property, never a correctness one: every call carries the token
deltas and the replica answers ``resync`` when it lacks a session, so a moved group is
re-prefilled from the Router's committed tokens.

The assignment table (``assignment.py``) is process-wide per deployment (``snapshot()`` shows
it), so several handles to one pool in a process share one view of the load.
"""

from __future__ import annotations

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from moa_serve.deployments.assignment import table


class SessionGroupRouter(RequestRouter):
    def _hint(self, r: RunningReplica) -> tuple:
        stats = r.routing_stats or {}
        queue = self._replica_queue_len_cache.get(r.replica_id)
        return (float(stats.get("sessions", 0)), queue if queue is not None else 0)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        group = pending_request.kwargs.get("group") if pending_request is not None else None
        if group is None or not candidate_replicas:
            return [candidate_replicas]  # Ray's choice: lowest queue length among them
        by_key = {r.replica_id.unique_id: r for r in candidate_replicas}
        hints = {k: self._hint(r) for k, r in by_key.items()}
        d = self._deployment_id
        key = table(f"{d.app_name}#{d.name}").pick(group, list(by_key), hints)
        # only the assigned replica: when it is busy the request waits (with Ray's backoff)
        # rather than landing on a replica without the group's caches
        return [[by_key[key]]]


# request_routing_stats_period_s: how often pool replicas report their sessions to the routers
# (``record_routing_stats``), used to place new groups on the least-loaded replica
AFFINITY = RequestRouterConfig(
    request_router_class="moa_serve.deployments.affinity:SessionGroupRouter",
    request_routing_stats_period_s=2.0,
    request_routing_stats_timeout_s=5.0,
)
