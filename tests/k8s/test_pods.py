"""The Ray Pods: resources, probes, a non-root security context, and secrets (the Hugging Face
token and the API keys from Secrets, never in the manifests or the Serve config)."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from tests.support.k8s_manifests import (
    KUSTOMIZATIONS,
    ROOT,
    _dockerfile_user,
    _yaml_files,
    embedded_serve_config,
    env_of,
    ray_container,
    ray_pods,
    render,
    the_rayservice,
)


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_resources_requests_and_limits(name, built):
    rs = the_rayservice(built[name])
    for role, group, template in ray_pods(rs):
        res = ray_container(template)["resources"]
        for key in ("cpu", "memory"):
            assert key in res["requests"] and res["requests"][key] == res["limits"][key], (role, key)
        gpus = res["limits"].get("nvidia.com/gpu", 0)
        assert res["requests"].get("nvidia.com/gpu", gpus) == gpus
        if role == "head":
            assert gpus == 0, "the head group is CPU-only"
    auto = rs["spec"]["rayClusterConfig"]["autoscalerOptions"]["resources"]
    assert auto["requests"] == auto["limits"]
    gpu_groups = [role for role, _, t in ray_pods(rs) if ray_container(t)["resources"]["limits"].get("nvidia.com/gpu")]
    assert gpu_groups == (["gpu"] if name != "cpu-dev" else [])


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_probes(name, built):
    rs = the_rayservice(built[name])
    serve = embedded_serve_config(rs)
    port = serve["http_options"]["port"]
    every_node = serve.get("proxy_location", "EveryNode") == "EveryNode"
    # EveryNode: workers carry the HTTP traffic, gated by the app's readiness; the head is
    # kept out. HeadOnly: only the head has a proxy, so it must stay in the Service.
    assert rs["spec"]["excludeHeadPodFromServeSvc"] is every_node

    def probe_text(probe: dict) -> str:
        return yaml.safe_dump(probe)

    for role, _, template in ray_pods(rs):
        c = ray_container(template)
        live, ready = c.get("livenessProbe"), c.get("readinessProbe")
        assert live and ready, f"{role}: liveness and readiness probes"
        # Liveness is the Ray node's own health, never the app's (a cluster-wide app fault must
        # not restart Pods); KubeRay only submits the Serve app once the head is Ready, so the
        # head's readiness must not depend on the app either.
        assert live["httpGet"]["path"] == "/api/healthz" and live["httpGet"]["port"] == 52365, role
        if role == "head":
            assert ready.get("httpGet", {}).get("path") == "/api/healthz", "head readiness is Ray-level"
            assert "readyz" not in probe_text(ready)
        elif every_node:
            cmd = " ".join(ready["exec"]["command"])
            assert f"http://localhost:{port}/readyz" in cmd, f"{role}: readiness = the app's /readyz"
            assert f"http://localhost:{port}/-/healthz" in cmd, f"{role}: and the proxy is not draining"
            waits = sum(int(t) for t in re.findall(r"-T (\d+)", cmd))
            assert ready["timeoutSeconds"] >= waits, "the probe must outlast its own wget timeouts"
        else:
            assert str(port) not in probe_text(ready), f"{role}: no proxy on workers with HeadOnly"


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_non_root_security_context(name, built):
    rs = the_rayservice(built[name])
    uid = _dockerfile_user()
    for role, _, template in ray_pods(rs):
        pod = template["spec"]["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == uid != 0, role
        assert pod["seccompProfile"]["type"] == "RuntimeDefault"
        assert not template["spec"].get("hostNetwork") and not template["spec"].get("hostPID")
        for c in template["spec"]["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged"), role
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), role
    auto = rs["spec"]["rayClusterConfig"]["autoscalerOptions"]["securityContext"]
    assert auto["runAsNonRoot"] is True and auto["allowPrivilegeEscalation"] is False


def test_hf_token_comes_from_a_secret(built):
    rs = the_rayservice(built["gpu-prod"])
    for role, _, template in ray_pods(rs):
        token = env_of(ray_container(template)).get("HF_TOKEN")
        assert token and "value" not in token, f"{role}: HF_TOKEN from a Secret, never inline"
        ref = token["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "hf-token", "key": "HF_TOKEN"}, role  # not optional: fail loudly
    for objs in built.values():
        assert not [o for o in objs if o["kind"] == "Secret"], "Secrets are created by hand, not committed"
    for path in list(_yaml_files()) + [ROOT / "Dockerfile"]:
        assert not re.search(r"hf_[A-Za-z0-9]{20,}", path.read_text()), f"{path}: looks like a real token"


def test_cpu_dev_needs_no_hf_token_and_uses_local_models(built):
    rs = the_rayservice(built["cpu-dev"])
    for role, _, template in ray_pods(rs):
        env = env_of(ray_container(template))
        assert "HF_TOKEN" not in env, role
        assert env["MOA_MODEL_DIR"]["value"] == "/opt/moa/models", role  # baked in by the Dockerfile
    assert "COPY --from=models" in (ROOT / "Dockerfile").read_text()
    assert "/opt/moa/models" in (ROOT / "Dockerfile").read_text()


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_api_keys_come_from_a_secret_on_every_ray_container(name, built):
    """The Gateway may run on any Ray Pod: each mounts the Secret read-only and names the file;
    the Secret is required (a Pod without it does not start) and no key is in the manifests."""
    rs = the_rayservice(built[name])
    for role, _, template in ray_pods(rs):
        container = ray_container(template)
        assert env_of(container)["MOA_API_KEYS_FILE"] == {"name": "MOA_API_KEYS_FILE", "value": render.API_KEYS_FILE}
        [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == render.API_KEYS_DIR]
        assert mount["readOnly"] is True, role
        [volume] = [v for v in template["spec"]["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"] == {"secretName": "moa-api-keys"}, role  # not optional: fail closed
    assert "http_auth" not in render.the_application(embedded_serve_config(rs))["args"]


def test_render_refuses_a_manifest_without_the_keys_or_with_keys_in_the_serve_config():
    target = render.TARGETS[0]
    text = (ROOT / target.manifest).read_text()
    for dropped in (
        "                  - {name: api-keys, mountPath: /etc/moa/api-keys, readOnly: true}\n",
        "                  - {name: MOA_API_KEYS_FILE, value: /etc/moa/api-keys/keys}    # as on the head\n",
    ):
        assert dropped in text
        with pytest.raises(render.RenderError, match="API keys are not mounted"):
            render.render(target, text.replace(dropped, "", 1))
    keyed = copy.deepcopy(render.load_yaml(ROOT / "deployments/configs/gpu.yaml"))
    keyed["applications"][0]["args"]["http_auth"] = {"api_keys": ["sk-in-the-yaml"]}
    with pytest.raises(render.RenderError, match="Secret"):
        render.serve_config_v2(keyed)
