"""The servers and clients a side-by-side run starts: each in its own session, a server waited for
until it answers, and stopped with everything it spawned."""

from __future__ import annotations

import datetime as _dt
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
from dataclasses import dataclass
from pathlib import Path

from moa_serve.loadtest.runner import end_session_leftovers, wait_until_ready

TAG = "[side-by-side]"
# a line of our server's log that says an application will not come up
DEPLOY_FAILED = re.compile(r"DEPLOY_FAILED|Failed to update the deployments|Deploying app .* failed")


def log(msg: str) -> None:
    print(f"{TAG} {msg}", file=sys.stderr, flush=True)


class SideError(RuntimeError):
    """A side could not be measured (server not ready, client failed); other sides go on."""


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


def ray_pids() -> set[int]:
    """Ray daemons running on this machine (anyone's)."""
    out = set()
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() in ("gcs_server", "raylet"):
                out.add(int(comm.parent.name))
        except (OSError, ValueError):
            continue
    return out


def default_sigint() -> None:  # children get the ordinary Ctrl-C behaviour even if we ignore it
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


@dataclass
class Readiness:
    """When a server counts as started: ``url`` answers 200 within ``timeout`` seconds; it failed when
    its log shows ``fail_pattern``; ``host``:``port`` must be free before and is waited free after."""

    url: str
    host: str
    port: int
    timeout: float
    fail_pattern: re.Pattern | None = None


class Server:
    """A server process in its own session; ``stop()`` ends it and everything it spawned."""

    def __init__(self, label: str, cmd: list[str], env: dict, log_path: Path, ready: Readiness):
        self.label, self.cmd, self.env, self.log_path, self.ready = label, cmd, env, log_path, ready
        self.host, self.port = ready.host, ready.port
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self) -> float:
        """Start and wait until ``ready.url`` answers 200; return the seconds it took."""
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
            preexec_fn=default_sigint,
        )

        def probe() -> tuple[bool, str]:
            try:
                code, _ = http_get(self.ready.url, timeout=5)
            except (OSError, urllib.error.URLError) as exc:
                return False, type(exc).__name__
            return code == 200, f"HTTP {code}"

        return wait_until_ready(
            self.label,
            self.proc,
            self.log_path,
            probe,
            self._log_match if self.ready.fail_pattern is not None else lambda: None,
            url=self.ready.url,
            timeout_s=self.ready.timeout,
            log_every_s=15,
            error=SideError,
            say=log,
        )

    def _log_match(self) -> str | None:
        try:
            with open(self.log_path, errors="replace") as f:
                for line in f:
                    if self.ready.fail_pattern.search(line):
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
        end_session_leftovers(sid)
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


class Running:
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
        preexec_fn=default_sigint,
    )
    Running.client = proc
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        err += f"\n{TAG} client killed after {timeout:.0f} s"
        rc = -9
    except BaseException:
        kill_group(proc)
        raise
    else:
        rc = proc.returncode
    finally:
        Running.client = None
    with open(log_path, "a") as f:
        f.write(f"$ {shlex.join(cmd)}\n{out}{err}(exit {rc})\n")
    return rc, out, err


def kill_group(proc: subprocess.Popen) -> None:
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
