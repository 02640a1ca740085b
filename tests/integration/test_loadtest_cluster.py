"""CI smoke load test and soak against the real cluster: `serve run deployments/configs/local-cpu.yaml`
started once for the module the way the runner starts it (``runner.Cluster``), 2 users for ~12 s
then a 14 s soak, both through ``moa loadtest --host``; any failed request fails the test."""

from __future__ import annotations

import importlib
import importlib.util
import json
import socket
from pathlib import Path

import pytest

if importlib.util.find_spec("locust") is None:  # never import Locust here: gevent patches ssl
    pytest.skip("locust is not installed", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]

try:
    importlib.import_module("moa_serve.deployments.app")
    _APP_ERROR = None
except ImportError as exc:  # the Ray Serve application is not written yet
    _APP_ERROR = exc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


pytestmark = [
    pytest.mark.skipif(
        _APP_ERROR is not None, reason=f"moa_serve.deployments.app cannot be imported yet ({_APP_ERROR})"
    )
]


@pytest.fixture(scope="module")
def local_cpu(tmp_path_factory):
    """The URL of `local-cpu.yaml` served on a free port (a cluster that someone runs on :8000 is
    left alone), started and stopped as ``moa loadtest --config`` does."""
    from moa_serve.loadtest import runner

    out = tmp_path_factory.mktemp("local-cpu")
    cfg, url = runner.derived_config(REPO / "deployments" / "configs" / "local-cpu.yaml", False, _free_port(), out)
    with runner.Cluster(cfg, url, out / "serve.log", ready_timeout=300):
        yield url


def test_smoke_load_local_cpu_cluster(local_cpu, tmp_path):
    from moa_serve.loadtest import runner

    out = tmp_path / "smoke"
    # one streaming chat user and one streaming /v1/generate user
    rc = runner.main(
        [
            "--host",
            local_cpu,
            "--users",
            "2",
            "--duration",
            "12s",
            "--max-tokens",
            "64",
            "--user-class",
            "ChatStreamUser,GenerateStreamUser",
            "--out",
            str(out),
            "--fail-on-failures",
        ]
    )
    s = json.loads((out / "summary.json").read_text())
    lv = s["levels"][0]
    assert lv["failures"] == 0, lv["errors"]
    assert rc == 0
    assert lv["requests"] > 0 and lv["output_tokens_per_s"] > 0
    assert lv["ttft_ms"]["p50"] is not None
    assert lv["mean_accepted_length"] is not None and lv["mean_accepted_length"] >= 1.0
    assert (out / "throughput.png").exists() and (out / "latency.png").exists()


def test_soak_samples_the_local_cpu_cluster(local_cpu, tmp_path):
    """A 14 s soak of the real cluster, a sample every 4 s: the cluster's replicas on this machine
    are found and measured, and the verifier's counters come from /v1/stats."""
    from moa_serve.loadtest import runner

    out = tmp_path / "soak"
    rc = runner.main(
        [
            "--host",
            local_cpu,
            "--users",
            "2",
            "--soak",
            "14s",
            "--soak-interval",
            "4s",
            "--max-tokens",
            "32",
            "--out",
            str(out),
            "--fail-on-failures",
        ]
    )
    assert rc == 0
    samples = [json.loads(line) for line in (out / "soak_samples.jsonl").read_text().splitlines()]
    assert len(samples) >= 3
    for s in samples:
        assert {"Gateway", "VerifierPool"} <= set(s["rss_mib"]) and all(v > 0 for v in s["rss_mib"].values())
        assert s["slots_in_use"] is not None and s["retained_prefixes"] is not None and s["queue_depth"] is not None
    assert sum(s["requests"] for s in samples) > 0 and sum(s["failures"] for s in samples) == 0
    summary = json.loads((out / "soak.json").read_text())["summary"]
    assert summary["rss"]["VerifierPool"]["growth_pct"] is not None
    assert (out / "soak.md").exists() and (out / "soak.png").exists() and (out / "soak_samples.csv").exists()
