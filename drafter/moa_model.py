"""The MoA drafter (Zimmer et al., ICLR 2025) as two halves that live in different places:

* ``FeatureHead`` — Layer Self-Attention (LSA) over the target's per-layer K/V of a token
  (attention *across layers*, no mask, rope over layer index), mean-pooled over layers, then
  ``Ekv2E`` to the target's hidden size. It runs beside the target (in the verifier), which
  holds those K/V anyway, so only one ``hidden_size`` vector per token leaves the verifier.
* ``DraftHead`` — Self-Attention (SA) decoder layer over the target's input embeddings, then a
  Cross-Attention (CA) decoder layer whose keys/values are the features of verified tokens,
  then optionally the target's last N layers + final norm (Target Layer Inference), then the
  target's LM head.

Parameter names equal the reference implementation's (``layer_self_attention.*``, ``Ekv2E.*``,
``self_attention.*``, ``cross_attention.*``); the target's embeddings, layers and LM head are
shared and never part of a drafter checkpoint.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from moa_serve.drafter.config import DrafterConfig
from moa_serve.model.layers import DecoderLayer, PreNormLayer, RMSNorm, Rotary, apply_rope, attend
from moa_serve.model.target import TargetArch, TargetModel, assign_weights
from moa_serve.model_files import load_selected_tensors, read_config, resolve_model_path


class FeatureHead(nn.Module):
    """LSA over a token's per-layer K/V, mean-pooled, ``Ekv2E`` to the hidden size (the paper);
    with ``value_readout_layers`` = N > 0, plus ``value_readout``: one linear map from the values
    of the target's last N layers (beyond the paper). The paper's path alone, distilled here,
    learned features that told the drafter nothing about the next token (its top-1 was the same
    with the feature of the very position it predicts from as with one 5 tokens old), while a
    linear probe on those values recovers most of the target's final hidden state."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        shape = cfg.lsa_shape()
        self.layer_self_attention = DecoderLayer(shape)
        self.Ekv2E = nn.Linear(shape.hidden_size, cfg.target.hidden_size)
        self.rotary = Rotary.plain(shape.head_dim, cfg.target.rope_theta)
        self.readout_layers = cfg.value_readout_layers
        self.kv_heads = cfg.target.num_kv_heads
        if self.readout_layers:
            width = self.readout_layers * cfg.target.kv_width // 2
            self.value_readout = nn.Linear(width, cfg.target.hidden_size)

    def readout_values(self, per_layer_kv: torch.Tensor) -> torch.Tensor:
        """per_layer_kv [n, num_layers, kv_width] -> the values of the last N layers, flat [n, N * kv_width / 2]
        (each layer's vector holds, per KV head, that head's key then its value)."""
        x = per_layer_kv[:, per_layer_kv.shape[1] - self.readout_layers :]
        x = x.reshape(*x.shape[:2], self.kv_heads, 2, -1)[:, :, :, 1]
        return x.reshape(x.shape[0], -1)

    def forward(self, per_layer_kv: torch.Tensor) -> torch.Tensor:
        """per_layer_kv [..., num_layers, kv_width] -> features [..., hidden_size]."""
        lead = per_layer_kv.shape[:-2]
        kv = per_layer_kv.reshape(-1, *per_layer_kv.shape[-2:])
        cos, sin = self.rotary(torch.arange(kv.shape[1], device=kv.device), kv.dtype)
        x = self.layer_self_attention(kv, cos, sin, lambda k, v: (k, v, None))
        out = self.Ekv2E(x.mean(1))
        if self.readout_layers:
            out = out + self.value_readout(self.readout_values(kv))
        return out.reshape(*lead, -1)


