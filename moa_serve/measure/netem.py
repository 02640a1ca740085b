"""Network emulation: an asyncio TCP proxy with the network settings of the MoA paper's client-server
scenario (:data:`PROFILES`: two cities 300 km apart, and the paper's emulated 5G and 4G links).

`tc netem` is not available in this kernel, so ``moa netem`` (or :class:`NetemProxy`) sits
between a client and a server on 127.0.0.1 and shapes each direction of each connection:

* every chunk read from one side is delivered to the other after a delay drawn from
  N(mean, std), truncated at 0 (as ``tc netem`` does), on top of its serialization time
  ``len / bandwidth`` (the link sends one chunk after another);
* delivery stays in order: a chunk is delivered at ``max(previous delivery, arrival + queueing
  + serialization + delay + stalls)``, never before the one read earlier (TCP is ordered);
* a drop of probability ``loss`` is drawn for every ~1460-byte segment (at least one per chunk);
  a dropped segment costs a retransmission stall of ``stall_ms`` (one RTO, 200 ms) that also
  holds back everything behind it;
* a new connection pays one round trip (2 × mean delay) before its first byte can be sent.

Every direction of every connection has its own RNG, seeded from ``(seed, connection number,
direction)``, so the delays and drops of a run are reproducible (connection numbers count
accepted connections from 0). Links are full duplex: the two directions do not share bandwidth.

A cut (``cut()``, or ``cut_after`` seconds after the *first accepted connection*) kills the link:
``blackhole`` stops forwarding in both directions and keeps accepting connections that are never
forwarded (clients see timeouts); ``reset`` closes every connection with an RST and stops
listening (new connections are refused). ``restore()`` brings the link back: connections that
lived through the cut are reset (the outage outlived TCP), new ones are forwarded again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import socket
import struct
import threading
from collections import deque
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

log = logging.getLogger(__name__)

CutMode = Literal["blackhole", "reset"]
CUT_MODES: tuple[str, ...] = ("blackhole", "reset")
DIRECTIONS = ("up", "down")  # up: client -> upstream, down: upstream -> client
SEGMENT_BYTES = 1460  # one Ethernet-sized TCP segment: the unit a drop is drawn for
CHUNK_BYTES = 64 * 1024  # largest read from a socket
QUEUE_CHUNKS = 16  # chunks in flight per direction before the reader stops (backpressure)
MAX_RECORDED_DELAYS = 10_000  # per link, for inspection
HISTORY_CONNECTIONS = 1_000  # connections kept in NetemProxy.history


@dataclass(frozen=True)
class Profile:
    """One direction's network conditions; both directions of a link use the same profile."""

    name: str
    delay_mean_ms: float = 0.0
    delay_std_ms: float = 0.0
    bandwidth_mbit: float | None = None  # None: unlimited
    loss: float = 0.0  # drop probability per segment
    stall_ms: float = 200.0  # cost of a drop: one retransmission timeout

    def __post_init__(self) -> None:
        if self.delay_mean_ms < 0 or self.delay_std_ms < 0:
            raise ValueError(f"profile {self.name}: delays must be >= 0")
        if self.bandwidth_mbit is not None and self.bandwidth_mbit <= 0:
            raise ValueError(f"profile {self.name}: bandwidth_mbit must be > 0 (or None for unlimited)")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"profile {self.name}: loss must be in [0, 1)")
        if self.stall_ms < 0:
            raise ValueError(f"profile {self.name}: stall_ms must be >= 0")

    @property
    def bytes_per_s(self) -> float | None:
        return None if self.bandwidth_mbit is None else self.bandwidth_mbit * 1e6 / 8

    def describe(self) -> str:
        delay = (
            f"N({self.delay_mean_ms:g}, {self.delay_std_ms:g}) ms"
            if self.delay_std_ms
            else f"{self.delay_mean_ms:g} ms"
        )
        bw = "unlimited" if self.bandwidth_mbit is None else f"{self.bandwidth_mbit:g} Mbit/s"
        return f"{self.name}: delay {delay} each way, {bw}, loss {self.loss:.2%}"


