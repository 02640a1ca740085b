"""Batch-invariant GPU kernels (Triton): a token's result does not depend on who shares its call.

Why: cuBLAS picks a GEMM kernel by the shape of the call, so a row computed alone and the same row
computed beside 63 others can differ in the last bits of bfloat16, and greedy speculative output
then stops being the target's own (the GPU check's invariance probe, ``tools/gpu/README.md``).
Speculative decoding verifies a session's drafts in whatever batch the round holds, so every op the
verify forward runs must be invariant to the rows beside it.

* :func:`matmul` — ``x @ w.T`` (+ bias) with ONE tile configuration per weight shape, chosen from
  (N, K) only, never from the number of rows M: every output element is the same sequence of
  ``tl.dot`` steps over K whatever M is. A narrow weight splits K into a fixed number of ranges
  (so one decode row keeps the GPU's SMs busy) whose float32 partial sums are added in a fixed
  order by a second kernel, never by atomics.
* :func:`rms_norm` — one program per row, the row's sum of squares over one fixed block.
* :func:`slot_attention` — causal attention of packed tokens over a per-slot KV cache layer, one
  program per (token, KV head): each token reads its own slot's keys in a fixed block order with an
  online softmax in float32, so its output depends on its own position only (the same contract as
  the CPU kernel ``moa_serve.kernels.cpu.attention``). The loop bound is read from the position buffer
  on the device, so a captured CUDA graph replays it for any context length.
* :func:`chunked_slot_attention` — the same contract with a token's keys split into chunks whose
  size depends on the cache only, run side by side and merged in chunk order (flash-decoding):
  for long contexts at few tokens per call. The GPU check times it beside
  :func:`slot_attention` (its production section, ``tools/gpu/production.py``) before it serves.

All run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``), which is how the
tests check them without a GPU; the interpreter's bfloat16 ``tl.dot`` is wrong, so there the
operands are widened to float32 first (``_WIDEN``: the GPU path multiplies bfloat16 on tensor
cores with float32 accumulation).
"""

from __future__ import annotations

