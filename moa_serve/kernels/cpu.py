"""CPU kernels for weights kept in their GGUF block formats (Q4_1, Q8_0) or in bfloat16, float32 math.

``qmatmul.c`` is compiled with the system C compiler the first time it is needed on a machine
(about a second; cached under ``moa_serve.local_cache.cache_dir()/kernels``, keyed by the source, the
flags and the compiler) and called through ctypes. It needs x86-64 with AVX2, FMA and F16C; on
anything else :func:`library` returns None and callers keep plain float32 weights and torch's
attention (``MOA_KERNELS=off`` does the same on purpose).

Why: on a CPU, decoding a small model is bound by reading its weights. SmolLM2-135M's float32
matrices are 540 MB per forward; in Q4_1/Q8_0 blocks they are 100 MB. The blocks are
de-quantized in registers to exactly the float32 values a float32 de-quantization gives (d*q is
exact in float32), so the model computed is the same one, and every output is one dot product
accumulated in a fixed order: a token's logits do not depend on how many tokens share the call.

Matmul precision ``medium`` (as torch's ``set_float32_matmul_precision``): on CPUs with AVX512-BF16
the same matrices multiply bfloat16-rounded activations and weights (VDPBF16PS, float32 sums in a
fixed order, so still batch-invariant), twice the multiply rate of float32 FMAs; everything between
the matmuls stays float32. Matmul precision ``low``: each row of activations is rounded to blocks
of 32 8-bit values and a scale and multiplied by the Q4_1 / Q8_0 integers (VPMADDUBSW, exact int32
block sums, float32 sums of the blocks in a fixed order), which is llama.cpp's CPU arithmetic for
these formats; it needs AVX2 only.

A bfloat16 model gets the same guarantee from bf16 weights (widened to float32 in registers, exact)
and a bf16 variant of the attention kernel: torch's bf16 attention rounds differently for a
different number of queries, and its bf16 GEMM may pick kernels by the number of rows.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from moa_serve.local_cache import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qmatmul.c")
HEADERS = [Path(__file__).with_name("qmatmul_x8.h")]  # included by qmatmul.c
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
REQUIRED_CPU_FLAGS = {"avx2", "fma", "f16c"}
BF16_DOT_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}  # bfloat16 products (VDPBF16PS)
VNNI_CPU_FLAGS = {"avx512f", "avx512vl", "avx512_vnni"}  # 8-bit products summed by VPDPBUSD (same bits as AVX2)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why_not = ""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compile(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    sources = SOURCE.read_bytes() + b"".join(h.read_bytes() for h in HEADERS)
    key = hashlib.sha256(sources + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"qmatmul-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}.so")
    proc = subprocess.run([cc, *FLAGS, "-o", str(tmp), str(SOURCE), "-lm"], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{cc} failed to build {SOURCE.name}: {proc.stderr.strip()[-2000:]}")
    os.replace(tmp, out)  # atomic: concurrent replicas may build at the same time
    return out


def switched_off(variable: str) -> bool:
    """True when the environment variable turns a kernel path off (0 / off / false / no)."""
    return os.environ.get(variable, "auto").lower() in ("0", "off", "false", "no")


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None when this machine cannot build or run them (reason in
    :func:`unavailable_reason`)."""
    global _lib, _tried, _why_not
    with _lock:
        if _tried:
            return _lib
        _tried = True
        missing = REQUIRED_CPU_FLAGS - _cpu_flags()
        cc = shutil.which(os.environ.get("CC", "gcc"))
        if switched_off("MOA_KERNELS"):
            _why_not = "MOA_KERNELS=off"
        elif missing:
            _why_not = f"the CPU lacks {', '.join(sorted(missing))}"
        elif cc is None:
            _why_not = "no C compiler (gcc, or $CC) on PATH"
        else:
            try:
                lib = ctypes.CDLL(str(_compile(cc)))
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _why_not = str(e)
            else:
                i64, ptr, i32, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
                lib.moa_packed_matmul.argtypes = [i32, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i32]
                lib.moa_bf16dot_compiled.argtypes = []
                lib.moa_bf16dot_compiled.restype = i32
                lib.moa_int8_vnni.argtypes = [i32]
                lib.moa_int8_vnni.restype = i32
                lib.moa_int8_vnni(int(_vnni_wanted()))
                lib.moa_q4_1_rows.argtypes = [ptr, ptr, ptr, i64, ptr, i64, ptr]
                lib.moa_q8_0_rows.argtypes = [ptr, ptr, i64, ptr, i64, ptr]
                # the C signatures (qmatmul.c), each parameter named beside its type
                # fmt: off
                lib.moa_attention.argtypes = [
                    ptr, i64, i64, i64, i64, ptr, ptr,  # q, n, H, KVH, hd, k, v
                    i64, i64, i64, ptr, ptr, ptr,  # ss, hs, ps, slots, pos, store_at
                    f32, ptr, i64, i32,  # scale, out, max_len, threads
                ]
                # fmt: on
                lib.moa_attention_bf16.argtypes = lib.moa_attention.argtypes
                # fmt: off
                lib.moa_decoder_layers.argtypes = [
                    ptr, i64, i64, i64, ptr, f32,  # x, n, H, layers, params, eps
                    i64, i64, i64, i64, ptr, ptr,  # heads, kv_heads, hd, inter, cos, sin
                    ptr, ptr, ptr, i64, i64, i64,  # slots, pos, store_at, ss, hs, ps
                    i64, i32, i32,  # max_len, kv_bf16, threads
                ]
                # fmt: on
                for f in (
                    lib.moa_packed_matmul,
                    lib.moa_q4_1_rows,
                    lib.moa_q8_0_rows,
                    lib.moa_attention,
                    lib.moa_attention_bf16,
                    lib.moa_decoder_layers,
                ):
                    f.restype = None
                _lib = lib
        if _lib is None:
            log.warning("packed-weight kernels unavailable (%s): plain torch weights and attention are used", _why_not)
        return _lib


