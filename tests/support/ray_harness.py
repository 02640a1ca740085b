"""Helpers for the tests that run a real Ray Serve cluster."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path

import ray

from moa_serve.loadtest import runner

# how long a test waits for a cluster to be ready: long enough that only a start that hangs fails
# (a start's time depends on the machine and its load; the runner prints it: ready after N s)
READY_TIMEOUT_S = 300


def kill_replica(deployment: str) -> None:
    """Kills one replica of the ``moa`` application's ``deployment`` (no restart by Ray itself:
    Serve replaces it)."""
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if f"moa#{deployment}#" in a["name"]]
    assert names, ray.util.list_named_actors(all_namespaces=True)
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)


@contextlib.contextmanager
def serve_run(config: Path, out: Path, ready_timeout_s: float = READY_TIMEOUT_S):
    """``serve run CONFIG`` as a subprocess in its own session (its own local Ray), served on a
    free loopback port; waits for ``/readyz`` 200 and yields the base URL. Afterwards every process
    of that session is killed by PID (no graceful drain: nothing is left to serve), never
    ``ray stop``, which would end other people's clusters on this machine too."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg, url = runner.derived_config(config, False, port, out)
    cluster = runner.Cluster(cfg, url, out / "serve.log", ready_timeout_s)
    try:
        cluster.start()
        yield url
    finally:
        if cluster.proc is not None:
            sid = cluster.proc.pid
            deadline = time.monotonic() + 30
            while (left := runner._session_pids(sid)) and time.monotonic() < deadline:
                for pid in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.2)
            cluster.proc.wait(timeout=10)
            cluster._log.close()
