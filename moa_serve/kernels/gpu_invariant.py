"""Batch-invariant GPU kernels (Triton): a token's result does not depend on who shares its call.

Why: cuBLAS picks a GEMM kernel by the shape of the call, so a row computed alone and the same row
computed beside 63 others can differ in the last bits of bfloat16, and greedy speculative output
then stops being the target's own (the GPU check's invariance probe, ``tools/gpu/README.md``). Speculative decoding verifies a session's
drafts in whatever batch the round holds, so every op the verify forward runs must be invariant
to the rows beside it.

* :func:`matmul` — ``x @ w.T`` (+ bias) with ONE tile configuration per weight shape, chosen from
  (N, K) only, never from the number of rows M, and no split-K: every output element is the same
  sequence of ``tl.dot`` steps over K whatever M is.
* :func:`slot_attention` — causal attention of packed tokens over a per-slot KV cache layer, one
  program per (token, KV head): each token reads its own slot's keys in a fixed block order with an
  online softmax in float32, so its output depends on its own position only (the same contract as
  the CPU kernel ``moa_serve.kernels.attention``). The loop bound is read from the position buffer
  on the device, so a captured CUDA graph replays it for any context length.

Both run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``), which is how the
tests check them without a GPU; the interpreter's bfloat16 ``tl.dot`` is wrong, so there the
operands are widened to float32 first (``_WIDEN``: the GPU path multiplies bfloat16 on tensor
cores with float32 accumulation).
"""

from __future__ import annotations

import functools
import os

import torch

try:  # Triton ships with CUDA builds of torch; a CPU-only install may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None
    tl = None

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_WIDEN = _INTERPRET


def available(device: torch.device | str) -> bool:
    """Whether these kernels run on ``device`` (CUDA with Triton, or a CPU under the interpreter)."""
    if triton is None:
        return False
    kind = torch.device(device).type
    return kind == "cuda" or (kind == "cpu" and _INTERPRET)


def unavailable_reason(device: torch.device | str) -> str:
    if triton is None:
        return "Triton is not installed"
    if not available(device):
        return f"Triton kernels run on CUDA (or on a CPU with TRITON_INTERPRET=1), not on {torch.device(device).type}"
    return ""


if triton is not None:

    @triton.jit
    def _matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sxm, sxk, swn, swk, sym, syn,
                       HAS_BIAS: tl.constexpr, WIDEN: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            rk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk,
                        mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            b = tl.load(w_ptr + rn[None, :] * swn + rk[:, None] * swk,
                        mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)
            if WIDEN:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if IEEE:  # float32 operands: full float32 products, not TF32 (lossless is judged in float32)
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn, acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _slot_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, slots_ptr, pos_ptr, at_ptr,
                               sqn, sqh, sks, skh, skp, son, soh, scale, GROUPS,
                               HEAD_DIM: tl.constexpr, GROUPS_P2: tl.constexpr, BLOCK: tl.constexpr):
        tok = tl.program_id(0)
        kvh = tl.program_id(1)
        slot = tl.load(slots_ptr + tok)
        pos = tl.load(pos_ptr + tok)
        at = tl.load(at_ptr + tok)
        g = tl.arange(0, GROUPS_P2)
        d = tl.arange(0, HEAD_DIM)
        heads = kvh * GROUPS + g
        gmask = g < GROUPS
        q = tl.load(q_ptr + tok * sqn + heads[:, None] * sqh + d[None, :], mask=gmask[:, None], other=0.0)
        q = q.to(tl.float32) * scale
        m = tl.full((GROUPS_P2,), float("-inf"), dtype=tl.float32)
        denom = tl.zeros((GROUPS_P2,), dtype=tl.float32)
        acc = tl.zeros((GROUPS_P2, HEAD_DIM), dtype=tl.float32)
        base = k_ptr + slot * sks + kvh * skh
        vbase = v_ptr + slot * sks + kvh * skh
        # keys 0 .. pos-1 from the cache, then the token's own key, stored at ``at``
        for start in range(0, pos + 1, BLOCK):
            j = start + tl.arange(0, BLOCK)
            live = j <= pos
            where = tl.where(j == pos, at, j)
            kb = tl.load(base + where[:, None] * skp + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            vb = tl.load(vbase + where[:, None] * skp + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * kb[None, :, :], axis=2)  # [G, BLOCK]
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            denom = denom * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vb[None, :, :], axis=1)
            m = m_new
        out = acc / denom[:, None]
        tl.store(o_ptr + tok * son + heads[:, None] * soh + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=gmask[:, None])


@functools.lru_cache(maxsize=None)
def tile_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for a weight of N rows and K columns. A function of
    the weight's shape alone: the number of rows multiplied never changes it (batch invariance).
    Narrow tiles along N for narrow weights keep enough programs in flight for one decode row."""
    block_n = 64 if n >= 8192 else 32
    block_k = 64 if k >= 64 else 32 if k >= 32 else 16  # tl.dot needs at least 16
    return 32, block_n, block_k, 4


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, batch-invariant: x [..., K], weight [N, K] -> [..., N] in x's dtype."""
    k = x.shape[-1]
    n = weight.shape[0]
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        bm, bn, bk, warps = tile_config(n, k)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _matmul_kernel[grid](flat, weight, bias if bias is not None else weight, out, m, n, k,
                             flat.stride(0), flat.stride(1), weight.stride(0), weight.stride(1),
                             out.stride(0), out.stride(1), HAS_BIAS=bias is not None, WIDEN=_WIDEN,
                             IEEE=x.dtype == torch.float32 or _WIDEN,
                             BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return out.reshape(*x.shape[:-1], n)


def slot_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                   positions: torch.Tensor, store_at: torch.Tensor | None = None) -> torch.Tensor:
    """The contract of ``moa_serve.kernels.attention`` on the GPU: q [n, H, hd]; k/v one cache layer
    [slots, KVH, max_len, hd] (rows contiguous); token i attends to keys 0..positions[i]-1 of slot
    slots[i] and to its own key at ``store_at[i]`` (default: positions[i]). Returns [n, H, hd] in
    q's dtype. ``head_dim`` must be a power of two."""
    n, heads, hd = q.shape
    kv_heads = k.shape[1]
    if hd & (hd - 1) or k.stride(-1) != 1 or k.stride() != v.stride():
        raise ValueError("slot_attention: head_dim must be a power of two and K/V alike, rows contiguous")
    groups = heads // kv_heads
    store_at = positions if store_at is None else store_at
    out = torch.empty_like(q)
    if n:
        q = q if q.stride(-1) == 1 else q.contiguous()
        _slot_attention_kernel[(n, kv_heads)](
            q, k, v, out, slots, positions, store_at, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            k.stride(2), out.stride(0), out.stride(1), hd ** -0.5, groups, HEAD_DIM=hd,
            GROUPS_P2=triton.next_power_of_2(groups), BLOCK=32, num_warps=4)
    return out
