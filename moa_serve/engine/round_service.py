"""The round service: sessions in, token events out; framework-free and async.

Sessions are pinned to a *session group* at admission; each group runs its own round loop
(``round_loop.RoundLoop``: draft -> verify -> commit for all of its sessions in one call per
pool) so that, with two or more groups, one group drafts while another verifies and neither pool
idles. Groups are hashable keys chosen by the caller: each Router replica passes keys of its own
(e.g. ``f"{replica_id}/{i}"``) so that the pools' affinity routing spreads every router's groups
over every pool replica. The pools are async callables (``pool_calls``): Ray Serve handles in the
cluster, local objects in the in-process engine (``engine.SpeculativeEngine``) and in tests.

Reliability: the committed tokens held here are the source of truth; a replica only ever holds
a cache of them (see ``round_loop``: requests carry deltas, any doubt resends everything). A round
that cannot complete errors its own sessions, never the loop. Nothing committed is ever lost or
duplicated.

Client-server mode: a *remote* session (``submit(..., remote=True)``) drafts on the user's
device. It joins a round only when its client has proposed drafts (``verify_remote``): the
drafter pool is never asked for it, but its drafts go into the same verify call as everyone
else's, and the round's tokens answer the client instead of a stream. Between its rounds it holds
a seat; when sessions wait for a seat and none is free, ``reclaim`` (installed by the client-server
sessions) gives back seats of remote sessions waiting for their clients, so that clients that went
away cannot hold every seat until their sessions expire.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Hashable, Sequence

import torch

from moa_serve.drafter.lookup import LookupTable
from moa_serve.engine.events import (
    QueueFullError,
    RemoteRound,
    TokenEvent,
    Tracked,
    error_reason,
    mark_aborted,
    stream_events,
)
from moa_serve.engine.feature_policy import FeaturePolicy, feature_policy
from moa_serve.engine.options import RoundContext, RoundOptions
from moa_serve.engine.pool_calls import PoolCalls, Pools, within
from moa_serve.engine.round_loop import RoundLoop
from moa_serve.engine.round_stats import Observer, ServiceStats
from moa_serve.engine.session import Session
from moa_serve.protocol import DraftResult

log = logging.getLogger(__name__)


class RoundService:
    def __init__(
        self,
        pools: Pools,
        options: RoundOptions | None = None,
        *,
        features: FeaturePolicy | None = None,
        lookup: LookupTable | None = None,
        groups: Sequence[Hashable] | None = None,
        observer: Observer | None = None,
    ):
        """``pools``: the calls to the verifier and drafter pools (``pools.cut`` ends a group's
        running multi-step verify call early, asked when a session is admitted to that group
        meanwhile: its prompt waits for the next call); ``features``: which verify calls ask for
        drafter features (default: all of them when there is a drafter pool, none otherwise);
        ``lookup``: prompt lookup over the sessions' own tokens, here (a session it drafts for
        skips the drafter pool that round; with no pool it is the only drafter)."""
        self.options = o = options or RoundOptions()
        self.groups = list(groups) if groups is not None else list(range(o.num_groups))
        if not self.groups or len(set(self.groups)) != len(self.groups):
            raise ValueError(f"session groups must be a non-empty list of distinct keys: {self.groups!r}")
        self.observer = observer or Observer()
        self.stats = ServiceStats()
        context = RoundContext(o, self.groups, self.stats, self.observer)
        self.calls = PoolCalls(pools, context)
        self.rounds = RoundLoop(
            context,
            self.calls,
            features or feature_policy(pools.draft is not None),
            lookup,
            queued=lambda: bool(self._waiting),
        )
        self._waiting: list[Tracked] = []
        self._active: dict[Hashable, list[Tracked]] = {g: [] for g in self.groups}
        self._wake: dict[Hashable, asyncio.Event] = {}
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        # frees up to n seats held by remote sessions between rounds (ClientSessions.reclaim)
        self.reclaim: Callable[[int], int] | None = None

    def governor_snapshot(self) -> dict:
        """Measured ms per committed token with speculation on/off, per group and batch bucket."""
        return {str(g): gov.snapshot() for g, gov in self.rounds.governors.items()}

    def draft_gate_snapshot(self) -> dict:
        """Per group: lookup drafts offered / kept, the fitted verify cost, acceptance by match length."""
        return {str(g): gate.snapshot() for g, gate in self.rounds.gates.items()}

    @property
    def lookup(self) -> LookupTable | None:
        return self.rounds.lookup

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    # ------------------------------------------------------------------ public API
    def start(self) -> None:
        if self._tasks:
            return
        self._stopping = False
        for g in self.groups:
            self._wake[g] = asyncio.Event()
            self._tasks.append(asyncio.get_running_loop().create_task(self._group_loop(g)))

    async def stop(self) -> None:
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self.rounds.lookahead.stop()
        await self.calls.settle_releases()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active_sessions(self) -> int:
        return sum(len(a) for a in self._active.values())

    @property
    def pending_releases(self) -> int:
        return self.calls.pending_releases

    def submit(self, session: Session, remote: bool = False) -> Tracked:
        """Queues a session; raises QueueFullError when the bounded queue is full. A ``remote``
        session's drafter is its client: it has rounds only through ``verify_remote``."""
        self.start()
        if len(self._waiting) >= self.options.max_queued and self._free_capacity() == 0:
            raise QueueFullError(f"{len(self._waiting)} requests are waiting")
        tracked = Tracked(session, remote=remote)
        self._waiting.append(tracked)
        self.observer.queue_depth(len(self._waiting))
        self._admit()
        return tracked

    def stream(self, tracked: Tracked):
        """Yields TokenEvents until the session finishes; aborting the consumer frees it."""
        return stream_events(tracked, self.abort)

    async def verify_remote(
        self,
        tracked: Tracked,
        drafts: list[int],
        probs: torch.Tensor | None = None,
        alternatives: list[list[int]] | None = None,
    ) -> TokenEvent:
        """One round of a remote session: the client's drafts (none: the target's next token,
        e.g. the first round, which prefills the prompt) are verified in its group's next verify
        call, beside the other sessions', with their ``alternatives`` (tree drafts, greedy).
        Returns the round's event (tokens committed and the finish reason). Drafts past the room
        left in the output or the context are dropped."""
        if not tracked.remote:
            raise ValueError("verify_remote needs a session submitted with remote=True")
        if tracked.pending is not None:
            raise RuntimeError(f"session {tracked.session.id} already has a round in flight")
        s = tracked.session
        if s.finished:
            return TokenEvent([], s.finish_reason)
        room = max(0, s.room - 1)
        drafts = list(drafts)[:room]
        probs = probs[: len(drafts)] if probs is not None and drafts else None
        alternatives = [list(a) for a in (alternatives or [])[: len(drafts)]]
        done = asyncio.get_running_loop().create_future()
        tracked.pending = RemoteRound(DraftResult(s.id, drafts, probs, alternatives), done)
        if tracked.group is not None:
            self._wake[tracked.group].set()
        return await done

    def abort(self, tracked: Tracked) -> None:
        queued = tracked.group is None
        if not mark_aborted(tracked, self._waiting):
            return
        self.stats.aborted += 1
        if queued:
            if tracked.remote:  # its client awaits the first round: it will not come
                tracked.emit(TokenEvent([], "abort"))
        else:
            # the group loop drops it before its next round and frees its caches
            self._wake[tracked.group].set()

    # ------------------------------------------------------------------ admission
    def _free_capacity(self) -> int:
        return max(0, self.options.max_sessions_per_round * self.num_groups - self.active_sessions)

    def _admit(self) -> None:
        while self._waiting and self._free_capacity() > 0:
            tracked = self._waiting.pop(0)
            g = min(self.groups, key=lambda k: len(self._active[k]))
            tracked.group, tracked.admitted = g, time.perf_counter()
            self._active[g].append(tracked)
            self.rounds.admitted(g)
            if g in self._wake:
                self._wake[g].set()
        if self._waiting and self.reclaim is not None:
            # seats of aborted sessions come free when their group loop drops them (then this runs again)
            freeing = sum(t.session.finished for active in self._active.values() for t in active)
            if len(self._waiting) > freeing:
                self.reclaim(len(self._waiting) - freeing)
        self.observer.queue_depth(len(self._waiting))

    # ------------------------------------------------------------------ group loop
    async def _group_loop(self, g: Hashable) -> None:
        while not self._stopping:
            self._drop_finished(g)
            await self.calls.before_round(g)
            batch = [t for t in self._active[g] if t.ready]
            if not batch:
                await self._idle(g)
                continue
            try:
                await self.rounds.run(g, batch, self._active[g])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a round that cannot complete fails its own sessions, not the loop
                log.exception("round failed for group %s", g)
                self._fail(batch, exc)

    async def _idle(self, g: Hashable) -> None:
        """Sleeps until work arrives; with releases still pending, wakes up to retry them."""
        self._wake[g].clear()
        if not self.calls.pending_release[g]:
            await self._wake[g].wait()
            return
        try:
            await within(self.options.retry_backoff_s, self._wake[g].wait())
        except TimeoutError:
            pass

    @staticmethod
    def _fail(batch: list[Tracked], exc: Exception) -> None:
        """Errors the sessions of a failed round, and only those: sessions admitted while it ran
        were never part of it."""
        reason = error_reason(exc)
        for t in batch:
            if not t.session.finished:
                t.session.finish_reason = "error"
                t.emit(TokenEvent([], reason))

    def _drop_finished(self, g: Hashable) -> None:
        done = [t for t in self._active[g] if t.session.finished]
        if not done:
            return
        self._active[g] = [t for t in self._active[g] if not t.session.finished]
        for t in done:
            self.rounds.forget(g, t.session.id)
            if t.session.finish_reason == "abort":
                t.emit(TokenEvent([], "abort"))
            self.calls.release_later(g, t.session.id)
        self._admit()