PROFILES: dict[str, Profile] = {
    "local": Profile("local"),
    # two cities 300 km apart: ping ~9 ms, so 4.5 ms each way, 50 Mbit/s
    "wan": Profile("wan", delay_mean_ms=4.5, bandwidth_mbit=50.0),
    # the paper's emulated 5G: delay N(10, 10) ms, 0.1% drops; no bandwidth given, 50 Mbit/s assumed
    "5g": Profile("5g", delay_mean_ms=10.0, delay_std_ms=10.0, bandwidth_mbit=50.0, loss=0.001),
    # the paper's emulated 4G: <= 20 Mbit/s, delay N(21, 19) ms, 0.1% drops
    "4g": Profile("4g", delay_mean_ms=21.0, delay_std_ms=19.0, bandwidth_mbit=20.0, loss=0.001),
}


def get_profile(profile: Profile | str) -> Profile:
    if isinstance(profile, Profile):
        return profile
    try:
        return PROFILES[profile]
    except KeyError:
        raise ValueError(f"unknown netem profile {profile!r}; choose from {', '.join(PROFILES)}") from None


@dataclass
class NetemStats:
    connections: int = 0
    bytes_up: int = 0  # delivered client -> upstream
    bytes_down: int = 0  # delivered upstream -> client
    segments: int = 0  # segments a drop was drawn for, both directions
    stalls: int = 0  # dropped segments, each one retransmission stall
    stall_s: float = 0.0
    cuts: int = 0

    def summary(self) -> str:
        return (
            f"netem: {self.connections} connections, {self.bytes_up} B up, {self.bytes_down} B down, "
            f"{self.stalls} stalls in {self.segments} segments ({self.stall_s:.2f} s), {self.cuts} cuts"
        )


def link_seed(seed: int, connection: int, direction: str) -> str:
    """The RNG seed of one direction of one connection (str seeds are hashed with SHA-512: stable)."""
    return f"netem/{seed}/{connection}/{direction}"


class Link:
    """One direction of one connection: when each chunk read from one side reaches the other."""

    def __init__(self, profile: Profile, seed: str, stats: NetemStats | None = None) -> None:
        self.profile = profile
        self.stats = stats if stats is not None else NetemStats()
        self._delay_rng = random.Random(f"{seed}/delay")
        self._loss_rng = random.Random(f"{seed}/loss")
        self._free_at = 0.0  # when the link has finished serializing what it was given
        self._last_delivery = 0.0
        self.delays: list[float] = []  # drawn delays in seconds, in order (the first MAX_RECORDED_DELAYS)

    def not_before(self, t: float) -> None:
        """Nothing may be sent before ``t`` (e.g. until the connection's handshake is done)."""
        self._free_at = max(self._free_at, t)

    def draw_delay(self) -> float:
        p = self.profile
        delay = max(0.0, self._delay_rng.gauss(p.delay_mean_ms, p.delay_std_ms)) / 1000
        if len(self.delays) < MAX_RECORDED_DELAYS:
            self.delays.append(delay)
        return delay

    def draw_stalls(self, nbytes: int) -> int:
        """Dropped segments among the ``nbytes`` of one chunk (an empty chunk, the FIN, is one segment)."""
        segments = max(1, math.ceil(nbytes / SEGMENT_BYTES))
        self.stats.segments += segments
        if self.profile.loss == 0:
            return 0
        lost = sum(self._loss_rng.random() < self.profile.loss for _ in range(segments))
        self.stats.stalls += lost
        self.stats.stall_s += lost * self.profile.stall_ms / 1000
        return lost

    def schedule(self, now: float, nbytes: int) -> float:
        """Delivery time of ``nbytes`` read at ``now`` (same clock), after every earlier chunk."""
        start = max(now, self._free_at)
        bps = self.profile.bytes_per_s
        self._free_at = start + (nbytes / bps if bps else 0.0)
        stall = self.draw_stalls(nbytes) * self.profile.stall_ms / 1000
        at = max(self._last_delivery, self._free_at + self.draw_delay() + stall)
        self._last_delivery = at
        return at


