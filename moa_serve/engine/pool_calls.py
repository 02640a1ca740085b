"""The round service's calls to its pools: time limits, bounded retries, releases.

A failed or slow draft call degrades the round to target-only decoding; a failed or slow verify
call is retried a bounded number of times with exponential backoff (the retry resends whole
token lists, so another or a restarted replica re-prefills), then fails that round's sessions
only. Finished sessions are released on both pools before their group's next round; a failed
release is kept and retried, a bounded number of times, without hammering a failing pool (the
pools also evict idle sessions). The pools are async callables: Ray Serve handles in the
cluster, local objects in the in-process engine and in tests."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Hashable

from moa_serve.engine.options import RoundContext
from moa_serve.engine.session import Session
from moa_serve.protocol import DraftRequest, DraftResult, VerifyRequest, VerifyResult

log = logging.getLogger(__name__)

DraftFn = Callable[[Hashable, list[DraftRequest]], Awaitable[list[DraftResult]]]
VerifyFn = Callable[[Hashable, list[VerifyRequest]], Awaitable[list[VerifyResult]]]
ReleaseFn = Callable[[Hashable, list[str]], Awaitable[None]]
CutFn = Callable[[Hashable], Awaitable[None]]  # ends the group's running multi-step verify early


async def within(seconds: float, aw):
    """``aw`` with a time limit. ``asyncio.timeout``, not ``wait_for``: on Python 3.11 ``wait_for``
    swallows a cancellation that arrives as the inner call completes, and a group loop that
    misses ``stop()``'s cancellation runs forever."""
    async with asyncio.timeout(seconds):
        return await aw


@dataclass
class Pools:
    """The calls a round service makes to its pools, each per session group: ``verify``, ``draft``
    (None: no drafter pool), ``release`` of sessions that ended, and ``cut``, which ends the
    group's running multi-step verify call early (None: calls are never cut)."""

    verify: VerifyFn
    draft: DraftFn | None
    release: ReleaseFn
    cut: CutFn | None = None


def resend_whole(sessions: list[Session]) -> None:
    """After a verify call that failed (or timed out): the next attempt may reach another replica,
    so the sessions' next request carries their whole token lists."""
    for s in sessions:
        s.verifier_base = 0