class CrossAttentionLayer(PreNormLayer):
    """A decoder layer whose attention reads keys/values projected from MoA features; the
    same ``input_layernorm`` normalises queries' inputs and features (as the reference)."""

    def project_features(self, features: torch.Tensor, cos, sin):
        """features [B, N, H] at positions given by cos/sin -> keys, values [B, KVH, N, hd]."""
        return self.self_attn.key_value(self.input_layernorm(features), cos, sin)

    def forward(self, x, cos, sin, keys, values, mask):
        q = self.self_attn.query(self.input_layernorm(x), cos, sin)
        x = x + self.self_attn.output(attend(q, keys, values, mask))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_packed(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention) -> torch.Tensor:
        """``forward`` for tokens packed along one axis: x [N, hidden], cos/sin [N, 1, head_dim];
        ``attention(q [N, H, hd])`` returns each token's attention output over its features."""
        n = x.shape[0]
        a, s = self.self_attn, self.self_attn.shape
        q = apply_rope(a.q_proj(self.input_layernorm(x)).reshape(n, s.num_heads, s.head_dim), cos, sin)
        x = x + a.o_proj(attention(q).reshape(n, -1))
        return x + self.mlp(self.post_attention_layernorm(x))

    def single_feature_output(self, values: torch.Tensor) -> torch.Tensor:
        """The attention block's output when one feature is visible (``cross_attention_latest_only``):
        softmax over a single key is exactly 1, so every query head returns its KV head's value,
        whatever the query. values [B, KVH, hd] -> [B, 1, hidden], fixed for a whole draft call."""
        heads = self.self_attn.shape.num_heads // values.shape[1]
        return self.self_attn.output(values.repeat_interleave(heads, dim=1)[:, :, None, :])

    def forward_single_feature(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """``forward`` with that output precomputed (no query projection, RoPE or attention)."""
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))


