"""``moa config check CONFIG.yaml``: what ``build_app`` checks of a serve config, printed without
starting Ray — the config models' validation (``deployments/config.py``), each pool replica's
memory fit (``deployments/fit.py``), the sessions the Routers admit against those the pools hold,
and every replica's CPU / GPU reservation against one machine (this one, or the nodes ``--node``
names; ``placement_report``, as ``build_app`` checks it inside a Ray cluster).

The file may be a ``serve run`` config (each application built by ``build_app``), a KubeRay
``RayService`` manifest (its ``serveConfigV2``) or a bare ``args`` mapping. Exit status 0 when
every application can work, 1 when one cannot (the message names the field and the numbers), 2
when the file cannot be read."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import yaml
from pydantic import ValidationError

from moa_serve.deployments import fit
from moa_serve.deployments.config import (
    AppConfig,
    ConfigError,
    Reservation,
    placement_report,
    reservations,
    session_warnings,
)
from moa_serve.verifier.vllm.engine import INSTALL_HINT, vllm_available

BUILD_APP = "moa_serve.deployments.app:build_app"


class ConfigFileError(ValueError):
    """The file cannot be read, or holds no application to check (``moa`` exits with 2)."""


def applications(path: Path) -> list[tuple[str, dict]]:
    """(name, ``args``) of every application in ``path`` that ``build_app`` builds."""
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigFileError(f"{path}: {exc}") from None
    out = []
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "RayService":
            doc = yaml.safe_load((doc.get("spec") or {}).get("serveConfigV2") or "{}")
        if isinstance(doc, dict) and "applications" in doc:
            out += [
                (str(a.get("name", "")), a.get("args") or {})
                for a in doc["applications"] or []
                if str(a.get("import_path", "")).endswith("deployments.app:build_app")
            ]
        elif isinstance(doc, dict) and "target" in doc:  # a bare args block
            out.append(("args", doc))
    if not out:
        raise ConfigFileError(f"{path}: no application built by {BUILD_APP} (nor an args block with a target)")
    return out


def field_errors(exc: ValidationError) -> list[str]:
    """A pydantic error as ``field.path: what is wrong`` lines (the model validator's own
    ConfigError, which has no field, as its message)."""
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        out.append(f"{loc}: {msg}" if loc else msg)
    return out


def this_machine() -> list[dict[str, float]]:
    """One node: the CPUs this process may run on and the GPUs torch sees (what ``ray start``
    would offer by default)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [{"CPU": float(cpus), "GPU": float(gpus)}]


