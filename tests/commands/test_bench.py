"""``moa bench`` end to end on stories260k: JSON keys, markdown, chart, greedy identity in float32."""

import pytest

from moa_serve.cli import main
from tests.support.moa_command import run_for_json, write_questions


@pytest.mark.slow
def test_bench_writes_results(tmp_path, stories_path, stories_drafter):
    q = write_questions(
        tmp_path / "q.jsonl",
        [
            {"question_id": 1, "category": "writing", "turns": ["Once upon a time", "Then what happened?"]},
            {"question_id": 2, "category": "qa", "turns": ["Lily had a dog"]},
        ],
    )
    out = tmp_path / "r" / "results.json"
    r = run_for_json(
        [
            "bench",
            "--target",
            str(stories_path),
            "--drafter",
            str(stories_drafter),
            "--questions",
            str(q),
            "--max-new-tokens",
            "16",
            "--num-speculative-tokens",
            "3",
            "--dtype",
            "float32",
        ],
        out,
    )
    for key in ("mean_accepted_length", "speedup", "greedy_identical_fraction", "per_category"):
        assert key in r
    assert r["greedy_identical_fraction"] == 1.0
    assert set(r["per_category"]) == {"writing", "qa"}
    assert r["mean_accepted_length"] >= 1.0
    van, spec = r["runs"]
    assert van["draft_ms_per_round"] == 0 < van["verify_ms_per_round"]  # vanilla never drafts
    assert spec["draft_ms_per_round"] > 0 and spec["verify_ms_per_round"] > 0
    assert out.with_suffix(".md").read_text().count("|") > 10
    assert out.with_suffix(".png").stat().st_size > 1000


def test_drafter_labels_tell_same_named_checkpoints_apart():
    from moa_serve.measure.spec_bench_run import drafter_labels

    labels = drafter_labels(
        ["drafter/checkpoints/x-moa", "runs/A/export/x-moa", "runs/B/export/x-moa", "lookup", "hybrid:x-moa", "x-eagle"]
    )
    assert labels == {
        "drafter/checkpoints/x-moa": "checkpoints/x-moa",
        "runs/A/export/x-moa": "A/export/x-moa",
        "runs/B/export/x-moa": "B/export/x-moa",
        "lookup": "lookup",
        "hybrid:x-moa": "hybrid:x-moa",
        "x-eagle": "x-eagle",
    }
    assert len(set(labels.values())) == len(labels)
    with pytest.raises(ValueError, match="given twice"):
        drafter_labels(["x-moa", "x-moa"])
    # a hybrid of a path keeps its prefix in front of the checkpoint's short name
    assert drafter_labels(["drafter/checkpoints/x-moa", "hybrid:drafter/checkpoints/x-moa"]) == {
        "drafter/checkpoints/x-moa": "x-moa",
        "hybrid:drafter/checkpoints/x-moa": "hybrid:x-moa",
    }
    assert drafter_labels(["lookup+outputs", "hybrid+outputs:drafter/checkpoints/x-moa"]) == {
        "lookup+outputs": "lookup+outputs",
        "hybrid+outputs:drafter/checkpoints/x-moa": "hybrid+outputs:x-moa",
    }


def test_bench_system_prompt_default_needs_a_template_that_has_one(tmp_path, stories_path, capsys):
    """--system-prompt default renders prompts as served chat requests are (the template's default
    system prompt); a target whose tokenizer has no such template is refused, naming the option."""
    q = write_questions(tmp_path / "q.jsonl", [{"question_id": 1, "category": "qa", "turns": ["Lily had a dog"]}])
    rc = main(
        [
            "bench",
            "--target",
            str(stories_path),
            "--drafter",
            "lookup",
            "--questions",
            str(q),
            "--max-new-tokens",
            "4",
            "--dtype",
            "float32",
            "--system-prompt",
            "default",
            "--out",
            str(tmp_path / "r.json"),
        ]
    )
    assert rc == 2 and "--system-prompt default" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_the_vllm_backend_refuses_the_output_store_by_name():
    import argparse

    from moa_serve.measure.spec_bench_run import _build_vllm_engines

    args = argparse.Namespace(
        drafter="lookup+outputs",
        branching="chain",
        dtype="float32",
        device="cpu",
        max_model_len=512,
        target="x",
        num_speculative_tokens="4",
    )
    with pytest.raises(ValueError, match=r"'\+outputs'.*torch backend only"):
        _build_vllm_engines(args)
