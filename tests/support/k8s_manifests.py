"""What the k8s/ tests (tests/k8s/) share: the repository's paths, k8s/render.py and
k8s/kustomize_lite.py loaded as modules, the overlays, ways into a rendered RayService, and what
pyproject.toml and the Dockerfile pin."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


K8S = ROOT / "k8s"


def _load_module(name: str, path: Path):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


render = _load_module("moa_k8s_render", K8S / "render.py")


kl = _load_module("moa_k8s_kustomize_lite", K8S / "kustomize_lite.py")


KUSTOMIZATIONS = {
    "base": K8S / "base",
    "gpu-prod": K8S / "overlays" / "gpu-prod",
    "cpu-dev": K8S / "overlays" / "cpu-dev",
}


def the_rayservice(objs: list[dict]) -> dict:
    found = [o for o in objs if o.get("kind") == "RayService"]
    assert len(found) == 1, f"expected one RayService, got {len(found)}"
    return found[0]


def ray_pods(rs: dict):
    """(role, group spec, pod template) for the head and every worker group."""
    cluster = rs["spec"]["rayClusterConfig"]
    yield "head", cluster["headGroupSpec"], cluster["headGroupSpec"]["template"]
    for g in cluster.get("workerGroupSpecs") or []:
        yield g["groupName"], g, g["template"]


def ray_container(template: dict) -> dict:
    return template["spec"]["containers"][0]  # KubeRay: the Ray container is the first one


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env") or []}


def port_named(container: dict, name: str) -> int | None:
    return next((p["containerPort"] for p in container.get("ports") or [] if p.get("name") == name), None)


def embedded_serve_config(rs: dict) -> dict:
    assert isinstance(rs["spec"]["serveConfigV2"], str), "serveConfigV2 must be a YAML string"
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def _yaml_files():
    return sorted(p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())


def _pyproject():
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _pyproject_version() -> str:
    return _pyproject()["project"]["version"]


def _pyproject_pin(dist: str) -> str:
    for dep in _pyproject()["project"]["dependencies"]:
        m = re.fullmatch(rf"{re.escape(dist)}(\[[^\]]*\])?==([\w.]+)", dep.replace(" ", ""))
        if m:
            return m.group(2)
    raise AssertionError(f"{dist} is not pinned with == in pyproject.toml")


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _dockerfile_user() -> int:
    users = [rest for word, rest in _dockerfile_instructions() if word == "USER"]
    assert users, "the image must not run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit(), "USER as a numeric uid so that runAsNonRoot can verify it"
    return int(uid)
