"""schemathesis against the served application: ``serve run`` of the shipped ``local-cpu.yaml`` in
float32 (real Ray, real HTTP on 127.0.0.1, the real tokenizer, chat template and rounds), every
check, a fixed seed and a number of cases per operation (``tools/cluster/fuzz_served.py``, which the longer run in
docs/benchmarks.md#resilience uses too). No server error, no undocumented status or body, no
schema-valid request rejected (except on the two client-server operations whose bodies no schema
can make always acceptable: the tool's docstring says why), the stateful phase opens client-server
sessions through the schema's links and uses them, and the server is healthy afterwards.

Bounded for CI: the context is cut to ``CONTEXT`` tokens, so that a generation the fuzzer asks to
run to the end of the context takes a fraction of a second, not many seconds; and the examples,
fuzzing and stateful phases run, not the coverage phase, whose exhaustive boundary cases take
minutes of real generations on two cores (the longer run has every phase and the shipped context).
The Router has ``SEATS`` round seats instead of the shipped config's many, so that the
client-server sessions the stateful phase opens and leaves outnumber them, as a longer run's do:
the requests behind them must still be served."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tools.cluster import fuzz_served

if importlib.util.find_spec("ray") is None:
    pytest.skip("ray is not installed", allow_module_level=True)

EXAMPLES = 4  # cases per operation and phase, no time budget: the same run on a slow machine
SEED = 0
CONTEXT = 256
SEATS = 4
PHASES = "examples,fuzzing,stateful"


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzz")
    with fuzz_served.serving(
        fuzz_served.DEFAULT_CONFIG, out, "float32", max_model_len=CONTEXT, router={"max_sessions_per_round": SEATS}
    ) as url:
        summary = fuzz_served.fuzz(url, out, "float32", seed=SEED, max_time=None, phases=PHASES, max_examples=EXAMPLES)
        summary["health_after"] = fuzz_served.health(url)
    summary["output"] = (out / "float32.txt").read_text()
    return summary


def test_no_server_error_and_no_undocumented_status_on_the_served_app(fuzzed):
    report = json.dumps({k: v for k, v in fuzzed.items() if k != "output"}, indent=1)
    assert fuzzed["errors"] == 0, fuzzed["output"][-4000:]
    assert fuzzed["server_errors"] == 0 and fuzzed["undocumented_statuses"] == 0, report
    assert fuzzed["failures"] == [] and fuzzed["exit_code"] == 0, fuzzed["output"][-4000:]
    # every operation, and cases past the examples phase (up to EXAMPLES distinct ones per operation
    # and phase: an operation without parameters has one)
    total = fuzzed["operations_total"]
    assert fuzzed["operations_tested"] == total and fuzzed["cases"] >= 2 * total, report


def test_the_stateful_phase_follows_the_links_into_client_server_sessions(fuzzed):
    """Handshake -> create (the server's fingerprints) -> verify / DELETE on the id create answered."""
    assert fuzzed["phases"].get("stateful") == "success", fuzzed["phases"]
    cs = fuzzed["health_after"]["client_server"]
    assert cs["created"] > 0 and cs["closed"] > 0, cs
    # how many sessions the fuzzer leaves open depends on its pace; where they outnumber the seats,
    # waiting requests took seats back (ClientSessions.reclaim; tests/client_server/test_protocol.py checks it alone)
    assert cs["created"] - cs["closed"] <= SEATS or cs["reclaimed"] > 0, cs


def test_the_server_is_healthy_after_the_run(fuzzed):
    """... and serves at once: the sessions the fuzzer opened and left do not hold the round seats."""
    h = fuzzed["health_after"]
    assert (h["healthz"], h["readyz"], h["generate"]) == (200, 200, 200) and h["generated_tokens"] > 0, h
    assert h["generate_s"] < 30, h
