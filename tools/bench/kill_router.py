"""Kills the busy Router replica mid-generation and reports what the clients got.

Against a running ``serve run <config>`` (application ``moa``): first N concurrent greedy chat
requests run uninterrupted (the reference texts and times); then the same N again, and
``--kill-after`` seconds the process of the Router replica serving them (the busiest) gets SIGKILL. Each
request counts as completed when it answered 200 with all its tokens, and as identical when its
text equals the uninterrupted one. Then the time until the server answers a request again.
With ``--stream`` the requests stream (SSE) and the text is what the deltas add up to.

    python tools/bench/kill_router.py --url http://127.0.0.1:8000 --serve-pid PID --stream
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import time

import httpx

PROMPTS = [
    "Tell me a story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "Write a letter to a friend about autumn.",
    "Describe a busy market in the morning.",
]


async def chat(client: httpx.AsyncClient, prompt: str, max_tokens: int, stream: bool) -> dict:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    t0 = time.perf_counter()
    try:
        if not stream:
            r = await client.post("/v1/chat/completions", json=body)
            ok = r.status_code == 200
            out = r.json() if ok else {}
            return {
                "status": r.status_code,
                "text": out["choices"][0]["message"]["content"] if ok else None,
                "tokens": out.get("usage", {}).get("completion_tokens"),
                "s": time.perf_counter() - t0,
            }
        pieces, done, status = [], False, None
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        break
                    pieces += [c["delta"].get("content", "") for c in ev["choices"]]
        return {
            "status": status if done else f"{status}, stream broken",
            "text": "".join(pieces) if done else None,
            "s": time.perf_counter() - t0,
        }
    except httpx.HTTPError as exc:
        return {"status": type(exc).__name__, "text": None, "s": time.perf_counter() - t0}


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def router_pids(serve_pid: int) -> list[int]:
    """The Router replica processes of the cluster ``serve run`` (pid ``serve_pid``) started: its
    raylet's children (other clusters on the machine are left alone)."""
    out = subprocess.run(["pgrep", "-f", "ServeReplica:moa:Router"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if parent(parent(int(p))) == serve_pid]


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


async def kill_busy_router(after_s: float, serve_pid: int) -> int:
    """SIGKILL, ``after_s`` seconds from now, of the Router replica process that used the most CPU
    in the second before (the one running the rounds)."""
    pids = router_pids(serve_pid)
    assert pids, f"no Router replica under serve run {serve_pid}"
    await asyncio.sleep(max(0.0, after_s - 1.0))
    before = {p: cpu_ticks(p) for p in pids}
    await asyncio.sleep(min(1.0, after_s))
    pid = max(pids, key=lambda p: cpu_ticks(p) - before[p])
    os.kill(pid, signal.SIGKILL)
    return pid


async def run(
    url: str, n: int, max_tokens: int, stream: bool, kill_after: float | None, serve_pid: int = 0
) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        calls = [asyncio.create_task(chat(client, PROMPTS[i % len(PROMPTS)], max_tokens, stream)) for i in range(n)]
        if kill_after is not None:
            await kill_busy_router(kill_after, serve_pid)
        return list(await asyncio.gather(*calls))


def serving_again_s(url: str, limit_s: float = 300.0) -> float:
    t0 = time.perf_counter()
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    while time.perf_counter() - t0 < limit_s:
        try:
            if httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return float("inf")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--kill-after", type=float, default=1.5)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--serve-pid", type=int, required=True, help="pid of the serve run process of the cluster")
    ap.add_argument("--out")
    args = ap.parse_args()
    ref = asyncio.run(run(args.url, args.requests, args.max_tokens, args.stream, None))
    killed = asyncio.run(run(args.url, args.requests, args.max_tokens, args.stream, args.kill_after, args.serve_pid))
    again = serving_again_s(args.url)
    result = {
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "stream": args.stream,
        "kill_after_s": args.kill_after,
        "completed": sum(k["text"] is not None for k in killed),
        "identical": sum(k["text"] is not None and k["text"] == r["text"] for k, r in zip(killed, ref)),
        "statuses": [k["status"] for k in killed],
        "uninterrupted_s": [round(r["s"], 2) for r in ref],
        "killed_s": [round(k["s"], 2) for k in killed],
        "serving_again_after_s": round(again, 2),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
