#!/usr/bin/env python3
"""A small re-implementation of ``kustomize build`` for the features this repo's overlays use.

The tests render the overlays without needing a kustomize binary (``kubectl kustomize``
is used and compared against when one is installed). Supported, with kustomize's semantics:

* ``resources``: files (multi-document YAML) and directories holding a kustomization;
* ``patches`` whose content is a JSON6902 op list (add/remove/replace/test/move/copy, RFC
  6902), selected by ``target`` group/version/kind/name/namespace;
* ``namespace``: set on every namespaced object (cluster-scoped kinds are left alone);
* ``images``: ``name`` -> ``newName``/``newTag``/``digest`` in every ``containers`` and
  ``initContainers`` list, at any depth (kustomize does this for custom resources too).

Transformers run in kustomize's order: patches, then namespace, then images. Anything else
in a kustomization (strategic-merge patches, generators, labels, name prefixes, ...) raises
``Unsupported``, so an overlay cannot silently drift from what this checks.

Usage: ``python k8s/kustomize_lite.py k8s/overlays/gpu-prod`` prints the rendered YAML.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}
CLUSTER_SCOPED = {
    "Namespace",
    "Node",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "APIService",
    "IngressClass",
    "RuntimeClass",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
    "CSIDriver",
    "VolumeAttachment",
}


class Unsupported(ValueError):
    """The kustomization uses a feature this module does not reproduce."""


class PatchError(ValueError):
    pass


def _kustomization_file(directory: Path) -> Path:
    for name in KUSTOMIZATION_FILES:
        if (directory / name).is_file():
            return directory / name
    raise FileNotFoundError(f"no kustomization file in {directory}")


def _load_docs(path: Path) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def resource_id(obj: dict) -> tuple:
    meta = obj.get("metadata") or {}
    return (obj.get("apiVersion"), obj.get("kind"), meta.get("namespace"), meta.get("name"))


# --------------------------------------------------------------------------- JSON6902


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _split(pointer: str) -> list[str]:
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise PatchError(f"JSON pointer must start with '/': {pointer!r}")
    return [_unescape(t) for t in pointer[1:].split("/")]


def _index(container: list, token: str, *, allow_end: bool) -> int:
    if token == "-" and allow_end:
        return len(container)
    if not token.isdigit() or (token != "0" and token.startswith("0")):
        raise PatchError(f"bad array index {token!r}")
    i = int(token)
    if i > len(container) or (i == len(container) and not allow_end):
        raise PatchError(f"array index {i} out of range (length {len(container)})")
    return i


def _parent(doc, tokens: list[str]):
    node = doc
    for t in tokens[:-1]:
        if isinstance(node, list):
            node = node[_index(node, t, allow_end=False)]
        elif isinstance(node, dict):
            if t not in node:
                raise PatchError(f"path segment {t!r} not found")
            node = node[t]
        else:
            raise PatchError(f"cannot descend into {type(node).__name__} at {t!r}")
    return node


def _get(doc, pointer: str):
    node = doc
    for t in _split(pointer):
        if isinstance(node, list):
            node = node[_index(node, t, allow_end=False)]
        elif isinstance(node, dict) and t in node:
            node = node[t]
        else:
            raise PatchError(f"path {pointer!r} not found")
    return node


def _add(doc, pointer: str, value):
    tokens = _split(pointer)
    if not tokens:
        return value
    parent, last = _parent(doc, tokens), tokens[-1]
    if isinstance(parent, list):
        parent.insert(_index(parent, last, allow_end=True), value)
    elif isinstance(parent, dict):
        parent[last] = value
    else:
        raise PatchError(f"cannot add into {type(parent).__name__}")
    return doc


def _remove(doc, pointer: str):
    tokens = _split(pointer)
    if not tokens:
        raise PatchError("cannot remove the whole document")
    parent, last = _parent(doc, tokens), tokens[-1]
    if isinstance(parent, list):
        return parent.pop(_index(parent, last, allow_end=False))
    if isinstance(parent, dict) and last in parent:
        return parent.pop(last)
    raise PatchError(f"path {pointer!r} not found")


def apply_json6902(doc, ops: list[dict]):
    """Apply RFC 6902 operations to a deep copy of ``doc``."""
    doc = copy.deepcopy(doc)
    for op in ops:
        kind, path = op.get("op"), op.get("path")
        if kind == "add":
            doc = _add(doc, path, copy.deepcopy(op["value"]))
        elif kind == "remove":
            _remove(doc, path)
        elif kind == "replace":
            _get(doc, path)  # must exist
            if _split(path):
                _remove(doc, path)
            doc = _add(doc, path, copy.deepcopy(op["value"]))
        elif kind == "test":
            if _get(doc, path) != op["value"]:
                raise PatchError(f"test failed at {path}: {_get(doc, path)!r} != {op['value']!r}")
        elif kind in ("move", "copy"):
            value = copy.deepcopy(_get(doc, op["from"]))
            if kind == "move":
                _remove(doc, op["from"])
            doc = _add(doc, path, value)
        else:
            raise PatchError(f"unknown op {kind!r}")
    return doc


# --------------------------------------------------------------------------- transformers


def _matches(obj: dict, target: dict) -> bool:
    unsupported = set(target) - {"group", "version", "kind", "name", "namespace"}
    if unsupported:
        raise Unsupported(f"patch target selectors {sorted(unsupported)}")
    api = obj.get("apiVersion", "")
    group, _, version = api.rpartition("/")
    meta = obj.get("metadata") or {}
    want = {
        "group": group,
        "version": version,
        "kind": obj.get("kind"),
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
    }
    return all(want[k] == v for k, v in target.items())


def _set_image(image: str, rule: dict) -> str:
    name, tag, digest = image, None, None
    if "@" in name:
        name, digest = name.split("@", 1)
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    if name != rule["name"]:
        return image
    name = rule.get("newName", name)
    if "digest" in rule:
        return f"{name}@{rule['digest']}"
    if "newTag" in rule:
        return f"{name}:{rule['newTag']}"
    return name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def _images(node, rules: list[dict]):
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for c in value:
                    if isinstance(c, dict) and isinstance(c.get("image"), str):
                        for rule in rules:
                            c["image"] = _set_image(c["image"], rule)
            _images(value, rules)
    elif isinstance(node, list):
        for item in node:
            _images(item, rules)


def build(directory) -> list[dict]:
    """The objects ``kustomize build directory`` would output (in resource order)."""
    directory = Path(directory)
    kfile = _kustomization_file(directory)
    k = yaml.safe_load(kfile.read_text()) or {}
    unknown = set(k) - SUPPORTED_KEYS
    if unknown:
        raise Unsupported(f"{kfile}: kustomization fields {sorted(unknown)}")

    objs: list[dict] = []
    for res in k.get("resources") or []:
        p = directory / res
        objs += build(p) if p.is_dir() else _load_docs(p)
    seen = set()
    for obj in objs:
        rid = resource_id(obj)
        if rid in seen:
            raise ValueError(f"{kfile}: duplicate resource {rid}")
        seen.add(rid)

    for patch in k.get("patches") or []:
        if set(patch) - {"path", "patch", "target"}:
            raise Unsupported(f"{kfile}: patch options {sorted(set(patch) - {'path', 'patch', 'target'})}")
        text = (directory / patch["path"]).read_text() if "path" in patch else patch["patch"]
        ops = yaml.safe_load(text)
        if not isinstance(ops, list):
            raise Unsupported(f"{kfile}: strategic-merge patches (only JSON6902 op lists are reproduced)")
        if "target" not in patch:
            raise Unsupported(f"{kfile}: a JSON6902 patch needs a target")
        hits = [i for i, obj in enumerate(objs) if _matches(obj, patch["target"])]
        if not hits:
            raise PatchError(f"{kfile}: patch target {patch['target']} matches nothing")
        for i in hits:
            objs[i] = apply_json6902(objs[i], ops)

    if k.get("namespace"):
        for obj in objs:
            if obj.get("kind") not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = k["namespace"]

    rules = k.get("images") or []
    for rule in rules:
        if set(rule) - {"name", "newName", "newTag", "digest"}:
            raise Unsupported(f"{kfile}: image fields {sorted(set(rule) - {'name', 'newName', 'newTag', 'digest'})}")
    if rules:
        for obj in objs:
            _images(obj, rules)
    return objs


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: kustomize_lite.py DIRECTORY", file=sys.stderr)
        return 2
    sys.stdout.write(yaml.safe_dump_all(build(argv[0]), sort_keys=False, width=4096))
    return 0


if __name__ == "__main__":
    sys.exit(main())
