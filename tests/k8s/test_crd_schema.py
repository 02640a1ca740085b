"""The RayServices (base and both overlays, rendered) validate against the KubeRay CRD
``openAPIV3Schema`` in ``../shared/k8s`` (strictly: unknown fields are errors), and the check is
not vacuous."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.support.k8s_manifests import KUSTOMIZATIONS, ROOT, ray_container, the_rayservice

SHARED = Path(os.environ.get("MOA_SHARED_DIR", ROOT.parent / "shared"))


CRDS = SHARED / "k8s"


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
