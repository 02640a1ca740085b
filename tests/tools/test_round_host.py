"""The host-time benchmark (tools/bench/round_host.py) at toy size: it runs each drafter at each batch
size and reports a round's parts; the replayed drafts are accepted, and the target's forward runs
through the fixed-shape bodies a GPU captures."""

import json
import math
from pathlib import Path

from tests.support.scripts import run_python

REPO = Path(__file__).resolve().parents[2]


def test_toy_round_host_reports_every_drafter_and_batch(tmp_path):
    out = tmp_path / "round_host.json"
    proc = run_python(
        [
            str(REPO / "tools" / "bench" / "round_host.py"),
            "--toy",
            "--batch-sizes",
            "1,3",
            "--rounds",
            "2",
            "--repeats",
            "1",
            "--profile-rows",
            "5",
            "--json",
            str(out),
        ],
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["drafter"], r["batch"]) for r in rows} == {(d, b) for d in ("moa", "replay") for b in (1, 3)}
    for r in rows:
        assert all(math.isfinite(r[key]) and r[key] >= 0 for key in ("wall_ms", "graph_ms", "verify_ms"))
        assert math.isclose(r["host_ms"], r["wall_ms"] - r["graph_ms"])
        assert r["graph_ms"] > 0  # the target's fixed-shape forward ran (and the MoA feature head and steps)
    replay = [r for r in rows if r["drafter"] == "replay"]
    assert all(r["tokens_per_round"] > 1.5 for r in replay)  # replayed drafts are the target's own tokens
    assert "Ordered by: internal time" in proc.stdout