def _vnni_wanted() -> bool:
    return VNNI_CPU_FLAGS <= _cpu_flags() and not switched_off("MOA_VNNI")


def int8_vnni_in_use() -> bool:
    """True when 8-bit products (matmul precision ``low``) are summed by AVX512-VNNI here (the same
    bits as the AVX2 path; ``MOA_VNNI=off`` keeps AVX2)."""
    lib = library()
    return lib is not None and bool(lib.moa_int8_vnni(int(_vnni_wanted())))


def unavailable_reason() -> str:
    library()
    return _why_not


@functools.cache
def _bf16_dot_here() -> bool:
    """The build has the bfloat16-product kernels and the CPU the instructions (asked once: this is
    on every matmul's path, and /proc/cpuinfo does not change)."""
    lib = library()
    return lib is not None and bool(lib.moa_bf16dot_compiled()) and BF16_DOT_CPU_FLAGS <= _cpu_flags()


def bf16_dot_available() -> bool:
    """True when the kernels run here and the CPU multiplies bfloat16 pairs natively (AVX512-BF16):
    what matmul precision ``medium`` needs (``MOA_BF16_DOT=off`` says no on purpose)."""
    return _bf16_dot_here() and not switched_off("MOA_BF16_DOT")


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _on_cpu(*tensors: torch.Tensor | None) -> None:
    """The kernels read host memory through raw pointers: a device tensor here is a caller's bug
    (a CUDA model keeps torch's layers and attention), refused before any pointer is taken."""
    for t in tensors:
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"the packed CPU kernels got a tensor on {t.device}: they run on CPU tensors only")


KIND_IDS = {"q4_1": 0, "q8_0": 1, "bf16": 2}  # moa_packed_matmul's kinds (qmatmul.c)
# what the matmul multiplies: float32 values, bfloat16-rounded ones (AVX512-BF16), or x rounded to
# 8-bit blocks times the weights' own integers (Q4_1 / Q8_0 weights, as llama.cpp's CPU backend)
PRODUCTS = {"float32": 0, "bfloat16": 3, "int8": 6}


def kind_id(kind: str, products: str = "float32") -> int:
    """The kernel's number for a packed matrix kind multiplied with ``products`` (:data:`PRODUCTS`)."""
    if products == "int8" and kind == "bf16":
        raise ValueError("8-bit products are for Q4_1 / Q8_0 weights; bf16 weights multiply in float32 or bfloat16")
    return KIND_IDS[kind] + PRODUCTS[products]


def packed_matmul(
    kind: str,
    products: str,
    x: torch.Tensor,
    qs: torch.Tensor,
    d: torch.Tensor | None,
    m: torch.Tensor | None,
    n: int | None = None,
) -> torch.Tensor:
    """x [M, K] float32 @ W.T for W [N, K] packed as ``kind``: ``q4_1`` (qs uint8 [N, K/2], d/m float32
    [N, K/32]), ``q8_0`` (qs int8 [N, K], d float32 [N, K/32]) or ``bf16`` (qs: the bfloat16 bits,
    contiguous 16-bit [N, K]); K a multiple of 32. ``products``: ``float32``; ``bfloat16`` (x and W
    rounded to bfloat16, products summed in float32; needs :func:`bf16_dot_available`); ``int8``
    (each row of x rounded to blocks of 32 8-bit values and a scale, multiplied by the Q4_1 / Q8_0
    integers, as llama.cpp's CPU backend; qs/d/m then in ``packed.interleave8``'s layout and ``n``
    the number of rows). The order of every sum is fixed in all three."""
    _on_cpu(x, qs, d, m)
    lib = library()
    if products == "bfloat16" and not bf16_dot_available():
        raise RuntimeError("bfloat16 products need a CPU with AVX512-BF16 (avx512_bf16)")
    rows, k = x.shape
    n = qs.shape[0] if n is None else n
    if kind == "bf16" and (qs.shape[1] != k or k % 32 or qs.element_size() != 2 or not qs.is_contiguous()):
        raise ValueError(f"bf16 matmul: W must be contiguous 16-bit [N, {k}] with K a multiple of 32")
    x = x.contiguous()
    y = torch.empty(rows, n, dtype=torch.float32)
    lib.moa_packed_matmul(
        kind_id(kind, products),
        _ptr(x),
        rows,
        k,
        _ptr(qs),
        0 if d is None else _ptr(d),
        0 if m is None else _ptr(m),
        n,
        _ptr(y),
        torch.get_num_threads(),
    )
    return y


