"""A random Llama with a 16-token vocabulary (bos 0, eos 15), saved with stories260k's tokenizer:
the exact distribution of a few sampled tokens can be enumerated."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def save_tiny_llama(
    out: Path, tokenizer_dir: Path, *, hidden: int, intermediate: int, heads: int, kv_heads: int, sharpen: float
) -> Path:
    """Seeded random weights; the LM head scaled by ``sharpen`` so that distributions are far from
    uniform. Any tokenizer decodes ids < 16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=16,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=15,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    model.save_pretrained(out)
    for f in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / f, out / f)
    return out
