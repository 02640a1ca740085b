"""The overlays (namespace, image, cpu-dev's local config) and k8s/kustomize_lite.py: JSON6902
patches, image rules, unsupported features refused, and the same objects as ``kubectl kustomize``
when one is installed."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.support.k8s_manifests import (
    KUSTOMIZATIONS,
    _pyproject_version,
    embedded_serve_config,
    kl,
    ray_container,
    ray_pods,
    the_rayservice,
)


def test_overlays_set_namespace_and_image(built):
    expected = {
        "gpu-prod": ("moa-serve", "registry.example.com/moa-serve:0.1.0-gpu"),
        "cpu-dev": ("moa-dev", "moa-serve:0.1.0-cpu"),
    }
    for name, (namespace, image) in expected.items():
        objs = built[name]
        assert [o["metadata"]["name"] for o in objs if o["kind"] == "Namespace"] == [namespace]
        for o in objs:
            if o["kind"] != "Namespace":
                assert o["metadata"]["namespace"] == namespace, (name, o["kind"])
        for role, _, template in ray_pods(the_rayservice(objs)):
            assert ray_container(template)["image"] == image, (name, role)
    version = _pyproject_version()
    assert expected["gpu-prod"][1].endswith(f":{version}-gpu") and expected["cpu-dev"][1].endswith(f":{version}-cpu")


def test_cpu_dev_mirrors_the_local_config(built):
    rs = the_rayservice(built["cpu-dev"])
    groups = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == ["cpu"]
    assert embedded_serve_config(rs)["proxy_location"] == "HeadOnly"


def _kustomize_command():
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        probe = subprocess.run(["kubectl", "kustomize", "--help"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["kubectl", "kustomize"]
    return None


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_overlays_render_like_kustomize(name, built):
    cmd = _kustomize_command()
    if cmd is None:
        pytest.skip("no kustomize/kubectl here; overlays were rendered by k8s/kustomize_lite.py only")
    out = subprocess.run(cmd + [str(KUSTOMIZATIONS[name])], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    real = {kl.resource_id(o): o for o in yaml.safe_load_all(out.stdout) if o}
    lite = {kl.resource_id(o): o for o in built[name]}
    assert real.keys() == lite.keys()
    for rid in real:
        assert real[rid] == lite[rid], f"{rid} differs between {' '.join(cmd)} and kustomize_lite"


def test_kustomize_lite_json6902():
    doc = {"a": {"b": [1, 2, 3]}, "c": "x"}
    out = kl.apply_json6902(
        doc,
        [
            {"op": "test", "path": "/c", "value": "x"},
            {"op": "add", "path": "/a/b/-", "value": 4},
            {"op": "add", "path": "/a/b/0", "value": 0},
            {"op": "remove", "path": "/a/b/1"},
            {"op": "replace", "path": "/c", "value": {"d~/e": 1}},
            {"op": "copy", "from": "/c/d~0~1e", "path": "/f"},
        ],
    )
    assert out == {"a": {"b": [0, 2, 3, 4]}, "c": {"d~/e": 1}, "f": 1}
    assert doc == {"a": {"b": [1, 2, 3]}, "c": "x"}, "input untouched"
    for bad in (
        [{"op": "test", "path": "/c", "value": "y"}],
        [{"op": "replace", "path": "/zz", "value": 1}],
        [{"op": "remove", "path": "/a/b/3"}],
        [{"op": "add", "path": "/q/r", "value": 1}],
    ):
        with pytest.raises(kl.PatchError):
            kl.apply_json6902(doc, bad)


def test_kustomize_lite_refuses_unsupported_features(tmp_path):
    (tmp_path / "r.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n")
    (tmp_path / "kustomization.yaml").write_text("resources: [r.yaml]\ncommonLabels: {a: b}\n")
    with pytest.raises(kl.Unsupported):
        kl.build(tmp_path)
    (tmp_path / "p.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata: {k: v}\n")
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [r.yaml]\npatches: [{path: p.yaml, target: {kind: ConfigMap, name: c}}]\n"
    )
    with pytest.raises(kl.Unsupported, match="strategic-merge"):
        kl.build(tmp_path)


def test_image_rules():
    rule = {"name": "moa-serve", "newName": "reg.io/x/moa-serve", "newTag": "1"}
    assert kl._set_image("moa-serve", rule) == "reg.io/x/moa-serve:1"
    assert kl._set_image("moa-serve:old", rule) == "reg.io/x/moa-serve:1"
    assert kl._set_image("other:1", rule) == "other:1"
    assert (
        kl._set_image("localhost:5000/moa-serve", {"name": "localhost:5000/moa-serve", "newTag": "2"})
        == "localhost:5000/moa-serve:2"
    )
    assert kl._set_image("moa-serve:1", {"name": "moa-serve", "digest": "sha256:ab"}) == "moa-serve@sha256:ab"