import dataclasses
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
    def _matmul_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        part_ptr,
        M,
        N,
        K,
        K_SPLIT,
        sxm,
        sxk,
        swn,
        swk,
        sym,
        syn,
        HAS_BIAS: tl.constexpr,
        WIDEN: tl.constexpr,
        IEEE: tl.constexpr,
        PARTIAL: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """One (BLOCK_M x BLOCK_N) tile over the K range [pid_s * K_SPLIT, +K_SPLIT): written to
        y (PARTIAL false: the whole K) or, in float32, to split pid_s of the partials [S, M, N]."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_lo = pid_s * K_SPLIT
        k_hi = tl.minimum(K, k_lo + K_SPLIT)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(
                x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=(rm[:, None] < M) & (rk[None, :] < k_hi), other=0.0
            )
            b = tl.load(
                w_ptr + rn[None, :] * swn + rk[:, None] * swk, mask=(rn[None, :] < N) & (rk[:, None] < k_hi), other=0.0
            )
            if WIDEN:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if IEEE:  # float32 operands: full float32 products, not TF32 (lossless is judged in float32)
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        if PARTIAL:
            tl.store(part_ptr + pid_s * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn, acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _split_sum_kernel(part_ptr, b_ptr, y_ptr, M, N, S, sym, syn, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        """y = partials[0] + partials[1] + ... in that order (+ bias), element by element."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = offs < M * N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(0, S):
            acc += tl.load(part_ptr + s * M * N + offs, mask=live, other=0.0)
        m = offs // N
        n = offs % N
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=live, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * sym + n * syn, acc.to(y_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, sx, sy, eps, BLOCK: tl.constexpr):
        """One row: y = w * (x * rsqrt(mean(x^2) + eps)) in x's dtype, the sum over one fixed block."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        live = cols < H
        x = tl.load(x_ptr + row * sx + cols, mask=live, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
        y = (x * r).to(y_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * sy + cols, (w * y).to(y_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _rope_store_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        slots_ptr,
        at_ptr,
        sx,
        sc,
        sqn,
        sqh,
        sks,
        skh,
        skp,
        HEADS,
        KV_HEADS,
        HALF: tl.constexpr,
    ):
        """Head j of token t from the fused q/k/v row: a query head roped into q, or a KV head's key
        roped and its value copied into the cache at (slot, at). ``layers.apply_rope``'s arithmetic:
        each product and the sum rounded to the model's dtype, as torch's elementwise ops round."""
        t = tl.program_id(0)
        j = tl.program_id(1)
        d = tl.arange(0, HALF)
        dt = q_ptr.dtype.element_ty
        c1 = tl.load(cos_ptr + t * sc + d).to(tl.float32)
        c2 = tl.load(cos_ptr + t * sc + HALF + d).to(tl.float32)
        s1 = tl.load(sin_ptr + t * sc + d).to(tl.float32)
        s2 = tl.load(sin_ptr + t * sc + HALF + d).to(tl.float32)
        src = qkv_ptr + t * sx + j * (2 * HALF)
        x1 = tl.load(src + d).to(tl.float32)
        x2 = tl.load(src + HALF + d).to(tl.float32)
        y1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
        y2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
        if j < HEADS:
            dst = q_ptr + t * sqn + j * sqh
            tl.store(dst + d, y1)
            tl.store(dst + HALF + d, y2)
        else:
            h = j - HEADS
            slot = tl.load(slots_ptr + t)
            at = tl.load(at_ptr + t)
            kdst = k_ptr + slot * sks + h * skh + at * skp
            tl.store(kdst + d, y1.to(k_ptr.dtype.element_ty))
            tl.store(kdst + HALF + d, y2.to(k_ptr.dtype.element_ty))
            vsrc = qkv_ptr + t * sx + (HEADS + KV_HEADS + h) * (2 * HALF)
            vdst = v_ptr + slot * sks + h * skh + at * skp
            tl.store(vdst + d, tl.load(vsrc + d).to(v_ptr.dtype.element_ty))
            tl.store(vdst + HALF + d, tl.load(vsrc + HALF + d).to(v_ptr.dtype.element_ty))

    @triton.jit
    def _slot_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,
        slots_ptr,
        pos_ptr,
        at_ptr,
        sqn,
        sqh,
        sks,
        skh,
        skp,
        son,
        soh,
        scale,
        GROUPS,
        HEAD_DIM: tl.constexpr,
        GROUPS_P2: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
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
        tl.store(
            o_ptr + tok * son + heads[:, None] * soh + d[None, :], out.to(o_ptr.dtype.element_ty), mask=gmask[:, None]
        )

    @triton.jit
    def _chunk_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        m_ptr,
        l_ptr,
        acc_ptr,
        slots_ptr,
        pos_ptr,
        at_ptr,
        sqn,
        sqh,
        sks,
        skh,
        skp,
        scale,
        GROUPS,
        KV_HEADS,
        NC,
        HEAD_DIM: tl.constexpr,
        GROUPS_P2: tl.constexpr,
        BLOCK: tl.constexpr,
        CHUNK: tl.constexpr,
        WIDEN: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """Keys [c * CHUNK, (c + 1) * CHUNK) of one (token, KV head): the running max, the sum of
        exponentials and the unnormalised output of its query heads, written to the scratch rows
        of chunk c (nothing for a chunk past the token's position). Scores and outputs as tensor-core
        products with float32 accumulation."""
        tok = tl.program_id(0)
        kvh = tl.program_id(1)
        c = tl.program_id(2)
        slot = tl.load(slots_ptr + tok)
        pos = tl.load(pos_ptr + tok)
        at = tl.load(at_ptr + tok)
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, pos + 1)
        g = tl.arange(0, GROUPS_P2)
        d = tl.arange(0, HEAD_DIM)
        heads = kvh * GROUPS + g
        gmask = g < GROUPS
        q = tl.load(q_ptr + tok * sqn + heads[:, None] * sqh + d[None, :], mask=gmask[:, None], other=0.0)
        if WIDEN:
            q = q.to(tl.float32)
        m = tl.full((GROUPS_P2,), float("-inf"), dtype=tl.float32)
        denom = tl.zeros((GROUPS_P2,), dtype=tl.float32)
        acc = tl.zeros((GROUPS_P2, HEAD_DIM), dtype=tl.float32)
        base = k_ptr + slot * sks + kvh * skh
        vbase = v_ptr + slot * sks + kvh * skh
        for start in range(lo, hi, BLOCK):
            j = start + tl.arange(0, BLOCK)
            live = j < hi
            where = tl.where(j == pos, at, j)  # the token's own key, stored at ``at``
            kb = tl.load(base + where[:, None] * skp + d[None, :], mask=live[:, None], other=0.0)
            vb = tl.load(vbase + where[:, None] * skp + d[None, :], mask=live[:, None], other=0.0)
            kb = kb.to(q.dtype)  # a bfloat16 cache under a float32 model (or widened by the interpreter)
            vb = vb.to(q.dtype)
            if IEEE:
                s = tl.dot(q, tl.trans(kb), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(kb))
            s = tl.where(live[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            pr = tl.exp(s - m_new[:, None])
            denom = denom * alpha + tl.sum(pr, axis=1)
            if IEEE:
                pv = tl.dot(pr, vb, input_precision="ieee")
            else:
                pv = tl.dot(pr.to(vb.dtype), vb)
            acc = acc * alpha[:, None] + pv
            m = m_new
        row = ((tok * KV_HEADS + kvh) * NC + c) * GROUPS + g
        keep = gmask & (lo + g * 0 <= pos)  # a chunk past the position stores nothing
        tl.store(m_ptr + row, m, mask=keep)
        tl.store(l_ptr + row, denom, mask=keep)
        tl.store(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=keep[:, None])

    @triton.jit
    def _chunk_combine_kernel(
        m_ptr,
        l_ptr,
        acc_ptr,
        o_ptr,
        pos_ptr,
        son,
        soh,
        GROUPS,
        KV_HEADS,
        NC,
        HEAD_DIM: tl.constexpr,
        GROUPS_P2: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        """A (token, KV head)'s chunks merged in chunk order: the output of its query heads."""
        tok = tl.program_id(0)
        kvh = tl.program_id(1)
        pos = tl.load(pos_ptr + tok)
        g = tl.arange(0, GROUPS_P2)
        d = tl.arange(0, HEAD_DIM)
        gmask = g < GROUPS
        m = tl.full((GROUPS_P2,), float("-inf"), dtype=tl.float32)
        denom = tl.zeros((GROUPS_P2,), dtype=tl.float32)
        acc = tl.zeros((GROUPS_P2, HEAD_DIM), dtype=tl.float32)
        for c in range(0, pos // CHUNK + 1):
            row = ((tok * KV_HEADS + kvh) * NC + c) * GROUPS + g
            mc = tl.load(m_ptr + row, mask=gmask, other=0.0)  # padding heads: finite, never stored
            lc = tl.load(l_ptr + row, mask=gmask, other=1.0)
            ac = tl.load(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=gmask[:, None], other=0.0)
            m_new = tl.maximum(m, mc)
            a = tl.exp(m - m_new)
            b = tl.exp(mc - m_new)
            denom = denom * a + lc * b
            acc = acc * a[:, None] + ac * b[:, None]
            m = m_new
        out = acc / denom[:, None]
        heads = kvh * GROUPS + g
        tl.store(
            o_ptr + tok * son + heads[:, None] * soh + d[None, :], out.to(o_ptr.dtype.element_ty), mask=gmask[:, None]
        )


@dataclasses.dataclass(frozen=True)
class Tiles:
    """How :func:`matmul` cuts a weight of N rows and K columns: output tiles of block_m x block_n,
    K in blocks of block_k, and K split into ``split`` ranges summed in a fixed order (enough
    programs in flight for a few decode rows on a narrow weight)."""

    block_m: int
    block_n: int
    block_k: int
    split: int
    num_warps: int = 4
    num_stages: int = 3


@functools.lru_cache(maxsize=None)
def tile_config(n: int, k: int, itemsize: int = 2, programs: int = 128) -> Tiles:
    """The tiles of a weight of N rows and K columns: a function of the weight's shape alone (and
    of the operands' size), never of the number of rows M multiplied, so a row's result is the
    same sequence of float32 additions whatever shares its call (batch invariance).

    128 x 128 x 64 tiles, 8 warps; K split in two, four, ... until one decode row runs at least
    ``programs`` programs (about the SMs of an H100), each range keeping 8 blocks of K or more.
    Chosen from 32 candidates per weight measured on an H100 over Llama-3-8B's weights at 1 to 512
    rows (``tools/gpu/tile_sweep.py``): close to cuBLAS at decode sizes, behind it at larger row
    counts, where one M-independent tile cannot match cuBLAS's per-shape choice; what a whole
    graphed forward costs against cuBLAS: docs/benchmarks.md#gpu."""
    block_k = 64 if k >= 64 else 32 if k >= 32 else 16  # tl.dot needs K blocks of 16 or more
    block_n = 128
    split = 1
    if triton is not None:
        tiles_n, k_blocks = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
        while tiles_n * split < programs and k_blocks // (split * 2) >= 8:
            split *= 2
    # three stages of bfloat16 tiles take 96 KiB of shared memory; float32 operands get two
    return Tiles(128, block_n, block_k, split, num_warps=8, num_stages=3 if itemsize <= 2 else 2)


def matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tiles: Tiles | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, batch-invariant: x [..., K], weight [N, K] -> [..., N] in x's
    dtype. ``tiles``: instead of :func:`tile_config` (the GPU check's tile sweep)."""
    k = x.shape[-1]
    n = weight.shape[0]
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        t = tiles or tile_config(n, k, x.element_size())
        k_split = triton.cdiv(triton.cdiv(k, t.split), t.block_k) * t.block_k
        split = triton.cdiv(k, k_split)
        partial = split > 1
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if partial else out
        grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), split)
        _matmul_kernel[grid](
            flat,
            weight,
            bias if bias is not None else weight,
            out,
            part,
            m,
            n,
            k,
            k_split,
            flat.stride(0),
            flat.stride(1),
            weight.stride(0),
            weight.stride(1),
            out.stride(0),
            out.stride(1),
            HAS_BIAS=bias is not None and not partial,
            WIDEN=_WIDEN,
            IEEE=x.dtype == torch.float32 or _WIDEN,
            PARTIAL=partial,
            BLOCK_M=t.block_m,
            BLOCK_N=t.block_n,
            BLOCK_K=t.block_k,
            num_warps=t.num_warps,
            num_stages=t.num_stages,
        )
        if partial:
            block = 1024
            _split_sum_kernel[(triton.cdiv(m * n, block),)](
                part,
                bias if bias is not None else weight,
                out,
                m,
                n,
                split,
                out.stride(0),
                out.stride(1),
                HAS_BIAS=bias is not None,
                BLOCK=block,
                num_warps=4,
            )
    return out.reshape(*x.shape[:-1], n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``layers.RMSNorm``'s arithmetic, one program per row: torch's reduction kernel picks how it
    splits a row's sum by the number of rows, so its result may depend on the batch."""
    h = x.shape[-1]
    flat = x.reshape(-1, h)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(flat.shape, dtype=x.dtype, device=x.device)
    if flat.shape[0]:
        block = triton.next_power_of_2(h)
        _rms_norm_kernel[(flat.shape[0],)](
            flat,
            weight,
            out,
            h,
            flat.stride(0),
            out.stride(0),
            eps,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    return out.reshape(x.shape)


def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    store_at: torch.Tensor,
) -> torch.Tensor:
    """One kernel for what a layer does between its fused q/k/v projection and attention: qkv
    [n, (H + 2 KVH) hd] (queries, keys, values of each token, heads in order), cos/sin [n, 1, hd];
    writes each token's roped keys and its values into the cache layer k/v [slots, KVH, max_len,
    hd] at (slots[i], store_at[i]) and returns the roped queries [n, H, hd]: ``apply_rope``'s
    arithmetic and the cache writes in one launch instead of about a dozen."""
    n, width = qkv.shape
    kv_heads, hd = k.shape[1], k.shape[-1]
    heads = width // hd - 2 * kv_heads
    half = hd // 2
    if hd % 2 or half & (half - 1) or qkv.stride(-1) != 1 or cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError("rope_store: head_dim must be twice a power of two, rows contiguous")
    if k.stride() != v.stride():
        raise ValueError("rope_store: the K and V cache layers must be laid out alike")
    q = torch.empty(n, heads, hd, dtype=qkv.dtype, device=qkv.device)
    if n:
        _rope_store_kernel[(n, heads + kv_heads)](
            qkv,
            cos,
            sin,
            q,
            k,
            v,
            slots,
            store_at,
            qkv.stride(0),
            cos.stride(0),
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            heads,
            kv_heads,
            HALF=half,
            num_warps=1,
        )
    return q


def _attention_inputs(
    name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    store_at: torch.Tensor | None,
    min_head_dim: int,
):
    """The checked arguments of the attention kernels: (tokens, head_dim, KV heads, query heads per
    KV head, q with unit last stride, store_at defaulting to positions). Raises ValueError for a
    head_dim that is not a power of two of at least ``min_head_dim`` or K/V rows laid out apart."""
    n, heads, hd = q.shape
    if hd & (hd - 1) or hd < min_head_dim or k.stride(-1) != 1 or k.stride() != v.stride():
        at_least = f" >= {min_head_dim}" if min_head_dim > 1 else ""
        raise ValueError(f"{name}: head_dim must be a power of two{at_least} and K/V alike, rows contiguous")
    kv_heads = k.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    return n, hd, kv_heads, heads // kv_heads, q, positions if store_at is None else store_at


def slot_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    store_at: torch.Tensor | None = None,
) -> torch.Tensor:
    """The contract of ``moa_serve.kernels.cpu.attention`` on the GPU: q [n, H, hd]; k/v one cache layer
    [slots, KVH, max_len, hd] (rows contiguous); token i attends to keys 0..positions[i]-1 of slot
    slots[i] and to its own key at ``store_at[i]`` (default: positions[i]). Returns [n, H, hd] in
    q's dtype. ``head_dim`` must be a power of two."""
    n, hd, kv_heads, groups, q, store_at = _attention_inputs("slot_attention", q, k, v, positions, store_at, 1)
    out = torch.empty_like(q)
    if n:
        _slot_attention_kernel[(n, kv_heads)](
            q,
            k,
            v,
            out,
            slots,
            positions,
            store_at,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            out.stride(0),
            out.stride(1),
            hd**-0.5,
            groups,
            HEAD_DIM=hd,
            GROUPS_P2=triton.next_power_of_2(groups),
            BLOCK=32,
            num_warps=4,
        )
    return out


# Tokens per launch of the chunked kernel: bounds its float32 scratch (tokens x KV heads x chunks x
# query heads per KV head x (head_dim + 2) values); the largest captured forward is one launch.
CHUNKED_MAX_TOKENS = 512
# The smallest head_dim the chunked kernel takes (tl.dot: 16 columns or more); below it, per token.
CHUNKED_MIN_HEAD_DIM = 16


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    store_at: torch.Tensor | None = None,
) -> torch.Tensor:
    """The verifier's batch-invariant attention on a GPU, :func:`slot_attention`'s contract: the
    chunked kernel (many programs per token, tensor-core products) where ``head_dim`` is
    ``CHUNKED_MIN_HEAD_DIM`` or more, else the per-token kernel. The choice depends on the model
    alone, never on the batch, and a long batch runs in launches of at most ``CHUNKED_MAX_TOKENS``
    tokens, each token's arithmetic the same in any of them."""
    if q.shape[-1] < CHUNKED_MIN_HEAD_DIM:
        return slot_attention(q, k, v, slots, positions, store_at)
    n = q.shape[0]
    if n <= CHUNKED_MAX_TOKENS:
        return chunked_slot_attention(q, k, v, slots, positions, store_at)
    parts = []
    for a in range(0, n, CHUNKED_MAX_TOKENS):
        b = min(a + CHUNKED_MAX_TOKENS, n)
        at = None if store_at is None else store_at[a:b]
        parts.append(chunked_slot_attention(q[a:b], k, v, slots[a:b], positions[a:b], at))
    return torch.cat(parts)


