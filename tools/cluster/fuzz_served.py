"""schemathesis against the served API: ``serve run`` of a shipped config (its ``dtype`` set), real
Ray and real HTTP on 127.0.0.1, every check, a fixed seed and a time budget (or, for a run of the
same size on any machine, a number of cases per operation: ``--max-examples``); then the server must
still be healthy (``/healthz``, ``/readyz`` and a generation answer 200).

Every check runs on every operation except one check on two operations: ``positive_data_acceptance``
("schema-valid request rejected") on ``POST /v1/cs/sessions`` and ``POST /v1/cs/sessions/{id}/verify``.
Their bodies cannot be made always acceptable by any schema: a binary frame's validity is a byte
layout (a length prefix that must match what follows) that JSON Schema cannot express, and a
well-formed create or verify is accepted only with the server's own model fingerprints, token ids
inside its vocabulary and the session's next round, which are the server's state, not the schema's.
Such a body gets a documented ``400`` naming what is wrong (``app/client_server.py``); every other check,
``not_a_server_error`` and ``status_code_conformance`` included, still runs on those two operations.

    python -m tools.cluster.fuzz_served --config deployments/configs/local-cpu.yaml \\
        --dtype float32 --dtype bfloat16 --max-time 300 --out benchmarks/fuzz

writes, per dtype, schemathesis' own output (``<dtype>.txt``), its JSON report
(``<dtype>-report.json``) and a summary (``<dtype>.json``: cases, server errors, conformance
failures, the command, the machine, the health afterwards). Exit status 1 when any run failed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from moa_serve.loadtest import runner

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "deployments" / "configs" / "local-cpu.yaml"
# operations whose schema-valid bodies the server may refuse (the module's docstring says why)
STATEFUL_BODIES = ("cs_create_session", "cs_verify_round")
# schemathesis' failure classes (its JSON report's failure "type"): a 5xx; everything else a check finds
# about statuses, headers, bodies and data acceptance (conformance); the response-time limit
SERVER_ERRORS = {"ServerError", "ContentTypeServerError"}
UNDOCUMENTED_STATUS = "UndefinedStatusCode"
SLOW = {"ResponseTimeExceeded"}
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_config(config: Path, out: Path, dtype: str, port: int, **args) -> tuple[Path, str]:
    """``config`` with ``args.dtype`` (and any other ``args``; a dict is merged into the config's,
    ``router={"max_sessions_per_round": 8}``) set and HTTP on ``port``, written into ``out`` (the
    load test's derived config, ``moa_serve.loadtest.runner.derived_config``); returns its path and
    base URL."""
    path, url = runner.derived_config(config, no_speculation=False, port=port, out=out)
    cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    changed = {"dtype": dtype, **args}
    for app in cfg["applications"]:
        app_args = app.setdefault("args", {})
        for key, value in changed.items():
            app_args[key] = {**app_args.get(key, {}), **value} if isinstance(value, dict) else value
    dst = out / f"serve-config-{dtype}.yaml"
    dst.write_text(f"# {config} with {changed}, port {port}\n" + yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    path.unlink()
    return dst, url


@contextlib.contextmanager
def serving(config: Path, out: Path, dtype: str, port: int | None = None, ready_timeout: float = 300.0, **args):
    """``serve run`` of ``config`` in ``dtype``, ``args`` set (``runner.Cluster``: its own Ray,
    stopped after); yields the base URL."""
    out.mkdir(parents=True, exist_ok=True)
    path, url = served_config(config, out, dtype, port or free_port(), **args)
    with runner.Cluster(path, url, out / f"serve-{dtype}.log", ready_timeout):
        yield url


def schemathesis_toml(path: Path, max_response_time: float) -> Path:
    """The run's configuration: every check (``max_response_time`` at ``max_response_time`` seconds),
    except ``positive_data_acceptance`` for exactly ``STATEFUL_BODIES``. In the file, not on the
    command line: a check named there (``--checks all``) overrides what an operation's section says."""
    ids = ", ".join(f'"{op}"' for op in STATEFUL_BODIES)
    path.write_text(
        "[checks]\nenabled = true\n"
        f"max_response_time = {max_response_time}\n\n"
        "# the stateful phase follows the schema's own links; links inferred from responses stay off:\n"
        "# schemathesis reads every string of a JSON response as a possible URL, and generated text\n"
        "# such as 'http://[...]' stops its run with an internal ValueError (urlsplit), not a finding\n"
        "[phases.stateful.inference]\nalgorithms = []\n\n"
        "# schema-valid bodies the server may refuse (a binary frame; fingerprints, vocabulary, round):\n"
        "# tools/cluster/fuzz_served.py says why\n"
        f"[[operations]]\ninclude-operation-id = [{ids}]\n"
        "checks.positive_data_acceptance.enabled = false\n",
        encoding="utf-8",
    )
    return path


def schemathesis_version() -> str:
    from schemathesis.core.version import SCHEMATHESIS_VERSION

    return SCHEMATHESIS_VERSION


def fuzz(
    url: str,
    out: Path,
    label: str,
    *,
    seed: int,
    max_time: float | None,
    workers: int = 1,
    request_timeout: float = 120.0,
    phases: str | None = None,
    max_examples: int | None = None,
) -> dict:
    """One schemathesis run, every check; its output in ``out/<label>.txt``, its report in
    ``out/<label>-report.json``. Returns the summary (``summarize``). ``max_response_time`` (one of
    the checks) is held to ``request_timeout``: a generation to the end of the context is a
    legitimate answer that takes seconds on a CPU. Under ``max_time`` the fuzzing and stateful
    phases draw cases until the time is spent (how many depends on the machine's speed); without it,
    ``max_examples`` cases per operation and phase (schemathesis' default 100), the same run on any
    machine."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    exe = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))
    report = out / f"{label}-report.json"
    toml = schemathesis_toml(out / f"{label}-schemathesis.toml", request_timeout)
    cmd = [
        exe,
        "--config-file",
        str(toml),
        "run",
        f"{url}/openapi.json",
        "--seed",
        str(seed),
        "--workers",
        str(workers),
        "--request-timeout",
        str(request_timeout),
        "--no-color",
        "--report",
        "json",
        "--report-json-path",
        str(report),
    ]
    cmd += ["--max-time", str(int(max_time))] if max_time else []
    cmd += ["--phases", phases] if phases else []
    cmd += ["--max-examples", str(max_examples)] if max_examples else []
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=out,  # its cache
        env={**os.environ, "NO_COLOR": "1", "COLUMNS": "120"},
    )
    wall = time.monotonic() - t0
    (out / f"{label}.txt").write_text(proc.stdout, encoding="utf-8")
    shown = [Path(cmd[0]).name] + [Path(c).name if c.startswith(str(out)) else c for c in cmd[1:]]
    return summarize(json.loads(report.read_text(encoding="utf-8")), proc.returncode, wall, shlex.join(shown))


def summarize(report: dict, exit_code: int, wall_s: float, command: str) -> dict:
    """cases, server errors, conformance failures (by check) and errors of a schemathesis JSON report."""
    by_type: dict[str, int] = {}
    for f in report["failures"]:
        by_type[f["type"]] = by_type.get(f["type"], 0) + f["count"]
    return {
        "schemathesis": report["schemathesis_version"],
        "command": command,
        "seed": report["seed"],
        "exit_code": exit_code,
        "wall_s": round(wall_s, 1),
        "running_time_s": round(report["running_time"], 1),
        "stop_reason": report["stop_reason"],
        "operations_tested": (report["operations"] or {}).get("tested"),
        "operations_total": (report["operations"] or {}).get("total"),
        "phases": {k: v["status"] for k, v in (report["phases"] or {}).items()},
        "cases": report["test_cases"]["generated"],
        "cases_with_failures": report["test_cases"]["with_failures"],
        "server_errors": sum(n for t, n in by_type.items() if t in SERVER_ERRORS),
        "undocumented_statuses": by_type.get(UNDOCUMENTED_STATUS, 0),
        "conformance_failures": sum(n for t, n in by_type.items() if t not in SERVER_ERRORS | SLOW),
        "slow_responses": sum(n for t, n in by_type.items() if t in SLOW),
        "failures_by_type": by_type,
        "failures": report["failures"],
        "errors": sum(e["count"] for e in report["errors"]),
        "error_titles": [e["title"] for e in report["errors"]],
    }


def health(url: str) -> dict:
    """What the server answers after the run: /healthz, /readyz, a greedy generation and how long
    it took (sessions the fuzzer opened and left must not hold it up), /v1/stats' client-server
    counters (sessions the fuzzer opened, rounds, closes, reclaimed seats)."""
    with httpx.Client(base_url=url, timeout=120) as c:
        t0 = time.monotonic()
        gen = c.post("/v1/generate", json={"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
        generate_s = time.monotonic() - t0
        stats = c.get("/v1/stats")
        return {
            "healthz": c.get("/healthz").status_code,
            "readyz": c.get("/readyz").status_code,
            "generate": gen.status_code,
            "generate_s": round(generate_s, 2),
            "generated_tokens": len(gen.json().get("token_ids", [])) if gen.status_code == 200 else 0,
            "client_server": stats.json().get("client_server") if stats.status_code == 200 else None,
        }


def machine() -> dict:
    """The CPU (``lscpu``: model, CPUs, the SIMD flags that matter here), memory, the date."""
    info = {}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        flags = set(fields.get("Flags", "").split())
        info = {
            "model": fields.get("Model name"),
            "cpus": fields.get("CPU(s)"),
            "flags": {f: f in flags for f in CPU_FLAGS},
        }
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        mem = re.search(r"MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text())
        info["mem_gib"] = round(int(mem.group(1)) / 2**20, 1) if mem else None
    except OSError:
        pass
    info["date"] = datetime.date.today().isoformat()
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a serve run config")
    p.add_argument(
        "--dtype",
        action="append",
        choices=["float32", "bfloat16"],
        help="args.dtype of the served config, one run each (repeatable; default float32)",
    )
    p.add_argument("--max-time", type=float, default=300.0, help="seconds of fuzzing per run (0: no time budget)")
    p.add_argument(
        "--max-examples",
        type=int,
        default=None,
        help="cases per operation and phase (with --max-time 0: the run's size)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="schemathesis' concurrent workers")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: a free one)")
    p.add_argument("--out", type=Path, required=True, help="directory for the outputs")
    args = p.parse_args(argv)
    failed = False
    for dtype in args.dtype or ["float32"]:
        with serving(args.config, args.out, dtype, args.port) as url:
            summary = fuzz(
                url,
                args.out,
                dtype,
                seed=args.seed,
                max_time=args.max_time,
                workers=args.workers,
                max_examples=args.max_examples,
            )
            summary["health_after"] = health(url)
        summary.update(
            config=str(args.config.resolve().relative_to(REPO))
            if args.config.resolve().is_relative_to(REPO)
            else str(args.config),
            dtype=dtype,
            machine=machine(),
            high_throughput_mode=os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1",
        )
        (args.out / f"{dtype}.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        print(
            json.dumps(
                {
                    k: summary[k]
                    for k in ("dtype", "cases", "server_errors", "conformance_failures", "errors", "health_after")
                }
            )
        )
        h = summary["health_after"]
        failed |= bool(
            summary["failures"] or summary["errors"] or (h["healthz"], h["readyz"], h["generate"]) != (200, 200, 200)
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
