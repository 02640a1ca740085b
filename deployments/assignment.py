"""The sticky group -> replica table behind ``affinity.SessionGroupRouter`` (framework-free).

It lives in its own module because Ray ships a request-router class *by value* (cloudpickle of
its module): state kept in ``affinity.py``'s globals would be a private copy inside the
deserialized class, invisible to the rest of the process (the Router's ``/v1/stats``). Functions
of this module are pickled by reference, so the router and the stats share one table.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

# a group not called for this long no longer counts as load (its Router replica is gone, or it
# holds no sessions); it keeps its replica if it comes back and that replica is still live
IDLE_S = 30.0
FORGET_S = 3600.0  # assignments not used for this long are dropped
MOVE_GAP = 2  # rebalance when a replica holds this many groups more than the least-loaded one


@dataclass
class _Entry:
    replica: str
    last_used: float = field(default_factory=time.monotonic)


class GroupAssignment:
    """The sticky group -> replica table of one deployment (framework-free, testable alone)."""

    def __init__(self, idle_s: float = IDLE_S, move_gap: int = MOVE_GAP, clock=time.monotonic):
        self.idle_s, self.move_gap, self.clock = idle_s, move_gap, clock
        self._owner: dict = {}
        self._lock = threading.Lock()  # picks run on Ray's router loop, snapshots on the replica's
        self.moves = 0  # groups moved off a live replica to balance load
        self.reassignments = 0  # groups whose replica disappeared

    def _counts(self, live: list[str], now: float, exclude=None) -> dict[str, int]:
        counts = {r: 0 for r in live}
        for g, e in self._owner.items():
            if g != exclude and e.replica in counts and now - e.last_used <= self.idle_s:
                counts[e.replica] += 1
        return counts

    def pick(self, group, live: list[str], hint: dict[str, tuple] | None = None) -> str:
        """The replica for ``group`` among ``live`` (non-empty) replica keys; ``hint`` orders
        equally loaded replicas (smaller first, e.g. (sessions, queue length))."""
        with self._lock:
            return self._pick(group, live, hint)

    def _pick(self, group, live: list[str], hint: dict[str, tuple] | None) -> str:
        now = self.clock()
        hint = hint or {}
        counts = self._counts(live, now, exclude=group)

        def least() -> str:
            return min(live, key=lambda r: (counts[r], hint.get(r, ()), r))

        entry = self._owner.get(group)
        if entry is not None and entry.replica in counts:
            best = least()
            # counts exclude this group: its replica holds counts+1 with it
            if counts[entry.replica] + 1 - counts[best] >= self.move_gap and best != entry.replica:
                entry.replica = best
                self.moves += 1
            entry.last_used = now
            return entry.replica
        if entry is not None:
            self.reassignments += 1
        choice = least()
        self._owner[group] = _Entry(choice, now)
        if len(self._owner) > 4096:
            self._owner = {g: e for g, e in self._owner.items() if now - e.last_used <= FORGET_S}
        return choice

    def snapshot(self) -> dict:
        with self._lock:
            return {str(g): e.replica for g, e in self._owner.items()}


_LOCK = threading.Lock()
_TABLES: dict[str, GroupAssignment] = {}


def table(deployment: str) -> GroupAssignment:
    with _LOCK:
        t = _TABLES.get(deployment)
        if t is None:
            t = _TABLES[deployment] = GroupAssignment()
        return t


def snapshot() -> dict[str, dict]:
    """{deployment: {group: replica id}} as assigned from this process."""
    with _LOCK:
        return {
            d: {"groups": t.snapshot(), "moves": t.moves, "reassignments": t.reassignments} for d, t in _TABLES.items()
        }
