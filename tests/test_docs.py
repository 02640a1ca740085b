"""The repository reads as a product: the README and docs/ links resolve, docs/configuration.md
matches the config models, and no tracked file or path speaks of the project's build history
(that belongs in ``git log``)."""

from __future__ import annotations

import re
import subprocess
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
