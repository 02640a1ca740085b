"""Verifier KV rollback, the drafter's bounded mask, incremental vs parallel drafting, and
checkpoint layouts."""

import json

import pytest
import torch
from safetensors.torch import save_file

from moa_serve.drafter.checkpoint import load_drafter, save_drafter
from moa_serve.drafter.config import DrafterConfig
from moa_serve.drafter.model import MoADrafter, TargetParts, init_weights
from moa_serve.drafter.proposer import MoAProposer
from moa_serve.kv_cache import PackedBatch
from moa_serve.model_files import load_state_dict, read_config
from moa_serve.protocol import DraftRequest, VerifyRequest
from moa_serve.target_model import TargetArch, TargetModel
from moa_serve.verifier.torch_runner import TorchTargetRunner


@pytest.fixture(scope="module")
def target(stories_path):
    return TargetModel.from_state_dict(read_config(stories_path), load_state_dict(stories_path), torch.float32)


def test_logits_match_transformers(stories_path, target):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(stories_path), dtype=torch.float32).eval()
    toks = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache(2, 64)
    slot = cache.allocate()
    with torch.no_grad():
        ours = target.lm_head(target.forward_packed(toks[0], PackedBatch(cache, [slot], [0], [30])))[None]
        ref = hf(toks).logits
    assert torch.allclose(ours, ref, atol=1e-4)


def test_kv_rollback_after_rejected_drafts(target):
    runner = TorchTargetRunner("unused", model=target, max_sessions=2, max_model_len=128)
    prompt = list(range(3, 20))
    (r0,) = runner.verify([VerifyRequest("a", prompt)])
    committed = prompt + r0.tokens
    wrong = [(r0.tokens[0] + 7) % 512, 11, 12]  # the first draft is wrong: everything rolls back
    (r1,) = runner.verify([VerifyRequest("a", committed, wrong)])
    assert r1.num_accepted == 0 and len(r1.tokens) == 1
    slot = runner.sessions["a"].slot
    assert int(runner.cache.lengths[slot]) == len(committed)  # the drafts' K/V are not kept
    fresh = TorchTargetRunner("unused", model=target, max_sessions=1, max_model_len=128)
    fresh.verify([VerifyRequest("b", committed + r1.tokens)])
    fs = fresh.sessions["b"].slot
    n = len(committed)
    assert torch.allclose(runner.cache.k[:, slot, :, :n], fresh.cache.k[:, fs, :, :n], atol=1e-5)
    # the next round continues exactly as a fresh session would
    (r2,) = runner.verify([VerifyRequest("a", committed + r1.tokens)])
    (f2,) = fresh.verify([VerifyRequest("b", committed + r1.tokens)])
    assert r2.tokens == f2.tokens


def test_verifier_reprefills_a_session_it_does_not_hold(target):
    a = TorchTargetRunner("unused", model=target, max_sessions=2, max_model_len=128)
    b = TorchTargetRunner("unused", model=target, max_sessions=2, max_model_len=128)
    toks = list(range(5, 25))
    (ra,) = a.verify([VerifyRequest("s", toks)])
    (ra2,) = a.verify([VerifyRequest("s", toks + ra.tokens)])
    (rb,) = b.verify([VerifyRequest("s", toks + ra.tokens)])  # another replica: full prefill
    assert ra2.tokens == rb.tokens and rb.num_computed == len(toks) + 1


def _bounded_mask(visible: torch.Tensor) -> torch.Tensor:
    """Position i sees features of positions j <= start_i, start_i = last visible position <= i."""
    s = visible.shape[-1]
    idx = torch.arange(s)
    start = torch.cummax(torch.where(visible, idx, torch.zeros_like(idx)), -1).values
    return ((idx[None, :] <= start[..., :, None]) & (idx[None, :] <= idx[:, None]))[:, None]


def test_bounded_mask_hides_unverified_features(stories_path, target):
    cfg = DrafterConfig(target=target.arch)
    moa = MoADrafter(cfg)
    init_weights(moa, seed=0)
    parts = TargetParts(target, 0)
    s = 24
    tokens = torch.randint(0, 512, (1, s), generator=torch.Generator().manual_seed(1))
    feats = torch.randn(1, s, cfg.feature_dim)
    visible = torch.zeros(1, s, dtype=torch.bool)
    visible[0, :8] = True  # the prompt
    visible[0, 15] = True  # a cut of the variable future length
    ca = _bounded_mask(visible)
    sa = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    pos = torch.arange(s)[None]
    with torch.no_grad():
        out, _ = moa.draft_head.forward_parallel(parts, tokens, feats, pos, sa, ca)
        changed = feats.clone()
        changed[0, 8:15] += 5.0  # features the positions 8..14 must not see
        changed[0, 16:] -= 3.0
        out2, _ = moa.draft_head.forward_parallel(parts, tokens, changed, pos, sa, ca)
    assert torch.allclose(out[0, :15], out2[0, :15], atol=1e-5)
    assert not torch.allclose(out[0, 16:], out2[0, 16:])  # later positions do see fresh features


