#!/usr/bin/env python3
"""Time to first token under closed-loop load, for any OpenAI-compatible server.

The shared closed-loop client (``../shared/tools/openai_load.py``) reads whole responses, so it
cannot see when the first token arrived. This probe runs the same kind of load (N users, each
sending the next first-turn prompt of a Spec-Bench-format file as soon as its previous request
ended, greedy, ``max_tokens``) but streams (``"stream": true``) and records, per request, the
time from sending it to the first chunk that carries text. It prints one JSON line per level:
requests, failures, TTFT p50/p90/p99 (s), end-to-end latency p50 (s) and streamed chunks per
second. ``python -m tools.side_by_side --ttft-duration`` runs it after each level, on every side.

    python tools/side_by_side/ttft_probe.py --base http://127.0.0.1:8000 --model M --users 1,4 --duration 15

Standard library and the installed ``moa_serve`` (for the API key header) only.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request

from moa_serve.app.auth import client_headers


def load_prompts(path: str, limit: int) -> list[str]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line)["turns"][0])
            if len(out) >= limit:
                break
    return out


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def request_headers() -> dict[str, str]:
    """JSON, and ``$MOA_API_KEY`` as a bearer token when set (a server with API keys)."""
    return {"Content-Type": "application/json", **client_headers()}


def stream_one(base: str, model: str, prompt: str, max_tokens: int, timeout: float) -> tuple[float | None, float, int]:
    """(seconds to the first text chunk or None, seconds to the end, text chunks) of one request."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    req = urllib.request.Request(
        base + "/v1/chat/completions", data=json.dumps(body).encode(), headers=request_headers()
    )
    t0 = time.perf_counter()
    first, chunks = None, 0
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            choices = json.loads(data).get("choices") or [{}]
            if (choices[0].get("delta") or {}).get("content"):
                chunks += 1
                if first is None:
                    first = time.perf_counter() - t0
    return first, time.perf_counter() - t0, chunks


def one_level(
    base: str, model: str, prompts: list[str], users: int, duration: float, max_tokens: int, timeout: float = 600.0
) -> dict:
    ttft, latency, errors = [], [], []
    chunks = [0]
    lock = threading.Lock()
    end = time.monotonic() + duration

    def user(uid: int) -> None:
        i = uid
        while time.monotonic() < end:
            try:
                first, total, n = stream_one(base, model, prompts[i % len(prompts)], max_tokens, timeout)
                with lock:
                    latency.append(total)
                    chunks[0] += n
                    if first is not None:
                        ttft.append(first)
            except Exception as exc:  # noqa: BLE001 - counted and reported, the level goes on
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
            i += users

    t0 = time.monotonic()
    threads = [threading.Thread(target=user, args=(u,), daemon=True) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    r = lambda x: None if x is None else round(x, 4)  # noqa: E731
    return {
        "users": users,
        "duration_s": round(wall, 2),
        "requests": len(latency),
        "failures": len(errors),
        "ttft_p50_s": r(percentile(ttft, 0.5)),
        "ttft_p90_s": r(percentile(ttft, 0.9)),
        "ttft_p99_s": r(percentile(ttft, 0.99)),
        "latency_p50_s": r(percentile(latency, 0.5)),
        "chunks_per_s": round(chunks[0] / wall, 2) if wall else 0.0,
        "errors": errors[:3],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="server URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", required=True)
    ap.add_argument("--questions", required=True, help="Spec-Bench-format JSONL (first turns are sent)")
    ap.add_argument("--users", default="1", help="comma-separated levels")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds per level")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=64, help="prompts used")
    a = ap.parse_args(argv)
    prompts = load_prompts(a.questions, a.limit)
    if not prompts:
        print(f"no prompts in {a.questions}", file=sys.stderr)
        return 2
    for u in [int(x) for x in a.users.split(",") if x.strip()]:
        print(json.dumps(one_level(a.base.rstrip("/"), a.model, prompts, u, a.duration, a.max_tokens)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
