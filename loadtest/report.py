"""Summaries and plots of load-test runs.

``summarize_level`` turns the per-request JSON lines that the locustfile writes into one
level of ``summary.json``; ``plot_runs`` draws throughput and latency against the number of
users for one or more runs (e.g. speculation on / off / a peer server).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

PERCENTILES = (50, 95, 99)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _dist(values: list[float]) -> dict:
    return {f"p{q}": _round(percentile(values, q)) for q in PERCENTILES} | {"mean": _round(_mean(values))}


def _mean(values):
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


def _round(x, nd=2):
    return None if x is None else round(float(x), nd)


def read_metrics(path: str | Path) -> tuple[list[dict], float | None, float | None]:
    """(request records, test start time, test stop time) of a metrics JSONL file."""
    reqs, start, stop = [], None, None
    p = Path(path)
    if not p.exists():
        return reqs, start, stop
    for line in p.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        ev = rec.get("event")
        if ev == "request":
            reqs.append(rec)
        elif ev == "test_start":
            start = rec["t"] if start is None else min(start, rec["t"])
        elif ev == "test_stop":
            stop = rec["t"] if stop is None else max(stop, rec["t"])
    return reqs, start, stop


def summarize_level(
    users: int,
    records: list[dict],
    duration_s: float | None = None,
    t_start: float | None = None,
    t_stop: float | None = None,
) -> dict:
    """One entry of ``summary.json["levels"]``.

    Throughput: the output tokens emitted inside the measuring window (Locust's test start
    + ``duration_s``), divided by its length. A request's tokens are spread evenly over its
    streaming time (first token to end; the whole request when not streamed), so requests
    that straddle the window's end count in part: the runner lets Locust finish them
    (``--stop-timeout``) instead of cutting them off, and no half-finished work is lost.
    """
    ok = [r for r in records if r.get("ok")]
    failed = [r for r in records if not r.get("ok")]
    if t_start is not None and duration_s:
        w0, w1 = t_start, t_start + float(duration_s)
    elif t_start is not None and t_stop is not None and t_stop > t_start:
        w0, w1 = t_start, t_stop
    elif records:
        w0 = min(r["t_start"] for r in records)
        w1 = max(r["t_start"] + (r["latency_ms"] or 0) / 1000 for r in records)
    else:
        w0 = w1 = None
    wall = (w1 - w0) if w0 is not None and w1 > w0 else None
    tokens = sum(int(r.get("output_tokens") or 0) for r in ok)
    in_window = 0.0
    for r in ok:
        n = int(r.get("output_tokens") or 0)
        end = r["t_start"] + (r.get("latency_ms") or 0) / 1000
        first = r["t_start"] + (r["ttft_ms"] / 1000 if r.get("ttft_ms") is not None else 0.0)
        if wall is None or n == 0:
            continue
        if end <= first:
            in_window += n if w0 <= end <= w1 else 0
        else:
            overlap = max(0.0, min(end, w1) - max(first, w0))
            in_window += n * overlap / (end - first)
    tps = in_window / wall if wall else None
    completed_in_window = [r for r in ok if wall is None or r["t_start"] + (r.get("latency_ms") or 0) / 1000 <= w1]
    # accepted length: per-request means weighted by their rounds (= tokens / rounds overall)
    acc = [(r["accepted_length"], r.get("rounds")) for r in ok if r.get("accepted_length") is not None]
    if acc and all(n for _, n in acc):
        mal = sum(a * n for a, n in acc) / sum(n for _, n in acc)
    else:
        mal = _mean([a for a, _ in acc])
    errors: dict[str, int] = {}
    for r in failed:
        key = (r.get("error") or "?")[:120]
        errors[key] = errors.get(key, 0) + 1
    return {
        "users": users,
        "requests": len(records),
        "failures": len(failed),
        "duration_s": _round(wall),
        "requests_per_s": _round(len(completed_in_window) / wall if wall else None, 3),
        "output_tokens": tokens,
        "mean_output_tokens": _round(tokens / len(ok) if ok else None),
        "output_tokens_per_s": _round(tps),
        "output_tokens_per_s_per_user": _round(tps / users if tps is not None and users else None),
        "ttft_ms": _dist([r.get("ttft_ms") for r in ok]),
        "latency_ms": _dist([r.get("latency_ms") for r in ok]),
        "itl_ms": _dist([r.get("itl_ms") for r in ok]),
        "request_tokens_per_s": _dist([r.get("tokens_per_s") for r in ok]),
        "mean_accepted_length": _round(mal, 3),
        "errors": errors,
    }


def load_summary(path: str | Path) -> dict:
    p = Path(path)
    if p.is_dir():
        p = p / "summary.json"
    return json.loads(p.read_text(encoding="utf-8"))


def plot_runs(summaries: list[dict], out_dir: str | Path, title: str = "") -> list[Path]:
    """throughput.png and latency.png comparing the runs (series = summary["label"])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def series(s, getter):
        xs, ys = [], []
        for lv in s["levels"]:
            y = getter(lv)
            if y is not None:
                xs.append(lv["users"])
                ys.append(y)
        return xs, ys

    all_users = sorted({lv["users"] for s in summaries for lv in s["levels"]})

    def users_axes(axes):
        """Concurrent users on a log2 x axis; values from 0."""
        for ax in axes:
            ax.set_xlabel("concurrent users")
            ax.set_xscale("log", base=2)
            ax.set_xticks(all_users, [str(u) for u in all_users])
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)

    def save(fig, name: str) -> None:
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        p = out / name
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)

    # throughput: aggregate and per user
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for s in summaries:
        label = s.get("label") or "run"
        for ax, key in zip(axes, ("output_tokens_per_s", "output_tokens_per_s_per_user")):
            xs, ys = series(s, lambda lv, k=key: lv.get(k))
            ax.plot(xs, ys, marker="o", label=label)
    axes[0].set_title("aggregate output tokens/s")
    axes[1].set_title("output tokens/s per user")
    users_axes(axes)
    for ax in axes:
        ax.legend()
    save(fig, "throughput.png")

    # latency: TTFT and end-to-end, p50 solid / p99 dashed
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, s in enumerate(summaries):
        label = s.get("label") or "run"
        color = f"C{i}"
        for ax, key in zip(axes, ("ttft_ms", "latency_ms")):
            for q, style in (("p50", "-"), ("p99", "--")):
                xs, ys = series(s, lambda lv, k=key, q=q: (lv.get(k) or {}).get(q))
                if xs:
                    ax.plot(xs, ys, style, marker="o", color=color, label=f"{label} {q}")
    axes[0].set_title("time to first token (ms)")
    axes[1].set_title("request latency (ms)")
    users_axes(axes)
    for ax in axes:
        if ax.lines:
            ax.legend(fontsize=8)
    save(fig, "latency.png")
    return written


def markdown_table(summaries: list[dict]) -> str:
    """A Markdown table of all levels of all runs (for reports)."""
    rows = [
        "| run | users | requests | failures | output tok/s | tok/s per user | TTFT p50 / p99 ms "
        "| latency p50 / p99 ms | ITL p50 ms | accepted length |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def f(x, nd=1):
        return "–" if x is None else f"{x:.{nd}f}"

    for s in summaries:
        for lv in s["levels"]:
            t, lat, itl = lv["ttft_ms"], lv["latency_ms"], lv.get("itl_ms") or {}
            rows.append(
                f"| {s.get('label', '')} | {lv['users']} | {lv['requests']} | {lv['failures']} "
                f"| {f(lv['output_tokens_per_s'])} | {f(lv['output_tokens_per_s_per_user'])} "
                f"| {f(t['p50'], 0)} / {f(t['p99'], 0)} | {f(lat['p50'], 0)} / {f(lat['p99'], 0)} "
                f"| {f(itl.get('p50'))} | {f(lv['mean_accepted_length'], 2)} |"
            )
    return "\n".join(rows) + "\n"