def _teacher_forced_drafts(moa, target, committed, drafts, feats, ca_mask_of) -> list[int]:
    """The greedy tokens the teacher-forced pass gives at the drafting positions, the features of
    the committed positions but the last visible (``ca_mask_of(visible)`` builds the CA mask)."""
    n = len(committed) - 1
    seq = committed + drafts[:-1]
    s = len(seq)
    visible = torch.zeros(1, s, dtype=torch.bool)
    visible[0, :n] = True
    allf = torch.cat([feats, torch.zeros(s - n, feats.shape[-1])])[None]
    sa = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        h, _ = moa.draft_head.forward_parallel(
            TargetParts(target, 0), torch.tensor([seq]), allf, torch.arange(s)[None], sa, ca_mask_of(visible)
        )
        return target.lm_head(h[0, n:]).argmax(-1).tolist()


def test_incremental_drafting_equals_parallel_pass(stories_path, stories_drafter, target):
    """The proposer's cached drafting computes what the teacher-forced pass computes with the
    bounded mask (position n sees features of 0..n-1)."""
    proposer = MoAProposer.load(str(stories_drafter), target_model=target, max_sessions=2, max_model_len=64)
    cfg, state = load_drafter(str(stories_drafter))
    moa = MoADrafter(cfg)
    moa.load_flat_state_dict(state)
    committed = list(range(40, 60))
    n = len(committed) - 1
    feats = torch.randn(n, cfg.feature_dim)
    (res,) = proposer.propose([DraftRequest("x", tokens=committed, num_drafts=3, feature_start=0, features=feats)])
    assert _teacher_forced_drafts(moa, target, committed, res.drafts, feats, _bounded_mask) == res.drafts


def test_latest_only_drafter_reads_only_its_freshest_feature(tmp_path, stories_path, stories_drafter, target):
    """cross_attention_latest_only (with a value readout): the proposer's cached drafting equals the
    teacher-forced pass with the latest-only mask, and its drafts ignore every feature but the
    last verified position's."""
    import dataclasses

    from moa_serve.drafter.training import masks

    cfg, state = load_drafter(str(stories_drafter))
    cfg = dataclasses.replace(cfg, cross_attention_latest_only=True, value_readout_layers=2)
    moa = MoADrafter(cfg)
    init_weights(moa, seed=3)
    moa.load_flat_state_dict({k: v for k, v in state.items() if not k.startswith("draft_vocab")}, new_readout=True)
    folder = save_drafter(tmp_path / "latest", cfg, moa.flat_state_dict())
    committed = list(range(40, 60))
    n = len(committed) - 1
    feats = torch.randn(n, cfg.feature_dim, generator=torch.Generator().manual_seed(1))

    def drafts(features):
        proposer = MoAProposer.load(str(folder), target_model=target, max_sessions=2, max_model_len=64)
        (res,) = proposer.propose(
            [DraftRequest("x", tokens=committed, num_drafts=3, feature_start=0, features=features)]
        )
        return res.drafts

    got = drafts(feats)
    assert _teacher_forced_drafts(moa, target, committed, got, feats, masks.latest_cross_mask) == got
    changed_last = []
    for seed in range(4):
        gen = torch.Generator().manual_seed(10 + seed)
        older = feats.clone()
        older[:-1] = 5 * torch.randn(n - 1, cfg.feature_dim, generator=gen)
        assert drafts(older) == got  # only the last verified feature counts
        fresher = feats.clone()
        fresher[-1] = 20 * torch.randn(cfg.feature_dim, generator=gen)
        changed_last.append(drafts(fresher) != got)
    assert any(changed_last)  # and it does count


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


def test_hub_download_fetches_only_what_is_loaded(tmp_path, monkeypatch):
    """A hub id that is not local is fetched with file patterns: safetensors weights (no .bin /
    ONNX / GGUF duplicates) for model replicas, config + tokenizer only for the router."""
    import huggingface_hub

    from moa_serve import model_files as models

    calls = []

    def fake_snapshot(repo_id, allow_patterns=None, **kw):
        calls.append(allow_patterns)
        (tmp_path / "config.json").write_text("{}")
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    monkeypatch.setenv("MOA_MODEL_DIR", str(tmp_path / "nothing-here"))
    assert models.resolve_model_path("some-org/some-model") == tmp_path
    assert models.resolve_model_path("some-org/some-model", weights=False) == tmp_path
    with_weights, without = calls
    assert "*.safetensors" in with_weights and "*.json" in with_weights
    assert "*.safetensors" not in without and "*.json" in without
    assert "*" not in with_weights and not any(x in p for p in with_weights for x in (".bin", ".gguf", ".onnx"))
