"""Running the sides one after the other: per side start the server, warm it up, run the closed-loop
client (and the streaming TTFT probe) once per user level, stop it; clean up after an interrupt."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from moa_serve.loadtest.runner import ray_stop_force
from moa_serve.measure.cpu_steal import cpu_ticks, steal_percent
from tools.side_by_side import together
from tools.side_by_side.report import fmt, write_reports
from tools.side_by_side.servers import (
    DEPLOY_FAILED,
    Readiness,
    Running,
    Server,
    SideError,
    http_get,
    kill_group,
    log,
    ray_pids,
    run_client,
)
from tools.side_by_side.sides import VLLM_SERVED_NAME, safe_label


def _load_command(a, script: str, url: str, model: str, users: int, duration: float) -> list[str]:
    cmd = [a.client_python, script, "--base", url, "--model", model, "--questions", str(a.questions)]
    cmd += ["--users", str(users), "--duration", str(duration), "--max-tokens", str(a.max_tokens)]
    if a.limit is not None:
        cmd += ["--limit", str(a.limit)]
    return cmd


def client_command(a, url: str, model: str, users: int) -> list[str]:
    """The closed-loop client at one level, for ``--duration`` s."""
    return _load_command(a, str(a.client), url, model, users, a.duration)


def ttft_command(a, url: str, model: str, users: int) -> list[str]:
    """The streaming probe (``ttft_probe.py`` beside this file) at the same level, for ``--ttft-duration`` s."""
    probe = str(Path(__file__).resolve().parent / "ttft_probe.py")
    return _load_command(a, probe, url, model, users, a.ttft_duration)


def _nan_to_none(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_nan_to_none(v) for v in x]
    return x


def parse_client_output(text: str) -> list[dict]:
    """The JSON objects the client printed, one per line (it prints one per user level). Lines
    that are not JSON are skipped; a line with a prefix before the object is read from its
    first '{'; NaN/Infinity become null."""
    found = []
    for line in text.splitlines():
        line = line.strip()
        if "{" not in line:
            continue
        start = line.index("{")
        try:
            obj, _ = json.JSONDecoder().raw_decode(line[start:])
        except ValueError:
            continue
        if isinstance(obj, dict):
            found.append(_nan_to_none(obj))
    return found


def _pick(d: dict, *names):
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    return None


def normalize(level: dict) -> dict:
    """The fields the tables show, whatever the client calls them (its raw line is kept too)."""
    ttft_key = next(
        (k for k in level if "ttft" in k.lower() and ("p50" in k.lower() or "mean" in k.lower())),
        next((k for k in level if "ttft" in k.lower()), None),
    )
    ttft = level.get(ttft_key) if ttft_key else None
    if isinstance(ttft, dict):
        ttft = _pick(ttft, "p50", "median", "mean")
    return {
        "users": _pick(level, "users"),
        "tok_per_s": _pick(level, "tok_per_s", "output_tokens_per_s", "tokens_per_s", "throughput"),
        "tok_per_s_per_user": _pick(level, "tok_per_s_per_user", "output_tokens_per_s_per_user"),
        "latency_p50_s": _pick(level, "latency_p50_s", "p50_s", "latency_p50"),
        "latency_p99_s": _pick(level, "latency_p99_s", "p99_s", "latency_p99"),
        "ttft": ttft,
        "ttft_key": ttft_key,
        "requests": _pick(level, "requests"),
        "failures": _pick(level, "failures"),
        "errors": _pick(level, "errors"),
    }


def first_model_id(url: str) -> str | None:
    try:
        code, body = http_get(url + "/v1/models", timeout=10)
        if code == 200:
            return json.loads(body)["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError, TypeError, urllib.error.URLError):
        pass
    return None


def warmup(url: str, model: str) -> str:
    body = json.dumps(
        {"model": model, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "Hello"}]}
    ).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()
            return f"HTTP {r.status} in {time.monotonic() - t0:.1f} s"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (OSError, urllib.error.URLError) as e:
        return f"failed: {type(e).__name__}: {e}"


def _run_level(a, s: dict, model: str, u: int, out: Path, level_timeout: float, slice_of: int | None = None) -> dict:
    """One user level against a started side: the shared client's summary (and the streaming TTFT
    probe's); ``error`` set when the client failed or printed no JSON. ``slice_of``: the pass
    this level is a slice of (``--together``)."""
    load = round(os.getloadavg()[0], 2)
    shown = s["label"] + ("" if slice_of is None else f" pass {slice_of + 1}")
    log(f"{shown} users={u} duration={a.duration:g}s max_tokens={a.max_tokens} (load avg {load}) ...")
    cmd = client_command(a, s["url"], model, u)
    ticks = cpu_ticks()
    rc, stdout, stderr = run_client(cmd, level_timeout, out / f"{safe_label(s['label'])}.client.log")
    steal = steal_percent(ticks, cpu_ticks())
    parsed = [o for o in parse_client_output(stdout) if "users" in o] or parse_client_output(stdout)
    level = {
        "users": u,
        **({} if slice_of is None else {"pass": slice_of}),
        "loadavg_start": load,
        "steal_percent": steal,  # of the machine's CPU time during the client's run: taken by the hypervisor
        "client_exit": rc,
        "raw": None,
        "error": None,
        "summary": normalize({"users": u}),
    }
    if parsed:
        level["raw"] = parsed[-1]
        level["summary"] = normalize(parsed[-1])
    if rc != 0 or not parsed:
        level["error"] = (f"client exit {rc}" if rc != 0 else "no JSON in client output") + (
            ": " + stderr.strip().splitlines()[-1][:300] if stderr.strip() else ""
        )
    if a.ttft_duration > 0:  # the shared client cannot see first tokens: a streaming probe
        prc, pout, _ = run_client(
            ttft_command(a, s["url"], model, u), level_timeout, out / f"{safe_label(s['label'])}.ttft.log"
        )
        probe = parse_client_output(pout)
        level["ttft_probe"] = probe[-1] if probe else {"error": f"probe exit {prc}"}
        level["summary"]["ttft"] = level["ttft_probe"].get("ttft_p50_s")
    if s["kind"] == "ours":  # what the rounds did during the level (cumulative since the server started)
        try:
            code, body = http_get(s["url"] + "/v1/stats", timeout=10.0)
            level["server_stats"] = json.loads(body) if code == 200 else {"error": f"HTTP {code}"}
        except (OSError, ValueError) as exc:
            level["server_stats"] = {"error": f"{type(exc).__name__}: {exc}"}
    sm = level["summary"]
    log(
        f"{shown} users={u}: tok/s={fmt(sm['tok_per_s'])} "
        f"per-user={fmt(sm['tok_per_s_per_user'])} p50={fmt(sm['latency_p50_s'])}s "
        f"p99={fmt(sm['latency_p99_s'])}s TTFT p50={fmt(sm.get('ttft'), 3)}s requests={fmt(sm['requests'])} "
        f"failures={fmt(sm['failures'])} steal={fmt(steal, 1)}%"
        + (f" ERROR {level['error']}" if level["error"] else "")
    )
    return level


class Progress:
    """What the cleanup after the sides needs to know: whether ours ran, whether a level failed,
    and the servers still running (none between sides)."""

    def __init__(self):
        self.ours_started = False
        self.failed = False
        self.running: list[Server] = []

    def stop_all(self) -> None:
        while self.running:
            self.running.pop().stop()


def _server_of(a, s: dict, r: dict) -> Server:
    """The server of one side (not started)."""
    ready = Readiness(
        s["url"] + s["ready_path"],
        "127.0.0.1",
        s["port"],
        a.ready_timeout,
        DEPLOY_FAILED if s["kind"] == "ours" else None,
    )
    return Server(s["label"], s["cmd"], s["env"], Path(r["log"]), ready)


def _warm_up(a, s: dict, r: dict) -> str:
    """The model name the side serves (noted in ``r``), after one short warm-up request."""
    model = r["model"] = s["model"] or first_model_id(s["url"]) or VLLM_SERVED_NAME
    if not a.no_warmup:
        r["warmup"] = warmup(s["url"], model)
        log(f"{s['label']}: warm-up request: {r['warmup']}")
    return model


def _run_side(a, s: dict, r: dict, out: Path, level_timeout: float, results: dict, progress: Progress) -> None:
    """Starts one side, warms it up, runs every user level against it and stops it."""
    server = _server_of(a, s, r)
    progress.running.append(server)
    try:
        progress.ours_started |= s["kind"] == "ours"
        r["ready_s"] = round(server.start(), 1)
        model = _warm_up(a, s, r)
        for u in a.users:
            level = _run_level(a, s, model, u, out, level_timeout)
            progress.failed |= level["error"] is not None
            r["levels"].append(level)
            write_reports(out, results)
    except SideError as exc:
        progress.failed = True
        r["error"] = str(exc)
        log(str(exc))
    finally:
        progress.stop_all()


def _run_together(
    a, sides: list[dict], rs: list[dict], out: Path, level_timeout: float, results: dict, progress: Progress
) -> None:
    """Every side served at once (``together.py``): our configs as applications of one ``serve
    run``, each peer its own server; then per level ``--slices`` passes of one slice per side,
    the order reversed every other pass."""
    ours = [(s, r) for s, r in zip(sides, rs) if s["kind"] == "ours"]
    try:
        if ours:
            progress.ours_started = True
            progress.running.append(together.start(a, [s for s, _ in ours], [r for _, r in ours], out))
            together.wait_all_ready([s for s, _ in ours], a.ready_timeout)
        for s, r in zip(sides, rs):
            if s["kind"] != "ours":
                server = _server_of(a, s, r)
                progress.running.append(server)
                r["ready_s"] = round(server.start(), 1)
        models = {s["label"]: _warm_up(a, s, r) for s, r in zip(sides, rs)}
        result_of = {s["label"]: r for s, r in zip(sides, rs)}
        for u, k, s in together.slices(a, sides):
            level = _run_level(a, s, models[s["label"]], u, out, level_timeout, slice_of=k)
            progress.failed |= level["error"] is not None
            result_of[s["label"]]["levels"].append(level)
            write_reports(out, results)
    except SideError as exc:
        progress.failed = True
        for r in rs:
            r["error"] = str(exc)
        log(str(exc))
    finally:
        progress.stop_all()


def _clean_up(a, progress: Progress, ray_before: set[int]) -> None:
    """Stops a server left running and, where ours ran, the Ray daemons this run started."""
    progress.stop_all()
    if progress.ours_started:
        left = ray_pids() - ray_before
        if a.ray_stop == "always" or (a.ray_stop == "auto" and left and not ray_before):
            log("ray stop --force")
            try:
                ray_stop_force(timeout_s=120)
            except (OSError, subprocess.TimeoutExpired) as exc:
                log(f"ray stop --force failed: {exc}")
        elif left:
            log(f"WARNING: Ray daemons started during this run are still running: {sorted(left)}")


class _Interrupted(KeyboardInterrupt):
    pass


def _install_signal_handlers() -> dict:
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    def _raise(signum, frame):
        raise _Interrupted(f"signal {signal.Signals(signum).name}")

    for s in old:
        signal.signal(s, _raise)
    return old


def run_sides(a, sides: list[dict], results: dict, out: Path, level_timeout: float) -> int:
    """Every side in turn, the reports rewritten after every level; whatever happens, the servers
    are stopped (and, where ours ran, the Ray daemons this run started). Returns the exit code:
    0 when every side ran all its levels, 1 when a side failed, 130 when interrupted."""
    old_handlers = _install_signal_handlers()
    ray_before = ray_pids()
    progress = Progress()
    write_reports(out, results)
    try:
        if a.together:
            _run_together(a, sides, results["sides"], out, level_timeout, results, progress)
        else:
            for s, r in zip(sides, results["sides"]):
                _run_side(a, s, r, out, level_timeout, results, progress)
                write_reports(out, results)
    except KeyboardInterrupt as exc:
        results["meta"]["interrupted"] = True
        log(f"interrupted ({exc}); stopping")
        if Running.client is not None:
            kill_group(Running.client)
        return_code = 130
    else:
        return_code = 1 if progress.failed else 0
    finally:
        # cleanup must not be cut short by a second Ctrl-C
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        try:
            _clean_up(a, progress, ray_before)
            results["meta"]["finished"] = _dt.datetime.now().isoformat(timespec="seconds")
            write_reports(out, results)
        finally:
            for s, h in old_handlers.items():
                signal.signal(s, h)
    return return_code
