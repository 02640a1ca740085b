"""A config update loses no stream: ``serve run deployments/configs/local-cpu.yaml`` in Ray Serve's
high-throughput mode (HAProxy, as the README serves it), 8 greedy streams of 30 s or more, and
``serve deploy`` of the config with another drafter while they run. The update replaces every
replica (Ray Serve restarts an application whose arguments changed); each stream finishes on the
Gateway replica it started on, which keeps serving it while it drains
(``gateway.graceful_shutdown_timeout_s``), its rounds resumed on the new verifier replica from the
committed tokens, and every stream is identical to the same stream without the update.
``tools/cluster/updates.py`` runs the longer version (three updates and more) of
docs/benchmarks.md#resilience."""

from __future__ import annotations

import re
import shutil

import pytest

from tests.conftest import REPO
from tests.support.ray_harness import serve_run
from tools.cluster import updates

STREAMS = 8
MAX_TOKENS = 1000  # streams that outlive Ray's default drain at 8 users (asserted below)


@pytest.fixture
def high_throughput_mode(monkeypatch):
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    monkeypatch.setenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S", "900")  # docs/kubernetes.md#updates-and-drains


@pytest.mark.timeout(600)
def test_streams_run_through_an_update_that_replaces_every_replica_unchanged(tmp_path, high_throughput_mode):
    if shutil.which("serve") is None:
        pytest.skip("no `serve` command")
    with serve_run(REPO / "deployments" / "configs" / "local-cpu.yaml", tmp_path) as url:
        log = (tmp_path / "serve.log").read_text(errors="replace")
        dashboard = re.search(r"dashboard at \S*(http://[0-9.]+:\d+)", log).group(1)
        reference = updates.streams(url, STREAMS, MAX_TOKENS)
        assert all(r["status"] == 200 and len(r["tokens"]) == MAX_TOKENS for r in reference), reference
        assert min(r["seconds"] for r in reference) >= 20  # long enough to outlive Ray's default drain (20 s)

        [(what, doc)] = updates.variants(tmp_path / "serve-config.yaml", ["drafter"])
        result = updates.under_updates(url, dashboard, STREAMS, MAX_TOKENS, [(what, doc)])
        [update] = result["updates"]
        rows = updates.compare(reference, result["streams"])
        assert len(rows) >= STREAMS
        lost = [r for r in rows if not (r["completed"] and r["identical"])]
        assert not lost, (update, lost)
        first = {r["user"]: r for r in reversed(rows)}  # each user's first stream: running when the update came
        assert min(r["seconds"] for r in first.values()) > update["sent_at_s"] + 20, (update, first)