class PoolCalls:
    def __init__(self, pools: Pools, context: RoundContext):
        self.verify_fn, self.draft_fn = pools.verify, pools.draft
        self.release_fn, self.cut_fn = pools.release, pools.cut
        self._cuts: set[asyncio.Task] = set()
        self.limits, self.stats, self.observer = context.options, context.stats, context.observer
        groups = context.groups
        self.pending_release: dict[Hashable, dict[str, int]] = {g: {} for g in groups}  # id -> attempts
        self._release_backoff: dict[Hashable, tuple[int, float]] = {}  # group -> (failures in a row, retry at)
        self._releasing: dict[Hashable, asyncio.Task] = {}  # group -> its release call in flight
        self._release_first: dict[Hashable, set[str]] = {g: set() for g in groups}  # live sessions resent whole

    # ------------------------------------------------------------------ draft
    async def draft(self, g: Hashable, reqs: list[DraftRequest]) -> list[DraftResult] | None:
        """The drafter pool's answer; None when the call failed or timed out (the round then
        verifies without drafts)."""
        try:
            return await within(self.limits.draft_timeout_s, self.draft_fn(g, reqs))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.stats.draft_fallbacks += 1
            self.observer.fallback(type(exc).__name__)
            log.warning("drafter unavailable (%s): group %s verifies without drafts", type(exc).__name__, g)
            return None

    # ------------------------------------------------------------------ verify
    async def verify(
        self, g: Hashable, sessions: list[Session], requests: Callable[[], list[VerifyRequest]]
    ) -> list[VerifyResult]:
        """A verify call of ``sessions`` with a timeout and bounded retries (exponential backoff);
        ``requests`` builds the call from the sessions' state. A failed or timed out attempt may
        have reached a replica that is gone: the sessions' verifier base drops to 0, so the retry
        sends whole token lists. A ``ValueError`` means the request itself is wrong: retrying
        cannot help."""
        for attempt in range(self.limits.verify_retries + 1):
            try:
                return await within(self.limits.verify_timeout_s, self.verify_fn(g, requests()))
            except asyncio.CancelledError:
                raise
            except ValueError:
                resend_whole(sessions)
                raise
            except Exception as exc:
                resend_whole(sessions)
                if attempt == self.limits.verify_retries:
                    raise
                self.stats.verify_retries += 1
                self.observer.fallback("verify_retry")
                log.warning(
                    "verify failed (%s: %s); retrying with whole token lists (attempt %d)",
                    type(exc).__name__,
                    exc,
                    attempt + 1,
                )
                await asyncio.sleep(self.limits.backoff(attempt))
        raise AssertionError("unreachable")

    def verify_ahead(self, g: Hashable, reqs: list[VerifyRequest]) -> asyncio.Future:
        """A verify call sent now, awaited later (lookahead): no retry, its sessions resync if it fails."""
        return asyncio.ensure_future(within(self.limits.verify_timeout_s, self.verify_fn(g, reqs)))

    def cut(self, g: Hashable) -> None:
        """Asks the group's verifier to end the multi-step decoding of its running call early (a
        session waits for the next call), without waiting for the answer. Only a hint: a cut that
        fails or comes late costs nothing but the time it would have saved."""
        if self.cut_fn is None:
            return
        self.stats.steps_cut += 1
        task = asyncio.ensure_future(within(self.limits.release_timeout_s, self.cut_fn(g)))
        self._cuts.add(task)
        task.add_done_callback(self._cut_done)

    def _cut_done(self, task: asyncio.Task) -> None:
        self._cuts.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("cutting multi-step decoding short failed: %r", task.exception())

    # ------------------------------------------------------------------ release
    def release_later(self, g: Hashable, session_id: str, before_next_round: bool = False) -> None:
        """Queues a session's release; ``before_next_round``: a live session that will be resent
        whole, whose release must reach the pools before its next verify call."""
        self.pending_release[g].setdefault(session_id, 0)
        if before_next_round:
            self._release_first[g].add(session_id)

    async def before_round(self, g: Hashable) -> None:
        """Releases the group's live sessions to be resent whole (awaited: a release arriving after
        the resend would drop it again) and starts the other pending releases in the background."""
        first = self._release_first[g]
        if first:
            first.clear()
            running = self._releasing.get(g)
            if running is not None:
                await asyncio.wait([running])
            await self.flush_releases(g)
        self.start_releases(g)

    @property
    def pending_releases(self) -> int:
        return sum(len(p) for p in self.pending_release.values())

    def start_releases(self, g: Hashable) -> None:
        """Sends the group's pending releases without waiting for them (one call in flight per
        group; what finishes meanwhile goes with the next one; ``flush_releases`` keeps a failing
        pool's backoff)."""
        if g in self._releasing or not self.pending_release[g]:
            return
        task = asyncio.ensure_future(self.flush_releases(g))
        self._releasing[g] = task
        task.add_done_callback(lambda _: self._releasing.pop(g, None))

    async def settle_releases(self) -> None:
        """Waits for the release calls in flight (a stopping service)."""
        await asyncio.gather(*list(self._releasing.values()), return_exceptions=True)

    async def flush_releases(self, g: Hashable) -> None:
        """Frees the caches of finished sessions. A failed release is kept and retried later, a
        bounded number of times (the pools also evict idle sessions)."""
        pending = self.pending_release[g]
        fails, retry_at = self._release_backoff.get(g, (0, 0.0))
        if not pending or time.monotonic() < retry_at:  # a failing pool is not hammered every round
            return
        ids = list(pending)
        try:
            await within(self.limits.release_timeout_s, self.release_fn(g, ids))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.stats.release_failures += 1
            log.warning("release failed for group %s (%s); %d sessions kept for a retry", g, exc, len(ids))
            for sid in ids:
                pending[sid] += 1
                if pending[sid] >= self.limits.release_attempts:
                    del pending[sid]
                    self.stats.releases_dropped += 1
            self._release_backoff[g] = (fails + 1, time.monotonic() + self.limits.backoff(fails))
            return
        self._release_backoff.pop(g, None)
        for sid in ids:
            pending.pop(sid, None)
