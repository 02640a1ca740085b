"""A compact Llama-family causal LM (Llama, Mistral without sliding window, Qwen2) that loads
Hugging Face weights and runs ragged batches against a per-slot KV cache with explicit
positions. Owning the forward (as gpt-fast and vLLM do) gives us the per-layer K/V that the
MoA feature head reads, and per-session rollback."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moa_serve.model.kv_cache import PackedBatch, SlotKVCache
from moa_serve.model.layers import DecoderLayer, LayerShape, Linear, RMSNorm, Rotary

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class TargetArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, cfg) -> "TargetArch":
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported target model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type == "mistral" and getattr(cfg, "sliding_window", None):
            raise ValueError("Mistral models with a sliding window are not supported")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        return cls(
            model_type=model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=cfg.intermediate_size,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            qkv_bias=model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=cfg.max_position_embeddings,
        )

    def layer_shape(self) -> LayerShape:
        return LayerShape(
            self.hidden_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate_size,
            self.rms_norm_eps,
            self.qkv_bias,
        )

    @property
    def kv_width(self) -> int:
        """Width of one layer's K and V for one token: the LSA's model width."""
        return 2 * self.num_kv_heads * self.head_dim


def rotary_for(cfg, arch: TargetArch) -> Rotary:
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        return Rotary.plain(arch.head_dim, arch.rope_theta)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    return Rotary(inv_freq, scaling)


def assign_weights(
    module: nn.Module,
    arch: TargetArch,
    cfg,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: str | torch.device,
):
    """Loads Hugging Face target weights into a module built on the meta device (``model.*`` and
    ``lm_head`` names: the whole target, or the drafter's part of it): checks that they match,
    ties the LM head to the embeddings when the config says so, sets the rotary embedding."""
    if arch.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (arch.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"target weights do not match a {arch.model_type} model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if arch.tie_word_embeddings:
        module.lm_head.weight = module.model.embed_tokens.weight
    module.rotary = rotary_for(cfg, arch)
    return module.to(device=device, dtype=dtype)


class _Backbone(nn.Module):
    def __init__(self, arch: TargetArch):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch.layer_shape()) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class TargetModel(nn.Module):
    def __init__(self, arch: TargetArch, rotary: Rotary):
        super().__init__()
        self.arch = arch
        self.model = _Backbone(arch)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = rotary

    @classmethod
    def from_state_dict(
        cls, cfg, state: dict[str, torch.Tensor], dtype: torch.dtype, device: str | torch.device = "cpu"
    ) -> "TargetModel":
        arch = TargetArch.from_hf_config(cfg)
        with torch.device("meta"):
            model = cls(arch, Rotary(torch.zeros(arch.head_dim // 2)))
        state = {k: v for k, v in state.items() if "rotary_emb" not in k}
        return assign_weights(model, arch, cfg, state, dtype, device).eval()

    def new_cache(self, num_slots: int, max_len: int, dtype: torch.dtype | None = None) -> SlotKVCache:
        """A slot KV cache in ``dtype`` (default: the model's)."""
        p = self.lm_head.weight
        return SlotKVCache(
            self.arch.num_layers,
            num_slots,
            self.arch.num_kv_heads,
            self.arch.head_dim,
            max_len,
            dtype or p.dtype,
            p.device,
        )

    def forward_packed(self, tokens: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """tokens [N]: the new tokens of several sessions packed one after another (``batch`` says
        where each sits). Writes their K/V into the cache (lengths are not advanced) and returns
        final-norm hidden states [N, H]."""
        x = self.model.embed_tokens(tokens)
        cos, sin = self.rotary(batch.positions, x.dtype)  # [1, N, hd]
        fused = getattr(self, "fused_stack", None)
        if fused is not None and batch.kernel and fused.usable(x, batch.cache):
            # updates x in place: the embedding lookup's output is this forward's own tensor
            x = fused(x, cos[0], sin[0], batch.cache, batch.token_slots, batch.positions, batch.store_at)
            return self.model.norm(x)
        cos, sin = cos[0][:, None], sin[0][:, None]  # [N, 1, hd]: broadcast over heads
        for i, layer in enumerate(self.model.layers):
            x = layer.forward_packed(x, cos, sin, batch.attention(i))
        return self.model.norm(x)

    # ------------------------------------------------------------------ training (additive)
    @torch.no_grad()
    def forward_train(
        self,
        tokens: torch.Tensor,
        valid: torch.Tensor | None = None,
        tli_layers: int = 0,
        vocab_ids: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Teacher-forced causal pass over whole (right-padded) sequences, for drafter distillation.

        tokens [B, S]; ``valid`` [B, S] bool marks real tokens (padding sits at the end, so the
        causal mask alone keeps real positions exact). Returns a dict:
          per_layer_kv [B, S, num_layers, kv_width] (post-rope K then V per KV head, the layout of
          ``SlotKVCache.per_layer_kv``), embeds [B, S, H] (input embeddings), tli_input [B, S, H]
          (hidden state entering the last ``tli_layers`` layers; the last pre-norm state when 0),
          prenorm [B, S, H], hidden [B, S, H] (after the final norm), logits [B, S, V'] (V' = the
          ``vocab_ids`` subset when given)."""
        b, s = tokens.shape
        positions = torch.arange(s, device=tokens.device)[None].expand(b, s)
        x = self.model.embed_tokens(tokens)
        embeds = x
        cos, sin = self.rotary(positions, x.dtype)
        causal = torch.ones(s, s, dtype=torch.bool, device=tokens.device).tril()[None, None]
        kvs = []
        tli_input = None
        n = len(self.model.layers)
        for i, layer in enumerate(self.model.layers):
            if i == n - tli_layers:
                tli_input = x

            def kv_and_mask(k, v):
                kvs.append(torch.cat((k, v), dim=-1))  # [B, KVH, S, 2hd]
                return k, v, causal

            x = layer(x, cos, sin, kv_and_mask)
        prenorm = x
        if tli_input is None:
            tli_input = x
        hidden = self.model.norm(x)
        kv = torch.stack(kvs, 1)  # [B, L, KVH, S, 2hd]
        kv = kv.permute(0, 3, 1, 2, 4).reshape(b, s, n, -1)
        w = self.lm_head.weight if vocab_ids is None else self.lm_head.weight[vocab_ids]
        return {
            "per_layer_kv": kv,
            "embeds": embeds,
            "tli_input": tli_input,
            "prenorm": prenorm,
            "hidden": hidden,
            "logits": hidden @ w.T,
        }