def dequantize_rows(
    kind: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, ids: torch.Tensor
) -> torch.Tensor:
    """Rows ``ids`` of a packed matrix as float32 [len(ids), K] (through the same de-quantization
    the matmul uses)."""
    lib = library()
    k = d.shape[1] * 32
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(len(ids), k, dtype=torch.float32)
    if kind == "q4_1":
        lib.moa_q4_1_rows(_ptr(qs), _ptr(d), _ptr(m), k, _ptr(ids), len(ids), _ptr(out))
    else:
        lib.moa_q8_0_rows(_ptr(qs), _ptr(d), k, _ptr(ids), len(ids), _ptr(out))
    return out


def _store_at(store_at: torch.Tensor | None, positions: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """``store_at`` as a contiguous int64 tensor and its address (None, 0: every token at its position)."""
    if store_at is None:
        return None, 0
    store_at = store_at.to(torch.int64).contiguous()
    if store_at.shape != positions.shape:
        raise ValueError("store_at must give one cache position per token")
    return store_at, _ptr(store_at)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    store_at: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over one layer of a slot KV cache, batch-invariant:
    q [n, H, hd]; k/v [slots, KVH, max_len, hd] float32 or bfloat16 (a view of the cache, strided
    is fine as long as the last dim is contiguous); token i attends to keys 0..positions[i] of
    slot slots[i] (its own K/V must already be written). ``store_at`` [n] (default: positions):
    where each token's own K/V is stored; token i then attends to keys 0..positions[i]-1 and its
    own at store_at[i], in the same order (a tree-draft alternative, stored past the chain it
    branches from). Computed in float32 (a bf16 cache is widened in registers); returns [n, H, hd]
    in q's dtype."""
    _on_cpu(q, k, v, slots, positions, store_at)
    lib = library()
    n, heads, hd = q.shape
    kv_heads, max_len = k.shape[1], k.shape[2]
    if hd % 8 or hd > 256 or k.stride(-1) != 1 or k.stride() != v.stride() or k.dtype != v.dtype:
        raise ValueError(
            "attention kernel: head_dim must be a multiple of 8 up to 256, K/V alike and contiguous per row"
        )
    if k.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"attention kernel: float32 or bfloat16 K/V; got {k.dtype}")
    dtype = q.dtype
    kernel = lib.moa_attention if k.dtype == torch.float32 else lib.moa_attention_bf16
    q = q.to(torch.float32).contiguous()
    slots = slots.to(torch.int64).contiguous()
    positions = positions.to(torch.int64).contiguous()
    store_at, at_ptr = _store_at(store_at, positions)
    out = torch.empty_like(q)
    ss, hs, ps, _ = k.stride()
    kernel(
        _ptr(q),
        n,
        heads,
        kv_heads,
        hd,
        _ptr(k),
        _ptr(v),
        ss,
        hs,
        ps,
        _ptr(slots),
        _ptr(positions),
        at_ptr,
        hd**-0.5,
        _ptr(out),
        max_len,
        torch.get_num_threads(),
    )
    return out.to(dtype)


LAYER_PARAMS = 24  # int64 slots per layer in moa_decoder_layers' parameter block (qmatmul.c, LP_SIZE)


def decoder_layers(
    x: torch.Tensor,
    params: torch.Tensor,
    eps: float,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    cache_strides: tuple[int, int, int],
    max_len: int,
    kv_bf16: bool = False,
    store_at: torch.Tensor | None = None,
) -> torch.Tensor:
    """Runs ``params.shape[0]`` fused float32 decoder layers over x [n, hidden] (in place; see
    ``moa_decoder_layers`` in qmatmul.c): cos/sin [n, head_dim], slots/positions [n] int64, the
    layers' K/V caches named in ``params`` with element strides (slot, head, position), float32 or
    (``kv_bf16``) bfloat16; ``store_at`` as in :func:`attention`."""
    _on_cpu(x, params, cos, sin, slots, positions, store_at)
    lib = library()
    n, hidden = x.shape
    if not (
        x.dtype == cos.dtype == sin.dtype == torch.float32
        and x.is_contiguous()
        and cos.is_contiguous()
        and sin.is_contiguous()
    ):
        raise ValueError("decoder_layers: x, cos and sin must be contiguous float32")
    slots = slots.to(torch.int64).contiguous()
    positions = positions.to(torch.int64).contiguous()
    store_at, at_ptr = _store_at(store_at, positions)
    ss, hs, ps = cache_strides
    lib.moa_decoder_layers(
        _ptr(x),
        n,
        hidden,
        params.shape[0],
        _ptr(params),
        eps,
        heads,
        kv_heads,
        head_dim,
        intermediate,
        _ptr(cos),
        _ptr(sin),
        _ptr(slots),
        _ptr(positions),
        at_ptr,
        ss,
        hs,
        ps,
        max_len,
        int(kv_bf16),
        torch.get_num_threads(),
    )
    return x
