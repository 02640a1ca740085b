"""``moa loadtest`` — headless Locust runs at several user levels, against a cluster that the
runner starts from a ``serve run`` config (and stops after), or against any server by URL.

Per level it runs ``locust -f loadtest/locustfile.py --headless -u N -r R -t DURATION`` as a
subprocess (Locust's CSV and HTML reports land in ``--out``), then reads the per-request
metrics that the locustfile wrote (JSON lines) and writes ``summary.json`` and the plots.

Examples::

    moa loadtest --config deployments/configs/local-cpu.yaml --users 1,4,16 --duration 45s --out runs/on
    moa loadtest --config deployments/configs/local-cpu.yaml --no-speculation --users 1,4,16 --out runs/off
    moa loadtest --host http://127.0.0.1:8001 --users 1,4,16 --label vllm --out runs/vllm
    moa loadtest --compare runs/on --compare runs/off --compare runs/vllm --out runs/all   # plots only
    # memory and latency drift over half an hour:
    moa loadtest --config deployments/configs/local-cpu.yaml --users 16 --soak 30m --out runs/soak
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import yaml

from moa_serve.app.auth import client_headers

from . import report, soak

LOCUSTFILE = Path(__file__).resolve().with_name("locustfile.py")
USER_CLASSES = ["ChatStreamUser", "ChatUser", "CompletionsStreamUser", "GenerateStreamUser", "GenerateUser"]


class LoadTestError(Exception):
    pass


def log(msg: str) -> None:
    print(f"[loadtest] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# arguments


def parse_users(text: str) -> list[int]:
    try:
        users = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LoadTestError(f"--users: expected a comma-separated list of integers, got {text!r}") from None
    if not users or any(u < 1 for u in users):
        raise LoadTestError(f"--users: need positive integers, got {text!r}")
    return users


def parse_duration(text: str) -> float:
    """'60s', '2m', '1m30s', '90' -> seconds."""
    m = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s?)?\s*", text)
    if not m or not any(m.groups()):
        raise LoadTestError(f"--duration: expected e.g. 60s, 2m or 1m30s, got {text!r}")
    h, mi, s = (float(g) if g else 0.0 for g in m.groups())
    secs = h * 3600 + mi * 60 + s
    if secs <= 0:
        raise LoadTestError("--duration must be > 0")
    return secs


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", help="serve run YAML: start this cluster, test it, stop it")
    src.add_argument("--host", help="URL of a running server (ours or any OpenAI-compatible one)")
    p.add_argument("--users", default="1,4,16", help="comma-separated concurrent user levels (default 1,4,16)")
    p.add_argument("--spawn-rate", type=float, default=None, help="users started per second (default: all at once)")
    p.add_argument("--duration", default="60s", help="measuring time per level (default 60s)")
    p.add_argument(
        "--no-speculation", action="store_true", help="with --config: start it with the application arg drafter: null"
    )
    p.add_argument("--out", help="output folder (Locust CSV/HTML, metrics JSONL, summary.json, plots)")
    p.add_argument(
        "--user-class",
        default="ChatStreamUser",
        help=f"Locust user class(es), comma-separated, from {', '.join(USER_CLASSES)} "
        "(default ChatStreamUser: OpenAI streaming chat, works on any peer)",
    )
    p.add_argument("--prompts", default="", help="JSONL prompts (default: Spec-Bench question.jsonl)")
    p.add_argument("--categories", default="", help="keep only these prompt categories (comma-separated)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly --max-tokens tokens per request")
    p.add_argument("--model", default="", help="model name for OpenAI routes (default: first of GET /v1/models)")
    p.add_argument("--label", default=None, help="series name in plots (default: speculation on/off or the host)")
    p.add_argument("--port", type=int, default=None, help="with --config: serve HTTP on this port instead")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for /readyz")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up request before the first level")
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="RUN_DIR",
        help="also draw these finished runs (folders with summary.json) in the plots; "
        "without --config/--host: only draw the plots",
    )
    p.add_argument("--fail-on-failures", action="store_true", help="exit 1 if any request failed (CI)")
    soak_opts = p.add_argument_group("soak (one level for a long time, the server sampled as it runs)")
    soak_opts.add_argument(
        "--soak",
        metavar="DURATION",
        default=None,
        help="run one closed-loop level of --users (a single number) for DURATION (e.g. 30m) and "
        "sample every --soak-interval: RSS per Ray Serve replica on this machine, the verifier's "
        "slots and retained prefixes, queue depth, latency and tok/s of the interval, failures",
    )
    soak_opts.add_argument("--soak-interval", default="30s", help="time between samples (default 30s)")
    soak_opts.add_argument(
        "--soak-warmup",
        default=None,
        help="RSS growth is measured from the first sample after this (default: a sixth of --soak)",
    )
    soak_opts.add_argument(
        "--soak-results",
        default=None,
        metavar="DIR",
        help="also copy the soak's small files (soak.md, soak.png, soak.json, samples) to DIR",
    )


# ---------------------------------------------------------------------------------------
# the cluster


def _port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _ray_running() -> bool:
    """Is a Ray cluster (anyone's) running on this machine?"""
    for stat in Path("/proc").glob("[0-9]*/comm"):
        try:
            if stat.read_text().strip() in ("gcs_server", "raylet"):
                return True
        except OSError:
            continue
    return False


def _session_pids(sid: int) -> list[int]:
    """PIDs of the processes in session ``sid`` (everything our ``serve run`` spawned)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after the ")" of comm: state ppid pgrp session ...
        if int(fields[3]) == sid:
            pids.append(int(stat.parent.name))
    return pids


def end_session_leftovers(sid: int) -> None:
    """Ends what is left in session ``sid`` (this process spared): SIGTERM, SIGKILL in the last 5 of
    10 s."""
    deadline = time.monotonic() + 10
    while (left := [p for p in _session_pids(sid) if p != os.getpid()]) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL if time.monotonic() > deadline - 5 else signal.SIGTERM)
            except ProcessLookupError:
                pass
        time.sleep(0.5)


def derived_config(config_path: str | Path, no_speculation: bool, port: int | None, out: Path) -> tuple[Path, str]:
    """Write the serve config to run (drafter: null for --no-speculation; --port) into ``out``;
    return its path and the server's base URL."""
    cfg = yaml.safe_load(Path(config_path).read_text(encoding="utf-8"))
    if not isinstance(cfg, dict) or not cfg.get("applications"):
        raise LoadTestError(f"{config_path}: not a serve run config (no 'applications')")
    if no_speculation:
        for app in cfg["applications"]:
            app.setdefault("args", {})["drafter"] = None
    http = cfg.setdefault("http_options", {})
    if port is not None:
        http["port"] = port
    host = http.get("host", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "", None) else host
    url = f"http://{host}:{http.get('port', 8000)}"
    prefix = cfg["applications"][0].get("route_prefix", "/") or "/"
    if prefix != "/":
        url += prefix.rstrip("/")
    dst = out / ("serve-config-nospec.yaml" if no_speculation else "serve-config.yaml")
    dst.write_text(
        f"# derived by moa loadtest from {config_path}\n" + yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8"
    )
    return dst, url


def serve_cli() -> list[str]:
    """Ray Serve's ``serve`` command of this Python (its module where the script is not installed)."""
    serve = Path(sys.executable).with_name("serve")
    return [str(serve)] if serve.exists() else [sys.executable, "-m", "ray.serve.scripts"]


class Cluster:
    """``serve run CONFIG`` in its own session; ``stop()`` ends everything it spawned."""

    def __init__(self, config: Path, url: str, log_path: Path, ready_timeout: float):
        self.config, self.url, self.log_path, self.ready_timeout = config, url, log_path, ready_timeout
        self.proc: subprocess.Popen | None = None
        self.ray_was_running = _ray_running()

    def start(self) -> None:
        u = httpx.URL(self.url)
        if _port_open(u.host, u.port or 80):
            raise LoadTestError(f"{u.host}:{u.port} is already in use (another cluster?); stop it or pass --port")
        # address=local: our own Ray, never a colleague's cluster that happens to run here
        cmd = serve_cli() + ["run", "--address", "local", str(self.config)]
        log(f"starting the cluster: {' '.join(cmd)} (log: {self.log_path})")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_default_sigint
        )  # Ctrl-C semantics even from a nohup'ed runner
        self.wait_ready()

    def wait_ready(self) -> None:
        def probe() -> tuple[bool, str]:
            try:
                r = httpx.get(self.url + "/readyz", timeout=5)
            except httpx.HTTPError as exc:
                return False, type(exc).__name__
            return r.status_code == 200, f"/readyz {r.status_code}"

        wait_until_ready(
            "serve run",
            self.proc,
            self.log_path,
            probe,
            lambda: _deploy_failure(self.log_path),
            url=self.url + "/readyz",
            timeout_s=self.ready_timeout,
            log_every_s=10,
            error=LoadTestError,
            say=log,
        )

    def stop(self) -> None:
        if self.proc is None:
            return
        sid = self.proc.pid
        log("stopping the cluster")
        # 1) SIGINT: serve run tears the application and its own Ray down
        for sig, wait in ((signal.SIGINT, 30.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # 2) whatever it spawned and left behind (raylet, gcs_server, workers) in its session
        end_session_leftovers(sid)
        # 3) a Ray that still runs and that was not running before we started is ours
        if not self.ray_was_running and _ray_running():
            log("Ray processes left behind: ray stop --force")
            ray_stop_force(timeout_s=60)
        self._log.close()
        self.proc = None

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()


_DEPLOY_FAILED = re.compile(r"DEPLOY_FAILED|Failed to update the deployments|Deploying app .* failed")


def wait_until_ready(
    name: str,
    proc: subprocess.Popen | None,
    log_path: Path,
    probe: Callable[[], tuple[bool, str]],
    deploy_failure: Callable[[], str | None],
    *,
    url: str,
    timeout_s: float,
    log_every_s: float,
    error: type[Exception],
    say: Callable[[str], None],
) -> float:
    """Polls ``probe`` (ready?, its state in words) once a second until it says ready; returns the
    seconds that took. Raises ``error`` when ``proc`` exits first, ``deploy_failure`` finds a line in
    ``log_path`` or ``timeout_s`` passes (with the end of the log); says how it waits every
    ``log_every_s``."""
    t0 = time.monotonic()
    last = 0.0
    while True:
        elapsed = time.monotonic() - t0
        if proc is not None and proc.poll() is not None:
            raise error(
                f"{name}: exited with code {proc.returncode} before it was ready; see {log_path}:\n{_tail(log_path)}"
            )
        failed = deploy_failure()
        if failed:
            raise error(
                f"{name}: the application failed to deploy ({failed.strip()[:200]}); "
                f"see {log_path}:\n{_tail(log_path, 40)}"
            )
        ready, state = probe()
        if ready:
            say(f"{name}: ready after {elapsed:.0f} s")
            return elapsed
        if elapsed > timeout_s:
            raise error(f"{name}: not ready after {timeout_s:.0f} s ({state}); see {log_path}:\n{_tail(log_path)}")
        if elapsed - last >= log_every_s:
            say(f"{name}: waiting for {url} ... {elapsed:.0f} s ({state})")
            last = elapsed
        time.sleep(1.0)


def _deploy_failure(log_path: Path) -> str | None:
    """The first line of serve run's log that says the application cannot come up."""
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                if _DEPLOY_FAILED.search(line):
                    return line
    except OSError:
        pass
    return None


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class _InterruptOnTerm:
    """While a cluster runs: SIGTERM (and an inherited, ignored SIGINT) end the runner through
    its cleanup path, so that the cluster is always stopped. Restores the handlers after."""

    def __enter__(self):
        import threading

        self.old = None
        if threading.current_thread() is threading.main_thread():
            self.old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

            def _raise(signum, frame):
                raise KeyboardInterrupt(f"signal {signum}")

            for s in self.old:
                signal.signal(s, _raise)
        return self

    def __exit__(self, *exc):
        for s, h in (self.old or {}).items():
            signal.signal(s, h)


def ray_stop_force(timeout_s: float) -> None:
    """``ray stop --force``, its output discarded."""
    subprocess.run(
        ["ray", "stop", "--force"],
        check=False,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=timeout_s,
    )


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------
# Locust


def warmup(url: str, args) -> None:
    """One short request so that the first level does not pay for lazy initialization."""
    classes = args.user_class.split(",")
    try:
        if any(c.startswith("Generate") for c in classes) and not any(
            c.startswith(("Chat", "Completions")) for c in classes
        ):
            r = httpx.post(
                url + "/v1/generate", json={"prompt": "Hello", "max_tokens": 8}, timeout=300, headers=client_headers()
            )
        else:
            model = (
                args.model
                or httpx.get(url + "/v1/models", timeout=30, headers=client_headers()).json()["data"][0]["id"]
            )
            r = httpx.post(
                url + "/v1/chat/completions",
                timeout=300,
                headers=client_headers(),
                json={"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]},
            )
        log(f"warm-up request: HTTP {r.status_code}")
    except Exception as exc:  # noqa: BLE001 — the load test will show what is wrong
        log(f"warm-up request failed: {exc}")


def locust_command(url: str, users: int, args, out: Path, duration_s: float, tag: str, metrics: Path) -> list[str]:
    """The headless Locust run of ``users`` closed-loop users for ``duration_s`` (reports under ``tag``)."""
    rate = args.spawn_rate or users
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--only-summary",
        "-u",
        str(users),
        "-r",
        str(rate),
        "-t",
        f"{duration_s:g}s",
        "--stop-timeout",
        f"{args.request_timeout:g}",
        "--host",
        url,
        "--csv",
        str(out / tag),
        "--html",
        str(out / f"{tag}.html"),
        "--metrics-file",
        str(metrics),
        "--max-tokens",
        str(args.max_tokens),
        "--temperature",
        str(args.temperature),
        "--request-timeout",
        str(args.request_timeout),
        "--loglevel",
        "WARNING",
    ]
    if args.prompts:
        cmd += ["--prompts", args.prompts]
    if args.categories:
        cmd += ["--categories", args.categories]
    if args.ignore_eos:
        cmd += ["--ignore-eos", "true"]
    if args.model:
        cmd += ["--model", args.model]
    return cmd + [c.strip() for c in args.user_class.split(",") if c.strip()]


def run_level(url: str, users: int, args, out: Path, duration_s: float) -> dict:
    tag = f"u{users}"
    metrics = out / f"metrics_{tag}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = locust_command(url, users, args, out, duration_s, tag, metrics)
    log(f"level {users} user(s): {duration_s:g} s ...")
    env = dict(os.environ)
    env.pop("MOA_LOADTEST_METRICS", None)
    with open(out / f"{tag}_locust.log", "wb") as lf:
        # bounded: the run, the stop timeout, and some slack
        proc = subprocess.run(
            cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, timeout=duration_s + args.request_timeout + 120
        )
    records, t_start, t_stop = report.read_metrics(metrics)
    if proc.returncode not in (0, 1) or (t_start is None and not records):
        raise LoadTestError(
            f"locust exited with {proc.returncode} at {users} user(s); "
            f"see {out / f'{tag}_locust.log'}:\n{_tail(out / f'{tag}_locust.log')}"
        )
    level = report.summarize_level(users, records, duration_s=duration_s, t_start=t_start, t_stop=t_stop)
    level["files"] = {"csv_prefix": tag, "html": f"{tag}.html", "metrics": metrics.name}
    t, lat = level["ttft_ms"], level["latency_ms"]
    log(
        f"  {level['requests']} requests, {level['failures']} failed, "
        f"{level['output_tokens_per_s']} output tok/s ({level['output_tokens_per_s_per_user']}/user), "
        f"TTFT p50 {t['p50']} ms, latency p50 {lat['p50']} / p99 {lat['p99']} ms, "
        f"accepted length {level['mean_accepted_length']}"
    )
    return level


def run(args) -> int:
    if not (args.config or args.host) and not args.compare:
        raise LoadTestError("give --config (start a cluster), --host (a running server) or --compare RUN_DIRs")
    if not args.out:
        raise LoadTestError("--out DIR is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    compared = [report.load_summary(d) for d in args.compare]
    if not (args.config or args.host):  # plots only
        paths = report.plot_runs(compared, out)
        (out / "summary.md").write_text(report.markdown_table(compared), encoding="utf-8")
        log(f"wrote {', '.join(str(p) for p in paths)} and {out / 'summary.md'}")
        return 0
    if args.no_speculation and not args.config:
        raise LoadTestError("--no-speculation needs --config (the runner starts the cluster without the drafter)")
    users = parse_users(args.users)
    duration_s = parse_duration(args.duration)
    for c in args.user_class.split(","):
        if c.strip() not in USER_CLASSES:
            raise LoadTestError(f"--user-class: unknown {c!r}; choose from {', '.join(USER_CLASSES)}")
    if args.config:
        label = args.label or ("speculation off" if args.no_speculation else "speculation on")
    else:
        label = args.label or args.host
    summary = {
        "label": label,
        "host": args.host,
        "config": args.config,
        "speculation": (not args.no_speculation) if args.config else None,
        "user_class": args.user_class,
        "duration_s": duration_s,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
        "prompts": args.prompts or "specbench",
        "categories": args.categories or None,
        "command": " ".join(sys.argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "levels": [],
    }

    def _levels(url: str) -> None:
        if not args.no_warmup:
            warmup(url, args)
        for u in users:
            summary["levels"].append(run_level(url, u, args, out, duration_s))
            (out / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")

    if args.soak:
        return run_soak(args, out, users, label)
    if args.config:
        cfg_path, url = derived_config(args.config, args.no_speculation, args.port, out)
        summary["served_config"] = cfg_path.name
        summary["host"] = url
        with _InterruptOnTerm(), Cluster(cfg_path, url, out / "serve.log", args.ready_timeout):
            _levels(url)
    else:
        _levels(args.host.rstrip("/"))

    (out / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    runs = [summary] + compared
    paths = report.plot_runs(runs, out)
    (out / "summary.md").write_text(report.markdown_table(runs), encoding="utf-8")
    log(f"wrote {out / 'summary.json'}, {', '.join(str(p) for p in paths)}")
    failures = sum(lv["failures"] for lv in summary["levels"])
    if args.fail_on_failures and failures:
        log(f"{failures} request(s) failed")
        return 1
    return 0


def soak_settings(args, users: list[int]) -> tuple[float, float, float]:
    """(duration, interval, warm-up) seconds of ``--soak``."""
    if len(users) != 1:
        raise LoadTestError(f"--soak runs one level: give --users N, not {args.users!r}")
    duration_s = parse_duration(args.soak)
    interval_s = parse_duration(args.soak_interval)
    warmup_s = parse_duration(args.soak_warmup) if args.soak_warmup else duration_s / 6
    if interval_s > duration_s / 2:
        raise LoadTestError(f"--soak-interval {args.soak_interval} leaves fewer than two samples in --soak {args.soak}")
    return duration_s, interval_s, warmup_s


def run_soak(args, out: Path, users: list[int], label: str) -> int:
    """``--soak``: one Locust run of ``users[0]`` users for the soak's duration, the server sampled
    every interval (``loadtest/soak.py``)."""
    duration_s, interval_s, warmup_s = soak_settings(args, users)
    meta = {
        "label": label,
        "config": args.config,
        "users": users[0],
        "duration_s": duration_s,
        "interval_s": interval_s,
        "warmup_s": warmup_s,
        "user_class": args.user_class,
        "max_tokens": args.max_tokens,
        "command": " ".join(sys.argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }

    def _soak(url: str, session: int | None) -> dict:
        if not args.no_warmup:
            warmup(url, args)
        s = soak.Soak(url, users[0], duration_s, interval_s, warmup_s, out, session=session)
        metrics = out / "metrics_soak.jsonl"
        metrics.unlink(missing_ok=True)
        log(f"soak: {users[0]} user(s) for {duration_s:g} s, a sample every {interval_s:g} s")
        try:
            s.run(
                locust_command(url, users[0], args, out, duration_s, "soak", metrics), metrics, out / "soak_locust.log"
            )
        except RuntimeError as exc:
            raise LoadTestError(f"{exc}:\n{_tail(out / 'soak_locust.log')}") from None
        meta["host"] = url
        return soak.write_outputs(s, meta, Path(args.soak_results) if args.soak_results else None)

    if args.config:
        cfg_path, url = derived_config(args.config, args.no_speculation, args.port, out)
        with _InterruptOnTerm(), Cluster(cfg_path, url, out / "serve.log", args.ready_timeout) as cluster:
            summary = _soak(url, cluster.proc.pid)  # start_new_session: its session id is its pid
    else:
        summary = _soak(args.host.rstrip("/"), None)
    log(
        f"wrote {out / 'soak.md'}, {out / 'soak.png'}, {out / 'soak_samples.csv'}: "
        f"{summary.get('samples', 0)} samples, {summary.get('failures')} failed request(s), "
        f"RSS growth after warm-up {summary.get('rss_total_growth_pct')} %"
    )
    if args.fail_on_failures and summary.get("failures"):
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moa loadtest", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except LoadTestError as exc:
        print(f"moa loadtest: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
