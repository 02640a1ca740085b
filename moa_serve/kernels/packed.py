"""Target weights kept in their GGUF blocks: ``PackedLinear`` modules swapped into a float32
``TargetModel`` loaded from a GGUF folder; or, for a bfloat16 ``TargetModel`` (any source), its
own bf16 weights behind the same fixed-order kernel (:func:`pack_bf16`), so that a token's
output does not depend on the batch in bf16 either.

Each GGUF matrix is read from the GGUF file, repacked (per-block scales as float32 next to the
quantized values) and checked bitwise against the float32 weight the model was loaded with (the
de-quantization transformers does); rows are matched by content, so the Q/K row permutation
transformers applies to llama GGUFs is carried over whatever it is. A matrix that is not a
supported block type, or does not match, keeps its float32 weight.
"""

from __future__ import annotations

import glob
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from moa_serve.kernels import cpu as cpu_kernels

log = logging.getLogger(__name__)

BLOCK = 32
_BYTES_PER_BLOCK = {"Q4_1": 20, "Q8_0": 34}

# GGUF tensor name -> Hugging Face module path (llama family)
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_module_name(gguf_name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return {"token_embd.weight": "lm_head", "output.weight": "lm_head"}.get(gguf_name)


@dataclass
class PackedMatrix:
    """W [N, K] in blocks of 32 along K: ``q4_1`` (qs uint8 [N, K/2], d, m float32 [N, K/32]),
    ``q8_0`` (qs int8 [N, K], d float32 [N, K/32]) or ``bf16`` (qs: the bfloat16 weights' bits as
    int16 [N, K], no scales). ``products`` (``cpu_kernels.PRODUCTS``): ``float32``; ``bfloat16`` rounds x
    and W to bfloat16 and sums their products in float32 (matmul precision ``medium``; AVX512-BF16
    CPUs); ``int8`` rounds x to 8-bit blocks and multiplies the weights' integers (precision ``low``;
    Q4_1 / Q8_0 only)."""

    kind: str
    qs: torch.Tensor
    d: torch.Tensor | None
    m: torch.Tensor | None
    products: str = "float32"
    _interleaved: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def shape(self) -> tuple[int, int]:
        if self.kind == "bf16":
            return tuple(self.qs.shape)
        return self.qs.shape[0], self.d.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    @classmethod
    def from_gguf(cls, tensor) -> "PackedMatrix":
        """From a ``gguf.GGUFReader`` tensor of type Q4_1 or Q8_0 (rows in file order)."""
        kind = tensor.tensor_type.name
        k, n = int(tensor.shape[0]), int(tensor.shape[1])
        raw = np.asarray(tensor.data).reshape(n * (k // BLOCK), _BYTES_PER_BLOCK[kind])
        d = torch.from_numpy(raw[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(n, k // BLOCK))
        if kind == "Q4_1":
            m = torch.from_numpy(raw[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(n, k // BLOCK))
            return cls("q4_1", torch.from_numpy(raw[:, 4:].copy().reshape(n, k // 2)), d, m)
        return cls("q8_0", torch.from_numpy(raw[:, 2:].copy().view(np.int8).reshape(n, k)), d, None)

    @classmethod
    def from_bf16(cls, weight: torch.Tensor) -> "PackedMatrix":
        """A bfloat16 [N, K] weight (K a multiple of 32) as its bits: shares the weight's storage
        when it is contiguous."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % BLOCK:
            raise ValueError(f"bf16 packing needs a bfloat16 [N, K] weight with K a multiple of {BLOCK}")
        return cls("bf16", weight.detach().contiguous().view(torch.int16), None, None)

    def rows(self, ids: torch.Tensor) -> "PackedMatrix":
        pick = lambda t: None if t is None else t[ids].contiguous()  # noqa: E731
        return PackedMatrix(self.kind, pick(self.qs), pick(self.d), pick(self.m), self.products)

    @staticmethod
    def cat(parts: list["PackedMatrix"]) -> "PackedMatrix":
        kinds = {(p.kind, p.products) for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot stack packed matrices of kinds {sorted(kinds)}")
        join = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
        return PackedMatrix(
            parts[0].kind,
            torch.cat([p.qs for p in parts]),
            join([p.d for p in parts]),
            join([p.m for p in parts]),
            parts[0].products,
        )

    def dequantize(self) -> torch.Tensor:
        """W as float32 [N, K]."""
        if self.kind == "bf16":
            return self.qs.view(torch.bfloat16).float()
        return cpu_kernels.dequantize_rows(self.kind, self.qs, self.d, self.m, torch.arange(self.shape[0]))

    def operands(self) -> tuple:
        """(qs, d, m) as the kernel for ``products`` reads them: the blocks as stored, or for ``int8``
        their copy interleaved 8 rows at a time (:func:`interleave8`, made once)."""
        if self.products != "int8":
            return self.qs, self.d, self.m
        if self._interleaved is None:
            self._interleaved = interleave8(self.kind, self.qs, self.d, self.m)
        return self._interleaved

    def matmul_t(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 -> x @ W.T [M, N] float32."""
        return cpu_kernels.packed_matmul(self.kind, self.products, x, *self.operands(), n=self.shape[0])


def interleave8(kind: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> tuple:
    """A Q4_1 / Q8_0 matrix in the layout of the 8-bit-product kernel (qmatmul.c, ``x8_tile``): rows
    in groups of 8 (the last group padded with copies of the last row, whose outputs are never
    stored), and for each group and block the 4 consecutive elements v*4..v*4+3 of the 8 rows side
    by side (Q4_1: elements 16 apart share a byte, low and high nibble); scales [groups, K/32, 8]."""
    if kind not in ("q4_1", "q8_0"):
        raise ValueError(f"8-bit products are for Q4_1 / Q8_0 weights, not {kind}")
    n, nb = d.shape
    groups, pad = (n + 7) // 8, -n % 8

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t[-1:].expand(pad, *t.shape[1:])]) if pad else t

    if kind == "q4_1":
        q = qs.view(n, nb, 16)
        values = padded(torch.cat([q & 0x0F, q >> 4], dim=2)).view(groups, 8, nb, 8, 4)
        blocks = values[:, :, :, :4] | (values[:, :, :, 4:] << 4)  # [groups, row, block, v, e]
    else:
        blocks = padded(qs.view(n, nb, 32)).view(groups, 8, nb, 8, 4)
    lanes = lambda t: None if t is None else padded(t).view(groups, 8, nb).permute(0, 2, 1).contiguous()  # noqa: E731
    return blocks.permute(0, 2, 3, 1, 4).contiguous(), lanes(d), lanes(m)


class PackedLinear(nn.Module):
    """A bias-optional linear layer over a :class:`PackedMatrix` (float32 in, float32 out; a
    ``bf16`` matrix also takes bfloat16 in: widened exactly, float32 sums, the output rounded to
    bfloat16 once). ``weight`` stays readable (de-quantized on demand, or the model's own tensor
    it shares: the tied embeddings, a bf16 weight)."""

    def __init__(self, packed: PackedMatrix, bias: torch.Tensor | None = None, dense: torch.Tensor | None = None):
        super().__init__()
        self.packed = packed
        self.bias = bias
        self._dense = dense

    @property
    def weight(self) -> torch.Tensor:
        return self._dense if self._dense is not None else self.packed.dequantize()

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1]
        flat = x.reshape(-1, k)
        dtype = flat.dtype
        if dtype == torch.bfloat16 and self.packed.kind == "bf16":
            flat = flat.float()
        elif dtype != torch.float32:
            raise TypeError(f"PackedLinear computes in float32 (bfloat16 too for bf16 weights); got {dtype}")
        out = self.packed.matmul_t(flat) if flat.shape[0] else flat.new_zeros(0, self.out_features)
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        n, k = self.packed.shape
        products = "" if self.packed.products == "float32" else f", {self.packed.products} products"
        return f"{k} -> {n}, {self.packed.kind}{products}, {self.packed.nbytes / 2**20:.1f} MiB"


def _match_rows(packed: PackedMatrix, dense: torch.Tensor) -> torch.Tensor | None:
    """The permutation p with packed.rows(p) bitwise equal to ``dense``, or None."""
    if tuple(dense.shape) != packed.shape or dense.dtype != torch.float32:
        return None
    mine = packed.dequantize()
    if torch.equal(mine, dense):
        return torch.arange(dense.shape[0])
    index = {mine[i].numpy().tobytes(): i for i in range(mine.shape[0])}
    perm = [index.get(dense[i].numpy().tobytes()) for i in range(dense.shape[0])]
    if any(p is None for p in perm):
        return None
    return torch.tensor(perm)


def gguf_file(path: Path) -> str | None:
    files = sorted(glob.glob(str(Path(path) / "*.gguf")))
    return files[0] if files else None


# matmul precision -> what the packed matmuls multiply (cpu_kernels.PRODUCTS)
PRECISION_PRODUCTS = {"highest": "float32", "medium": "bfloat16", "low": "int8"}
MATMUL_PRECISIONS = tuple(PRECISION_PRODUCTS)


def pack_target(model: nn.Module, path: Path, matmul_precision: str = "highest") -> dict:
    """Swaps the float32 linear layers of ``model`` (a ``TargetModel`` loaded from the GGUF in
    ``path``) for :class:`PackedLinear` over the file's blocks; a bfloat16 CPU model (GGUF or
    not) gets :func:`pack_bf16` instead. ``matmul_precision`` as torch's
    ``set_float32_matmul_precision``: ``highest`` multiplies in float32; ``medium`` multiplies
    bfloat16-rounded activations and weights (float32 sums, everything else float32) where the CPU
    has AVX512-BF16, and is ``highest`` elsewhere; ``low`` rounds activations to 8-bit blocks and
    multiplies the GGUF's Q4_1 / Q8_0 integers (llama.cpp's CPU arithmetic for these formats; AVX2).
    Returns what was done:
    ``{"packed": n, "kept": [names...], "bytes": packed bytes, "dense_bytes": float32 bytes,
    "matmul_precision": the one in force}``; ``{"packed": 0, "reason": ...}`` when nothing could be
    packed."""
    if matmul_precision not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)}; got {matmul_precision!r}")
    on_cpu = next(model.parameters()).device.type == "cpu"
    dtype = model.model.embed_tokens.weight.dtype
    if not on_cpu:  # a GPU target keeps torch's layers (cuBLAS, SDPA); the kernels are never built there
        return {"packed": 0, "reason": f"packed kernels run on CPU; the target is on {next(model.parameters()).device}"}
    if dtype == torch.bfloat16:
        return pack_bf16(model)
    gguf_path = gguf_file(path)
    if gguf_path is None:
        return {"packed": 0, "reason": "no GGUF file: the weights are not block-quantized"}
    if cpu_kernels.library() is None:
        return {"packed": 0, "reason": cpu_kernels.unavailable_reason()}
    if dtype != torch.float32:
        return {"packed": 0, "reason": "packed kernels run float32 (or bfloat16) on CPU"}
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    modules = dict(model.named_modules())
    packed, kept, nbytes, dense_bytes = 0, [], 0, 0
    for tensor in reader.tensors:
        name = hf_module_name(tensor.name)
        if name is None or name not in modules:
            continue
        module = modules[name]
        dense = module.weight.detach()
        if tensor.tensor_type.name not in _BYTES_PER_BLOCK:
            kept.append(f"{name} ({tensor.tensor_type.name})")
            continue
        matrix = PackedMatrix.from_gguf(tensor)
        perm = _match_rows(matrix, dense)
        if perm is None:
            kept.append(f"{name} (does not match the loaded weights)")
            continue
        if not torch.equal(perm, torch.arange(len(perm))):
            matrix = matrix.rows(perm)
        tied = name == "lm_head" and dense.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        bias = getattr(module, "bias", None)
        replacement = PackedLinear(matrix, None if bias is None else bias.detach(), dense if tied else None)
        parent, _, attr = name.rpartition(".")
        setattr(modules[parent] if parent else model, attr, replacement)
        packed += 1
        nbytes += matrix.nbytes
        dense_bytes += dense.numel() * 4
    fused = fuse_projections(model.model.layers)
    precision = "highest"
    if matmul_precision == "medium" and not cpu_kernels.bf16_dot_available():
        log.warning("matmul precision medium needs AVX512-BF16; this CPU multiplies in float32 (highest)")
    elif matmul_precision != "highest":
        precision = matmul_precision
        for module in model.modules():
            if isinstance(module, PackedLinear):
                module.packed.products = PRECISION_PRODUCTS[precision]
                module.packed.operands()  # int8: the interleaved copy made here, not in the first request
    model.fused_stack = FusedStack.build(model)
    if kept:
        log.warning("kept float32 for %d matrices: %s", len(kept), ", ".join(kept[:5]))
    return {
        "packed": packed,
        "kept": kept,
        "bytes": nbytes,
        "dense_bytes": dense_bytes,
        "fused": fused,
        "fused_layers": model.fused_stack is not None,
        "matmul_precision": precision,
    }


def _linear_layers(module: nn.Module):
    """(parent, attribute, dotted name, layer) of every ``nn.Linear`` in ``module``, listed before
    any is swapped."""
    return [
        (parent, attr, f"{parent_name}.{attr}" if parent_name else attr, child)
        for parent_name, parent in list(module.named_modules())
        for attr, child in list(parent.named_children())
        if isinstance(child, nn.Linear)
    ]


def _swap_for_bf16(parent: nn.Module, attr: str, layer: nn.Linear, bits: torch.Tensor) -> int:
    """Replaces ``parent.attr`` by a :class:`PackedLinear` over ``bits`` (the layer's weights as
    bfloat16), the layer's own weight staying readable; returns the packed bytes."""
    bias = None if layer.bias is None else layer.bias.detach()
    setattr(parent, attr, PackedLinear(PackedMatrix.from_bf16(bits), bias, layer.weight.detach()))
    return bits.numel() * 2


def pack_bf16(model: nn.Module) -> dict:
    """Swaps every bfloat16 ``nn.Linear`` of ``model`` (a CPU ``TargetModel``: the projections and
    the LM head) for a :class:`PackedLinear` over its own weights (``bf16`` kind, sharing their
    storage), then fuses q/k/v and gate/up. Each output is a fixed-order float32 dot product, so a
    token's result does not depend on how many rows share the call (torch's bf16 GEMM may pick
    a kernel by the number of rows). Same report as :func:`pack_target`; a weight whose input
    size is not a multiple of 32 stays a torch layer."""
    if cpu_kernels.library() is None:
        return {"packed": 0, "reason": cpu_kernels.unavailable_reason()}
    packed, kept, nbytes = 0, [], 0
    for parent, attr, name, module in _linear_layers(model):
        if module.weight.dtype != torch.bfloat16:
            continue
        if module.weight.device.type != "cpu" or module.in_features % BLOCK:
            kept.append(f"{name} (in_features {module.in_features})")
            continue
        nbytes += _swap_for_bf16(parent, attr, module, module.weight.detach())
        packed += 1
    fused = fuse_projections(model.model.layers)
    _share_fused_storage(model)
    if kept:
        log.warning("kept torch bf16 layers for %d matrices: %s", len(kept), ", ".join(kept[:5]))
    return {"packed": packed, "kept": kept, "bytes": nbytes, "dense_bytes": nbytes, "fused": fused}


def pack_bf16_exact(module: nn.Module) -> dict:
    """Swaps every float32 CPU linear layer of ``module`` (a drafter's halves) whose weights are
    exactly bfloat16 values — drafter checkpoints are stored in bf16 — for a :class:`PackedLinear`
    over those bf16 bits: the same weights, half the bytes read per call (drafting one token at a
    time is bound by reading its weights), float32 sums in a fixed order. The float32 weight stays
    the layer's readable ``weight``. A layer whose weights are not bf16 values, or whose input
    size is not a multiple of 32, stays as it is. Returns {"packed": n, "bytes": bf16 bytes}."""
    if cpu_kernels.library() is None:
        return {"packed": 0, "bytes": 0, "reason": cpu_kernels.unavailable_reason()}
    packed, nbytes = 0, 0
    for parent, attr, _, layer in _linear_layers(module):
        weight = layer.weight.detach()
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or layer.in_features % BLOCK:
            continue
        bits = weight.to(torch.bfloat16)
        if torch.equal(bits.float(), weight):
            nbytes += _swap_for_bf16(parent, attr, layer, bits)
            packed += 1
    return {"packed": packed, "bytes": nbytes}


def for_inference(module: nn.Module, device, dtype: torch.dtype) -> nn.Module:
    """A drafter half (e.g. the verifier-side LSA feature head) on ``device``/``dtype`` in eval mode,
    its bf16-valued linear layers packed (:func:`pack_bf16_exact`) when it runs in float32 on a CPU."""
    module = module.to(device, dtype).eval()
    if dtype == torch.float32 and torch.device(device).type == "cpu":
        pack_bf16_exact(module)
    return module


def _share_fused_storage(model: nn.Module) -> None:
    """Points the q/k/v and gate/up layers of a bf16 model at row slices of their fused matrix
    (same values), so the model holds those weights once, not twice."""
    for layer in model.model.layers:
        for fused, parts in (
            (layer.self_attn.qkv, ("q_proj", "k_proj", "v_proj")),
            (layer.mlp.gate_up, ("gate_proj", "up_proj")),
        ):
            if fused is None or fused.packed.kind != "bf16":
                continue
            owner = layer.self_attn if parts[0] == "q_proj" else layer.mlp
            start = 0
            for attr in parts:
                part = getattr(owner, attr)
                rows = fused.packed.qs[start : start + part.out_features]
                part.packed = PackedMatrix("bf16", rows, None, None)
                part._dense = rows.view(torch.bfloat16)
                start += part.out_features


def packed_lm_head(lm_head: nn.Module, path: Path | None, rows: torch.Tensor | None = None) -> PackedMatrix | None:
    """The LM head (or its ``rows``, e.g. a drafter's draft vocabulary) as a packed matrix, for a
    drafter that borrows the target's head: taken from a target already packed, or read from the
    target's GGUF and checked bitwise against the float32 weight it was loaded with. None when
    that is not possible (no GGUF, not float32 on CPU, no kernels)."""
    if isinstance(lm_head, PackedLinear):
        matrix = lm_head.packed
    else:
        weight = lm_head.weight
        gguf_path = gguf_file(path) if path is not None else None
        if (
            gguf_path is None
            or weight.dtype != torch.float32
            or weight.device.type != "cpu"
            or cpu_kernels.library() is None
        ):
            return None
        import gguf

        tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
        tensor = tensors.get("output.weight") or tensors.get("token_embd.weight")
        if tensor is None or tensor.tensor_type.name not in _BYTES_PER_BLOCK:
            return None
        matrix = PackedMatrix.from_gguf(tensor)
        perm = _match_rows(matrix, weight.detach())
        if perm is None:
            return None
        if not torch.equal(perm, torch.arange(len(perm))):
            matrix = matrix.rows(perm)
    return matrix.rows(rows.cpu()) if rows is not None else matrix


def fuse_projections(layers) -> int:
    """Per decoder layer, [q; k; v] and [gate; up] as one packed matrix each (fewer, larger kernel
    calls; every output row is still its own dot product, so the values are the same)."""
    fused = 0
    for layer in layers:
        a, mlp = layer.self_attn, layer.mlp
        qkv = [a.q_proj, a.k_proj, a.v_proj]
        if all(isinstance(m, PackedLinear) and m.bias is None for m in qkv) and len({m.packed.kind for m in qkv}) == 1:
            a.qkv = PackedLinear(PackedMatrix.cat([m.packed for m in qkv]))
            fused += 1
        gu = [mlp.gate_proj, mlp.up_proj]
        if all(isinstance(m, PackedLinear) and m.bias is None for m in gu) and len({m.packed.kind for m in gu}) == 1:
            mlp.gate_up = PackedLinear(PackedMatrix.cat([m.packed for m in gu]))
            fused += 1
    return fused


class FusedStack:
    """Llama decoder layers whose projections are packed (fused q/k/v and gate/up, no biases,
    float32 norms) as one kernel call per forward (``cpu_kernels.decoder_layers``): the per-op cost of
    ~40 small torch ops per layer disappears from every decode step. :func:`pack_target` builds
    one for all layers of a float32 ``TargetModel``; :meth:`for_layers` for any such layers (a
    drafter's self-attention layer over its own cache). ``MOA_FUSED_LAYERS=off`` keeps the
    per-layer torch path."""

    KINDS = cpu_kernels.KIND_IDS

    def __init__(self, shape, layers: list[tuple]):
        self.shape = shape  # a LayerShape
        self._layers = layers  # (norm1, norm2, qkv, o, gate_up, down) per layer
        self._params: dict[int, torch.Tensor] = {}  # per cache (its K storage address)

    @classmethod
    def build(cls, model: nn.Module) -> "FusedStack | None":
        """All decoder layers of a packed target (None if any of them cannot be fused)."""
        arch = getattr(model, "arch", None)
        if arch is None:
            return None
        return cls.for_layers(arch.layer_shape(), list(model.model.layers))

    @classmethod
    def for_layers(cls, shape, layers: list[nn.Module]) -> "FusedStack | None":
        """``layers`` (``DecoderLayer``s of ``shape``, their projections packed and fused) as one
        stack, or None when the kernels cannot run them."""
        if cpu_kernels.switched_off("MOA_FUSED_LAYERS") or cpu_kernels.library() is None or shape.qkv_bias:
            return None
        if shape.hidden_size % 8 or shape.intermediate_size % 8 or shape.head_dim % 8 or shape.head_dim > 256:
            return None
        fused = []
        for layer in layers:
            a, mlp = layer.self_attn, layer.mlp
            mats = (a.qkv, a.o_proj, mlp.gate_up, mlp.down_proj)
            if not all(isinstance(m, PackedLinear) and m.bias is None and m.packed.kind in cls.KINDS for m in mats):
                return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(n.weight.dtype != torch.float32 or n.eps != shape.rms_norm_eps for n in norms):
                return None
            fused.append((norms[0].weight.detach().contiguous(), norms[1].weight.detach().contiguous(), *mats))
        return cls(shape, fused) if fused else None

    def _params_for(self, cache) -> torch.Tensor:
        key = cache.k.data_ptr()
        params = self._params.get(key)
        if params is None:
            rows = []
            for i, (n1, n2, *mats) in enumerate(self._layers):
                row = [n1.data_ptr(), n2.data_ptr()]
                for m in mats:
                    pm = m.packed
                    qs, d, m = pm.operands()
                    row += [
                        cpu_kernels.kind_id(pm.kind, pm.products),
                        qs.data_ptr(),
                        d.data_ptr() if d is not None else 0,
                        m.data_ptr() if m is not None else 0,
                        pm.shape[0],
                    ]
                row += [cache.k[i].data_ptr(), cache.v[i].data_ptr()]
                rows.append(row)
            params = self._params[key] = torch.tensor(rows, dtype=torch.int64)
            assert params.shape[1] == cpu_kernels.LAYER_PARAMS
        return params

    def usable(self, x: torch.Tensor, cache) -> bool:
        return (
            x.dtype == torch.float32
            and x.device.type == "cpu"
            and cache.k.dtype in (torch.float32, torch.bfloat16)
            and cache.v.dtype == cache.k.dtype
            and cache.k.is_contiguous()
            and cache.v.is_contiguous()
        )

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache,
        slots: torch.Tensor,
        positions: torch.Tensor,
        store_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [n, hidden] through every layer (K/V of the n tokens written to ``cache`` at
        ``slots``/``positions``, or ``store_at``: see ``cpu_kernels.attention``); cos/sin [n, head_dim]."""
        a = self.shape
        _, ss, hs, ps, _ = cache.k.stride()
        return cpu_kernels.decoder_layers(
            x.contiguous(),
            self._params_for(cache),
            a.rms_norm_eps,
            a.num_heads,
            a.num_kv_heads,
            a.head_dim,
            a.intermediate_size,
            cos.contiguous(),
            sin.contiguous(),
            slots,
            positions,
            (ss, hs, ps),
            cache.k.shape[3],
            kv_bf16=cache.k.dtype == torch.bfloat16,
            store_at=store_at,
        )
