"""The anchor of the GPU check: one plain-PyTorch decode step over the target's own weights,
replayed from a CUDA graph — the speed a torch verifier can aim at on the card in the same run.

The step is the layer math of ``moa_serve.model.layers`` written straight (fused q/k/v and gate/up
GEMMs on cuBLAS, RMSNorm, RoPE-free attention with SDPA over a fixed ``context``-token cache, LM
head and argmax), no cache writes, no host work: a floor, not a server. Off CUDA it runs eagerly.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def _fused(layer) -> tuple[torch.Tensor, torch.Tensor]:
    a, mlp = layer.self_attn, layer.mlp
    qkv = a.qkv.weight if a.qkv is not None else torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
    gate_up = mlp.gate_up.weight if mlp.gate_up is not None else torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
    return qkv, gate_up


def decode_step(target, batch: int, context: int):
    """A function running one decode step of ``batch`` sessions (one token each) over a random
    ``context``-token cache: returns the argmax ids [batch]."""
    arch = target.arch
    dev, dt = target.lm_head.weight.device, target.lm_head.weight.dtype
    heads, kv_heads, hd, hidden = arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.hidden_size
    layers = []
    for layer in target.model.layers:
        qkv, gate_up = _fused(layer)
        layers.append(
            (
                layer.input_layernorm.weight,
                qkv,
                layer.self_attn.o_proj.weight,
                layer.post_attention_layernorm.weight,
                gate_up,
                layer.mlp.down_proj.weight,
            )
        )
    g = torch.Generator(device=dev).manual_seed(0)
    keys = torch.randn(len(layers), batch, kv_heads, context, hd, device=dev, dtype=dt, generator=g)
    values = torch.randn(len(layers), batch, kv_heads, context, hd, device=dev, dtype=dt, generator=g)
    x0 = torch.randn(batch, 1, hidden, device=dev, dtype=dt, generator=g) * 0.02
    eps = arch.rms_norm_eps
    q_width, kv_width = heads * hd, kv_heads * hd

    def step():
        x = x0
        for i, (n1, qkv, o, n2, gate_up, down) in enumerate(layers):
            h = F.rms_norm(x, (hidden,), n1, eps)
            q, k, v = F.linear(h, qkv).split([q_width, kv_width, kv_width], -1)
            q = q.view(batch, 1, heads, hd).transpose(1, 2)
            k = torch.cat([keys[i], k.view(batch, 1, kv_heads, hd).transpose(1, 2)], 2)
            v = torch.cat([values[i], v.view(batch, 1, kv_heads, hd).transpose(1, 2)], 2)
            attn = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            x = x + F.linear(attn.transpose(1, 2).reshape(batch, 1, q_width), o)
            gate, up = F.linear(F.rms_norm(x, (hidden,), n2, eps), gate_up).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, down)
        return F.linear(F.rms_norm(x, (hidden,), target.model.norm.weight, eps), target.lm_head.weight).argmax(-1)

    return step


def _time_ms(fn, cuda: bool, reps: int) -> float:
    for _ in range(2):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


@torch.inference_mode()
def anchor_row(target, batch: int, context: int, reps: int = 20) -> dict:
    """ms and tokens/s of one plain decode step at ``batch``: eager, and from a CUDA graph on a GPU."""
    cuda = target.lm_head.weight.is_cuda
    step = decode_step(target, batch, context)
    row = {"B": batch, "eager_ms": round(_time_ms(step, cuda, reps), 3)}
    if cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        row["graph_ms"] = round(_time_ms(graph.replay, cuda, reps), 3)
        del graph
    best = row.get("graph_ms", row["eager_ms"])
    row["tokens_per_s"] = round(batch / best * 1e3, 1)
    return row
