"""`moa generate` / `moa drafter init`: outputs and clear errors for bad arguments."""

import json

import pytest

from moa_serve.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def generate_json(capsys, target, drafter, max_new_tokens: int, *extra) -> dict:
    """``moa generate --json`` from "Once upon a time"; it exits 0."""
    code, out, _ = run(
        capsys,
        "generate",
        "--target",
        str(target),
        "--drafter",
        str(drafter),
        "--prompt",
        "Once upon a time",
        "--max-new-tokens",
        str(max_new_tokens),
        "--json",
        *extra,
    )
    assert code == 0
    return json.loads(out)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, stories_path):
    out = tmp_path_factory.mktemp("cli") / "d"
    assert main(["drafter", "init", "--target", str(stories_path), "--out", str(out), "--seed", "3"]) == 0
    return out


def test_generate_json_identical_with_and_without_drafter(capsys, stories_path, drafter_dir):
    results = []
    for d in ["none", str(drafter_dir)]:
        results.append(generate_json(capsys, stories_path, d, 16))
    for r in results:
        assert {"text", "token_ids", "num_tokens", "rounds", "mean_accepted_length", "tokens_per_s"} <= set(r)
        assert r["num_tokens"] == len(r["token_ids"]) > 0
    assert results[0]["token_ids"] == results[1]["token_ids"]
    assert results[0]["rounds"] == results[0]["num_tokens"]  # plain decoding: one token per round


def test_generate_with_tree_drafts_gives_the_same_tokens(capsys, stories_path, drafter_dir):
    outs = []
    for shape in ("chain", "4-2", "8-3-2@0.01"):
        outs.append(generate_json(capsys, stories_path, drafter_dir, 24, "--branching", shape))
    assert [o["branching"] for o in outs] == ["chain", "4-2", "8-3-2@0.01"]
    assert outs[0]["token_ids"] == outs[1]["token_ids"] == outs[2]["token_ids"]
    code, _, err = run(
        capsys, "generate", "--target", str(stories_path), "--drafter", "lookup", "--prompt", "hi", "--branching", "4-2"
    )
    assert code == 2 and "--branching" in err and "chains only" in err


@pytest.mark.parametrize(
    "args, field",
    [
        (["-k", "0"], "--num-speculative-tokens"),
        (["--temperature", "-0.5"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--branching", "4-0"], "--branching"),
    ],
)
def test_bad_arguments_name_the_field(capsys, stories_path, args, field):
    code, _, err = run(capsys, "generate", "--target", str(stories_path), "--drafter", "none", "--prompt", "hi", *args)
    assert code == 2 and field in err


def test_unknown_model_is_a_clear_error(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--target", str(tmp_path / "nope"), "--drafter", "none", "--prompt", "x")
    assert code == 2 and "not found" in err and "nope" in err


def test_prompt_longer_than_context(capsys, stories_path):
    code, _, err = run(
        capsys,
        "generate",
        "--target",
        str(stories_path),
        "--drafter",
        "none",
        "--max-model-len",
        "32",
        "--prompt",
        "Once upon a time " * 20,
    )
    assert code == 2 and "--prompt" in err and "context" in err


def test_drafter_for_another_target_is_refused(capsys, tiny_model, drafter_dir):
    code, _, err = run(capsys, "generate", "--target", str(tiny_model), "--drafter", str(drafter_dir), "--prompt", "x")
    assert code == 2 and "another target" in err
