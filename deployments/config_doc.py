"""``docs/configuration.md``, written from the config models' own field descriptions
(``deployments/config.py``), so the page cannot drift from the code:

    python -m moa_serve.deployments.config_doc > docs/configuration.md

``tests/test_docs.py`` fails when the page differs from what this renders."""

from __future__ import annotations

import sys
import types
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from moa_serve.deployments.config import AppConfig

INTRO = """# Configuration

`serve run deployments/configs/<name>.yaml` passes the application's `args` block to
`build_app(args)`, which validates it against the pydantic models in
[`deployments/config.py`](../deployments/config.py) (unknown fields are refused) and then checks
that the config can work: the sessions the Routers admit against the sessions the pools hold, and
KV cache + weights against each replica's memory ([`deployments/fit.py`](../deployments/fit.py)).
A config that cannot work is refused with the numbers to change. The same block is the
`serveConfigV2` of the KubeRay manifests ([kubernetes.md](kubernetes.md)).

`moa config check CONFIG.yaml` prints those checks without starting Ray: each pool replica's
weights, KV cache and activations against its memory, the sessions a session group, a Router and
all Routers admit against what a replica and the pool hold, and every deployment's CPU / GPU
reservation against this machine, or against the cluster's nodes (`--node CPUS[,GPUS]`, once per
node; `--cluster-may-grow` where an autoscaler adds nodes). It exits with 1 naming the field and the
numbers when the config cannot work. It reads a `serve run` config, a KubeRay `RayService` manifest
or a bare `args` block.

This page is generated from the models' field descriptions
(`python -m moa_serve.deployments.config_doc > docs/configuration.md`); a test fails when it is
stale. The shipped configs and why they set what they set: the comments in
[`deployments/configs/`](../deployments/configs/); the measurements behind them:
[benchmarks.md](benchmarks.md).
"""


def _type_name(annotation) -> str:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" if a is not None else "`null`" for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _default(field, value) -> str:
    if value is PydanticUndefined:
        return "**required**"
    if isinstance(value, BaseModel):
        return "see below"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _bounds(field) -> str:
    marks = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    out = []
    for meta in field.metadata:
        for attr, sign in marks.items():
            bound = getattr(meta, attr, None)
            if bound is not None:
                out.append(f"{sign} {bound}")
    return ", ".join(out)


def _nested(annotation) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _section(model: type[BaseModel], path: str, out: list[str], defaults: BaseModel | None = None) -> None:
    """One table per model; ``defaults`` is the parent's default instance of it (a pool's
    ``ray_actor_options`` default differs from the bare model's)."""
    out += [f"## `{path}`" if path else "## Top level (`args`)", ""]
    doc = (model.__doc__ or "").strip()
    if doc and model is not AppConfig:
        out += [" ".join(doc.split()), ""]
    out += ["| field | type | default | limits | what it does |", "| --- | --- | --- | --- | --- |"]
    children = []
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        if defaults is not None:
            value = getattr(defaults, name)
        elif field.default is PydanticUndefined and field.default_factory is None:
            value = PydanticUndefined
        else:
            value = field.get_default(call_default_factory=True)
        desc = " ".join((field.description or "").split()).replace("|", "\\|").replace("<", "&lt;")
        out.append(
            f"| `{name}` | {_type_name(field.annotation)} | {_default(field, value)} | {_bounds(field)} | {desc} |"
        )
        child = _nested(field.annotation)
        if child is not None:
            children.append((child, f"{path}.{name}" if path else name, value))
    out.append("")
    for child, child_path, value in children:
        _section(child, child_path, out, value if isinstance(value, BaseModel) else None)


def render() -> str:
    """The whole page, Markdown."""
    out = [INTRO]
    _section(AppConfig, "", out)
    return "\n".join(out).rstrip() + "\n"


def undocumented_fields(model: type[BaseModel] = AppConfig, path: str = "") -> list[str]:
    """Fields of the config models without a description (the page would have a blank cell)."""
    missing = []
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        if not (field.description or "").strip():
            missing.append(f"{path}{name}")
        child = _nested(field.annotation)
        if child is not None:
            missing += undocumented_fields(child, f"{path}{name}.")
    return missing


if __name__ == "__main__":
    sys.stdout.write(render())