def attention_scratch_bytes(tokens: int, kv_heads: int, groups: int, head_dim: int, cache_len: int) -> int:
    """The float32 scratch one :func:`attention` launch of ``tokens`` tokens holds (0 for the
    per-token kernel)."""
    if head_dim < CHUNKED_MIN_HEAD_DIM:
        return 0
    chunks = -(-cache_len // attention_chunk(cache_len))
    return min(tokens, CHUNKED_MAX_TOKENS) * kv_heads * chunks * groups * (head_dim + 2) * 4


def attention_chunk(cache_len: int) -> int:
    """Keys per program of :func:`chunked_slot_attention` for a cache of ``cache_len`` positions:
    256, or more so that a cache splits into at most 32 chunks. A function of the cache alone, so
    every call of a replica chunks a token's keys the same way (batch invariance)."""
    return max(256, 1 << (-(-cache_len // 32) - 1).bit_length())


def chunked_slot_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    store_at: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`slot_attention`'s contract, a token's keys split into fixed chunks
    (:func:`attention_chunk`) that run side by side, then merged in chunk order by a second
    kernel (flash-decoding with a split that depends on the cache, never on the batch): one decode
    row at a long context keeps many programs busy where :func:`slot_attention` runs one per KV
    head. Query heads of a KV head are one tensor-core product (padded to 16 rows)."""
    n, hd, kv_heads, groups, q, store_at = _attention_inputs(
        "chunked_slot_attention", q, k, v, positions, store_at, CHUNKED_MIN_HEAD_DIM
    )
    cache_len = k.shape[2]
    out = torch.empty_like(q)
    if n:
        chunk = attention_chunk(cache_len)
        nc = triton.cdiv(cache_len, chunk)
        m = torch.empty(n * kv_heads * nc * groups, dtype=torch.float32, device=q.device)
        denom = torch.empty_like(m)
        acc = torch.empty(m.shape[0], hd, dtype=torch.float32, device=q.device)
        gp2 = max(16, triton.next_power_of_2(groups))  # tl.dot takes 16 rows or more
        _chunk_attention_kernel[(n, kv_heads, nc)](
            q,
            k,
            v,
            m,
            denom,
            acc,
            slots,
            positions,
            store_at,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            hd**-0.5,
            groups,
            kv_heads,
            nc,
            HEAD_DIM=hd,
            GROUPS_P2=gp2,
            BLOCK=64,
            CHUNK=chunk,
            WIDEN=_WIDEN,
            IEEE=q.dtype == torch.float32 or _WIDEN,
            num_warps=4,
        )
        _chunk_combine_kernel[(n, kv_heads)](
            m,
            denom,
            acc,
            out,
            positions,
            out.stride(0),
            out.stride(1),
            groups,
            kv_heads,
            nc,
            HEAD_DIM=hd,
            GROUPS_P2=triton.next_power_of_2(groups),
            CHUNK=chunk,
            num_warps=4,
        )
    return out
