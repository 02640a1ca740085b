"""The locustfile, runner and report against a fake server (test scaffolding, no model).

The fake server (tests/support/fake_llm_server.py) only checks the plumbing: its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

if importlib.util.find_spec("locust") is None:  # never import Locust here: gevent patches ssl
    pytest.skip("locust is not installed", allow_module_level=True)
pytest.importorskip("matplotlib")

from moa_serve.loadtest import report, runner, soak  # noqa: E402
from tests.support.loadtest_args import loadtest_args  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SUPPORT = REPO / "tests" / "support"
SPECBENCH = REPO.parent / "shared" / "data" / "specbench" / "question.jsonl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_server(request):
    """Start the fake server (params: fail_every) in its own process group; yield its URL."""
    fail_every = getattr(request, "param", 0)
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, str(SUPPORT / "fake_llm_server.py"), "--port", str(port), "--fail-every", str(fail_every)],
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                pytest.fail("fake server exited")
            time.sleep(0.2)
        else:
            pytest.fail("fake server did not start")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _check_level(lv: dict) -> None:
    for key in (
        "users",
        "requests",
        "failures",
        "output_tokens_per_s",
        "output_tokens_per_s_per_user",
        "mean_accepted_length",
    ):
        assert key in lv, key
    for key in ("ttft_ms", "latency_ms", "itl_ms"):
        assert set(lv[key]) >= {"p50", "p95", "p99"}, key


def test_runner_all_user_classes(fake_server, tmp_path):
    out = tmp_path / "run"
    classes = ",".join(runner.USER_CLASSES)
    rc = runner.main(
        loadtest_args(fake_server, "1,5", 16, out, "--duration", "5s", "--user-class", classes, "--label", "fake")
    )
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["label"] == "fake" and s["speculation"] is None
    assert [lv["users"] for lv in s["levels"]] == [1, 5]
    for lv in s["levels"]:
        _check_level(lv)
        assert lv["requests"] > 0 and lv["failures"] == 0
        assert lv["output_tokens_per_s"] > 0
        assert lv["ttft_ms"]["p50"] is not None and lv["latency_ms"]["p99"] >= lv["latency_ms"]["p50"]
        assert lv["mean_accepted_length"] == pytest.approx(16 / 6, abs=0.01)
        assert (out / f"u{lv['users']}.html").exists() and (out / f"u{lv['users']}_stats.csv").exists()
    # every route was exercised (5 users, 5 classes)
    names = {json.loads(line).get("name") for line in (out / "metrics_u5.jsonl").read_text().splitlines()}
    assert {
        "/v1/generate",
        "/v1/generate [stream]",
        "/v1/chat/completions",
        "/v1/chat/completions [stream]",
        "/v1/completions [stream]",
    } <= names
    for png in ("throughput.png", "latency.png"):
        assert (out / png).stat().st_size > 1000
    # plots only: compare two runs
    both = tmp_path / "both"
    assert runner.main(["--compare", str(out), "--compare", str(out), "--out", str(both)]) == 0
    assert (both / "throughput.png").exists() and "| fake | 5 |" in (both / "summary.md").read_text()


@pytest.mark.parametrize("fake_server", [2], indirect=True)
def test_failures_are_counted(fake_server, tmp_path):
    out = tmp_path / "run"
    rc = runner.main(loadtest_args(fake_server, "2", 8, out, "--duration", "4s", "--no-warmup"))
    assert rc == 1
    lv = json.loads((out / "summary.json").read_text())["levels"][0]
    assert lv["requests"] > 0 and 0 < lv["failures"] < lv["requests"]
    assert any("500" in k for k in lv["errors"])


def test_cli_registration(fake_server, tmp_path):
    from moa_serve.cli import main

    out = tmp_path / "cli"
    rc = main(
        [
            "loadtest",
            "--host",
            fake_server,
            "--users",
            "1",
            "--duration",
            "2s",
            "--max-tokens",
            "4",
            "--out",
            str(out),
            "--no-warmup",
        ]
    )
    assert rc == 0 and (out / "summary.json").exists()
    assert main(["loadtest", "--users", "1", "--out", str(out)]) == 2  # neither --config nor --host


def test_parse_arguments():
    assert runner.parse_users("1,4,16") == [1, 4, 16]
    assert runner.parse_duration("60s") == 60 and runner.parse_duration("1m30s") == 90
    assert runner.parse_duration("45") == 45 and runner.parse_duration("2m") == 120
    for bad in ("", "x", "0s"):
        with pytest.raises(runner.LoadTestError):
            runner.parse_duration(bad)
    with pytest.raises(runner.LoadTestError):
        runner.parse_users("1,a")


def test_derived_config_no_speculation(tmp_path):
    src = REPO / "deployments" / "configs" / "local-cpu.yaml"
    path, url = runner.derived_config(src, no_speculation=True, port=8765, out=tmp_path)
    cfg = yaml.safe_load(path.read_text())
    orig = yaml.safe_load(src.read_text())
    assert cfg["applications"][0]["args"]["drafter"] is None
    assert url == "http://127.0.0.1:8765" and cfg["http_options"]["port"] == 8765
    # nothing else changed
    cfg["applications"][0]["args"]["drafter"] = orig["applications"][0]["args"]["drafter"]
    cfg["http_options"]["port"] = orig["http_options"]["port"]
    assert cfg == orig
    path, url = runner.derived_config(src, no_speculation=False, port=None, out=tmp_path)
    assert yaml.safe_load(path.read_text()) == orig and url.endswith(":8000")


def test_prompts(tmp_path):
    from moa_serve.loadtest import prompts

    if SPECBENCH.exists():
        ps = prompts.load_prompts(SPECBENCH)
        assert len(ps) == 240 and ps[0]["messages"][0]["role"] == "user"
        assert {p["category"] for p in prompts.load_prompts(SPECBENCH, {"qa", "rag"})} == {"qa", "rag"}
    f = tmp_path / "p.jsonl"
    f.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"prompt": "a"},
                {"messages": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]},
                {"turns": ["d", "e"]},
                {"nothing": 1},
            ]
        )
        + "\n"
    )
    ps = prompts.load_prompts(f)
    assert [p["messages"][-1]["content"] for p in ps] == ["a", "b", "d"]
    with pytest.raises(ValueError):
        prompts.load_prompts(f, {"nope"})


def test_summarize_level_window():
    t0 = 1000.0
    recs = [  # a streamed request inside the window, one straddling its end, one failure
        {
            "t_start": t0 + 1,
            "latency_ms": 2000,
            "ttft_ms": 1000,
            "itl_ms": 10,
            "output_tokens": 100,
            "ok": True,
            "accepted_length": 2.0,
            "rounds": 50,
            "tokens_per_s": 50,
        },
        {
            "t_start": t0 + 9,
            "latency_ms": 3000,
            "ttft_ms": 1000,
            "itl_ms": 20,
            "output_tokens": 100,
            "ok": True,
            "accepted_length": 4.0,
            "rounds": 25,
            "tokens_per_s": 33,
        },
        {"t_start": t0 + 2, "latency_ms": 5, "ttft_ms": None, "output_tokens": 0, "ok": False, "error": "HTTP 429"},
    ]
    lv = report.summarize_level(2, recs, duration_s=10, t_start=t0, t_stop=t0 + 12)
    assert lv["requests"] == 3 and lv["failures"] == 1 and lv["errors"] == {"HTTP 429": 1}
    assert lv["output_tokens_per_s"] == pytest.approx((100 + 100 * 0 / 2) / 10)  # 2nd streams from t0+10
    assert lv["output_tokens_per_s_per_user"] == pytest.approx(5.0)
    assert lv["mean_accepted_length"] == pytest.approx(200 / 75, abs=1e-3)
    assert lv["ttft_ms"]["p50"] == 1000 and lv["latency_ms"]["p99"] == pytest.approx(2990)
    empty = report.summarize_level(1, [], duration_s=10, t_start=t0)
    assert empty["requests"] == 0 and empty["output_tokens_per_s"] == 0 and empty["ttft_ms"]["p50"] is None


def test_deploy_failure_is_detected(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text("INFO starting\n(ServeController pid=1) INFO application 'moa' deploying\n")
    assert runner._deploy_failure(log) is None
    with log.open("a") as f:
        f.write("(ServeController pid=1) ERROR controller -- Failed to update the deployments ['Router'].\n")
    assert "Failed to update" in runner._deploy_failure(log)
    assert runner._deploy_failure(tmp_path / "missing.log") is None


def test_ttft_probe_streams_and_reports_first_token_times(fake_server, tmp_path):
    from tools.side_by_side import ttft_probe

    q = tmp_path / "q.jsonl"
    q.write_text(
        "\n".join(json.dumps({"question_id": i, "category": "c", "turns": [f"question {i}"]}) for i in range(3)) + "\n"
    )
    level = ttft_probe.one_level(fake_server, "fake/model", ttft_probe.load_prompts(str(q), 8), 2, 1.0, 16)
    assert level["users"] == 2 and level["failures"] == 0 and level["requests"] >= 2
    assert 0 < level["ttft_p50_s"] <= level["latency_p50_s"]  # the first chunk comes before the end
    assert level["chunks_per_s"] > 0
    bad = ttft_probe.one_level(fake_server.rsplit(":", 1)[0] + ":9", "fake/model", ["x"], 1, 0.2, 4)
    assert bad["requests"] == 0 and bad["failures"] >= 1 and bad["ttft_p50_s"] is None


@pytest.fixture
def fake_replica():
    """A process titled like a Ray Serve replica (``ray::ServeReplica:<app>:<deployment>``), in its
    own session; yields its PID."""
    proc = subprocess.Popen(["ray::ServeReplica:fake:Router", "120"], executable="sleep", start_new_session=True)
    try:
        for _ in range(100):  # until the exec has replaced the forked test process
            if Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(b"ray::"):
                break
            time.sleep(0.05)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_replica_processes_by_title(fake_replica):
    mine = soak.replica_processes(session=fake_replica)
    assert mine == [{"deployment": "Router", "app": "fake", "pid": fake_replica}]
    assert fake_replica in [r["pid"] for r in soak.replica_processes()]  # every session on the machine
    replicas, per_deployment = soak.replica_memory(session=fake_replica)
    assert replicas[0]["rss_mib"] > 0 and per_deployment == {"Router": replicas[0]["rss_mib"]}
    assert soak.rss_mib(2**22 + 12345) is None  # no such process


def test_soak_samples_and_reports(fake_server, fake_replica, tmp_path):
    out, results = tmp_path / "soak", tmp_path / "results"
    rc = runner.main(
        loadtest_args(
            fake_server,
            "2",
            8,
            out,
            "--soak",
            "8s",
            "--soak-interval",
            "2s",
            "--soak-results",
            str(results),
            "--no-warmup",
        )
    )
    assert rc == 0
    samples = [json.loads(line) for line in (out / "soak_samples.jsonl").read_text().splitlines()]
    assert len(samples) >= 3
    for s in samples:
        for key in (
            "t",
            "elapsed_s",
            "rss_mib",
            "rss_total_mib",
            "slots_in_use",
            "retained_prefixes",
            "free_slots",
            "queue_depth",
            "requests",
            "failures",
            "latency_p50_ms",
            "latency_p99_ms",
            "output_tokens_per_s",
            "replicas",
        ):
            assert key in s, key
        assert s["rss_mib"]["Router"] > 0 and fake_replica in [r["pid"] for r in s["replicas"]]
        assert s["queue_depth"] == 0 and s["retained_prefixes"] is not None
    assert [s["elapsed_s"] for s in samples] == sorted(s["elapsed_s"] for s in samples)
    assert sum(s["requests"] for s in samples) > 0 and sum(s["failures"] for s in samples) == 0
    assert any(s["latency_p50_ms"] for s in samples) and any(s["output_tokens_per_s"] for s in samples)
    with open(out / "soak_samples.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(samples) and "rss_Router_mib" in rows[0] and "latency_p99_ms" in rows[0]
    summary = json.loads((out / "soak.json").read_text())["summary"]
    assert summary["samples"] == len(samples) and summary["failures"] == 0
    assert summary["rss"]["Router"]["growth_pct"] is not None and summary["latency_p50_first_ms"] is not None
    md = (out / "soak.md").read_text()
    assert "RSS growth after warm-up" in md and "| Router |" in md and "latency p50, last interval" in md
    assert (out / "soak.png").stat().st_size > 1000
    assert sorted(p.name for p in results.iterdir()) == sorted(soak.SMALL_FILES)


def test_soak_summary_growth_after_warmup():
    def sample(t, router, verifier, p50, failures=0):
        return {
            "elapsed_s": t,
            "rss_mib": {"Router": router, "VerifierPool": verifier},
            "rss_total_mib": router + verifier,
            "requests": 10,
            "failures": failures,
            "latency_p50_ms": p50,
            "slots_in_use": 4,
            "retained_prefixes": 2,
            "queue_depth": 0,
        }

    samples = [
        sample(30, 100, 1000, 500),
        sample(60, 200, 2000, 600, failures=1),
        sample(90, 210, 2000, 700),
        sample(120, 220, 2200, 800),
    ]
    s = soak.summarize(samples, warmup_s=60)
    assert s["baseline_elapsed_s"] == 60  # growth is measured from the first sample after the warm-up
    assert s["rss"]["Router"]["growth_pct"] == 10.0 and s["rss"]["VerifierPool"]["growth_pct"] == 10.0
    assert s["rss"]["VerifierPool"]["max_mib"] == 2200 and s["rss_total_growth_pct"] == 10.0
    assert s["requests"] == 40 and s["failures"] == 1
    assert (s["latency_p50_first_ms"], s["latency_p50_last_ms"]) == (500, 800)
    assert soak.summarize([], 60) == {"samples": 0}


def test_soak_arguments(tmp_path):
    def settings(*argv):
        p = argparse.ArgumentParser()
        runner.add_arguments(p)
        args = p.parse_args(list(argv))
        return runner.soak_settings(args, runner.parse_users(args.users))

    assert settings("--users", "16", "--soak", "30m") == (1800, 30, 300)  # warm-up: a sixth
    assert settings("--users", "4", "--soak", "20s", "--soak-interval", "5s", "--soak-warmup", "5s") == (20, 5, 5)
    with pytest.raises(runner.LoadTestError, match="one level"):
        settings("--users", "1,4", "--soak", "30m")
    with pytest.raises(runner.LoadTestError, match="fewer than two samples"):
        settings("--users", "4", "--soak", "20s", "--soak-interval", "15s")


def test_load_tools_send_the_api_key_from_the_environment(monkeypatch):
    from moa_serve.app.auth import API_KEY_ENV
    from tools.side_by_side.ttft_probe import request_headers

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert "Authorization" not in request_headers()
    monkeypatch.setenv(API_KEY_ENV, "k-123")
    assert request_headers()["Authorization"] == "Bearer k-123"
