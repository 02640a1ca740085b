"""Lanes: many sessions' commits over one stream between the Gateway and a Router replica.

A per-session stream costs one message per session per round; at 16 sessions that is 16
messages per round across the process boundary, each paid in CPU beside the verifier. A *lane*
link carries every commit of one round of its sessions as one batch instead.

* ``LaneHub`` (Router side, over a ``RoundService`` or ``StreamService``): ``connect(link)``
  yields batches ``[(session id, Update), ...]`` (first an empty one: connected); ``start`` submits
  a session whose commits go to that link (``QueueFullError`` when full, ``LinkLost`` when the link
  is not connected here); ``cancel`` aborts one. A link that closes aborts its sessions.
* ``LaneLink`` (Gateway side): keeps one link open and hands each session its own updates;
  ``open(session)`` is a ``StreamService`` stream. When the link breaks (its Router replica died),
  every session on it raises ``ConnectionError``, and ``StreamService`` resumes each from the tokens
  it received, over a new link.

Framework-free: the transport is three async callables (Ray Serve handle calls in the cluster)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import AsyncIterator, Awaitable, Callable

from moa_serve.engine.events import TokenEvent, Tracked
from moa_serve.engine.session import Session
from moa_serve.protocol import Update

log = logging.getLogger(__name__)

Batch = list[tuple[str, Update]]


class LinkLost(ConnectionError):
    """A session was started for a link that is not connected to this replica."""


class LaneHub:
    def __init__(self, service, replica: str | None = None):
        self.service = service
        self.replica = replica
        self._links: dict[str, asyncio.Queue] = {}
        self._sessions: dict[str, tuple[str, Tracked]] = {}  # session id -> (link, as the service runs it)

    async def connect(self, link: str) -> AsyncIterator[Batch]:
        """The link's batches until the caller goes away; its sessions are aborted then."""
        queue: asyncio.Queue = asyncio.Queue()
        self._links[link] = queue
        try:
            yield []
            while True:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                yield batch
        finally:
            if self._links.get(link) is queue:
                del self._links[link]
            for sid in [s for s, (owner, _) in self._sessions.items() if owner == link]:
                self.cancel(sid)

    def start(self, session: Session, link: str) -> None:
        if link not in self._links:
            raise LinkLost(f"lane link {link} is not connected to this replica")
        tracked = self.service.submit(session)
        # a round's events go straight into the link's queue (no task per session in between:
        # one hop less on the way to the first token, none per session and round)
        tracked.sink = lambda ev: self._deliver(session, link, ev)
        self._sessions[session.id] = (link, tracked)

    def cancel(self, session_id: str) -> None:
        entry = self._sessions.pop(session_id, None)
        if entry is not None:
            self.service.abort(entry[1])

    def _deliver(self, session: Session, link: str, ev: TokenEvent) -> None:
        if ev.finish_reason is not None:
            self._sessions.pop(session.id, None)
        queue = self._links.get(link)
        if queue is None:  # the link closed (its sessions are being aborted)
            return
        queue.put_nowait(
            (
                session.id,
                Update(
                    list(ev.tokens),
                    ev.finish_reason,
                    session.drafted,
                    session.accepted,
                    self.replica,
                    ev.logprobs,
                    ev.prompt_logprobs,
                ),
            )
        )


class LaneLink:
    def __init__(
        self,
        connect: Callable[[str], AsyncIterator[Batch]],
        start: Callable[[Session, str], Awaitable[None]],
        cancel: Callable[[str], Awaitable[None]],
    ):
        self._connect, self._start, self._cancel = connect, start, cancel
        self._link: str | None = None
        self._reader: asyncio.Task | None = None
        self._connected: asyncio.Future | None = None
        self._queues: dict[str, tuple[str, asyncio.Queue]] = {}  # session id -> (link, its updates)
        self._cancels: set[asyncio.Task] = set()

    async def _linked(self) -> str:
        """The id of a connected link, connecting a new one when there is none."""
        if self._reader is None or self._reader.done():
            loop = asyncio.get_running_loop()
            self._link, self._connected = uuid.uuid4().hex, loop.create_future()
            self._reader = loop.create_task(self._read(self._link, self._connected))
        link = self._link
        await asyncio.shield(self._connected)
        return link

    async def _read(self, link: str, connected: asyncio.Future) -> None:
        stream = self._connect(link)
        try:
            async for batch in stream:
                if not connected.done():
                    connected.set_result(None)
                for sid, update in batch:
                    entry = self._queues.get(sid)
                    if entry is not None:
                        entry[1].put_nowait(update)
            raise ConnectionError("the lane link ended")
        except BaseException as exc:
            lost = ConnectionError(f"lane link lost ({type(exc).__name__}: {exc})")
            if not connected.done():
                connected.set_exception(lost)
            for owner, queue in list(self._queues.values()):
                if owner == link:
                    queue.put_nowait(lost)
            if not isinstance(exc, Exception):
                raise
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    async def open(self, session: Session) -> AsyncIterator[Update]:
        """A ``StreamService`` stream: the rest of ``session`` from its committed tokens on (its
        prompt and what it received are the new prompt), over this lane's link."""
        link = await self._linked()
        rest = session.continuation(uuid.uuid4().hex)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rest.id] = (link, queue)
        finished = False
        try:
            try:
                await self._start(rest, link)
            except LinkLost:  # the lane moved to another replica: connect there next time
                self._drop(link)
                raise
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            del self._queues[rest.id]
            if not finished:  # stopped here (a stop string, a client gone): abort it there
                task = asyncio.get_running_loop().create_task(self._cancel_quietly(rest.id))
                self._cancels.add(task)
                task.add_done_callback(self._cancels.discard)

    def _drop(self, link: str) -> None:
        """Closes ``link`` (its sessions fail over to the next link)."""
        if self._link == link and self._reader is not None and not self._reader.done():
            self._reader.cancel()

    async def _cancel_quietly(self, session_id: str) -> None:
        try:
            await self._cancel(session_id)
        except asyncio.CancelledError:
            log.warning("cancelling %s on its Router was itself cancelled (it runs there to its end)", session_id)
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. its replica died: nothing left to abort there
            log.warning("cancelling %s on its Router failed: %s: %s", session_id, type(exc).__name__, exc)
