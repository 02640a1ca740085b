"""The repository reads as a product: the README and docs/ links resolve, docs/configuration.md
matches the config models, and no tracked file or path speaks of the project's build history
(that belongs in ``git log``)."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

from moa_serve.deployments.config_doc import render, undocumented_fields

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300

# a session of the project's own work named by its number, or an earlier/later one: a build log,
# not the product's own sessions (users' sessions are never numbered in prose)
HISTORY_TEXT = re.compile(r"\bsessions?[ -]\d+\b|\b(?:earlier|previous|prior|later|last) sessions?\b", re.IGNORECASE)
# path parts named by run or session: "s18", "side-by-side-s14", "sbs12b", "ablation-s12"
HISTORY_PATH = re.compile(r"(?:^|[-_.])(?:s|sbs|session)\d{1,3}[a-z]?(?:[-_.]|$)", re.IGNORECASE)
MD_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")

# A measured result in a comment or docstring (those belong in docs/benchmarks.md and benchmarks/;
# the code says what a setting does and links the benchmark): two figures compared with a unit
# ("N vs M ms", "N s instead of ~M ms"), a throughput ("N tok/s", "N training tokens/s"), a
# speed-up ("N.Nx", "N.N×", "Nx faster"), a timing something took ("took N ms", "near N ms"), a
# gain or cost in percent ("gained N-M %"), a timing on a named machine ("N ms on a 2-core host");
# test_measured_number_patterns_catch_what_they_are_for lists examples. Settings stay free: "timeout N s",
# "every N s instead of M s", "N x N tiles".
_NUM = r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?"
_TIME = r"(?:ms|µs|us)"
_VS = r"\s+(?:vs\.?|versus|against|instead of)\s+~?"
MEASURED = re.compile(
    "|".join(
        [
            rf"\d(?:\.\d+)?(?:\s*(?:{_TIME}|s|%|tok/s))?{_VS}{_NUM}\s*(?:{_TIME}|%|tok/s)(?!\w)",
            rf"\d(?:\.\d+)?\s*(?:{_TIME}|%|tok/s){_VS}\d",
            r"\d\s*(?:[a-z]+\s+)?(?:tok|tokens)/s(?!\w)",
            r"\d\.\d+[x×](?!\w)",
            r"\d\s*[x×]\s+(?:faster|slower|quicker|the speed|the throughput)",
            rf"\b(?:took|takes|take|taking|near|costs?|costing)\s+(?:about\s+|~)?{_NUM}\s*{_TIME}(?!\w)",
            rf"\b(?:gain(?:s|ed)?|costs?|lost|loses)\s+(?:about\s+|~)?{_NUM}\s*%",
            rf"\d\s*(?:{_TIME}|tok/s)(?!\w)[^.;]{{0,40}}\bon (?:a|an|one|this)\b[^.;]{{0,30}}"
            r"\b(?:EPYC|Xeon|H100|H200|A100|\d-core|cores?|host|CPU|GPU|vCPU)",
        ]
    ),
    re.IGNORECASE,
)
# where measured numbers live, and tests (whose scenarios are made of numbers)
NUMBERS_ALLOWED = ("benchmarks/", "tests/")
LOCAL_CPU_MAX_COMMENT_SHARE = 0.4


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [ROOT / p for p in out.decode().split("\0") if p]


def text_of(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_configuration_page_matches_the_config_models():
    assert undocumented_fields() == [], "every config field needs a description (deployments/config.py)"
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert page == render(), (
        "docs/configuration.md is stale: python -m moa_serve.deployments.config_doc > docs/configuration.md"
    )


def test_no_tracked_file_speaks_of_build_history():
    this = Path(__file__).resolve()
    hits = []
    for path in tracked_files():
        if path.resolve() == this or not path.is_file():
            continue
        text = text_of(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if HISTORY_TEXT.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert hits == [], "build history belongs in git log, not in the product:\n" + "\n".join(hits[:40])


def test_no_tracked_path_is_named_by_run_or_session():
    named = [
        str(p.relative_to(ROOT))
        for p in tracked_files()
        if any(HISTORY_PATH.search(part) for part in p.relative_to(ROOT).parts)
    ]
    assert named == []


def test_history_patterns_catch_what_they_are_for():
    n = 14  # the examples are built, so that this file does not read as what it forbids
    assert HISTORY_TEXT.search(f"measured in Session {n}") and HISTORY_TEXT.search("an earlier " + "session found")
    assert HISTORY_TEXT.search(f"the session-{n} drafters") and HISTORY_TEXT.search(f"sessions {n} and {n + 1}")
    assert not HISTORY_TEXT.search("16 sessions per round") and not HISTORY_TEXT.search("this session's tokens")
    assert HISTORY_PATH.search("side-by-side-s14") and HISTORY_PATH.search("s18") and HISTORY_PATH.search("sbs12b")
    assert not HISTORY_PATH.search("sessions.py") and not HISTORY_PATH.search("smollm2-135m-instruct")


def python_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of a Python file's comments and of its module, class and function docstrings."""
    out = []
    try:
        out += [
            (tok.start[0], tok.string)
            for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT
        ]
        tree = ast.parse(source)
    except (tokenize.TokenError, SyntaxError):
        return out
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                out += [(node.body[0].lineno + i, line) for i, line in enumerate(doc.splitlines())]
    return out


