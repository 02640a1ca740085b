"""Session-group affinity for the pools.

A Ray Serve handle picks a replica by itself (power of two choices), but a session's KV cache
and drafter state live on one replica. Every pool call carries ``group=<int>``: the Router pins
each session to a group, and this request router sends a group's calls to the replica that
wins rendezvous (highest-random-weight) hashing of (group, replica id). Scaling up or down, or
a replica dying, moves only the groups of the replicas that changed; the new replica rebuilds
those sessions from the committed tokens (and features) the calls carry, so affinity is a
performance property, never a correctness one.
"""

from __future__ import annotations

import hashlib

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


def _weight(group, replica_key: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{group}:{replica_key}".encode(), digest_size=8).digest(), "big")


def pick(group, replica_keys: list[str]) -> str:
    return max(replica_keys, key=lambda r: _weight(group, r))


class SessionGroupRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        group = pending_request.kwargs.get("group") if pending_request is not None else None
        if group is None or not candidate_replicas:
            return [candidate_replicas]
        by_key = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_key[pick(group, list(by_key))]]]
