"""deployments/fit.py's arithmetic against what a torch verifier replica really allocates."""

import json

import torch

from moa_serve.deployments import fit
from moa_serve.deployments.config import AppConfig
from moa_serve.model_files import read_config
from moa_serve.synthetic import SHAPES
from moa_serve.verifier.torch.runner import RunnerOptions, TorchTargetRunner

# Llama-3-8B's proportions (GQA 4:1, untied LM head) at a few layers and a narrow width
REDUCED = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 896,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _allocated(runner: TorchTargetRunner) -> int:
    """Bytes of the model's parameters and buffers (each storage once) and the KV cache."""
    seen, total = set(), 0
    for t in [*runner.model.parameters(), *runner.model.buffers(), runner.cache.k, runner.cache.v]:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _reduced_llama_config(tmp_path, monkeypatch) -> None:
    """The reduced Llama's config.json alone, as target "reduced-llama"."""
    model_dir = tmp_path / "reduced-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(REDUCED))
    monkeypatch.setenv("MOA_MODEL_DIR", str(tmp_path))


def test_fit_is_within_five_percent_of_what_the_runner_allocates(tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model_dir = tmp_path / "reduced-llama"
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in REDUCED.items() if k != "architectures"})).save_pretrained(
        model_dir
    )
    monkeypatch.setenv("MOA_MODEL_DIR", str(tmp_path))
    cfg = AppConfig.model_validate(
        {
            "target": "reduced-llama",
            "drafter": None,
            "dtype": "float32",
            "max_model_len": 256,
            "verifier_pool": {"max_sessions": 6},
            "router": {"max_sessions_per_round": 3, "session_groups": 2},
        }
    )
    shape = fit.target_shape(cfg)
    arithmetic = fit.verifier_fit(cfg, shape)
    runner = TorchTargetRunner(
        str(model_dir), "float32", "cpu", max_sessions=6, max_model_len=256, options=RunnerOptions(packed_weights="off")
    )
    # the GPU's fused q/k/v and gate/up projections are views of one weight each, not copies
    from moa_serve.model.layers import fuse_dense_projections

    assert fuse_dense_projections(runner.model.model.layers) == 2 * REDUCED["num_hidden_layers"]
    measured = _allocated(runner)
    predicted = arithmetic.weights + arithmetic.kv
    assert abs(measured - predicted) <= 0.05 * measured, (measured, predicted)


def test_a_gpu_verifier_counts_its_cuda_graph_pool(tmp_path, monkeypatch):
    _reduced_llama_config(tmp_path, monkeypatch)
    base = {
        "target": "reduced-llama",
        "drafter": None,
        "dtype": "bfloat16",
        "max_model_len": 256,
        "router": {"max_sessions_per_round": 3, "session_groups": 2},
        "verifier_pool": {"max_sessions": 6, "max_num_batched_tokens": 300},
    }
    gpu = AppConfig.model_validate(
        {
            **base,
            "device": "cuda",
            "verifier_pool": {**base["verifier_pool"], "gpu_memory_gb": 80, "ray_actor_options": {"num_gpus": 1}},
        }
    )
    cpu = AppConfig.model_validate(base)
    shape = fit.target_shape(gpu)
    pool = fit.graph_pool_bytes(gpu, shape)
    assert fit.graph_pool_bytes(cpu, shape) == 0
    # the largest graph is 256 rows (the largest size within the 300-token budget); its chunked
    # attention keeps float32 (head_dim + 2) per row, KV head, chunk (257 positions: 2 of 256) and
    # query head of a KV head
    scratch = 256 * 2 * 2 * 4 * (32 + 2) * 4
    assert pool == 256 * (3 * 896 + (256 + 2 * 64) + 256 + 5 * 256) * 2 + scratch
    assert fit.verifier_fit(gpu, shape).activations == 300 * 2048 * 4 + pool
    # at Llama-3-8B's width the narrow matmuls split K: their float32 partials are in the pool too
    import pytest

    pytest.importorskip("triton")
    wide = fit.ModelShape.from_hf(read_config(SHAPES / "llama-3-8b-shape"))  # Llama-3-8B
    assert (wide.hidden, wide.heads, wide.kv_heads, wide.head_dim, wide.intermediate) == (4096, 32, 8, 128, 14336)
    base_row = (3 * 14336 + 6144 + 4096 + 5 * 4096) * 2
    wide_scratch = 256 * 8 * 2 * 4 * (128 + 2) * 4
    # q/k/v: 4 ranges of 6,144 columns
    assert fit.graph_pool_bytes(gpu, wide) == 256 * (base_row + 4 * 4 * 6144) + wide_scratch


def test_a_vllm_verifier_counts_the_hidden_states_an_eagle_drafter_keeps_in_its_forward(tmp_path, monkeypatch):
    """Backend vllm keeps an EAGLE-style drafter's final hidden states inside the forward, one
    step's tokens, counted with the verifier's activations; a MoA drafter's K/V come from the paged
    cache (nothing kept), and nothing is kept without a drafter."""
    _reduced_llama_config(tmp_path, monkeypatch)
    base = {
        "target": "reduced-llama",
        "backend": "vllm",
        "dtype": "float32",
        "max_model_len": 256,
        "router": {"max_sessions_per_round": 3, "session_groups": 1},
        "verifier_pool": {"max_sessions": 3, "max_num_batched_tokens": 300},
    }
    plain = AppConfig.model_validate({**base, "drafter": None})
    moa = AppConfig.model_validate({**base, "drafter": "smollm2-135m-instruct-moa"})
    eagle = AppConfig.model_validate({**base, "drafter": "smollm2-135m-instruct-eagle"})
    shape = fit.target_shape(plain)
    assert fit.kept_feature_bytes(plain, shape) == 0
    assert fit.kept_feature_bytes(moa, shape) == 0  # its K/V are read from vLLM's paged cache
    kept = fit.kept_feature_bytes(eagle, shape)
    assert kept == 300 * shape.hidden * 4  # tokens x hidden x float32
    assert fit.verifier_fit(eagle, shape).activations == fit.verifier_fit(plain, shape).activations + kept
