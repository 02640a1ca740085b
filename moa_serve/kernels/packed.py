"""Target weights kept in their GGUF blocks: ``PackedLinear`` modules swapped into a float32
``TargetModel`` loaded from a GGUF folder.

Each matrix is read from the GGUF file, repacked (per-block scales as float32 next to the
quantized values) and checked bitwise against the float32 weight the model was loaded with (the
de-quantization transformers does); rows are matched by content, so the Q/K row permutation
transformers applies to llama GGUFs is carried over whatever it is. A matrix that is not a
supported block type, or does not match, keeps its float32 weight.
"""

from __future__ import annotations

import glob
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from moa_serve import kernels

log = logging.getLogger(__name__)

BLOCK = 32
_BYTES_PER_BLOCK = {"Q4_1": 20, "Q8_0": 34}

# GGUF tensor name -> Hugging Face module path (llama family)
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}


def hf_module_name(gguf_name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return {"token_embd.weight": "lm_head", "output.weight": "lm_head"}.get(gguf_name)


@dataclass
class PackedMatrix:
    """W [N, K] in blocks of 32 along K: ``q4_1`` (qs uint8 [N, K/2], d, m float32 [N, K/32]) or
    ``q8_0`` (qs int8 [N, K], d float32 [N, K/32])."""
    kind: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
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

    def rows(self, ids: torch.Tensor) -> "PackedMatrix":
        return PackedMatrix(self.kind, self.qs[ids].contiguous(), self.d[ids].contiguous(),
                            None if self.m is None else self.m[ids].contiguous())

    @staticmethod
    def cat(parts: list["PackedMatrix"]) -> "PackedMatrix":
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot stack packed matrices of kinds {sorted(kinds)}")
        return PackedMatrix(parts[0].kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]),
                            None if parts[0].m is None else torch.cat([p.m for p in parts]))

    def dequantize(self) -> torch.Tensor:
        return kernels.dequantize_rows(self.kind, self.qs, self.d, self.m, torch.arange(self.shape[0]))

    def matmul_t(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 -> x @ W.T [M, N]."""
        if self.kind == "q4_1":
            return kernels.q4_1_matmul(x, self.qs, self.d, self.m)
        return kernels.q8_0_matmul(x, self.qs, self.d)


class PackedLinear(nn.Module):
    """A bias-optional linear layer over a :class:`PackedMatrix` (float32 in, float32 out).
    ``weight`` stays readable (de-quantized on demand, or the tied float32 tensor it shares)."""

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
        if flat.dtype != torch.float32:
            raise TypeError(f"PackedLinear computes in float32; got {flat.dtype}")
        out = self.packed.matmul_t(flat) if flat.shape[0] else flat.new_zeros(0, self.out_features)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        n, k = self.packed.shape
        return f"{k} -> {n}, {self.packed.kind}, {self.packed.nbytes / 2**20:.1f} MiB"


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


def pack_target(model: nn.Module, path: Path) -> dict:
    """Swaps the float32 linear layers of ``model`` (a ``TargetModel`` loaded from the GGUF in
    ``path``) for :class:`PackedLinear` over the file's blocks. Returns what was done:
    ``{"packed": n, "kept": [names...], "bytes": packed bytes, "dense_bytes": float32 bytes}``;
    ``{"packed": 0, "reason": ...}`` when nothing could be packed."""
    gguf_path = gguf_file(path)
    if gguf_path is None:
        return {"packed": 0, "reason": "no GGUF file: the weights are not block-quantized"}
    if kernels.library() is None:
        return {"packed": 0, "reason": kernels.unavailable_reason()}
    if next(model.parameters()).device.type != "cpu" or model.model.embed_tokens.weight.dtype != torch.float32:
        return {"packed": 0, "reason": "packed kernels run float32 on CPU"}
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
    fused = _fuse_projections(model)
    if kept:
        log.warning("kept float32 for %d matrices: %s", len(kept), ", ".join(kept[:5]))
    return {"packed": packed, "kept": kept, "bytes": nbytes, "dense_bytes": dense_bytes, "fused": fused}


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
        if (gguf_path is None or weight.dtype != torch.float32 or weight.device.type != "cpu"
                or kernels.library() is None):
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


def _fuse_projections(model: nn.Module) -> int:
    """Per layer, [q; k; v] and [gate; up] as one packed matrix each (fewer, larger kernel calls;
    every output row is still its own dot product, so the values are the same)."""
    fused = 0
    for layer in model.model.layers:
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