def yaml_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of a YAML file's comments (a ``#`` at a line's start or after a space)."""
    return [
        (n, m.group(1)) for n, line in enumerate(source.splitlines(), 1) if (m := re.search(r"(?:^|\s)#(.*)", line))
    ]


def c_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of a C file's comments."""
    out = []
    for m in re.finditer(r"/\*.*?\*/|//[^\n]*", source, re.DOTALL):
        first = source.count("\n", 0, m.start()) + 1
        out += [(first + i, line) for i, line in enumerate(m.group(0).splitlines())]
    return out


PROSE = {".py": python_prose, ".yaml": yaml_prose, ".yml": yaml_prose, ".c": c_prose, ".h": c_prose}


def test_no_measured_numbers_in_code_comments_or_config_comments():
    hits = []
    for path in tracked_files():
        rel = path.relative_to(ROOT).as_posix()
        if path.suffix not in PROSE or rel.startswith(NUMBERS_ALLOWED) or not path.is_file():
            continue
        for number, text in PROSE[path.suffix](path.read_text(encoding="utf-8")):
            if MEASURED.search(text):
                hits.append(f"{rel}:{number}: {text.strip()[:120]}")
    assert hits == [], (
        "measured figures belong in docs/benchmarks.md (and benchmarks/); say what the code or setting "
        "does and link the benchmark's section instead:\n" + "\n".join(hits[:40])
    )


def test_measured_number_patterns_catch_what_they_are_for():
    for measured in (
        "# 21 vs 27 ms at one user",
        "# 84 tok/s",
        "# 1.3x faster",
        "a matmul alone 1.5-3.9x float32's",
        "took 1.9-2.4 s instead of ~50 ms",
        "2.0 vs 1.0 ms on an AVX512-BF16 EPYC",
        "110 training tokens/s with a float32 target",
        "ours 1.61× llama.cpp",
        "~7x faster than repeat_interleave",
        "passive waiting keeps it near 75 ms",
        "a dynamic tree gained 5-6 % over 4G",
        "(~0.6 ms on a loaded 2-core host)",
    ):
        assert MEASURED.search(measured), measured
    for setting in (
        "# timeout 30 s",
        "metrics pushed every 0.5 s instead of 10 s",
        "128 x 128 x 64 tiles, 8 warps",
        "budget = memory_utilization 0.9 x 80 GiB",
        "aggregate tok/s per level",
        "retry after 2 s; a deadline of at least 15 s",
        "K split in two, four, ... (4x fewer bytes than float32)",
        "a delay of 10 ms each way",
    ):
        assert not MEASURED.search(setting), setting


def test_benchmark_sections_cited_in_code_and_configs_exist():
    sections = anchors(ROOT / "docs" / "benchmarks.md")
    broken = []
    for path in tracked_files():
        rel = path.relative_to(ROOT).as_posix()
        if path.suffix not in PROSE or not path.is_file():
            continue
        for anchor in re.findall(r"docs/benchmarks\.md#([\w-]+)", path.read_text(encoding="utf-8")):
            if anchor not in sections:
                broken.append(f"{rel}: docs/benchmarks.md#{anchor}")
    assert broken == []


def test_local_cpu_yaml_is_mostly_config():
    lines = (ROOT / "deployments" / "configs" / "local-cpu.yaml").read_text(encoding="utf-8").splitlines()
    comments = sum(1 for line in lines if line.lstrip().startswith("#"))
    assert comments <= LOCAL_CPU_MAX_COMMENT_SHARE * len(lines), (
        f"local-cpu.yaml: {comments} of {len(lines)} lines are comments; say why in a line and link "
        "docs/benchmarks.md, `moa config check` prints the arithmetic"
    )


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text))


def anchors(md: Path) -> set[str]:
    out = set()
    in_code = False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    for target in MD_LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert broken == []


def test_readme_is_short_and_the_license_is_there():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES
    assert "Apache License" in (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert (ROOT / "NOTICE").is_file()
    for page in (
        "architecture",
        "configuration",
        "client-server",
        "vllm-backend",
        "training",
        "kubernetes",
        "benchmarks",
        "security",
    ):
        assert f"docs/{page}.md" in readme, f"the README links docs/{page}.md"
