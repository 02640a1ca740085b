"""``--together``: every side served at once, the load moved from one to the next in slices.

A small cloud VM's speed drifts: the same forward can take twice as long a few minutes later (its
neighbours), more than the few per cent a drafter's cost or gain is. Servers measured one after
the other (each started, loaded at every level, stopped) put minutes between two sides, so such a
comparison cannot resolve a few per cent. Here every ``--ours``/``--ours-off`` config is one
application of a single ``serve run`` (route prefix ``/<label>``), each peer (llama.cpp, vLLM)
runs beside it on its own port, and at each user level the closed-loop client loads one side for
``--duration`` seconds, then the next, ``--slices`` times, the order reversed every other time
(A B C, C B A, A B C, ...): two sides' slices of one pass lie seconds apart, and drift that is
linear over a pass cancels over two. An idle side costs almost nothing (its threads sleep, its
round loop waits); our replicas reserve no CPU (``num_cpus: 0``), so any number of them fit a
machine the config was written for alone.

Each side's result per level is its tokens over its seconds, summed over its slices; the report
(``report.together_table``) adds each side's ratio to the first side, per pass (the two slices a
pass holds) and their geometric mean, with the range over passes.
"""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

import yaml

from tools.side_by_side.servers import DEPLOY_FAILED, Readiness, Server, SideError, http_get
from tools.side_by_side.sides import safe_label, serve_command


def app_name(label: str) -> str:
    """``ours/moa1`` -> ``moa1``: the application's name and route prefix."""
    return safe_label(label.split("/", 1)[-1])


def _no_cpu_reservations(node) -> None:
    """Every ``ray_actor_options`` in an application's args reserves 0 CPUs (in place)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "ray_actor_options" and isinstance(value, dict):
                value["num_cpus"] = 0
            else:
                _no_cpu_reservations(value)
    elif isinstance(node, list):
        for value in node:
            _no_cpu_reservations(value)


def combined_config(sides: list[dict], host: str, port: int, dst: Path) -> Path:
    """One serve config holding each side's (first) application, named and routed by its label,
    reserving no CPU; the sides' ``url`` is set to their route. The first side's top-level
    settings (proxy, logging) are kept."""
    apps, top = [], None
    for s in sides:
        cfg = yaml.safe_load(Path(s["served_config"]).read_text(encoding="utf-8"))
        if top is None:
            top = {k: v for k, v in cfg.items() if k != "applications"}
        app = dict(cfg["applications"][0])
        name = app_name(s["label"])
        app["name"], app["route_prefix"] = name, f"/{name}"
        _no_cpu_reservations(app.get("args"))
        apps.append(app)
        s["url"] = f"http://{host}:{port}/{name}"
    top["http_options"] = {**(top.get("http_options") or {}), "host": host, "port": port}
    dst.write_text(
        "# derived by tools/side_by_side --together: every side one application, none reserving CPU\n"
        + yaml.safe_dump({**top, "applications": apps}, sort_keys=False),
        encoding="utf-8",
    )
    return dst


def pass_order(sides: list, k: int) -> list:
    """The sides in pass ``k``: as given on even passes, reversed on odd ones."""
    return list(sides) if k % 2 == 0 else list(reversed(sides))


def start(a, sides: list[dict], results: list[dict], out: Path) -> Server:
    """Starts the combined server and waits until every application answers ``/readyz``."""
    cfg = combined_config(sides, "127.0.0.1", a.port, out / "together.serve.yaml")
    env = dict(sides[0]["env"])
    cmd = [*serve_command(a.ours_python), "--address", "local", str(cfg)]
    server = Server(
        "ours (together)",
        cmd,
        env,
        out / "together.log",
        Readiness(sides[0]["url"] + "/readyz", "127.0.0.1", a.port, a.ready_timeout, DEPLOY_FAILED),
    )
    ready_s = server.start()
    for s, r in zip(sides, results):
        r["url"], r["log"], r["served_config"] = s["url"], str(out / "together.log"), str(cfg)
        r["command"] = f"MOA_MODEL_DIR={shlex.quote(env.get('MOA_MODEL_DIR', ''))} {shlex.join(cmd)}"
        r["ready_s"] = round(ready_s, 1)
    return server


def wait_all_ready(sides: list[dict], timeout: float) -> None:
    """Every application's ``/readyz`` answers 200 (the server waited for the first only)."""
    deadline = time.monotonic() + timeout
    for s in sides:
        while True:
            try:
                if http_get(s["url"] + "/readyz", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SideError(f"{s['label']}: {s['url']}/readyz not 200 after {timeout:.0f} s")
            time.sleep(1.0)


def slices(a, sides: list[dict]) -> list[tuple[int, int, dict]]:
    """(users, pass, side) in the order they run: per level, ``a.slices`` passes."""
    return [(u, k, s) for u in a.users for k in range(a.slices) for s in pass_order(sides, k)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("our sides together")
    g.add_argument(
        "--together",
        action="store_true",
        help="serve every side at once (our configs: one serve run, one application each, no CPU reserved; "
        "peers beside it) and move the load between them in slices of --duration s (tools/side_by_side/together.py)",
    )
    g.add_argument(
        "--slices",
        type=int,
        default=4,
        help="with --together: passes per level, each a slice of every side, the order reversed every other pass "
        "(default 4)",
    )


def check_arguments(a) -> str | None:
    """Why --together cannot run with these arguments (None: it can)."""
    if not a.together:
        return None
    if a.slices < 1:
        return "--slices must be >= 1"
    peers = bool(a.vllm_python) * ((not a.no_vllm_plain) + bool(a.vllm_ngram)) + bool(a.llama_server)
    if len(a.ours or []) + len(a.ours_off or []) + peers < 2:
        return "--together needs at least two sides"
    if a.vllm_python and not a.no_vllm_plain and a.vllm_ngram:
        return "--together: vLLM and vLLM n-gram would both listen on --vllm-port; keep one (--no-vllm-plain)"
    if a.ours_env:
        return "--ours-env sets a process's environment: not with --together (one process for every side)"
    return None
