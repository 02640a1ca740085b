"""``moa loadtest --soak DURATION``: one closed-loop level for a long time, with the server sampled
every ``--soak-interval``, to see whether memory, caches or latency drift.

Each sample records, for the interval that just ended:

- the resident memory (``VmRSS`` of ``/proc/<pid>/status``) of every Ray Serve replica on this
  machine (processes titled ``ray::ServeReplica:<app>:<deployment>``; with ``--config`` only those
  of the cluster the runner started), summed per deployment (Router, VerifierPool, DrafterPool, ...);
- from ``GET /v1/stats``: the verifier engine's slots in use (live sessions), retained prefixes and
  free slots (``verifier_engine``, one verifier replica), the Router's queue depth and active sessions;
- from the locustfile's per-request metrics: requests and failures that ended in the interval, their
  latency p50/p99 and TTFT p50, and output tokens of the requests that ended in it per second.

Outputs in ``--out``: ``soak_samples.jsonl`` (one sample a line, written as it is taken, with the
PID of every replica), ``soak_samples.csv`` (the same, flat), ``soak.md`` (the summary: RSS growth
after the warm-up, failures, latency of the first and the last interval) and ``soak.png``.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from moa_serve.app.auth import client_headers

from . import report

# ray::ServeReplica:moa:Router, ray::ServeReplica:moa:VerifierPool.verify; while the replica
# starts: ray::SERVE_REPLICA::moa#Router#abc123:ServeReplica:moa:Router.__init__
REPLICA_TITLE = re.compile(r"ray::(?:\S*:)?ServeReplica:(?P<app>[^:\s]+):(?P<deployment>[^.\s:]+)")
SMALL_FILES = ("soak.md", "soak.png", "soak.json", "soak_samples.csv", "soak_samples.jsonl")


# ---------------------------------------------------------------------------------------
# replica processes


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return ""


def _session_of(pid: int) -> int | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[3])  # after the ")" of comm: state ppid pgrp session


def replica_processes(session: int | None = None) -> list[dict]:
    """Ray Serve replicas on this machine: ``{"deployment", "app", "pid"}``, from the process
    titles Ray gives its actor workers (``ray::ServeReplica:<app>:<deployment>``, with
    ``.<method>`` while a call runs). ``session``: only processes of that session id."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        m = REPLICA_TITLE.match(_cmdline(pid))
        if m is None or (session is not None and _session_of(pid) != session):
            continue
        found.append({"deployment": m["deployment"], "app": m["app"], "pid": pid})
    return sorted(found, key=lambda r: (r["deployment"], r["pid"]))


def rss_mib(pid: int) -> float | None:
    """Resident memory of a process (``VmRSS``) in MiB; None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def replica_memory(session: int | None) -> tuple[list[dict], dict[str, float]]:
    """(each replica with its RSS, RSS summed per deployment), both in MiB."""
    replicas, per_deployment = [], {}
    for r in replica_processes(session):
        rss = rss_mib(r["pid"])
        if rss is None:
            continue
        replicas.append({**r, "rss_mib": round(rss, 1)})
        per_deployment[r["deployment"]] = per_deployment.get(r["deployment"], 0.0) + rss
    return replicas, {k: round(v, 1) for k, v in per_deployment.items()}


# ---------------------------------------------------------------------------------------
# the server's counters and the requests of an interval


def server_counters(url: str) -> dict:
    """Queue depth, sessions and the verifier engine's slots from ``GET /v1/stats`` (None for a
    server without them)."""
    try:
        stats = httpx.get(url + "/v1/stats", timeout=10, headers=client_headers()).json()
    except (httpx.HTTPError, ValueError) as exc:
        return {"stats_error": type(exc).__name__}
    engine = stats.get("verifier_engine") or {}
    return {
        "queue_depth": stats.get("queue_depth"),
        "active_sessions": stats.get("active_sessions"),
        "slots_in_use": engine.get("sessions"),
        "retained_prefixes": engine.get("retained_slots"),
        "free_slots": engine.get("free_slots"),
        "verifier_replica": engine.get("replica"),
    }


class MetricsTail:
    """Reads the request records that the locustfile appended since the last call (whole lines)."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def new_requests(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return []
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        records = [json.loads(line) for line in chunk[:end].splitlines() if line.strip()]
        return [r for r in records if r.get("event") == "request"]