def parse_node(text: str) -> dict[str, float]:
    """``--node CPUS[,GPUS]``."""
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 2 or any(p < 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected CPUS or CPUS,GPUS (e.g. 16,4)")
    return {"CPU": parts[0], "GPU": parts[1] if len(parts) == 2 else 0.0}


def _n(x: float) -> str:
    return f"{x:g}"


def session_lines(cfg: AppConfig) -> list[str]:
    """Sessions a session group, a Router and all Routers admit, against what a pool replica and
    the whole pool hold (``session_problems`` refuses a config where they do not fit)."""
    r = cfg.router
    routers = cfg.router_replicas
    where = "gateway (router.in_gateway)" if r.in_gateway else "router"
    total = routers.max_replicas * r.session_groups * r.max_sessions_per_round
    out = [
        f"a session group admits router.max_sessions_per_round {r.max_sessions_per_round}; a Router runs "
        f"router.session_groups {r.session_groups}; {where} max_replicas {routers.max_replicas}: "
        f"{total} sessions at most"
    ]
    for name, pool in cfg.pools().items():
        most = pool.autoscaling_config.max_replicas
        cap = pool.max_sessions * most
        group = "<=" if r.max_sessions_per_round <= pool.max_sessions else ">"
        whole = "<=" if total <= cap else ">"
        out.append(
            f"{name}: a group's {r.max_sessions_per_round} {group} max_sessions {pool.max_sessions} of one replica; "
            f"all {total} {whole} {pool.max_sessions} x max_replicas {most} = {cap}"
        )
    if cfg.backend == "vllm":
        out.append("backend vllm: a verifier replica's vLLM queues what its batch (max_sessions) cannot take")
    return out


def reservation_lines(demands: list[Reservation], nodes: list[dict[str, float]], named: bool) -> list[str]:
    out = []
    for d in demands:
        replicas = f"{d.start}" if d.start == d.most else f"{d.start} at start, up to {d.most}"
        out.append(f"{d.deployment}: {_n(d.cpus)} CPU, {_n(d.gpus)} GPU per replica x {replicas}")
    for label, count in (("at start", lambda d: d.start), ("at max_replicas", lambda d: d.most)):
        cpu = sum(count(d) * d.cpus for d in demands)
        gpu = sum(count(d) * d.gpus for d in demands)
        out.append(f"{label}: {_n(cpu)} CPU, {_n(gpu)} GPU")
    have = ", ".join(f"{_n(n['CPU'])} CPU / {_n(n['GPU'])} GPU" for n in nodes)
    out.append(f"against {'the nodes' if named else 'this machine'}: {have}")
    return out


def check(args: dict, nodes: list[dict[str, float]], named_nodes: bool, may_grow: bool) -> tuple[list, list, list]:
    """(report sections as (title, lines), problems, warnings) of one application's ``args``."""
    try:
        cfg = AppConfig.model_validate(args)
    except ValidationError as exc:
        return [], field_errors(exc), []
    sections = [
        (
            "config",
            [
                f"target {cfg.target}, drafter {cfg.drafter}, backend {cfg.backend}, device {cfg.device}, "
                f"dtype {cfg.dtype}, max_model_len {cfg.max_model_len}"
            ],
        ),
        ("sessions", session_lines(cfg)),
    ]
    problems, warnings = [], session_warnings(cfg)
    try:
        results = fit.fits(cfg)
    except ConfigError as exc:
        problems.append(str(exc))
    except ValueError as exc:  # a model whose config cannot be read here
        problems.append(f"target / drafter: {exc}")
    else:
        counted = {"cpu": "float32", "cuda": "bfloat16"}[cfg.device]
        title = f"memory per replica (dtype auto counted as {counted})" if cfg.dtype == "auto" else "memory per replica"
        sections.append((title, [f.describe() for f in results]))
        message = fit.misfit(results)
        if message:
            problems.append(message)
        warnings += fit.host_warnings(cfg, results)
    demands = reservations(cfg)
    sections.append(("reservations (Ray resources)", reservation_lines(demands, nodes, named_nodes)))
    placed, placing = placement_report(demands, nodes, may_grow)
    problems += [f"placement: {p}" for p in placed]
    warnings += placing
    if cfg.backend == "vllm" and not vllm_available():
        warnings.append(f"backend vllm: not installed here ({INSTALL_HINT}); build_app refuses it where it is not")
    return sections, problems, warnings


def cmd_check(args) -> int:
    path = Path(args.config)
    apps = applications(path)
    if args.app:
        apps = [a for a in apps if a[0] == args.app]
        if not apps:
            raise ConfigFileError(f"--app {args.app!r}: no such application in {path}")
    nodes = args.node or this_machine()
    failed = False
    for name, app_args in apps:
        sections, problems, warnings = check(app_args, nodes, bool(args.node), args.cluster_may_grow)
        print(f"{path}: application {name}")
        for title, lines in sections:
            print(f"  {title}")
            print("".join(f"    {line}\n" for line in lines), end="")
        for w in warnings:
            print(f"  warning: {w}")
        if problems:
            failed = True
            print(f"  cannot work ({name}):", file=sys.stderr)
            print("".join(f"    - {p}\n".replace("\n  ", "\n      ") for p in problems), end="", file=sys.stderr)
        else:
            print("  ok: build_app would accept this application")
    return 1 if failed else 0


def register(sub) -> None:
    c = sub.add_parser("config", help="serve configs (deployments/configs/*.yaml)")
    csub = c.add_subparsers(dest="config_command", required=True)
    p = csub.add_parser(
        "check",
        help="what build_app checks of a serve config, without Ray: validation, memory fit per replica, "
        "sessions, CPU/GPU reservations",
    )
    p.add_argument("config", help="a serve run YAML, a KubeRay RayService manifest or an args block")
    p.add_argument("--app", default=None, help="only this application of the file")
    p.add_argument(
        "--node",
        action="append",
        type=parse_node,
        metavar="CPUS[,GPUS]",
        help="a node of the Ray cluster to place the replicas on (repeat for several); default: this machine",
    )
    p.add_argument(
        "--cluster-may-grow",
        action="store_true",
        help="replicas that do not fit the nodes wait for nodes an autoscaler adds (KubeRay): a warning, not an error",
    )
    p.set_defaults(func=cmd_check)
