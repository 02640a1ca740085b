"""The sides of a side-by-side run: what starts each server (our ``serve run`` of a derived config,
vLLM, llama.cpp) and where it answers."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import yaml

from tools.side_by_side.servers import SideError

VLLM_SERVED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
NGRAM_CONFIG = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2"}
# llama.cpp's server as CPU users of GGUF models run it: 2 threads, 16 parallel slots sharing a
# 32k-token cache, the model's own chat template
LLAMA_ARGS = "-t 2 -np 16 -c 32768 --jinja"


def repo_root() -> Path:
    """The checkout this script lives in (``tools/side_by_side/`` two folders down)."""
    return Path(__file__).resolve().parents[2]


def split_label(spec: str, default: str) -> tuple[str, str]:
    """``LABEL=PATH`` or ``PATH`` (a PATH that itself holds '=' needs a label)."""
    if "=" in spec:
        label, path = spec.split("=", 1)
        if label and "/" not in label and not label.endswith((".yaml", ".yml")):
            return label, path
    return default, spec


def derived_config(config: Path, host: str, port: int, drafter_off: bool, dst: Path) -> tuple[Path, str]:
    """Copy of a serve run config with http_options host/port replaced (and the application
    arg drafter: null for an "off" side); return its path and the server's base URL."""
    try:
        cfg = yaml.safe_load(config.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise SideError(f"{config}: cannot read the serve config ({exc})") from exc
    if not isinstance(cfg, dict) or not cfg.get("applications"):
        raise SideError(f"{config}: not a serve run config (no 'applications')")
    if drafter_off:
        args = cfg["applications"][0].get("args")
        if not isinstance(args, dict):
            args = cfg["applications"][0]["args"] = {}
        args["drafter"] = None
    http = cfg.get("http_options")
    if not isinstance(http, dict):
        http = cfg["http_options"] = {}
    http["host"], http["port"] = host, port
    url = f"http://{host}:{port}"
    prefix = cfg["applications"][0].get("route_prefix", "/") or "/"
    if prefix != "/":
        url += "/" + prefix.strip("/")
    dst.write_text(
        f"# derived by tools/side_by_side from {config}"
        f"{' (drafter: null)' if drafter_off else ''}\n" + yaml.safe_dump(cfg, sort_keys=False),
        encoding="utf-8",
    )
    return dst, url


def serve_command(python: str) -> list[str]:
    serve = Path(python).with_name("serve")
    if serve.exists():
        return [str(serve), "run"]
    return [python, "-m", "ray.serve.scripts", "run"]


def safe_label(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label)


def build_sides(a, repo: Path, out: Path) -> list[dict]:
    """The sides to run, in order, each with what is needed to start its server."""
    sides: list[dict] = []
    used: set[str] = set()

    def unique(label: str) -> str:
        base, n = label, 2
        while label in used:
            label, n = f"{base}-{n}", n + 1
        used.add(label)
        return label

    moa_dir = a.moa_model_dir or os.environ.get("MOA_MODEL_DIR") or str(repo.parent / "shared" / "models")
    for specs, off in ((a.ours or [], False), (a.ours_off or [], True)):
        for spec in specs:
            name, path = split_label(spec, "off" if off else "on")
            label = unique(f"ours/{name}")
            config = Path(path)
            if not config.is_absolute() and not config.exists() and (repo / config).exists():
                config = repo / config
            cfg_path, url = derived_config(config, "127.0.0.1", a.port, off, out / f"{safe_label(label)}.serve.yaml")
            shown = {"MOA_MODEL_DIR": moa_dir, **(a.ours_env or {}).get(name, {})}
            env = dict(os.environ, **shown)
            cmd = [*serve_command(a.ours_python), "--address", "local", str(cfg_path)]
            sides.append(
                {
                    "label": label,
                    "kind": "ours",
                    "drafter_off": off,
                    "config": str(config),
                    "served_config": str(cfg_path),
                    "url": url,
                    "ready_path": "/readyz",
                    "cmd": cmd,
                    "env": env,
                    "env_shown": shown,
                    "port": a.port,
                    "model": a.model,
                }
            )
    if a.vllm_python or a.vllm_model:
        if not (a.vllm_python and a.vllm_model):
            raise SystemExit("--vllm-python and --vllm-model go together")
        variants = [] if a.no_vllm_plain else [("vllm", [])]
        if a.vllm_ngram:
            variants.append(("vllm/ngram", ["--speculative-config", a.vllm_ngram_config]))
        for name, extra in variants:
            label = unique(name)
            cmd = [
                a.vllm_python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                a.vllm_model,
                "--served-model-name",
                a.vllm_served_name,
                "--dtype",
                "bfloat16",
                "--max-model-len",
                "2048",
                "--host",
                "127.0.0.1",
                "--port",
                str(a.vllm_port),
                *extra,
                *shlex.split(a.vllm_args or ""),
            ]
            sides.append(
                {
                    "label": label,
                    "kind": "vllm",
                    "url": f"http://127.0.0.1:{a.vllm_port}",
                    "ready_path": "/v1/models",
                    "cmd": cmd,
                    "env": dict(os.environ, **VLLM_ENV),
                    "env_shown": dict(VLLM_ENV),
                    "port": a.vllm_port,
                    "model": a.model or a.vllm_served_name,
                }
            )
    elif a.vllm_ngram or a.no_vllm_plain:
        raise SystemExit("--vllm-ngram / --no-vllm-plain need --vllm-python and --vllm-model")
    if a.llama_server:
        gguf = a.llama_gguf or _default_gguf(repo)
        name = a.model or VLLM_SERVED_NAME
        cmd = [
            a.llama_server,
            "-m",
            str(gguf),
            "--alias",
            name,
            "--host",
            "127.0.0.1",
            "--port",
            str(a.llama_port),
            *shlex.split(a.llama_args),
        ]
        sides.append(
            {
                "label": unique("llama.cpp"),
                "kind": "llama.cpp",
                "url": f"http://127.0.0.1:{a.llama_port}",
                "ready_path": "/health",
                "cmd": cmd,
                "env": dict(os.environ),
                "env_shown": {},
                "port": a.llama_port,
                "model": name,
            }
        )
    return sides


def _default_gguf(repo: Path) -> Path:
    """The target's GGUF weights in ``../shared/models`` (the same file our server de-quantizes)."""
    found = sorted((repo.parent / "shared" / "models" / "smollm2-135m-instruct").glob("*.gguf"))
    if not found:
        raise SystemExit("--llama-gguf: no GGUF found in ../shared/models/smollm2-135m-instruct")
    return found[0]


def questions_of(questions: Path, categories: list[str], dst: Path) -> Path:
    """The lines of a Spec-Bench-format file whose ``category`` is one of ``categories``, in their
    order, written to ``dst``; ValueError when none is."""
    wanted = set(categories)
    lines = [ln for ln in questions.read_text().splitlines() if ln.strip() and json.loads(ln).get("category") in wanted]
    if not lines:
        raise ValueError(f"no question of {sorted(wanted)} in {questions}")
    dst.write_text("\n".join(lines) + "\n")
    return dst
