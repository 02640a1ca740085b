"""Two Ray nodes on this machine (tools/cluster/two_nodes.py): the verifier on node B, the Router
and the drafter on the head; node B is killed under load. The verifier must come back on the head
and every request, those in flight at the kill included, must complete with unchanged greedy text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_verifier_node_killed_under_load(stories_path, stories_drafter, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "tools.cluster.two_nodes",
        "--target",
        str(stories_path),
        "--drafter",
        str(stories_drafter),
        "--users",
        "4",
        "--max-tokens",
        "48",
        "--duration",
        "24",
        "--kill-at",
        "8",
        "--cpus",
        "1",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=400, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert (tmp_path / "result.json").exists(), proc.stderr[-3000:]
    r = json.loads((tmp_path / "result.json").read_text())
    before = dict(r["replicas_before"])
    assert before.pop("Gateway", ["head"]) == ["head"]  # the HTTP ingress, when the config has one, stays on the head
    assert before == {"Router": ["head"], "DrafterPool": ["head"], "VerifierPool": ["node-b"]}
    assert r["replicas_after"]["VerifierPool"] == ["head"] and r["verifier_rescheduled_s"] is not None
    assert r["in_flight_at_kill"] > 0 and r["in_flight_completed"] == r["in_flight_at_kill"]
    assert r["failed"] == 0, r["errors"]
    assert r["completed_after_kill"] > 0 and r["text_differs_from_first_answer"] == 0
    assert proc.returncode == 0
