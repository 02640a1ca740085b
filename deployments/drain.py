"""A Ray Pod's ``preStop``: drain this node before Kubernetes stops its containers.

``python -m moa_serve.deployments.drain [--deadline-s N]``

1. asks Ray to drain this node (``ray drain-node``, as autoscaler v2 does before it removes a
   node): Serve starts the node's replicas again elsewhere and stops these gracefully, each
   within its ``graceful_shutdown_timeout_s`` (a Gateway keeps its streams to their end); a node
   left without replicas has its Serve proxy report draining (``/-/healthz`` 503), so the
   readiness probe takes the Pod out of the Service;
2. waits until no Serve replica runs on this node and no client connection to the Serve port is
   open (the streams the Pod's proxy carries), or the deadline passes.

Kubernetes sends SIGTERM once this returns or the Pod's ``terminationGracePeriodSeconds`` is spent,
whichever comes first; ``k8s/render.py`` writes that period from the Serve config (the Gateway's
``graceful_shutdown_timeout_s`` and a margin): docs/kubernetes.md#updates-and-drains.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPLICA_TITLE = "ray::ServeReplica:"  # the process title Ray gives a Serve replica's actor
SERVE_PORT = 8000


def serve_replicas() -> list[int]:
    """PIDs of the Serve replicas running on this node."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info.get("cmdline") or []
        if cmd and cmd[0].startswith(REPLICA_TITLE):
            out.append(p.info["pid"])
    return out


def open_connections(port: int = SERVE_PORT) -> int:
    """Established TCP connections to ``port`` on this node (the proxy's clients)."""
    return sum(
        1
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port
    )


def request_drain(deadline_s: int | None) -> bool:
    """Asks Ray to drain this node; False where Ray refuses (the head node) or is not running."""
    ray = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    cmd = [
        ray,
        "drain-node",
        "--reason",
        "DRAIN_NODE_REASON_PREEMPTION",
        "--reason-message",
        "the Pod is terminating (preStop)",
    ]
    if deadline_s is not None:
        cmd += ["--deadline-remaining-seconds", str(deadline_s)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        print(f"drain: ray drain-node failed: {(done.stderr or done.stdout).strip()[-300:]}", file=sys.stderr)
    return done.returncode == 0


def wait_drained(
    deadline_s: float | None, poll_s: float = 2.0, replicas=serve_replicas, connections=open_connections
) -> bool:
    """Whether the node emptied (no replica, no client connection) before ``deadline_s``."""
    end = time.monotonic() + (deadline_s if deadline_s is not None else float("inf"))
    while True:
        left, conns = replicas(), connections()
        if not left and not conns:
            return True
        if time.monotonic() >= end:
            print(f"drain: deadline passed with {len(left)} replica(s) and {conns} connection(s)", file=sys.stderr)
            return False
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--deadline-s", type=int, default=None, help="give up after this long (default: the Pod's grace period ends it)"
    )
    a = p.parse_args(argv)
    t0 = time.monotonic()
    request_drain(a.deadline_s)
    left = None if a.deadline_s is None else a.deadline_s - (time.monotonic() - t0)
    drained = wait_drained(left)
    print(f"drain: {'drained' if drained else 'not drained'} after {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return 0  # Kubernetes goes on either way: a failed preStop only delays SIGTERM


if __name__ == "__main__":
    raise SystemExit(main())
