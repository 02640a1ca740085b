"""Llama-family building blocks shared by the target runner and the MoA drafter.

Parameter names follow Hugging Face's ``LlamaDecoderLayer`` (``self_attn.q_proj``,
``mlp.gate_proj``, ``input_layernorm`` ...) so that Hugging Face target weights and the
reference MoA checkpoint layout load without renaming.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel


@dataclass(frozen=True)
class LayerShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")


# Small-M matmuls: for x [M, K] times a weight [N, K], MKL's x @ W.T kernel is slow for a few rows
# on AVX2 CPUs, several times the cost of one row, where (W @ x.T).T costs about what one row does
# (which is what makes verifying K drafts nearly free); from a few dozen rows on, the plain form is
# faster again.
SMALL_M = (2, 32)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for x [..., K], computed as (W @ x.T).T when x has few rows on a CPU."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if SMALL_M[0] <= rows <= SMALL_M[1] and x.device.type == "cpu" and x.dtype == torch.float32:
        flat = x.reshape(rows, x.shape[-1])
        out = (weight @ flat.T).T
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state-dict keys) through :func:`linear`, or through the
    ``matmul`` set on it by :func:`use_matmul` (e.g. the batch-invariant GPU matmul)."""

    matmul = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.matmul is not None:
            return self.matmul(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)


def _set_on_every(module: nn.Module, kind: type, attribute: str, value) -> int:
    """Sets ``attribute`` on every submodule of class ``kind`` under ``module``; returns how many."""
    found = [m for m in module.modules() if isinstance(m, kind)]
    for m in found:
        setattr(m, attribute, value)
    return len(found)


def use_matmul(module: nn.Module, matmul) -> int:
    """Every :class:`Linear` under ``module`` (fused projections included: they are registered
    submodules) multiplies with ``matmul(x, weight, bias)`` instead of :func:`linear` (None: back
    to it). Returns how many."""
    return _set_on_every(module, Linear, "matmul", matmul)


def use_rms_norm(module: nn.Module, rms_norm) -> int:
    """Every :class:`RMSNorm` under ``module`` normalises with ``rms_norm(x, weight, eps)`` (e.g.
    the batch-invariant GPU kernel; None: back to torch's ops). Returns how many."""
    return _set_on_every(module, RMSNorm, "kernel", rms_norm)


class RMSNorm(nn.Module):
    kernel = None

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """Rotary position embedding; ``inv_freq`` comes from transformers' rope initialisers so that
    every rope_scaling type a Hugging Face config names (llama3, linear, dynamic, ...) is exact."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = attention_scaling

    @classmethod
    def plain(cls, head_dim: int, theta: float) -> "Rotary":
        return cls(1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [..., T] (long) -> cos, sin [..., 1, T, head_dim] ready to broadcast over heads."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos.unsqueeze(-3), sin.unsqueeze(-3)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.gate_up = None  # optional fused [gate; up] projection (one matmul instead of two)

    def forward(self, x):
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Projections of one attention block; the attention itself is done by the caller, which
    owns the cache and the mask (ragged batches, cross-attention, attention across layers)."""

    def __init__(self, shape: LayerShape):
        super().__init__()
        self.shape = shape
        s = shape
        self.q_proj = Linear(s.hidden_size, s.num_heads * s.head_dim, bias=s.qkv_bias)
        self.k_proj = Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.v_proj = Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.o_proj = Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)
        self.qkv = None  # optional fused [q; k; v] projection (one matmul instead of three)

    def split_heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        # [B, T, heads*hd] -> [B, heads, T, hd]
        b, t, _ = x.shape
        return x.view(b, t, heads, self.shape.head_dim).transpose(1, 2)

    def query(self, h, cos, sin):
        return apply_rope(self.split_heads(self.q_proj(h), self.shape.num_heads), cos, sin)

    def key_value(self, h, cos, sin):
        k = apply_rope(self.split_heads(self.k_proj(h), self.shape.num_kv_heads), cos, sin)
        v = self.split_heads(self.v_proj(h), self.shape.num_kv_heads)
        return k, v

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        # [B, H, T, hd] -> [B, T, hidden]
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))


