"""The synthetic target (``load_format: dummy``): a config.json's architecture with random weights,
asked for explicitly, said so where users look, refused beside a trained drafter."""

import json

import pytest
import torch

from moa_serve.deployments.config import AppConfig
from moa_serve.model_files import load_tokenizer, resolve_model_path
from moa_serve.synthetic import describe
from moa_serve.verifier.torch.runner import RunnerOptions, TorchTargetRunner


@pytest.fixture
def shape_only(tmp_path, stories_path):
    """stories260k's config.json alone: no weights, no tokenizer."""
    (tmp_path / "config.json").write_text((stories_path / "config.json").read_text())
    return tmp_path


def test_a_config_alone_serves_random_weights_with_a_word_tokenizer(shape_only):
    runner = TorchTargetRunner(str(shape_only), "float32", "cpu", 2, 64, options=RunnerOptions(load_format="dummy"))
    assert runner.packing["reason"] == describe("dummy")
    assert runner.model.arch.vocab_size == 512 and torch.isfinite(runner.model.lm_head.weight).all()
    tok = load_tokenizer(shape_only, "dummy")
    assert len(tok) == 512 and tok.encode("<5> <7> unknown") == [5, 7, 0]
    assert tok.decode([5, 7]) == "<5> <7>"
    with pytest.raises(Exception):
        TorchTargetRunner(str(shape_only), "float32", "cpu", 2, 64)  # weights are never made up unasked


def test_the_shipped_shape_is_llama3_8b():
    path = resolve_model_path("llama-3-8b-shape", weights=False)
    c = json.loads((path / "config.json").read_text())
    assert (c["vocab_size"], c["hidden_size"], c["num_hidden_layers"], c["num_key_value_heads"]) == (
        128256,
        4096,
        32,
        8,
    )


def test_only_with_no_trained_drafter():
    base = {"target": "stories260k", "load_format": "dummy", "router": {"session_groups": 1}}
    assert AppConfig.model_validate({**base, "drafter": None}).load_format == "dummy"
    assert AppConfig.model_validate({**base, "drafter": "lookup"}).drafter == "lookup"
    with pytest.raises(ValueError, match="load_format dummy with drafter"):
        AppConfig.model_validate({**base, "drafter": "smollm2-135m-instruct-moa"})
    with pytest.raises(ValueError, match="synthetic target runs on backend torch"):
        AppConfig.model_validate({**base, "backend": "vllm"})
    assert AppConfig.model_validate({**base, "load_format": "auto"}).load_format == "auto"


def test_moa_generate_takes_load_format_dummy(shape_only, capsys):
    from moa_serve import cli

    argv = ["generate", "--target", str(shape_only), "--drafter", "none", "--max-new-tokens", "4", "--json"]
    assert cli.main([*argv, "--prompt", "<3> <4>", "--load-format", "dummy", "--ignore-eos"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["weights"] == describe("dummy") and len(out["token_ids"]) == 4
    assert cli.main(["generate", "--target", str(shape_only), "--prompt", "x", "--load-format", "dummy"]) == 2
    assert "--load-format dummy: a synthetic target drafts with --drafter none or lookup" in capsys.readouterr().err
