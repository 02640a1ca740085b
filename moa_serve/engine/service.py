"""The router's scheduling core, framework-free and async.

Sessions are pinned to a *session group* at admission; each group runs its own round loop
(draft -> verify -> commit for all of its sessions in one call per pool) so that, with two or
more groups, one group drafts while another verifies and neither pool idles. The pools are
async callables: Ray Serve handles in the cluster, local objects in tests.

Reliability: the committed tokens held here are the source of truth. A failed draft call
degrades that round to target-only decoding (and the drafter re-receives all features next
time); a failed verify call is retried (another or a restarted replica re-prefills from the
committed tokens the request carries). Nothing committed is ever lost or duplicated.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from moa_serve.drafter.proposer import DraftRequest, DraftResult
from moa_serve.engine import rounds
from moa_serve.engine.session import Session
from moa_serve.verifier.api import VerifyRequest, VerifyResult

log = logging.getLogger(__name__)

DraftFn = Callable[[int, list[DraftRequest]], Awaitable[list[DraftResult]]]
VerifyFn = Callable[[int, list[VerifyRequest]], Awaitable[list[VerifyResult]]]
ReleaseFn = Callable[[int, list[str]], Awaitable[None]]


class QueueFullError(RuntimeError):
    pass


@dataclass
class TokenEvent:
    tokens: list[int]
    finish_reason: str | None = None


@dataclass
class _Tracked:
    session: Session
    group: int
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class ServiceStats:
    rounds: int = 0
    sessions_in_rounds: int = 0
    max_sessions_in_round: int = 0
    multi_session_rounds: int = 0
    draft_fallbacks: int = 0
    drafter_resyncs: int = 0  # a drafter replica lacked a session's features and got them again
    verify_retries: int = 0
    reprefills: int = 0  # a verifier replica rebuilt a session's KV cache from its committed tokens
    completed: int = 0
    aborted: int = 0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["mean_sessions_per_round"] = round(self.sessions_in_rounds / self.rounds, 3) if self.rounds else 0.0
        return d


class Observer:
    """Hooks for metrics; the Ray layer plugs Prometheus metrics in."""

    def round_done(self, group: int, sessions: int, draft_s: float, verify_s: float, round_s: float) -> None: ...
    def accepted(self, length: int) -> None: ...
    def queue_depth(self, depth: int) -> None: ...
    def fallback(self, reason: str) -> None: ...


class RoundService:
    def __init__(self, verify: VerifyFn, draft: DraftFn | None, release: ReleaseFn, *, num_groups: int = 1,
                 max_sessions_per_round: int = 16, max_queued: int = 64, verify_retries: int = 30,
                 retry_backoff_s: float = 1.0, draft_timeout_s: float = 5.0, observer: Observer | None = None):
        self._verify, self._draft, self._release = verify, draft, release
        self.num_groups = num_groups
        self.max_sessions_per_round = max_sessions_per_round
        self.max_queued = max_queued
        self.verify_retries = verify_retries
        self.retry_backoff_s = retry_backoff_s
        self.draft_timeout_s = draft_timeout_s
        self.observer = observer or Observer()
        self.stats = ServiceStats()
        self._waiting: list[_Tracked] = []
        self._active: dict[int, list[_Tracked]] = {g: [] for g in range(num_groups)}
        self._wake: dict[int, asyncio.Event] = {}
        self._tasks: list[asyncio.Task] = []
        self._ids = itertools.count()

    # ------------------------------------------------------------------ public API
    def start(self) -> None:
        if self._tasks:
            return
        for g in range(self.num_groups):
            self._wake[g] = asyncio.Event()
            self._tasks.append(asyncio.get_running_loop().create_task(self._group_loop(g)))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active_sessions(self) -> int:
        return sum(len(a) for a in self._active.values())

    def submit(self, session: Session) -> _Tracked:
        """Queues a session; raises QueueFullError when the bounded queue is full."""
        self.start()
        if len(self._waiting) >= self.max_queued and self._free_capacity() == 0:
            raise QueueFullError(f"{len(self._waiting)} requests are waiting")
        tracked = _Tracked(session, group=-1)
        self._waiting.append(tracked)
        self.observer.queue_depth(len(self._waiting))
        self._admit()
        return tracked

    async def stream(self, tracked: _Tracked):
        """Yields TokenEvents until the session finishes; aborting the consumer frees it."""
        try:
            while True:
                ev: TokenEvent = await tracked.events.get()
                yield ev
                if ev.finish_reason is not None:
                    return
        finally:
            if not tracked.session.finished:
                self.abort(tracked)

    def abort(self, tracked: _Tracked) -> None:
        s = tracked.session
        if s.finished:
            return
        s.finish_reason = "abort"
        self.stats.aborted += 1
        if tracked in self._waiting:
            self._waiting.remove(tracked)
        elif tracked.group >= 0:
            # the group loop drops it at the next commit and frees its caches
            self._wake[tracked.group].set()

    # ------------------------------------------------------------------ admission
    def _free_capacity(self) -> int:
        return max(0, self.max_sessions_per_round * self.num_groups - self.active_sessions)

    def _admit(self) -> None:
        while self._waiting and self._free_capacity() > 0:
            tracked = self._waiting.pop(0)
            g = min(self._active, key=lambda k: len(self._active[k]))
            tracked.group = g
            self._active[g].append(tracked)
            if g in self._wake:
                self._wake[g].set()
        self.observer.queue_depth(len(self._waiting))

    # ------------------------------------------------------------------ rounds
    async def _group_loop(self, g: int) -> None:
        while True:
            await self._drop_finished(g)
            if not self._active[g]:
                self._wake[g].clear()
                await self._wake[g].wait()
                continue
            try:
                await self._round(g, list(self._active[g]))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a round that cannot complete fails its sessions, not the loop
                log.exception("round failed for group %d", g)
                for t in self._active[g]:
                    if not t.session.finished:
                        t.session.finish_reason = "error"
                        last = (str(exc).strip().splitlines() or [""])[-1]
                        t.events.put_nowait(TokenEvent([], f"error: {type(exc).__name__}: {last}"))

    async def _drop_finished(self, g: int) -> None:
        done = [t for t in self._active[g] if t.session.finished]
        if not done:
            return
        self._active[g] = [t for t in self._active[g] if not t.session.finished]
        for t in done:
            if t.session.finish_reason == "abort":
                t.events.put_nowait(TokenEvent([], "abort"))
        try:
            await self._release(g, [t.session.id for t in done])
        except Exception:  # a dead replica holds nothing to free
            log.warning("release failed for group %d", g, exc_info=True)
        self._admit()

    async def _round(self, g: int, batch: list[_Tracked]) -> None:
        t0 = time.perf_counter()
        sessions = [t.session for t in batch]
        by_id = {s.id: s for s in sessions}
        drafts: dict[str, DraftResult] = {}
        if self._draft is not None:
            reqs = rounds.draft_requests(sessions)
            if reqs:
                try:
                    res = await asyncio.wait_for(self._draft(g, reqs), self.draft_timeout_s)
                    self.stats.drafter_resyncs += sum(r.needs_features_from is not None for r in res)
                    drafts = rounds.note_drafts_delivered(by_id, res)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self.stats.draft_fallbacks += 1
                    self.observer.fallback(type(exc).__name__)
                    log.warning("drafter unavailable (%s): group %d verifies without drafts", exc, g)
                    for s in sessions:
                        s.features_sent = 0  # a replacement drafter needs every feature again
        t1 = time.perf_counter()
        results = await self._verify_with_retry(g, rounds.verify_requests(sessions, drafts, self._draft is not None))
        t2 = time.perf_counter()
        for r in results:
            s = by_id[r.session_id]
            d = drafts.get(r.session_id)
            if s.rounds > 0 and r.num_computed > 1 + (len(d.drafts) if d else 0):
                self.stats.reprefills += 1
        committed = rounds.commit(by_id, results, drafts)
        for c, t in zip(committed, batch):
            if t.session.finish_reason == "abort":
                continue
            d = drafts.get(t.session.id)
            if d is not None:
                self.observer.accepted(len(c.new_tokens))
            t.events.put_nowait(TokenEvent(c.new_tokens, t.session.finish_reason))
            if t.session.finished:
                self.stats.completed += 1
        n = len(batch)
        self.stats.rounds += 1
        self.stats.sessions_in_rounds += n
        self.stats.max_sessions_in_round = max(self.stats.max_sessions_in_round, n)
        self.stats.multi_session_rounds += n > 1
        self.observer.round_done(g, n, t1 - t0, t2 - t1, time.perf_counter() - t0)

    async def _verify_with_retry(self, g: int, reqs: list[VerifyRequest]) -> list[VerifyResult]:
        for attempt in range(self.verify_retries + 1):
            try:
                return await self._verify(g, reqs)
            except asyncio.CancelledError:
                raise
            except ValueError:
                raise  # the request itself is wrong: retrying cannot help
            except Exception as exc:
                if attempt == self.verify_retries:
                    raise
                self.stats.verify_retries += 1
                self.observer.fallback("verify_retry")
                log.warning("verify failed (%s); retrying on a live replica (attempt %d)", exc, attempt + 1)
                await asyncio.sleep(self.retry_backoff_s)
        raise AssertionError("unreachable")
