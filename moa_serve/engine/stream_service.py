"""The Router's service when the verifier schedules its own rounds (the vLLM backend).

With ``backend: torch`` the Router batches the draft/verify rounds of all users itself
(``RoundService``). With ``backend: vllm`` vLLM's scheduler does that inside the verifier replica
(continuous batching; one batched drafter-pool call per engine step, ``StepDrafting``), so here a
session is one streaming call to a verifier replica, opened by ``open_stream(session)`` with the
session's committed tokens as the prompt, whose
updates (``protocol.Update``) are committed to the session and become its
``TokenEvent``s. The interface is the one ``app.frontend`` uses of ``RoundService``: ``submit``,
``stream``, ``abort``, ``stats``, ``queue_depth``, ``active_sessions``.

Admission is bounded the same way: ``max_sessions`` streams at once (a Router's share of the
verifier pool: ``session_groups x max_sessions_per_round``), ``max_queued`` more wait here, beyond
that ``QueueFullError`` (HTTP 429); with ``max_queue_wait_s``, a request whose expected wait for a
seat (``admission.expected_wait_s``: the measured time per token at full seats, the tokens the
running sessions and the requests queued ahead may still generate) is longer gets
``QueueFullError`` at once too, its Retry-After the time until the first seat may free (at most
``max_queue_wait_s``: an estimate made at a burst's start errs long), and so
does one that finds every seat taken before a round was timed (the Gateway's service for every
backend). A stream that breaks
(its replica died, a connection dropped) is resumed a bounded number of times from the committed
tokens, which are the source of truth here as with the torch backend: nothing committed is lost or
repeated. A request the engine itself fails (``error: ...``) errors its own session only. A
consumer that goes away aborts the stream, which aborts the request in vLLM.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from moa_serve.engine.admission import RoundClock, expected_wait_s, next_seat_s, retry_after_s
from moa_serve.engine.events import (
    QueueFullError,
    TokenEvent,
    Tracked,
    error_reason,
    last_line,
    mark_aborted,
    stream_events,
)
from moa_serve.engine.session import Session

log = logging.getLogger(__name__)

OpenStream = Callable[[Session], AsyncIterator]  # yields objects with tokens / finish_reason / drafted / accepted


class _VerifierError(RuntimeError):
    """The verifier ended a request with ``error: ...`` (the message is passed on as is)."""


@dataclass
class StreamStats:
    admitted: int = 0
    completed: int = 0
    aborted: int = 0
    errors: int = 0
    updates: int = 0  # engine steps that moved a session (its rounds)
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    max_active: int = 0
    stream_retries: int = 0  # streams lost (a replica died) and resumed from the committed tokens
    refused_by_wait: int = 0  # 429s for an expected wait over max_queue_wait_s
    expected_wait_s: float | None = None  # of the last request submitted

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["rounds"] = self.updates
        d["mean_accepted_length"] = round(self.tokens / self.updates, 4) if self.updates else 0.0
        d["acceptance_rate"] = round(self.accepted / self.drafted, 4) if self.drafted else 0.0
        return d


class StreamService:
    def __init__(
        self,
        open_stream: OpenStream,
        *,
        max_sessions: int = 32,
        max_queued: int = 64,
        stream_retries: int = 3,
        retry_backoff_s: float = 1.0,
        max_backoff_s: float = 8.0,
        max_queue_wait_s: float | None = None,
    ):
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self._open = open_stream
        self.stream_retries = stream_retries
        self.retry_backoff_s, self.max_backoff_s = retry_backoff_s, max_backoff_s
        self.max_sessions = max_sessions
        self.max_queued = max_queued
        self.max_queue_wait_s = max_queue_wait_s
        self.round_clock = RoundClock()
        self.stats = StreamStats()
        self._waiting: list[Tracked] = []
        self._running: dict[str, tuple[Tracked, asyncio.Task]] = {}

    # ------------------------------------------------------------------ the Frontend's interface
    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active_sessions(self) -> int:
        return len(self._running)

    def submit(self, session: Session, remote: bool = False) -> Tracked:
        if remote:
            raise ValueError("client-server sessions need backend: torch (the Router's rounds)")
        if len(self._waiting) >= self.max_queued and len(self._running) >= self.max_sessions:
            raise QueueFullError(f"{len(self._waiting)} requests are waiting")
        wait = expected_wait_s(
            self.round_clock,
            (t.session.room for t, _ in self._running.values()),
            (t.session.room for t in self._waiting),
            self.max_sessions - len(self._running),
        )
        self.stats.expected_wait_s = None if wait is None else round(wait, 3)
        if wait is None and self.max_queue_wait_s is not None:  # every seat taken, no round timed yet
            self.stats.refused_by_wait += 1
            raise QueueFullError("every seat is taken and no round was timed yet to estimate a wait")
        if wait is not None and self.max_queue_wait_s is not None and wait > self.max_queue_wait_s:
            self.stats.refused_by_wait += 1
            seat = next_seat_s(self.round_clock, (t.session.room for t, _ in self._running.values()))
            raise QueueFullError(
                f"{len(self._waiting)} requests are waiting; this one would wait about {wait:.1f} s for a seat "
                f"(http_limits.max_queue_wait_s: {self.max_queue_wait_s:g})",
                retry_after_s=retry_after_s(min(wait, seat or wait, self.max_queue_wait_s)),
            )
        tracked = Tracked(session)
        self._waiting.append(tracked)
        self._admit()
        return tracked

    def stream(self, tracked: Tracked):
        """Yields TokenEvents until the session finishes; a consumer that stops aborts it."""
        return stream_events(tracked, self.abort)

    def abort(self, tracked: Tracked) -> None:
        if not mark_aborted(tracked, self._waiting):
            return
        self.stats.aborted += 1
        running = self._running.pop(tracked.session.id, None)
        if running is not None:
            running[1].cancel()  # closes the stream: the verifier aborts the request
            self.round_clock.ended(tracked.session.id)
            self._admit()
        tracked.emit(TokenEvent([], "abort"))

    # ------------------------------------------------------------------ admission and streams
    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_sessions:
            tracked = self._waiting.pop(0)
            task = asyncio.get_running_loop().create_task(self._consume(tracked))
            self._running[tracked.session.id] = (tracked, task)
            self.round_clock.started(tracked.session.id)
            self.stats.admitted += 1
            self.stats.max_active = max(self.stats.max_active, len(self._running))

    async def _consume(self, tracked: Tracked) -> None:
        s = tracked.session
        try:
            for attempt in range(self.stream_retries + 1):
                try:
                    await self._follow(tracked)
                    return
                except (asyncio.CancelledError, _VerifierError):
                    raise
                except Exception as exc:  # noqa: BLE001 - a lost replica or connection: resume
                    if s.finished or attempt == self.stream_retries:
                        raise
                    self.stats.stream_retries += 1
                    log.warning(
                        "session %s: stream lost (%s: %s); resuming from its %d committed tokens",
                        s.id,
                        type(exc).__name__,
                        exc,
                        len(s.tokens),
                    )
                    await asyncio.sleep(min(self.max_backoff_s, self.retry_backoff_s * 2**attempt))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - errors this session only
            if s.finished:
                return
            log.warning("session %s failed: %s", s.id, exc)
            self.stats.errors += 1
            s.finish_reason = "error"
            tracked.emit(TokenEvent([], last_line(exc) if isinstance(exc, _VerifierError) else error_reason(exc)))
        finally:
            if self._running.get(s.id, (None,))[0] is tracked:
                del self._running[s.id]
                self.round_clock.ended(s.id)
                self._admit()

    async def _follow(self, tracked: Tracked) -> None:
        """One stream from a verifier replica, from the session's committed tokens on (a resumed
        session is re-prefilled there: its committed tokens are its prompt), until it finishes."""
        s = tracked.session
        drafted = accepted = 0  # a stream's counts are cumulative from its own start
        stream = self._open(s)
        try:
            async for u in stream:
                if s.finished:  # aborted here meanwhile
                    return
                reason = u.finish_reason
                if reason is not None and reason.startswith("error"):
                    raise _VerifierError(reason)
                logprobs = getattr(u, "logprobs", None)
                prompt_logprobs = getattr(u, "prompt_logprobs", None)
                if prompt_logprobs is not None:
                    s.prompt_logprobs = list(prompt_logprobs)
                held = len(s.token_logprobs)
                kept = (
                    s.commit(list(u.tokens), u.drafted - drafted, u.accepted - accepted, logprobs) if u.tokens else []
                )
                self.stats.drafted += u.drafted - drafted
                self.stats.accepted += u.accepted - accepted
                drafted, accepted = u.drafted, u.accepted
                if u.tokens:
                    self.round_clock.committed(s.id, len(kept), len(self._running))
                    self.stats.updates += 1
                    self.stats.tokens += len(kept)
                if reason is not None and not s.finished:  # the engine's own stop (it knows best)
                    s.finish_reason = reason if reason in ("stop", "length", "abort") else "stop"
                if kept or s.finished:
                    got = s.token_logprobs[held:] if logprobs is not None else None
                    tracked.emit(TokenEvent(kept, s.finish_reason, got, prompt_logprobs))
                if s.finished:
                    self.stats.completed += s.finish_reason != "abort"
                    return
            raise ConnectionError("the verifier's stream ended before the session finished")
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:  # a session that ends here (stop, abort) ends its request upstream
                try:
                    await aclose()
                except Exception:  # noqa: BLE001
                    log.debug("closing the stream of %s failed", s.id, exc_info=True)
