"""``moa fidelity``: the divergence arithmetic, perplexity against transformers' own loss, and the
command end to end on stories260k (no GGUF: every precision is float32 there, so all agree)."""

import math

import pytest
import torch

from moa_serve.cli import main
from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.measure.fidelity_run import agreement, first_divergence, score_text
from tests.support.moa_command import run_for_json, write_questions


def test_first_divergence_and_agreement():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert first_divergence([5, 2], [1, 2]) == 0
    assert first_divergence([1, 2, 3], [1, 2]) == 2 and first_divergence([1, 2], [1, 2, 3]) == 2  # one stopped early
    a = agreement(
        [[1, 2, 3, 4], [1, 2, 3, 4], [7, 7, 7, 7], [1, 1]], [[1, 2, 3, 4], [1, 9, 3, 4], [7, 7, 7, 0], [2, 1]]
    )
    assert a["identical"] == 1 and a["prompts"] == 4 and a["first_divergence"] == [None, 1, 3, 0]
    assert a["mean_first_divergence"] == round(4 / 3, 2) and a["median_first_divergence"] == 1
    assert a["mean_agreeing_prefix"] == (4 + 1 + 3 + 0) / 4


def test_perplexity_is_the_targets_own_loss(stories_path):
    """The summed NLL of a text from the verifier's forward equals transformers' loss on the same
    weights (mean over the predicted tokens)."""
    from transformers import AutoModelForCausalLM

    engine = SpeculativeEngine.load(str(stories_path), None, "float32", max_sessions=1, max_model_len=256)
    ids = engine.tokenizer.encode(
        "Once upon a time, there was a little girl named Lily. She loved to play outside "
        "with her dog Max. One day, they found a big red ball in the park."
    )
    nll, top1 = score_text(engine, ids)
    hf = AutoModelForCausalLM.from_pretrained(str(stories_path), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([ids]), labels=torch.tensor([ids]))
    assert nll / (len(ids) - 1) == pytest.approx(out.loss.item(), rel=1e-4)
    assert top1 == out.logits[0, :-1].argmax(-1).tolist()
    with pytest.raises(ValueError, match="needs 2..256 tokens"):
        score_text(engine, ids[:1])


@pytest.mark.slow
def test_fidelity_command_on_stories260k(tmp_path, stories_path):
    q = tmp_path / "q.jsonl"
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["Once upon a time"]},
        {"question_id": 2, "category": "writing", "turns": ["Lily had a dog"]},
        {"question_id": 3, "category": "summarization", "turns": ["Tom went to the park. He saw a big tree."]},
        {"question_id": 4, "category": "summarization", "turns": ["The sun was hot. Sue and Ben played in the sand."]},
        {"question_id": 5, "category": "rag", "turns": ["A cat sat on a mat. The cat was happy and sleepy."]},
    ]
    write_questions(q, rows)
    out = tmp_path / "f" / "fidelity.json"
    r = run_for_json(
        [
            "fidelity",
            "--target",
            str(stories_path),
            "--questions",
            str(q),
            "--per-category",
            "1",
            "--max-new-tokens",
            "8",
            "--ppl-texts",
            "2",
            "--ppl-tokens",
            "32",
            "--max-model-len",
            "128",
        ],
        out,
    )
    cfg = r["config"]
    # greedy prompts: one per category; perplexity texts: summarization / rag ones not among them
    assert cfg["greedy_prompts"] == [1, 3, 5] and cfg["ppl_texts"] == [4]
    assert [run["matmul_precision"] for run in r["runs"]] == ["highest", "low", "medium"]
    ref = r["runs"][0]
    assert math.isfinite(ref["perplexity"]) and ref["perplexity"] > 1 and ref["scored_tokens"] > 5
    for run in r["runs"]:  # no GGUF: nothing is packed, every precision computes the same
        assert run["greedy"]["identical"] == 3 and run["greedy"]["mean_first_divergence"] is None
        assert run["perplexity"] == ref["perplexity"] and run["top1_same_as_reference"] == 1.0
        assert len(run["tokens"]) == 3 and all(len(t) == 8 or t[-1] in (1, 2) for t in run["tokens"])
    assert "| `low` | 3 / 3 |" in out.with_suffix(".md").read_text()
    assert (
        main(
            [
                "fidelity",
                "--target",
                str(stories_path),
                "--questions",
                str(q),
                "--precisions",
                "low,medium",
                "--out",
                str(tmp_path / "x.json"),
            ]
        )
        == 2
    )  # no reference
