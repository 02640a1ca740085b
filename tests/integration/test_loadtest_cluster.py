"""CI smoke load test, soak and abusive clients against the real cluster: `serve run
deployments/configs/local-cpu.yaml` started once for the module the way the runner starts it
(``runner.Cluster``), with short ``http_limits`` bounds and ``SEATS`` round seats so that the
abuse tests run in seconds: 2 users for ~12 s then a 14 s soak, both through ``moa loadtest
--host`` (any failed request fails the test); then half-open requests and a body sent at 1 byte/s,
a burst beyond the expected wait, and a client that stops reading its stream
(``tools/cluster/abuse.py``, which measures the same for docs/benchmarks.md#resilience)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import socket
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.loadtest_args import loadtest_args

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


# short bounds for the abuse tests (the shipped defaults are in app/limits.py)
LIMITS = {"body_timeout_s": 3.0, "max_slow_requests_per_client": 16, "max_queue_wait_s": 0.5}
KEEP_ALIVE_S = 3  # http_options.keep_alive_timeout_s: Serve's proxy closes an idle connection after it
SEATS = 8  # round seats (router.max_sessions_per_round): a burst of BURST users overloads them
BURST = 64


@pytest.fixture(scope="module")
def local_cpu(tmp_path_factory):
    """The URL of `local-cpu.yaml` served on a free port (a cluster that someone runs on :8000 is
    left alone), started and stopped as ``moa loadtest --config`` does, with ``LIMITS`` and ``SEATS``."""
    from moa_serve.loadtest import runner

    out = tmp_path_factory.mktemp("local-cpu")
    cfg, url = runner.derived_config(REPO / "deployments" / "configs" / "local-cpu.yaml", False, _free_port(), out)
    served = yaml.safe_load(cfg.read_text())
    served["http_options"]["keep_alive_timeout_s"] = KEEP_ALIVE_S
    args = served["applications"][0]["args"]
    args["http_limits"] = LIMITS
    args["router"]["max_sessions_per_round"] = SEATS
    cfg.write_text(yaml.safe_dump(served, sort_keys=False))
    with runner.Cluster(cfg, url, out / "serve.log", ready_timeout=300):
        yield url


def test_an_idle_keep_alive_connection_is_closed_by_the_server(local_cpu):
    from tools.cluster import abuse

    with socket.create_connection(abuse.address(local_cpu), timeout=60) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        while s.recv(4096):  # the answer's rest, then the server's close (b"") after the idle timeout
            pass


def test_smoke_load_local_cpu_cluster(local_cpu, tmp_path):
    from moa_serve.loadtest import runner

    out = tmp_path / "smoke"
    # one streaming chat user and one streaming /v1/generate user
    rc = runner.main(
        loadtest_args(local_cpu, "2", 64, out, "--duration", "12s", "--user-class", "ChatStreamUser,GenerateStreamUser")
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
    rc = runner.main(loadtest_args(local_cpu, "2", 32, out, "--soak", "14s", "--soak-interval", "4s"))
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


def test_half_open_requests_and_a_slow_body_are_closed_and_other_clients_are_served(local_cpu):
    """Connections that announce a body and never send it are answered (429 past the per-client
    bound, 408 at ``body_timeout_s``) and closed; meanwhile other clients are served; a body sent
    at 1 byte/s gets 408."""
    from tools.cluster import abuse

    socks = abuse.open_half(local_cpu, 48)
    try:
        abuse.latencies(local_cpu, 3)  # answered (raises for a status other than 2xx)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(abuse.closed_by_server(s) for s in socks):
            time.sleep(0.5)
        answers = {s.recv(12)[9:12] for s in socks}
    finally:
        for s in socks:
            s.close()
    assert answers <= {b"408", b"429", b""} and b"429" in answers, answers
    slow = abuse.slow_body(local_cpu, limit_s=30)
    assert slow["status"] == 408 and slow["closed_after_s"] is not None, slow


def test_a_burst_beyond_the_expected_wait_gets_429_with_retry_after_at_once_and_no_server_error(local_cpu):
    from tools.cluster import abuse

    abuse.latencies(local_cpu, 2, max_tokens=16)  # the rounds are timed
    burst = abuse.overload(local_cpu, BURST, 48)
    assert set(burst["statuses"]) == {"200", "429"}, burst
    assert burst["retry_after"] and all(int(r) >= 1 for r in burst["retry_after"]), burst
    gateway = httpx.get(local_cpu + "/v1/stats", timeout=10).json()["gateway"]
    assert gateway["refused_by_wait"] >= burst["statuses"]["429"] and gateway["errors"] == 0, gateway


def test_a_client_that_stops_reading_its_stream_holds_up_no_one_else(local_cpu):
    """A stream whose client never reads (its receive window full) beside one read to the end:
    the other stream completes, then the stalled session leaves /v1/stats."""
    from tools.cluster import abuse

    stalled = abuse.stalled_stream(local_cpu, 200)
    try:
        tokens, _ = abuse.stream_tokens_per_s(local_cpu, 32)
        assert tokens == 32
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and abuse.active_sessions(local_cpu):
            time.sleep(0.5)
        assert abuse.active_sessions(local_cpu) == 0
    finally:
        stalled.close()
