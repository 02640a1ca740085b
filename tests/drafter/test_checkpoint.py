"""Drafter checkpoint layouts: one saved the way the HEBO reference saves it loads (sizes read off
the tensors, inconsistent sizes refused), and our own round-trips, target layer inference included.
(``target``: tests/drafter/conftest.py.)"""

import json

import pytest
import torch
from safetensors.torch import save_file

from moa_serve.drafter.checkpoint import load_drafter, save_drafter
from moa_serve.drafter.config import DrafterConfig
from moa_serve.drafter.moa_model import MoADrafter, init_weights
from moa_serve.drafter.proposer import MoAProposer
from moa_serve.model.target import TargetArch
from moa_serve.model_files import read_config
from moa_serve.protocol import DraftRequest


def test_reference_layout_checkpoint_loads(tmp_path, stories_path):
    """A checkpoint written the way the HEBO reference saves it: the target's HF config as
    config.json (+ the sizes it was built with), weights under the reference's key names."""
    hf_cfg = json.loads((stories_path / "config.json").read_text())
    arch = TargetArch.from_hf_config(read_config(stories_path))
    cfg = DrafterConfig(
        target=arch,
        layer_self_attention_num_key_value_heads=2,
        layer_self_attention_intermediate_size=96,
        self_attention_num_key_value_heads=2,
        self_attention_intermediate_size=80,
        cross_attention_num_key_value_heads=8,
        cross_attention_intermediate_size=120,
    )
    moa = MoADrafter(cfg)
    init_weights(moa, seed=5)
    state = moa.flat_state_dict()
    keys = set(state)
    assert {
        "layer_self_attention.self_attn.q_proj.weight",
        "layer_self_attention.mlp.gate_proj.weight",
        "self_attention.input_layernorm.weight",
        "cross_attention.self_attn.k_proj.weight",
        "cross_attention.post_attention_layernorm.weight",
        "Ekv2E.weight",
        "Ekv2E.bias",
    } <= keys
    assert not any(k.startswith(("model.", "lm_head", "embed")) for k in keys)  # no target weights
    ref = dict(state)
    ref["self_attention.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # older transformers stored it
    save_file({k: v.contiguous() for k, v in ref.items()}, str(tmp_path / "model.safetensors"))
    hf_cfg.update(
        {
            "layer_self_attention_num_key_value_heads": 2,
            "self_attention_intermediate_size": 80,
            "target_layer_inference": 1,
        }
    )
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    loaded_cfg, loaded = load_drafter(str(tmp_path))
    assert loaded_cfg.layer_self_attention_num_key_value_heads == 2
    assert loaded_cfg.layer_self_attention_intermediate_size == 96  # read off the tensors
    assert loaded_cfg.cross_attention_num_key_value_heads == 8
    assert loaded_cfg.target_layer_inference == 1
    assert loaded_cfg.target == arch
    again = MoADrafter(loaded_cfg)
    again.load_flat_state_dict(loaded)
    assert all(torch.equal(again.flat_state_dict()[k], state[k]) for k in state)
    # inconsistent sizes are refused
    hf_cfg["cross_attention_num_key_value_heads"] = 4
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    with pytest.raises(ValueError, match="cross_attention_num_key_value_heads"):
        load_drafter(str(tmp_path))


def test_our_checkpoint_roundtrip_and_tli(tmp_path, stories_path, target):
    cfg = DrafterConfig(target=target.arch, target_layer_inference=1)
    moa = MoADrafter(cfg)
    init_weights(moa, seed=2)
    save_drafter(tmp_path, cfg, moa.flat_state_dict())
    cfg2, state = load_drafter(str(tmp_path))
    assert cfg2 == cfg
    proposer = MoAProposer.load(str(tmp_path), target_model=target, max_sessions=1, max_model_len=64)
    (res,) = proposer.propose([DraftRequest("t", list(range(30, 45)), 4, 0, torch.randn(14, cfg.feature_dim))])
    assert len(res.drafts) == 4 and all(0 <= t < 512 for t in res.drafts)