class TargetParts(nn.Module):
    """What the drafter borrows from the target, frozen: embeddings, rotary, LM head, final
    norm and (TLI) its last N layers.

    ``TargetParts(target, n)`` shares the modules of a loaded ``TargetModel`` (the in-process
    engine and training, where the target is there anyway); ``TargetParts.load`` /
    ``from_state_dict`` build the same parts from only the tensors they need (a drafter replica,
    which must not hold the whole target)."""

    def __init__(self, target: TargetModel | "_PartialTarget", tli_layers: int):
        super().__init__()
        self.arch = target.arch
        self.embed_tokens = target.model.embed_tokens
        self.lm_head = target.lm_head
        self.norm = target.model.norm
        self.rotary = target.rotary
        self.tli = nn.ModuleList(target.model.layers[len(target.model.layers) - tli_layers :] if tli_layers else [])
        self.requires_grad_(False)

    @staticmethod
    def wanted(arch: TargetArch, tli_layers: int) -> Callable[[str], bool]:
        """Which Hugging Face tensor names of the target the parts read: embeddings, LM head,
        final norm, and the last ``tli_layers`` decoder layers."""
        first = arch.num_layers - tli_layers
        tli = tuple(f"model.layers.{i}." for i in range(first, arch.num_layers))
        names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
        return lambda key: key in names or key.startswith(tli)

    @classmethod
    def from_state_dict(
        cls,
        hf_config,
        state: dict[str, torch.Tensor],
        tli_layers: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> "TargetParts":
        """The parts from a (partial) Hugging Face state dict holding at least the ``wanted`` tensors;
        the same values, dtype and device as ``TargetParts(TargetModel.from_state_dict(...), n)``."""
        arch = TargetArch.from_hf_config(hf_config)
        if not 0 <= tli_layers <= arch.num_layers:
            raise ValueError(f"tli_layers must be in [0, {arch.num_layers}], got {tli_layers}")
        first = arch.num_layers - tli_layers
        wanted = cls.wanted(arch, tli_layers)
        renamed = {}
        for k, v in state.items():
            if not wanted(k):
                continue
            if k.startswith("model.layers."):  # layer i of the target is layer i - first here
                i, rest = k[len("model.layers.") :].split(".", 1)
                k = f"model.layers.{int(i) - first}.{rest}"
            renamed[k] = v
        with torch.device("meta"):
            partial = _PartialTarget(arch, tli_layers)
        return cls(assign_weights(partial, arch, hf_config, renamed, dtype, device), tli_layers).eval()

    @classmethod
    def load(
        cls, target: str, tli_layers: int, dtype: torch.dtype, device: str | torch.device = "cpu"
    ) -> "TargetParts":
        """Reads only the tensors the parts need from the target's weight files (never the whole
        target: for an 8B target, embeddings + LM head are about 1/8 of it)."""
        path = resolve_model_path(target)
        hf_config = read_config(path)
        arch = TargetArch.from_hf_config(hf_config)
        state = load_selected_tensors(path, cls.wanted(arch, tli_layers))
        return cls.from_state_dict(hf_config, state, tli_layers, dtype, device)


class _PartialTarget(nn.Module):
    """A target with only the modules the drafter borrows (Hugging Face names, ``model.layers``
    holding only the last N layers)."""

    def __init__(self, arch: TargetArch, num_layers: int):
        super().__init__()
        self.arch = arch
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(arch.layer_shape()) for _ in range(num_layers))
        self.model.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rotary = Rotary(torch.zeros(arch.head_dim // 2))


class DraftHead(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attention = DecoderLayer(cfg.sa_shape())
        self.cross_attention = CrossAttentionLayer(cfg.ca_shape())

    def forward_parallel(
        self,
        parts: TargetParts,
        tokens: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        sa_mask: torch.Tensor,
        ca_mask: torch.Tensor,
        tli_inputs: torch.Tensor | None = None,
        tli_keep: torch.Tensor | None = None,
    ):
        """Teacher-forced pass over whole sequences (training, tests).

        tokens/positions [B, S]; features [B, S, H] (feature j belongs to position j);
        sa_mask/ca_mask bool [B, 1, S, S]: the staircase/causal SA mask and the T-step bounded
        CA mask. With TLI, positions where ``tli_keep`` is False take ``tli_inputs`` (the
        target's true hidden state entering its last N layers) as the reference does.
        Returns (hidden before the LM head [B, S, H], CA output [B, S, H])."""
        x = parts.embed_tokens(tokens)
        cos, sin = parts.rotary(positions, x.dtype)
        x = self.self_attention(x, cos, sin, lambda k, v: (k, v, sa_mask))
        keys, values = self.cross_attention.project_features(features, cos, sin)
        ca_out = self.cross_attention(x, cos, sin, keys, values, ca_mask)
        if not len(parts.tli):
            return ca_out, ca_out
        x = ca_out
        if tli_inputs is not None:
            x = torch.where(tli_keep.unsqueeze(-1), x, tli_inputs)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()[None, None]
        for layer in parts.tli:
            x = layer(x, cos, sin, lambda k, v: (k, v, causal))
        return parts.norm(x), ca_out


class MoADrafter(nn.Module):
    """Both halves together, for training and checkpoint I/O (flat reference key layout)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.feature_head = FeatureHead(cfg)
        self.draft_head = DraftHead(cfg)

    def flat_state_dict(self) -> dict[str, torch.Tensor]:
        return {**self.feature_head.state_dict(), **self.draft_head.state_dict()}

    def load_flat_state_dict(self, state: dict[str, torch.Tensor], new_readout: bool = False) -> None:
        """Loads a flat (reference-layout) state dict; ``new_readout`` lets a checkpoint without a
        ``value_readout`` start one (training a paper-layout drafter on with the readout added)."""
        fh = {k: v for k, v in state.items() if k.startswith(("layer_self_attention.", "Ekv2E.", "value_readout."))}
        dh = {k: v for k, v in state.items() if k.startswith(("self_attention.", "cross_attention."))}
        unexpected = set(state) - set(fh) - set(dh)
        if unexpected:
            raise ValueError(f"unexpected drafter weights: {sorted(unexpected)[:5]}")
        missing, unexpected = self.feature_head.load_state_dict(fh, strict=False)
        if unexpected:
            raise ValueError(f"drafter weights this config has no place for: {sorted(unexpected)[:5]}")
        if missing and not (new_readout and all(k.startswith("value_readout.") for k in missing)):
            raise ValueError(f"missing drafter weights: {sorted(missing)[:5]}")
        self.draft_head.load_state_dict(dh)


def init_weights(module: nn.Module, std: float = 0.02, seed: int | None = None) -> None:
    """Normal(0, std) linear weights, zero biases, unit norms."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for m in module.modules():
        if isinstance(m, nn.Linear):
            with torch.no_grad():
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * std)
                if m.bias is not None:
                    m.bias.zero_()
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)
