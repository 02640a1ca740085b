"""The shape of the code, kept: no import circle among the project's modules (function-local
imports included), drafter/ and verifier/ never import each other, the runtime never imports the
tools, imports at the top of each module (a few guarded ones aside), no function over 120 lines,
no constructor over 12 parameters."""

from __future__ import annotations

import ast
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the repository's top-level folders installed under moa_serve (pyproject.toml's package-dir)
INSTALLED_AS = {
    "app": "moa_serve.app",
    "deployments": "moa_serve.deployments",
    "drafter": "moa_serve.drafter",
    "verifier": "moa_serve.verifier",
    "loadtest": "moa_serve.loadtest",
}
PACKAGES = {"moa_serve", *INSTALLED_AS}
MAX_LOCAL_IMPORTS = 20  # function-local imports of the project's own modules, in all
MAX_FUNCTION_LINES = 120
MAX_INIT_PARAMS = 8


def module_name(path: str) -> str:
    top = path.split("/")[0]
    if top in INSTALLED_AS:
        path = INSTALLED_AS[top] + path[len(top) :]
    name = path[:-3].replace("/", ".")
    return name.removesuffix(".__init__")


@pytest.fixture(scope="module")
def modules() -> dict[str, ast.Module]:
    files = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    return {module_name(f): ast.parse((REPO / f).read_text(), f) for f in files if f.split("/")[0] in PACKAGES}


def imported(node: ast.Import | ast.ImportFrom, name: str, is_package: bool, known) -> list[str]:
    """The project modules an import statement of module ``name`` reads."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = (name if is_package else name.rpartition(".")[0]).split(".")
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = []
    for t in targets:
        while t and t not in known:
            t = t.rpartition(".")[0]
        if t and t != name:
            out.append(t)
    return out


@pytest.fixture(scope="module")
def imports(modules) -> tuple[dict[str, set[str]], list[tuple[str, int]]]:
    """(module -> the project modules it imports anywhere, the function-local imports)."""
    graph, local = defaultdict(set), []
    for name, tree in modules.items():
        is_package = name == "moa_serve" or any(m.startswith(name + ".") for m in modules)
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)) and imported(node, name, is_package, modules):
                        local.append((name, node.lineno))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name].update(imported(node, name, is_package, modules))
    return graph, sorted(set(local))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles(imports):
    graph, _ = imports
    assert cycles(graph) == []


def test_drafter_and_verifier_meet_only_in_the_protocol_module(imports):
    graph, _ = imports
    crossing = [
        (a, b)
        for a, bs in graph.items()
        for b in bs
        if (a.startswith("moa_serve.drafter") and b.startswith("moa_serve.verifier"))
        or (a.startswith("moa_serve.verifier") and b.startswith("moa_serve.drafter"))
    ]
    assert crossing == []


def test_the_runtime_never_imports_the_tools(imports):
    graph, _ = imports
    runtime = (
        "moa_serve.engine",
        "moa_serve.drafter",
        "moa_serve.verifier",
        "moa_serve.deployments",
        "moa_serve.app",
        "moa_serve.client_server",
        "moa_serve.client.",
    )
    uses = [
        (a, b)
        for a, bs in graph.items()
        for b in bs
        if a.startswith(runtime)
        and a != "moa_serve.client.cli"
        and (b in ("moa_serve.cli", "moa_serve.cli_args") or b.startswith(("moa_serve.commands", "moa_serve.loadtest")))
    ]
    assert uses == []


def test_vllm_is_a_room_of_the_verifier(modules):
    """vLLM is imported only by the vLLM backend's package (``verifier/vllm/``) and the benchmark
    that runs it; the verifier's top level holds what both backends share, and each backend is a
    package of its own (``verifier/torch/``, ``verifier/vllm/``)."""

    def imports_vllm(tree: ast.Module) -> bool:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "vllm" for a in node.names):
                return True
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "vllm":
                return True
        return False

    allowed = ("moa_serve.verifier.vllm.", "moa_serve.measure.vllm_bench_run")
    assert [name for name, tree in modules.items() if imports_vllm(tree) and not name.startswith(allowed)] == []
    top = sorted(p.stem for p in (REPO / "verifier").glob("*.py"))
    assert top == ["__init__", "acceptance", "api", "logprobs"]
    assert sorted(p.name for p in (REPO / "verifier").iterdir() if (p / "__init__.py").exists()) == ["torch", "vllm"]


def test_imports_at_the_top(imports):
    _, local = imports
    assert len(local) <= MAX_LOCAL_IMPORTS, local


def test_no_long_functions_no_long_constructors(modules):
    long, wide = [], []
    for name, tree in modules.items():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES:
                    long.append((name, fn.name, fn.end_lineno - fn.lineno + 1))
                a = fn.args
                if fn.name == "__init__" and len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) - 1 > MAX_INIT_PARAMS:
                    wide.append((name, fn.lineno))
    assert long == [] and wide == []