def delay_schedule(
    profile: Profile | str, seed: int, connection: int = 0, direction: str = "up", n: int = 10
) -> list[float]:
    """The first ``n`` delays (seconds) that connection ``connection``'s ``direction`` link will draw."""
    link = Link(get_profile(profile), link_seed(seed, connection, direction))
    return [link.draw_delay() for _ in range(n)]


def _reset(writer: asyncio.StreamWriter, rst: bool = True) -> None:
    """Close a stream now, with an RST rather than a FIN when ``rst``."""
    sock = writer.get_extra_info("socket")
    if rst and sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass(eq=False)
class _Connection:
    id: int
    client: asyncio.StreamWriter
    up: Link
    down: Link
    upstream: asyncio.StreamWriter | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    def abort(self, rst: bool = True) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                _reset(writer, rst)
        if self.task is not None:
            self.task.cancel()


class NetemProxy:
    """A TCP proxy from ``listen`` to ``upstream`` shaping traffic with a :class:`Profile`.

    Runs on the current event loop: ``await start()`` returns the listening (host, port);
    ``cut(mode)``, ``await restore()`` and ``await stop()`` control it. For synchronous code
    use :func:`netem_proxy`, which runs one in a background thread.
    """

    def __init__(
        self,
        profile: Profile | str,
        upstream: tuple[str, int],
        listen: tuple[str, int] = ("127.0.0.1", 0),
        seed: int = 0,
        cut_after: float | None = None,
        cut_mode: CutMode = "blackhole",
    ) -> None:
        if cut_mode not in CUT_MODES:
            raise ValueError(f"cut_mode must be one of {', '.join(CUT_MODES)}, got {cut_mode!r}")
        if cut_after is not None and cut_after < 0:
            raise ValueError("cut_after must be >= 0 seconds")
        self.profile = get_profile(profile)
        self.upstream = upstream
        self.seed = seed
        self.cut_after = cut_after
        self.cut_mode: CutMode = cut_mode
        self.stats = NetemStats()
        self.history: deque[_Connection] = deque(maxlen=HISTORY_CONNECTIONS)  # accepted connections, in order
        self._listen = listen
        self._server: asyncio.Server | None = None
        self._conns: set[_Connection] = set()
        self._link_up = asyncio.Event()
        self._cut: CutMode | None = None
        self._cut_timer: asyncio.TimerHandle | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self._listen

    @property
    def is_cut(self) -> CutMode | None:
        return self._cut

    async def start(self) -> tuple[str, int]:
        self._link_up.set()
        await self._start_listening()
        log.info("netem %s listening on %s:%d -> %s:%d", self.profile.describe(), *self._listen, *self.upstream)
        return self._listen

    async def _start_listening(self) -> None:
        self._server = await asyncio.start_server(self._on_accept, *self._listen)
        self._listen = self._server.sockets[0].getsockname()[:2]  # the real port when 0 was asked

    async def stop(self) -> None:
        if self._cut_timer is not None:
            self._cut_timer.cancel()
        if self._server is not None:
            self._server.close()
            self._server = None
        conns = list(self._conns)
        for conn in conns:
            conn.abort(rst=False)
        await asyncio.gather(*(c.task for c in conns if c.task is not None), return_exceptions=True)
        log.info("%s", self.stats.summary())

    def cut(self, mode: CutMode = "blackhole") -> None:
        """Kill the link now (see the module docstring for what each mode does)."""
        if mode not in CUT_MODES:
            raise ValueError(f"cut mode must be one of {', '.join(CUT_MODES)}, got {mode!r}")
        self.stats.cuts += 1
        self._cut = mode
        self._link_up.clear()
        if mode == "reset":
            for conn in list(self._conns):
                conn.abort()
            if self._server is not None:
                self._server.close()
                self._server = None
        log.info("netem: link cut (%s)", mode)

    async def restore(self) -> None:
        """Bring the link back: connections from before are reset, new ones are forwarded."""
        if self._cut is None:
            return
        for conn in list(self._conns):
            conn.abort()
        if self._server is None:
            await self._start_listening()
        self._cut = None
        self._link_up.set()
        log.info("netem: link restored")

    def _on_accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut == "reset":  # accepted just before the listener closed
            _reset(writer)
            return
        loop = asyncio.get_running_loop()
        if self.cut_after is not None and self._cut_timer is None:
            self._cut_timer = loop.call_later(self.cut_after, self.cut, self.cut_mode)
        n = self.stats.connections
        self.stats.connections += 1
        up, down = (Link(self.profile, link_seed(self.seed, n, d), self.stats) for d in DIRECTIONS)
        up.not_before(loop.time() + 2 * self.profile.delay_mean_ms / 1000)  # the TCP handshake
        conn = _Connection(n, writer, up, down)
        self._conns.add(conn)
        self.history.append(conn)
        conn.task = loop.create_task(self._run(conn, reader))

    async def _run(self, conn: _Connection, client_reader: asyncio.StreamReader) -> None:
        try:
            await self._link_up.wait()  # a blackholed link accepts but never forwards
            try:
                upstream_reader, conn.upstream = await asyncio.open_connection(*self.upstream)
            except OSError as exc:
                log.warning("netem: cannot reach upstream %s:%d: %s", *self.upstream, exc)
                conn.abort()
                return
            reset = False
            try:
                async with asyncio.TaskGroup() as tg:
                    for reader, writer, link, direction in (
                        (client_reader, conn.upstream, conn.up, "up"),
                        (upstream_reader, conn.client, conn.down, "down"),
                    ):
                        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)
                        tg.create_task(self._receive(reader, link, queue))
                        tg.create_task(self._deliver(queue, writer, direction))
            except* OSError:  # one side reset or vanished: the other side sees a reset too
                reset = True
            if reset:
                conn.abort()
                return
            for writer in (conn.client, conn.upstream):
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
        finally:
            self._conns.discard(conn)

    async def _receive(
        self, reader: asyncio.StreamReader, link: Link, queue: asyncio.Queue[tuple[float, bytes]]
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            data = await reader.read(CHUNK_BYTES)
            await queue.put((link.schedule(loop.time(), len(data)), data))
            if not data:  # EOF travels the link like data
                return

    async def _deliver(
        self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter, direction: str
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            at, data = await queue.get()
            await asyncio.sleep(max(0.0, at - loop.time()))
            await self._link_up.wait()
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
            if direction == "up":
                self.stats.bytes_up += len(data)
            else:
                self.stats.bytes_down += len(data)


async def _call(fn: Any, *args: Any) -> Any:
    return fn(*args)


class NetemThread:
    """A :class:`NetemProxy` on its own event loop in a background thread, for synchronous code.

    Iterating gives ``(host, port)``, so ``with netem_proxy(...) as (host, port)`` works.
    """

    def __init__(self, proxy: NetemProxy) -> None:
        self.proxy = proxy
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="netem", daemon=True)

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def start(self) -> tuple[str, int]:
        self._thread.start()
        try:
            return self._call(self.proxy.start())
        except BaseException:
            self._stop_loop()
            raise

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def stop(self) -> None:
        try:
            self._call(self.proxy.stop())
        finally:
            self._stop_loop()

    def cut(self, mode: CutMode = "blackhole") -> None:
        self._call(_call(self.proxy.cut, mode))

    def restore(self) -> None:
        self._call(self.proxy.restore())

    @property
    def address(self) -> tuple[str, int]:
        return self.proxy.address

    @property
    def host(self) -> str:
        return self.address[0]

    @property
    def port(self) -> int:
        return self.address[1]

    @property
    def stats(self) -> NetemStats:
        return self.proxy.stats

    def __iter__(self) -> Iterator[Any]:
        return iter(self.address)


@contextlib.contextmanager
def netem_proxy(
    profile: Profile | str,
    upstream: tuple[str, int],
    seed: int = 0,
    listen: tuple[str, int] = ("127.0.0.1", 0),
    cut_after: float | None = None,
    cut_mode: CutMode = "blackhole",
) -> Iterator[NetemThread]:
    """Run a :class:`NetemProxy` in a background thread for the ``with`` block."""
    handle = NetemThread(NetemProxy(profile, upstream, listen, seed, cut_after, cut_mode))
    handle.start()
    try:
        yield handle
    finally:
        handle.stop()
