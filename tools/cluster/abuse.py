"""Abusive clients against a served cluster, and what the other users see meanwhile: the rows of
docs/benchmarks.md#resilience.

* ``half-open``: N connections that each send a POST's headers (``Content-Length: 100``) and never
  the body; meanwhile sequential short ``/v1/generate`` requests from another client, timed, against
  the same requests without the attack.
* ``slow-body``: one POST whose body arrives at 1 byte/s: when the server answered or closed it.
* ``stalled-reader``: a streaming request whose client never reads (a small receive buffer, so its
  TCP window fills), beside a normal stream: the normal stream's tok/s, and when the stalled
  session left ``/v1/stats``.
* ``overload``: a burst of concurrent streaming requests: statuses, ``Retry-After``, and the
  admitted requests' time to first token.
* ``closed-loop``: users that send one streaming request after another for a while (after a 429
  they wait its Retry-After): statuses and the admitted requests' time to first token.

    python -m tools.cluster.abuse --url http://127.0.0.1:8000 half-open --connections 1000

prints one JSON object per scenario. The functions are what tests/integration use too."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import statistics
import threading
import time
from urllib.parse import urlsplit

import httpx

STALLED_TOKENS = 2000  # a stream that runs near the end of the context (2048) of the shipped configs
PROMPT = [{"role": "user", "content": "Name three colors."}]


def address(url: str) -> tuple[str, int]:
    u = urlsplit(url)
    return u.hostname or "127.0.0.1", u.port or 80


def post_head(url: str, path: str, length: int, extra: str = "") -> bytes:
    host, port = address(url)
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    ).encode()


def open_half(url: str, n: int, path: str = "/v1/generate") -> list[socket.socket]:
    """``n`` connections, each with a POST's headers sent and no body."""
    head = post_head(url, path, 100)
    socks = []
    for _ in range(n):
        s = socket.create_connection(address(url), timeout=10)
        s.sendall(head)
        socks.append(s)
    return socks


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server answered or closed ``s`` (without blocking)."""
    s.setblocking(False)
    try:
        return s.recv(1 << 16, socket.MSG_PEEK) is not None
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        s.setblocking(True)


def generate_once(client: httpx.Client, url: str, max_tokens: int = 4) -> float:
    t0 = time.perf_counter()
    r = client.post(
        url + "/v1/generate",
        json={"messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )
    r.raise_for_status()
    return time.perf_counter() - t0


def latencies(url: str, n: int, max_tokens: int = 4) -> list[float]:
    """``n`` sequential short generations, each on a fresh connection (a client of its own)."""
    out = []
    for _ in range(n):
        with httpx.Client() as c:
            out.append(generate_once(c, url, max_tokens))
    return out


def half_open(url: str, connections: int, requests: int = 10, reopen: bool = False) -> dict:
    """p50 of ``requests`` short generations without and with ``connections`` half-open requests,
    and how many of them the server closed meanwhile; with ``reopen``, each one the server closes
    is opened again at once."""
    before = latencies(url, requests)
    socks = open_half(url, connections)
    stop, reopened = threading.Event(), [0]

    def hold():
        while not stop.is_set():
            for i, s in enumerate(socks):
                if reopen and closed_by_server(s):
                    s.close()
                    socks[i] = open_half(url, 1)[0]
                    reopened[0] += 1
            stop.wait(0.05)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        time.sleep(1.0)
        during = latencies(url, requests)
    finally:
        stop.set()
        holder.join(timeout=30)
        closed = reopened[0] + sum(closed_by_server(s) for s in socks)
        for s in socks:
            s.close()
    return {
        "scenario": "half-open",
        "connections": connections,
        "reopen": reopen,
        "p50_without_s": round(statistics.median(before), 4),
        "p50_with_s": round(statistics.median(during), 4),
        "ratio": round(statistics.median(during) / statistics.median(before), 3),
        "closed_by_server": closed,
    }


def slow_body(url: str, limit_s: float = 60.0, path: str = "/v1/generate") -> dict:
    """A POST whose 100-byte body is sent at 1 byte/s: seconds until the server answered or closed
    the connection (None: still open after ``limit_s``), and the status it answered."""
    s = socket.create_connection(address(url), timeout=limit_s)
    s.sendall(post_head(url, path, 100))
    t0 = time.monotonic()
    answer = b""
    try:
        while time.monotonic() - t0 < limit_s:
            s.settimeout(1.0)
            try:
                chunk = s.recv(4096)
                answer += chunk
                if not chunk or answer:
                    break
            except socket.timeout:
                pass
            try:
                s.sendall(b" ")
            except OSError:
                break
        took = time.monotonic() - t0
    finally:
        s.close()
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else None
    return {"scenario": "slow-body", "closed_after_s": round(took, 1) if took < limit_s else None, "status": status}


def stalled_stream(url: str, max_tokens: int, rcvbuf: int = 4096) -> socket.socket:
    """A streaming /v1/generate whose client never reads its answer (a small receive buffer)."""
    body = json.dumps(
        {"messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    ).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(address(url))
    s.sendall(post_head(url, "/v1/generate", len(body)) + body)
    return s


def stream_tokens_per_s(url: str, max_tokens: int) -> tuple[int, float]:
    """One streaming generation read to its end: (tokens, tok/s)."""
    t0, n = time.perf_counter(), 0
    with httpx.stream(
        "POST",
        url + "/v1/generate",
        json={"messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True},
        timeout=120,
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                n += len(json.loads(line[6:]).get("token_ids") or [])
    return n, n / (time.perf_counter() - t0)


def active_sessions(url: str) -> int:
    """Sessions the server is generating for or holds queued (``/v1/stats``)."""
    s = httpx.get(url + "/v1/stats", timeout=10).json()
    return int(s.get("active_sessions", 0)) + int(s.get("queue_depth", 0))


def _wait_idle(url: str, limit_s: float) -> float | None:
    """Seconds until no session is running or queued (None: still some after ``limit_s``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if active_sessions(url) == 0:
            return round(time.monotonic() - t0, 1)
        time.sleep(0.5)
    return None


def _beside_reader(url: str, max_tokens: int, limit_s: float) -> float:
    """A normal stream's tok/s beside a long stream that its client reads to the end."""
    reader = threading.Thread(target=stream_tokens_per_s, args=(url, STALLED_TOKENS), daemon=True)
    reader.start()
    time.sleep(1.0)
    _, tok_s = stream_tokens_per_s(url, max_tokens)
    reader.join(timeout=limit_s)
    return tok_s


def _beside_stalled(url: str, max_tokens: int, limit_s: float) -> tuple[float, float | None]:
    """A normal stream's tok/s beside the same long stream whose client never reads, and when the
    stalled session left /v1/stats (seconds after it was sent)."""
    s = stalled_stream(url, STALLED_TOKENS)
    t0 = time.monotonic()
    try:
        time.sleep(1.0)
        _, tok_s = stream_tokens_per_s(url, max_tokens)
        gone = _wait_idle(url, limit_s)
    finally:
        s.close()
    return tok_s, None if gone is None else round(time.monotonic() - t0, 1)


def stalled_reader(url: str, max_tokens: int, limit_s: float = 120.0, repeats: int = 1) -> dict:
    """A normal stream beside a long stream that its client reads, and beside the same long stream
    whose client never reads, ``repeats`` pairs in alternating order (reader first, then stalled
    first): tok/s of each, their ratio per pair and its geometric mean, and when each stalled
    session left /v1/stats."""
    pairs = []
    for i in range(repeats):
        if i % 2 == 0:
            reader = _beside_reader(url, max_tokens, limit_s)
            stalled, gone = _beside_stalled(url, max_tokens, limit_s)
        else:
            stalled, gone = _beside_stalled(url, max_tokens, limit_s)
            reader = _beside_reader(url, max_tokens, limit_s)
        pairs.append({"beside_reader": round(reader, 1), "beside_stalled": round(stalled, 1), "stalled_gone_s": gone})
    ratios = [p["beside_stalled"] / p["beside_reader"] for p in pairs]
    return {
        "scenario": "stalled-reader",
        "pairs": pairs,
        "ratios": [round(r, 3) for r in ratios],
        "ratio_geomean": round(statistics.geometric_mean(ratios), 3),
    }


async def _burst_one(client: httpx.AsyncClient, url: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    body = {"messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", url + "/v1/generate", json=body, timeout=300) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "retry_after": r.headers.get("retry-after")}
        ttft = None
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = time.perf_counter() - t0
        return {"status": 200, "ttft_s": ttft}


async def _burst(url: str, users: int, max_tokens: int) -> list[dict]:
    limits = httpx.Limits(max_connections=users, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        return await asyncio.gather(*(_burst_one(client, url, max_tokens) for _ in range(users)))


def _statuses_and_ttfts(results: list[dict]) -> tuple[dict[str, int], list[float]]:
    """How many requests ended with each status, and the admitted requests' TTFTs, sorted."""
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    return statuses, sorted(r["ttft_s"] for r in results if r.get("ttft_s") is not None)


def overload(url: str, users: int, max_tokens: int) -> dict:
    """``users`` streaming requests at once: statuses, Retry-After, admitted requests' TTFT."""
    results = asyncio.run(_burst(url, users, max_tokens))
    statuses, ttfts = _statuses_and_ttfts(results)
    return {
        "scenario": "overload",
        "users": users,
        "statuses": statuses,
        "retry_after": sorted({r["retry_after"] for r in results if r.get("retry_after")}),
        "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "ttft_max_s": round(ttfts[-1], 3) if ttfts else None,
    }


async def _user(client: httpx.AsyncClient, url: str, max_tokens: int, until: float, out: list[dict]) -> None:
    """A closed-loop user: one streaming request after another; after a 429 it waits Retry-After."""
    while time.perf_counter() < until:
        r = await _burst_one(client, url, max_tokens)
        out.append(r)
        if r["status"] == 429:
            await asyncio.sleep(min(float(r["retry_after"] or 1), max(0.0, until - time.perf_counter())))


async def _closed_loop(url: str, users: int, duration_s: float, max_tokens: int) -> list[dict]:
    limits = httpx.Limits(max_connections=users, max_keepalive_connections=users)
    until = time.perf_counter() + duration_s
    out: list[dict] = []
    async with httpx.AsyncClient(limits=limits) as client:
        await asyncio.gather(*(_user(client, url, max_tokens, until, out) for _ in range(users)))
    return out


def closed_loop(url: str, users: int, duration_s: float, max_tokens: int) -> dict:
    """``users`` closed-loop users for ``duration_s``: statuses, admitted requests' TTFT."""
    results = asyncio.run(_closed_loop(url, users, duration_s, max_tokens))
    statuses, ttfts = _statuses_and_ttfts(results)
    return {
        "scenario": "closed-loop",
        "users": users,
        "duration_s": duration_s,
        "statuses": statuses,
        "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 3) if ttfts else None,
        "ttft_max_s": round(ttfts[-1], 3) if ttfts else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    sub = p.add_subparsers(dest="scenario", required=True)
    h = sub.add_parser("half-open")
    h.add_argument("--connections", type=int, default=1000)
    h.add_argument("--requests", type=int, default=10)
    h.add_argument("--reopen", action="store_true", help="open again at once each connection the server closes")
    sub.add_parser("slow-body")
    st = sub.add_parser("stalled-reader")
    st.add_argument("--max-tokens", type=int, default=256)
    st.add_argument("--repeats", type=int, default=1, help="reader / stalled pairs, alternated")
    o = sub.add_parser("overload")
    o.add_argument("--users", type=int, default=160)
    o.add_argument("--max-tokens", type=int, default=128)
    c = sub.add_parser("closed-loop")
    c.add_argument("--users", type=int, default=160)
    c.add_argument("--duration", type=float, default=30.0)
    c.add_argument("--max-tokens", type=int, default=128)
    a = p.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        if a.scenario == "half-open":
            out = half_open(a.url, a.connections, a.requests, a.reopen)
        elif a.scenario == "slow-body":
            out = slow_body(a.url)
        elif a.scenario == "stalled-reader":
            out = stalled_reader(a.url, a.max_tokens, repeats=a.repeats)
        elif a.scenario == "closed-loop":
            out = closed_loop(a.url, a.users, a.duration, a.max_tokens)
        else:
            out = overload(a.url, a.users, a.max_tokens)
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
