"""Drafter checkpoints: ``config.json`` + ``model.safetensors``.

Two layouts are read:
* ours — ``config.json`` has ``"format": "moa-serve-drafter"`` with the target's dimensions
  and the drafter's sizes;
* the reference implementation's (HEBO branch ``mixture-of-attentions``, e.g.
  ``huawei-noah/MOASpec-Llama-3-8B-Instruct``) — ``config.json`` is the *target's* Hugging
  Face config (optionally with ``*_num_key_value_heads``, ``*_intermediate_size``,
  ``target_layer_inference``); sizes missing from it are read off the tensor shapes.
Both store the same keys: ``layer_self_attention.*``, ``Ekv2E.*``, ``self_attention.*``,
``cross_attention.*`` (plus our optional ``draft_vocab_ids``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moa_serve.drafter.config import FORMAT, DrafterConfig
from moa_serve.drafter.moa_model import MoADrafter, init_weights
from moa_serve.drafter.spec import DrafterSpec, checkpoint_kind, resolve_drafter_path
from moa_serve.model.target import TargetArch
from moa_serve.model_files import read_config, resolve_model_path

DRAFT_VOCAB_KEY = "draft_vocab_ids"
_PARTS = ("layer_self_attention", "self_attention", "cross_attention")


def _state(path: Path) -> dict[str, torch.Tensor]:
    state = load_file(str(path / "model.safetensors"))
    return {k: v for k, v in state.items() if "rotary_emb" not in k}


def _reference_config(raw: dict, state: dict[str, torch.Tensor]) -> DrafterConfig:
    from transformers import AutoConfig

    fields = {k: v for k, v in raw.items() if k != "model_type"}
    hf = AutoConfig.for_model(raw.get("model_type", "llama"), **fields)
    target = TargetArch.from_hf_config(hf)

    def kv_heads(part: str, head_dim: int) -> int:
        return state[f"{part}.self_attn.k_proj.weight"].shape[0] // head_dim

    lsa_head_dim = target.kv_width // target.num_heads
    inferred = {
        "layer_self_attention_num_key_value_heads": kv_heads("layer_self_attention", lsa_head_dim),
        "layer_self_attention_intermediate_size": state["layer_self_attention.mlp.gate_proj.weight"].shape[0],
        "self_attention_num_key_value_heads": kv_heads("self_attention", target.head_dim),
        "self_attention_intermediate_size": state["self_attention.mlp.gate_proj.weight"].shape[0],
        "cross_attention_num_key_value_heads": kv_heads("cross_attention", target.head_dim),
        "cross_attention_intermediate_size": state["cross_attention.mlp.gate_proj.weight"].shape[0],
    }
    for key, value in inferred.items():
        if key in raw and int(raw[key]) != value:
            raise ValueError(f"reference checkpoint config says {key}={raw[key]} but its weights have {value}")
    return DrafterConfig(
        target=target,
        target_name_or_path=raw.get("_name_or_path", ""),
        target_layer_inference=int(raw.get("target_layer_inference", 0)),
        **inferred,
    )


def load_drafter(name_or_path: str) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """(config, flat state dict) of a drafter checkpoint in either layout."""
    path = resolve_drafter_path(name_or_path)
    raw = json.loads((path / "config.json").read_text())
    state = _state(path)
    if checkpoint_kind(raw) != "moa":  # baseline drafters
        return DrafterConfig.from_dict(raw), state
    missing = [p for p in _PARTS if not any(k.startswith(p + ".") for k in state)]
    if missing or not any(k.startswith("Ekv2E.") for k in state):
        raise ValueError(f"{path} is not a MoA drafter checkpoint: no weights for {missing or ['Ekv2E']}")
    cfg = DrafterConfig.from_dict(raw) if raw.get("format") == FORMAT else _reference_config(raw, state)
    return cfg, state


def load_draft_vocab(drafter: "str | DrafterSpec | None") -> torch.Tensor | None:
    """The draft vocabulary of a drafter checkpoint: target token ids (long, [V'], on CPU) whose
    rows the drafter's LM head keeps, in the order of its outputs; ``None`` when the drafter
    drafts over the whole target vocabulary. When sampling, a drafter ships q as [K, V'] over
    this vocabulary: ``q_full[:, vocab] = q`` (every other token has probability 0). Reads only
    that tensor of the checkpoint."""
    drafter = DrafterSpec.parse(drafter).checkpoint
    if drafter is None:
        return None
    path = resolve_drafter_path(drafter)
    with safe_open(str(path / "model.safetensors"), framework="pt") as st:
        if DRAFT_VOCAB_KEY not in st.keys():
            return None
        return st.get_tensor(DRAFT_VOCAB_KEY).long()


def save_drafter(
    out_dir: str | Path, cfg: DrafterConfig, state: dict[str, torch.Tensor], dtype: torch.dtype | None = None
) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
        for k, v in state.items()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": FORMAT})
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    return out


def init_drafter(target: str, out_dir: str | Path, seed: int = 0, target_layer_inference: int = 0, **sizes) -> Path:
    """Writes an untrained MoA drafter sized for ``target`` (the starting point of training)."""
    path = resolve_model_path(target)
    arch = TargetArch.from_hf_config(read_config(path))
    cfg = DrafterConfig(
        target=arch, target_name_or_path=str(target), target_layer_inference=target_layer_inference, **sizes
    )
    model = MoADrafter(cfg)
    init_weights(model, seed=seed)
    return save_drafter(out_dir, cfg, model.flat_state_dict())
