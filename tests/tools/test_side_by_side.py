"""loadtest/side_by_side.py's own logic (no server is started here)."""

from __future__ import annotations

import json

import pytest

from moa_serve.loadtest import side_by_side


def test_categories_keep_only_their_questions_in_order(tmp_path):
    src = tmp_path / "q.jsonl"
    rows = [
        {"question_id": i, "category": c, "turns": [f"q{i}"]}
        for i, c in enumerate(["writing", "rag", "qa", "summarization", "rag"])
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dst = side_by_side.questions_of(src, ["rag", "summarization"], tmp_path / "out.jsonl")
    assert [json.loads(ln)["question_id"] for ln in dst.read_text().splitlines()] == [1, 3, 4]
    with pytest.raises(ValueError, match="no question"):
        side_by_side.questions_of(src, ["coding"], tmp_path / "none.jsonl")


def test_an_environment_variable_goes_to_the_side_it_names(tmp_path):
    repo = side_by_side.repo_root()
    config = repo / "deployments" / "configs" / "local-cpu.yaml"
    a = side_by_side.build_parser(repo).parse_args(
        [
            "--ours",
            f"fast={config}",
            "--ours",
            f"plain={config}",
            "--ours-env",
            "fast:RAY_SERVE_THROUGHPUT_OPTIMIZED=1",
            "--ours-env",
            "fast:A=b=c",
            "--out",
            str(tmp_path),
        ]
    )
    sides = {s["label"]: s for s in side_by_side.build_sides(a, repo, tmp_path)}
    assert sides["ours/fast"]["env"]["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert sides["ours/fast"]["env_shown"]["A"] == "b=c"
    assert "A" not in sides["ours/plain"]["env_shown"]
    for bad in ("fast", "fast:X", ":X=1"):
        with pytest.raises(SystemExit):
            side_by_side.build_parser(repo).parse_args(["--ours-env", bad])
