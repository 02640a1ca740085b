"""k8s/render.py: every manifest parses; the generated parts are up to date and rendering
overwrites hand edits; what cannot be translated is refused; the embedded ``serveConfigV2`` is the
Serve config (only the documented changes), valid for ``AppConfig`` and, when Ray is installed, for
Ray's own ``ServeDeploySchema``."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from tests.support.k8s_manifests import (
    KUSTOMIZATIONS,
    ROOT,
    _yaml_files,
    embedded_serve_config,
    port_named,
    ray_container,
    ray_pods,
    render,
    the_rayservice,
)

SERVE_CONFIGS = {
    "base": "deployments/configs/gpu.yaml",
    "gpu-prod": "deployments/configs/gpu.yaml",
    "cpu-dev": "deployments/configs/local-cpu.yaml",
}


# The only differences allowed between a Serve config and the serveConfigV2 made from it.
ALLOWED_CHANGES = {
    "base": {},
    "gpu-prod": {},
    "cpu-dev": {("http_options", "host"): ("127.0.0.1", "0.0.0.0")},
}


def test_every_manifest_parses():
    files = _yaml_files()
    assert len(files) >= 8, files
    name_re = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path} is empty"
        for doc in docs:
            if isinstance(doc, list):  # a JSON6902 patch
                for op in doc:
                    assert op.get("op") in {"add", "remove", "replace", "test", "move", "copy"}, (path, op)
                    assert str(op.get("path", "")).startswith("/"), (path, op)
                continue
            assert isinstance(doc, dict), path
            assert doc.get("apiVersion") and doc.get("kind"), f"{path}: apiVersion/kind missing"
            if doc["kind"] == "Kustomization":
                continue
            name = (doc.get("metadata") or {}).get("name", "")
            assert name_re.match(name) and len(name) <= 63, f"{path}: bad metadata.name {name!r}"


def test_generated_parts_are_up_to_date():
    for r in render.render_all():
        current = (ROOT / r.target.manifest).read_text()
        assert current == r.text, (
            f"{r.target.manifest} is stale (its Serve config or pod shapes changed): "
            f"run `python k8s/render.py` and commit the result"
        )


def test_render_rewrites_hand_edits_and_is_idempotent():
    target = render.TARGETS[0]
    text = (ROOT / target.manifest).read_text()
    edited = text.replace(
        "maxReplicas: 10  # render: gpu.maxReplicas", "maxReplicas: 3  # render: gpu.maxReplicas"
    ).replace("        target: meta-llama/Meta-Llama-3-8B-Instruct", "        target: some/other-model")
    assert edited != text
    again = render.render(target, edited).text
    assert again == render.render(target).text  # the edits are overwritten
    assert render.render(target, again).text == again  # and rendering is a fixed point


def test_render_refuses_what_it_cannot_translate():
    base = render.load_yaml(ROOT / "deployments/configs/gpu.yaml")
    cfg, changes = render.serve_config_v2(base)
    assert changes == [] and cfg == base
    bad_port = copy.deepcopy(base)
    bad_port["http_options"]["port"] = 9000
    with pytest.raises(render.RenderError, match="port"):
        render.serve_config_v2(bad_port)
    local_code = copy.deepcopy(base)
    local_code["applications"][0]["runtime_env"] = {"working_dir": "."}
    with pytest.raises(render.RenderError, match="local paths"):
        render.serve_config_v2(local_code)
    remote_code = copy.deepcopy(base)
    remote_code["applications"][0]["runtime_env"] = {"working_dir": "s3://bucket/code.zip"}
    render.serve_config_v2(remote_code)
    loopback = copy.deepcopy(base)
    loopback["http_options"]["host"] = "127.0.0.1"
    cfg, changes = render.serve_config_v2(loopback)
    assert cfg["http_options"]["host"] == "0.0.0.0" and len(changes) == 1


# --------------------------------------------------------------------------- serveConfigV2
def _diff(a, b, path=()) -> dict:
    if isinstance(a, dict) and isinstance(b, dict):
        out = {}
        for k in a.keys() | b.keys():
            out.update(_diff(a.get(k), b.get(k), path + (k,)))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        out = {}
        for i, (x, y) in enumerate(zip(a, b)):
            out.update(_diff(x, y, path + (i,)))
        return out
    return {} if a == b else {path: (a, b)}


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_serve_config_v2_is_the_serve_config(name, built):
    rs = the_rayservice(built[name])
    embedded = embedded_serve_config(rs)
    source = render.load_yaml(ROOT / SERVE_CONFIGS[name])
    assert _diff(source, embedded) == ALLOWED_CHANGES[name], (
        f"serveConfigV2 differs from {SERVE_CONFIGS[name]} beyond the documented changes: run `python k8s/render.py`"
    )
    assert embedded["applications"] == source["applications"]
    assert embedded["http_options"]["host"] == "0.0.0.0"

    app = render.the_application(embedded)
    assert app["import_path"] == "moa_serve.deployments.app:build_app"
    render.app_config_class().model_validate(app["args"])  # what build_app validates

    # The Serve port is the `serve` port of every Ray container, the Service's and the probes'.
    port = embedded["http_options"]["port"]
    for _, _, template in ray_pods(rs):
        assert port_named(ray_container(template), "serve") == port
    assert [p["port"] for p in rs["spec"]["serveService"]["spec"]["ports"] if p["name"] == "serve"] == [port]


@pytest.mark.parametrize("name", ["gpu-prod", "cpu-dev"])
def test_serve_config_v2_passes_rays_schema(name, built):
    schema = pytest.importorskip("ray.serve.schema")
    cfg = embedded_serve_config(the_rayservice(built[name]))
    schema.ServeDeploySchema.model_validate(cfg)