# SDPA's backends on a GPU, cuDNN left out: cuDNN builds an execution plan for every new shape
# (hundreds of milliseconds of host time), and a drafter's context grows by a few tokens each round.
_GPU_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with a boolean mask (True = may attend), never on cuDNN."""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with sdpa_kernel(_GPU_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [B,H,T,hd], k/v [B,KVH,L,hd], mask bool [B or 1,1,T,L] (True = may attend) or None.

    Grouped-query attention without copying keys/values per query head: the G query heads that
    share a KV head are folded into the query length ([B,KVH,G*T,hd]) and the mask repeated
    along it (much faster than ``repeat_interleave``, which copies every KV head G times)."""
    b, heads, t, hd = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    if groups == 1:
        return sdpa(q, k, v, mask)
    if mask is not None and mask.shape[1] != 1:  # a per-head mask: fall back to copying
        return sdpa(q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), mask)
    q = q.reshape(b, kv_heads, groups * t, hd)
    if mask is not None:
        mb, _, _, length = mask.shape
        mask = mask.unsqueeze(2).expand(mb, 1, groups, t, length).reshape(mb, 1, groups * t, length)
    # reshape, not view: on CUDA this SDPA output is not contiguous (its kernels choose the layout)
    return sdpa(q, k, v, mask).reshape(b, heads, t, hd)


class PreNormLayer(nn.Module):
    """The parts of a pre-norm Llama layer, under the checkpoints' names: attention, MLP and the
    RMSNorms before each. Subclasses say what the attention reads."""

    def __init__(self, shape: LayerShape):
        super().__init__()
        self.self_attn = Attention(shape)
        self.mlp = MLP(shape.hidden_size, shape.intermediate_size)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class DecoderLayer(PreNormLayer):
    """Pre-norm Llama decoder layer. ``forward`` takes a function that, given this step's
    rope'd keys/values, returns all keys/values to attend to plus the mask (cache policy
    belongs to the caller)."""

    def forward_packed(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention) -> torch.Tensor:
        """The same layer over tokens of many sequences packed along one axis: x [N, hidden],
        cos/sin [N, 1, head_dim]; ``attention(q [N, H, hd], k [N, KVH, hd], v)`` stores this
        step's keys/values and returns each token's attention output [N, H, hd]; where it has
        ``from_qkv`` and q/k/v are fused, ``from_qkv(qkv [N, (H + 2 KVH) hd], cos, sin)`` ropes,
        stores and attends instead."""
        n = x.shape[0]
        a, s = self.self_attn, self.self_attn.shape
        h = self.input_layernorm(x)
        from_qkv = getattr(attention, "from_qkv", None)  # rope and the K/V store fused with attention
        if a.qkv is not None and from_qkv is not None:
            out = from_qkv(a.qkv(h), cos, sin)
        else:
            if a.qkv is not None:
                kv = s.num_kv_heads * s.head_dim
                q, k, v = a.qkv(h).split([s.num_heads * s.head_dim, kv, kv], dim=-1)
            else:
                q, k, v = a.q_proj(h), a.k_proj(h), a.v_proj(h)
            q = apply_rope(q.reshape(n, s.num_heads, s.head_dim), cos, sin)
            k = apply_rope(k.reshape(n, s.num_kv_heads, s.head_dim), cos, sin)
            v = v.reshape(n, s.num_kv_heads, s.head_dim)
            out = attention(q, k, v)
        x = x + a.o_proj(out.reshape(n, -1))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x, cos, sin, kv_and_mask):
        h = self.input_layernorm(x)
        q = self.self_attn.query(h, cos, sin)
        k, v = self.self_attn.key_value(h, cos, sin)
        k_all, v_all, mask = kv_and_mask(k, v)
        x = x + self.self_attn.output(attend(q, k_all, v_all, mask))
        return x + self.mlp(self.post_attention_layernorm(x))


def fuse_dense_projections(layers) -> int:
    """Per decoder layer, [q; k; v] and [gate; up] as one ``Linear`` each (one GEMM instead of
    three and two: fewer kernel launches per decode step on a GPU). The separate layers keep
    their parameters as row views of the fused weight, so the weights are held once and every
    other path (``DecoderLayer.forward``, state dicts) reads the same values. Biased q/k/v
    (Qwen2) and already fused layers are left as they are. Returns the projections fused."""
    fused = 0
    for layer in layers:
        a, mlp = layer.self_attn, layer.mlp
        for owner, attr, parts in (
            (a, "qkv", ("q_proj", "k_proj", "v_proj")),
            (mlp, "gate_up", ("gate_proj", "up_proj")),
        ):
            mods = [getattr(owner, p) for p in parts]
            if getattr(owner, attr) is not None or any(type(m) is not Linear or m.bias is not None for m in mods):
                continue
            weight = torch.cat([m.weight.detach() for m in mods])
            joint = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            joint.weight = nn.Parameter(weight, requires_grad=False)
            start = 0
            for m in mods:
                rows = m.out_features
                m.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
                start += rows
            setattr(owner, attr, joint)
            fused += 1
    return fused