def interval_requests(records: list[dict], seconds: float) -> dict:
    """Requests that ended in an interval of ``seconds``: counts, latency, tokens per second."""
    ok = [r for r in records if r.get("ok")]
    latency = [r.get("latency_ms") for r in ok]
    tokens = sum(int(r.get("output_tokens") or 0) for r in ok)
    return {
        "requests": len(records),
        "failures": len(records) - len(ok),
        "latency_p50_ms": _r(report.percentile(latency, 50)),
        "latency_p99_ms": _r(report.percentile(latency, 99)),
        "ttft_p50_ms": _r(report.percentile([r.get("ttft_ms") for r in ok], 50)),
        "output_tokens": tokens,
        "output_tokens_per_s": _r(tokens / seconds if seconds > 0 else None),
    }


def _r(x, nd=1):
    return None if x is None else round(float(x), nd)


# ---------------------------------------------------------------------------------------
# sampling while Locust runs


@dataclass
class Soak:
    url: str
    users: int
    duration_s: float
    interval_s: float
    warmup_s: float
    out: Path
    session: int | None = None  # the cluster's session id (only its replicas are measured)
    samples: list[dict] = field(default_factory=list)

    def sample(self, t0: float, last: float, tail: MetricsTail) -> dict:
        now = time.time()
        replicas, per_deployment = replica_memory(self.session)
        s = {
            "t": round(now, 3),
            "elapsed_s": round(now - t0, 1),
            "interval_s": round(now - last, 1),
            "rss_mib": per_deployment,
            "rss_total_mib": round(sum(per_deployment.values()), 1),
            **server_counters(self.url),
            **interval_requests(tail.new_requests(), now - last),
            "replicas": replicas,
        }
        self.samples.append(s)
        with open(self.out / "soak_samples.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(s) + "\n")
        return s

    def run(self, locust_cmd: list[str], metrics: Path, log_path: Path) -> None:
        """Starts Locust, samples every interval until it exits, then once more for what ended
        while it stopped."""
        (self.out / "soak_samples.jsonl").unlink(missing_ok=True)
        tail = MetricsTail(metrics)
        t0 = last = time.time()
        with open(log_path, "wb") as lf:
            proc = subprocess.Popen(locust_cmd, stdout=lf, stderr=subprocess.STDOUT)
            try:
                while _running_until(proc, last + self.interval_s):
                    _log_sample(self.sample(t0, last, tail))
                    last = time.time()
                if time.time() - last > 0.5:
                    _log_sample(self.sample(t0, last, tail))
            finally:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(timeout=30)
        if proc.returncode not in (0, 1):
            raise RuntimeError(f"locust exited with {proc.returncode}; see {log_path}")


def _running_until(proc: subprocess.Popen, deadline: float) -> bool:
    """Waits until ``deadline``; False as soon as ``proc`` has exited."""
    while proc.poll() is None:
        left = deadline - time.time()
        if left <= 0:
            return True
        time.sleep(min(0.5, left))
    return False


def _log_sample(s: dict) -> None:
    rss = ", ".join(f"{k} {v:.0f}" for k, v in s["rss_mib"].items()) or "no replicas found"
    print(
        f"[soak] {s['elapsed_s']:7.0f} s  RSS MiB: {rss}  slots {s.get('slots_in_use')} "
        f"retained {s.get('retained_prefixes')} queue {s.get('queue_depth')}  {s['requests']} req "
        f"{s['failures']} failed  p50 {s['latency_p50_ms']} ms  {s['output_tokens_per_s']} tok/s",
        file=sys.stderr,
        flush=True,
    )


# ---------------------------------------------------------------------------------------
# the summary


def growth_pct(first: float | None, last: float | None) -> float | None:
    if not first or last is None:
        return None
    return round((last - first) / first * 100, 2)


def summarize(samples: list[dict], warmup_s: float) -> dict:
    """RSS growth per deployment from the first sample after the warm-up to the last, failures,
    latency p50 of the first and the last interval."""
    if not samples:
        return {"samples": 0}
    after = [s for s in samples if s["elapsed_s"] >= warmup_s] or samples[-1:]
    base, end = after[0], samples[-1]
    deployments = sorted({d for s in samples for d in s["rss_mib"]})
    rss = {
        d: {
            "after_warmup_mib": base["rss_mib"].get(d),
            "last_mib": end["rss_mib"].get(d),
            "growth_pct": growth_pct(base["rss_mib"].get(d), end["rss_mib"].get(d)),
            "max_mib": max((s["rss_mib"].get(d) or 0) for s in samples),
        }
        for d in deployments
    }
    # the sample taken after Locust stopped covers a short tail: not an interval to compare
    nominal = max(s.get("interval_s", 0) for s in samples)
    with_latency = [s for s in samples if s.get("latency_p50_ms") is not None and s.get("interval_s", 0) >= nominal / 2]
    return {
        "samples": len(samples),
        "elapsed_s": end["elapsed_s"],
        "warmup_s": warmup_s,
        "baseline_elapsed_s": base["elapsed_s"],
        "rss": rss,
        "rss_total_growth_pct": growth_pct(base["rss_total_mib"], end["rss_total_mib"]),
        "requests": sum(s["requests"] for s in samples),
        "failures": sum(s["failures"] for s in samples),
        "latency_p50_first_ms": with_latency[0]["latency_p50_ms"] if with_latency else None,
        "latency_p50_last_ms": with_latency[-1]["latency_p50_ms"] if with_latency else None,
        "max_slots_in_use": _max(samples, "slots_in_use"),
        "max_retained_prefixes": _max(samples, "retained_prefixes"),
        "max_queue_depth": _max(samples, "queue_depth"),
    }


def _max(samples, key):
    xs = [s.get(key) for s in samples if s.get(key) is not None]
    return max(xs) if xs else None


def markdown(summary: dict, meta: dict) -> str:
    def f(x, unit=""):
        return "–" if x is None else f"{x}{unit}"

    lines = [
        f"# Soak: {meta['users']} users, {meta['duration_s'] / 60:g} min, a sample every {meta['interval_s']:g} s",
        "",
        f"Command: `{meta['command']}`  ",
        f"Server: {meta['host']}; started {meta['started']}.",
        "",
        f"{summary.get('samples', 0)} samples over {f(summary.get('elapsed_s'), ' s')}; warm-up "
        f"{f(summary.get('warmup_s'), ' s')} (RSS growth is measured from the sample at "
        f"{f(summary.get('baseline_elapsed_s'), ' s')} to the last).",
        "",
        "| replica (summed per deployment) | RSS after warm-up MiB | last MiB | max MiB | growth |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for d, r in (summary.get("rss") or {}).items():
        lines.append(
            f"| {d} | {f(r['after_warmup_mib'])} | {f(r['last_mib'])} | {f(r['max_mib'])} "
            f"| {f(r['growth_pct'], ' %')} |"
        )
    lines += [
        "",
        "| | |",
        "| --- | ---: |",
        f"| all replicas, RSS growth after warm-up | {f(summary.get('rss_total_growth_pct'), ' %')} |",
        f"| requests / failed | {f(summary.get('requests'))} / {f(summary.get('failures'))} |",
        f"| latency p50, first interval | {f(summary.get('latency_p50_first_ms'), ' ms')} |",
        f"| latency p50, last interval | {f(summary.get('latency_p50_last_ms'), ' ms')} |",
        f"| most slots in use / retained prefixes | {f(summary.get('max_slots_in_use'))} / "
        f"{f(summary.get('max_retained_prefixes'))} |",
        f"| deepest queue | {f(summary.get('max_queue_depth'))} |",
        "",
        "Samples: `soak_samples.csv` (and `.jsonl`, with each replica's PID); plot: `soak.png`.",
        "",
    ]
    return "\n".join(lines)


CSV_FIELDS = [
    "t",
    "elapsed_s",
    "interval_s",
    "rss_total_mib",
    "slots_in_use",
    "retained_prefixes",
    "free_slots",
    "queue_depth",
    "active_sessions",
    "requests",
    "failures",
    "latency_p50_ms",
    "latency_p99_ms",
    "ttft_p50_ms",
    "output_tokens",
    "output_tokens_per_s",
    "replica_pids",
    "stats_error",
]


def write_csv(samples: list[dict], path: Path) -> None:
    deployments = sorted({d for s in samples for d in s["rss_mib"]})
    fields = CSV_FIELDS[:4] + [f"rss_{d}_mib" for d in deployments] + CSV_FIELDS[4:]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for s in samples:
            row = {
                **s,
                **{f"rss_{d}_mib": v for d, v in s["rss_mib"].items()},
                "replica_pids": " ".join(f"{r['deployment']}:{r['pid']}" for r in s["replicas"]),
            }
            w.writerow(row)


def plot(samples: list[dict], warmup_s: float, path: Path, title: str) -> None:
    """RSS per deployment, latency p50/p99, tok/s and failures, slots/prefixes/queue over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s["elapsed_s"] / 60 for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharex=True)
    (mem, lat), (tps, caches) = axes
    for d in sorted({d for s in samples for d in s["rss_mib"]}):
        mem.plot(minutes, [s["rss_mib"].get(d) for s in samples], marker=".", label=d)
    mem.set_title("RSS per deployment (MiB)")
    for key, style in (("latency_p50_ms", "-"), ("latency_p99_ms", "--"), ("ttft_p50_ms", ":")):
        lat.plot(minutes, [s.get(key) for s in samples], style, marker=".", label=key.removesuffix("_ms"))
    lat.set_title("request latency of the interval (ms)")
    tps.plot(minutes, [s.get("output_tokens_per_s") for s in samples], marker=".", label="output tok/s")
    fails = tps.twinx()
    fails.bar(
        minutes,
        [s["failures"] for s in samples],
        width=0.4 * (minutes[1] - minutes[0]) if len(minutes) > 1 else 0.1,
        color="C3",
        alpha=0.5,
        label="failures",
    )
    fails.set_ylim(0, 1.2 * max(1, max(s["failures"] for s in samples)))
    fails.set_ylabel("failed requests")
    tps.set_title("throughput and failures of the interval")
    for key in ("slots_in_use", "retained_prefixes", "queue_depth"):
        caches.plot(minutes, [s.get(key) for s in samples], marker=".", label=key.replace("_", " "))
    caches.set_title("verifier slots, retained prefixes, Router queue")
    for ax in axes.flat:
        ax.axvspan(0, warmup_s / 60, color="grey", alpha=0.12)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8, loc="lower right")
    for ax in axes[1]:
        ax.set_xlabel("minutes (grey: warm-up)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(soak: Soak, meta: dict, results_dir: Path | None = None) -> dict:
    """soak_samples.csv, soak.md, soak.png in ``soak.out`` (the JSONL is written while sampling);
    with ``results_dir``, a copy of those small files there."""
    summary = summarize(soak.samples, soak.warmup_s)
    write_csv(soak.samples, soak.out / "soak_samples.csv")
    (soak.out / "soak.md").write_text(markdown(summary, meta), encoding="utf-8")
    (soak.out / "soak.json").write_text(json.dumps({**meta, "summary": summary}, indent=2), encoding="utf-8")
    if soak.samples:
        plot(soak.samples, soak.warmup_s, soak.out / "soak.png", f"soak: {soak.users} users, {meta['host']}")
    if results_dir is not None:
        results_dir.mkdir(parents=True, exist_ok=True)
        for name in SMALL_FILES:
            if (soak.out / name).exists():
                shutil.copy(soak.out / name, results_dir / name)
    return summary
