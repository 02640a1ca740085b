"""Config updates under load: ``serve deploy`` of changed configs while greedy streams run, and
whether every stream completes identical to its reference (docs/benchmarks.md#resilience).

The cluster is one that ``serve run`` or ``serve deploy`` started from ``--config`` (its dashboard
on ``--dashboard``). First the reference: ``--streams`` users stream their prompts at once, to the
end. Then the same users stream their prompts again and again while one ``serve deploy`` after
another deploys the next variant of the config (``--changes``, applied cumulatively), each once
the previous one runs (the application RUNNING, every deployment HEALTHY). Every stream is
compared with its user's reference. Last, the config as it was, so the cluster is left as found.

    python -m tools.cluster.updates --config deployments/configs/local-cpu.yaml \\
        --streams 8 --max-tokens 1200 --changes router,drafter,replicas,limits

prints one JSON object: per stream whether it completed and is identical, its duration, its
longest wait between two events and the attempts that got no stream before it (retried as the
official clients retry them); per update when it was sent and when the application ran it.
The functions are what tests/integration/test_config_updates.py uses too."""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from moa_serve.loadtest.runner import serve_cli

PROMPTS = [
    "Tell a long story about a lighthouse keeper and a storm.",
    "Explain how a CPU cache works, step by step, with examples.",
    "Write a travel diary of a week in the mountains.",
    "Describe the history of the printing press in detail.",
    "Write a long letter from a gardener to her grandson.",
    "Explain the rules of chess to a beginner, one piece at a time.",
    "Tell the story of a robot that learns to paint.",
    "Describe a day in the life of a medieval baker.",
]


def _app_args(doc: dict) -> dict:
    return doc["applications"][0]["args"]


def _router(args: dict) -> dict:
    return args.setdefault("router", {})


def change_router(args: dict) -> str:
    """A Router setting: the speculation token budget."""
    r = _router(args)
    r["speculation_token_budget"] = int(r.get("speculation_token_budget") or 16) + 4
    return f"router.speculation_token_budget={r['speculation_token_budget']}"


def change_drafter(args: dict) -> str:
    """The drafter: prompt lookup alone, or with the output store."""
    args["drafter"] = "lookup" if args.get("drafter") != "lookup" else "lookup+outputs"
    return f"drafter={args['drafter']}"


def change_replicas(args: dict) -> str:
    """The Gateway's replica count (one more, or back to one)."""
    gw = args.setdefault("gateway", {})
    auto = gw.setdefault("autoscaling_config", {})
    n = 2 if int(auto.get("max_replicas", 1)) == 1 else 1
    auto.update(min_replicas=n, max_replicas=n)
    return f"gateway.replicas={n}"


def change_limits(args: dict) -> str:
    """The Gateway's limits: the longest wait for a first round it admits."""
    limits = args.setdefault("http_limits", {})
    limits["max_queue_wait_s"] = float(limits.get("max_queue_wait_s") or 4.0) + 1.0
    return f"http_limits.max_queue_wait_s={limits['max_queue_wait_s']}"


CHANGES = {"router": change_router, "drafter": change_drafter, "replicas": change_replicas, "limits": change_limits}


def variants(config: Path, changes: list[str]) -> list[tuple[str, dict]]:
    """The config after each change in turn (cumulative), each as (what changed, document)."""
    doc = yaml.safe_load(config.read_text())
    out = []
    for name in changes:
        doc = copy.deepcopy(doc)
        out.append((CHANGES[name](_app_args(doc)), doc))
    return out


def serve_env() -> dict[str, str]:
    """Ray 2.60's dashboard wants its token from ``serve deploy`` / ``serve status``."""
    return {**os.environ, "RAY_AUTH_MODE": "token"}


def deploy(doc: dict, dashboard: str) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(doc, f, sort_keys=False)
    try:
        cmd = serve_cli() + ["deploy", "--address", dashboard, f.name]
        subprocess.run(cmd, check=True, env=serve_env(), capture_output=True, timeout=120)
    finally:
        os.unlink(f.name)


