"""What a serving session is to the services that run it: its ``TokenEvent`` stream, the tracking
record the services keep per session, and the errors they answer with. Shared by the round
service (``service.py``, the torch backend) and the stream service (``stream_service.py``, the
vLLM backend), so the Frontend and the Gateway see one interface."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable

from moa_serve.engine.session import Session
from moa_serve.protocol import DraftResult, TokenLogprobs


class QueueFullError(RuntimeError):
    """The bounded queue is full, or the request would wait too long for a seat (HTTP 429);
    ``retry_after_s``: when to come back, where the service estimated it."""

    def __init__(self, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class TokenEvent:
    tokens: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # of ``tokens``, when the session asks
    prompt_logprobs: list[TokenLogprobs] | None = None  # a scored prompt's, with its first tokens


@dataclass
class RemoteRound:
    """The drafts a remote client proposed for its session's next round, and where the round's
    event goes."""

    drafts: DraftResult
    done: asyncio.Future


@dataclass
class Tracked:
    """A session as a service runs it: its group (None while queued), its event stream, and, for a
    remote (client-server) session, the client's proposal waiting for its round."""

    session: Session
    group: Hashable | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    admitted: float | None = None  # when it joined a group (perf_counter)
    remote: bool = False  # drafts come from the client (client-server mode), one round per proposal
    pending: RemoteRound | None = None
    # where events go instead of ``events`` (a Router's lane link: no task per session between them)
    sink: Callable[[TokenEvent], None] | None = None

    @property
    def ready(self) -> bool:
        """Whether the session takes part in the next round (a remote one only with a proposal)."""
        return not self.remote or self.pending is not None

    def emit(self, ev: TokenEvent) -> None:
        """A round's outcome: to the stream, or to the remote client's pending proposal."""
        if not self.remote:
            if self.sink is not None:
                self.sink(ev)
            else:
                self.events.put_nowait(ev)
        elif self.pending is not None:
            if not self.pending.done.done():
                self.pending.done.set_result(ev)
            self.pending = None


def mark_aborted(tracked: Tracked, waiting: list[Tracked]) -> bool:
    """Marks a session aborted and takes it out of ``waiting`` if it is still queued there;
    False when it had finished already (nothing to abort)."""
    if tracked.session.finished:
        return False
    tracked.session.finish_reason = "abort"
    if tracked in waiting:
        waiting.remove(tracked)
    return True


def last_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[-1]


def error_reason(exc: BaseException) -> str:
    """A session's finish reason for a failure: ``error: <type>: <last line of the message>``."""
    return f"error: {type(exc).__name__}: {last_line(exc)}"


async def stream_events(tracked: Tracked, abort: Callable[[Tracked], None]):
    """A session's TokenEvents until it finishes; a consumer that stops early aborts it."""
    try:
        while True:
            ev: TokenEvent = await tracked.events.get()
            yield ev
            if ev.finish_reason is not None:
                return
    finally:
        if not tracked.session.finished:
            abort(tracked)