def app_state(dashboard: str) -> tuple[str, dict]:
    """(application status, its deployments' statuses) from the dashboard's Serve API."""
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    r = httpx.get(dashboard + "/api/serve/applications/", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    r.raise_for_status()
    app = next(iter(r.json()["applications"].values()))
    return app["status"], {name: d["status"] for name, d in app["deployments"].items()}


def wait_running(dashboard: str, since: float, limit_s: float = 300.0) -> float:
    """Seconds from ``since`` until the application and each deployment are RUNNING (HEALTHY)."""
    deadline = time.monotonic() + limit_s
    time.sleep(1.0)  # the controller takes the new config before it reports on it
    while time.monotonic() < deadline:
        status, deployments = app_state(dashboard)
        if status == "RUNNING" and all(s == "HEALTHY" for s in deployments.values()):
            return time.monotonic() - since
        if status == "DEPLOY_FAILED":
            raise RuntimeError(f"the update failed to deploy: {deployments}")
        time.sleep(1.0)
    raise TimeoutError(f"the application was not RUNNING {limit_s:.0f} s after the update")


# what the official clients retry (openai-python: a connection error, 408, 409, 429, 5xx; twice, with
# backoff from 0.5 s): a request that got no stream, never one that did
RETRY_STATUSES = {408, 409, 429, 500, 502, 503, 504}
RETRIES, BACKOFF_S = 2, 0.5


async def _stream_once(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    t0 = last = time.monotonic()
    tokens: list[int] = []
    gap, error, status = 0.0, None, None
    try:
        async with client.stream("POST", url + "/v1/generate", json=body) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.monotonic()
                gap, last = max(gap, now - last), now
                event = json.loads(line[6:])
                if "error" in event:
                    error = str(event["error"])
                tokens += event.get("token_ids") or []
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"status": status, "tokens": tokens, "seconds": time.monotonic() - t0, "max_gap_s": gap, "error": error}


async def one_stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, t0: float = 0.0) -> dict:
    """One greedy stream, retried as the official clients retry a request that got no stream;
    ``started_at_s``: when it was sent, from ``t0``; ``retries``: the attempts before it."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    started, refused = time.monotonic(), []
    while True:
        out = await _stream_once(client, url, body)
        got_no_stream = not out["tokens"] and (out["status"] is None or out["status"] in RETRY_STATUSES)
        if not got_no_stream or len(refused) == RETRIES:
            break
        refused.append(out["status"] or out["error"])
        await asyncio.sleep(BACKOFF_S * 2 ** (len(refused) - 1))
    return {**out, "started_at_s": round(started - t0, 1), "retries": refused}


async def _streams(url: str, n: int, max_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=600.0)) as client:
        jobs = [one_stream(client, url, PROMPTS[i % len(PROMPTS)], max_tokens) for i in range(n)]
        return await asyncio.gather(*jobs)


def streams(url: str, n: int, max_tokens: int) -> list[dict]:
    """``n`` concurrent greedy streams (``ignore_eos``) read to their end, user ``i`` asking prompt ``i``."""
    return asyncio.run(_streams(url, n, max_tokens))


async def _users(url: str, n: int, max_tokens: int, updating: asyncio.Event, t0: float) -> list[tuple[int, dict]]:
    """``n`` users, each streaming its prompt again and again until the updates are done."""
    out: list[tuple[int, dict]] = []

    async def user(client: httpx.AsyncClient, i: int) -> None:
        while True:
            out.append((i, await one_stream(client, url, PROMPTS[i % len(PROMPTS)], max_tokens, t0)))
            if not updating.is_set():
                return

    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=600.0)) as client:
        await asyncio.gather(*(user(client, i) for i in range(n)))
    return out


def under_updates(url: str, dashboard: str, n: int, max_tokens: int, updates: list[tuple[str, dict]]) -> dict:
    """``n`` users streaming while each update is deployed in turn, the next once the previous runs;
    each user's last stream is one it started before the last update was running."""
    applied: list[dict] = []
    t0 = time.monotonic()

    async def main():
        updating = asyncio.Event()
        updating.set()
        users = asyncio.ensure_future(_users(url, n, max_tokens, updating, t0))
        await asyncio.sleep(3.0)  # every stream admitted and generating
        for what, doc in updates:
            sent = time.monotonic()
            await asyncio.to_thread(deploy, doc, dashboard)
            took = await asyncio.to_thread(wait_running, dashboard, sent)
            applied.append({"change": what, "sent_at_s": round(sent - t0, 1), "running_after_s": round(took, 1)})
        updating.clear()
        return await users

    done = asyncio.run(main())
    return {"streams": done, "updates": applied, "seconds": round(time.monotonic() - t0, 1)}


def compare(reference: list[dict], streamed: list[tuple[int, dict]]) -> list[dict]:
    """Each stream against its user's reference stream."""
    rows = []
    for i, got in streamed:
        ref = reference[i]
        rows.append(
            {
                "user": i,
                "started_at_s": got.get("started_at_s"),
                "status": got["status"],
                "retries": got.get("retries", []),
                "completed": got["status"] == 200 and got["error"] is None and len(got["tokens"]) == len(ref["tokens"]),
                "identical": got["tokens"] == ref["tokens"],
                "tokens": len(got["tokens"]),
                "seconds": round(got["seconds"], 1),
                "reference_seconds": round(ref["seconds"], 1),
                "max_gap_s": round(got["max_gap_s"], 2),
                "error": got["error"],
            }
        )
    return rows


def run(url: str, dashboard: str, config: Path, n: int, max_tokens: int, changes: list[str]) -> dict:
    reference = streams(url, n, max_tokens)
    result = under_updates(url, dashboard, n, max_tokens, variants(config, changes))
    restore_sent = time.monotonic()
    deploy(yaml.safe_load(config.read_text()), dashboard)
    restored_after = wait_running(dashboard, restore_sent)
    rows = compare(reference, result["streams"])
    return {
        "config": str(config),
        "users": n,
        "max_tokens": max_tokens,
        "reference_seconds": [round(r["seconds"], 1) for r in reference],
        "updates": result["updates"],
        "seconds": result["seconds"],
        "streams": len(rows),
        "retried": sum(bool(r["retries"]) for r in rows),
        "completed": sum(r["completed"] for r in rows),
        "identical": sum(r["identical"] for r in rows),
        "longest_gap_s": max(r["max_gap_s"] for r in rows),
        "per_stream": rows,
        "restored_after_s": round(restored_after, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--dashboard", default="http://127.0.0.1:8265")
    p.add_argument("--config", type=Path, required=True, help="the config the cluster runs now")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=1200)
    p.add_argument("--changes", default="router,drafter,replicas,limits", help=f"of {', '.join(CHANGES)}")
    a = p.parse_args(argv)
    changes = [c for c in a.changes.split(",") if c]
    unknown = [c for c in changes if c not in CHANGES]
    if unknown:
        p.error(f"--changes: unknown {unknown}; choose from {list(CHANGES)}")
    print(json.dumps(run(a.url, a.dashboard, a.config, a.streams, a.max_tokens, changes), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
