"""The client-server wire format: a small JSON header followed by raw tensors.

A frame is ``uint32 little-endian header length | UTF-8 JSON header | tensor bytes``. The header
lists its tensors under ``"tensors"`` as ``[name, dtype, shape]`` in the order their bytes follow
(row-major, little-endian); everything else in the header is the message itself. Frames travel
as ``application/octet-stream``; a request without tensors may also be plain JSON.

Features (one ``hidden_size`` vector per newly verified position) are the bulk of the traffic:
``float16`` halves float32, ``int8`` (symmetric, one float32 scale per position) quarters it. Their
precision only affects the drafts, never the output: verification is exact either way."""

from __future__ import annotations

import json
import struct

import torch

MEDIA_TYPE = "application/octet-stream"
FEATURE_CODECS = ("float16", "int8")
DTYPES = {"float16": torch.float16, "float32": torch.float32, "int8": torch.int8, "bfloat16": torch.bfloat16}
_NAMES = {v: k for k, v in DTYPES.items()}
_LEN = struct.Struct("<I")
MAX_HEADER = 1 << 20


class WireError(ValueError):
    """A malformed frame; ``param`` names what is wrong."""

    def __init__(self, message: str, param: str = "body"):
        super().__init__(message)
        self.param = param


def pack(header: dict, tensors: dict[str, torch.Tensor] | None = None) -> bytes:
    tensors = {k: v for k, v in (tensors or {}).items() if v is not None}
    meta, blobs = [], []
    for name, t in tensors.items():
        if t.dtype not in _NAMES:
            raise ValueError(f"tensor {name}: dtype {t.dtype} cannot travel")
        t = t.detach().contiguous().cpu()
        meta.append([name, _NAMES[t.dtype], list(t.shape)])
        blobs.append(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    head = json.dumps({**header, "tensors": meta} if meta else header, separators=(",", ":")).encode()
    return _LEN.pack(len(head)) + head + b"".join(blobs)


def unpack(data: bytes) -> tuple[dict, dict[str, torch.Tensor]]:
    """(header, tensors) of a frame; raises WireError naming what is malformed."""
    if len(data) < _LEN.size:
        raise WireError("frame shorter than its length prefix")
    (n,) = _LEN.unpack_from(data)
    if n > MAX_HEADER or _LEN.size + n > len(data):
        raise WireError(f"frame header length {n} does not fit the {len(data)}-byte body")
    try:
        header = json.loads(data[_LEN.size : _LEN.size + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"frame header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("frame header must be a JSON object")
    meta = header.pop("tensors", [])
    offset, tensors = _LEN.size + n, {}
    if not isinstance(meta, list):
        raise WireError("tensors must be a list of [name, dtype, shape]", "tensors")
    for i, entry in enumerate(meta):
        try:
            name, dtype, shape = entry
            dt = DTYPES[dtype]
            shape = [int(s) for s in shape]
            if any(s < 0 for s in shape) or not isinstance(name, str):
                raise ValueError
        except (ValueError, TypeError, KeyError):
            raise WireError(f"tensors.{i}: expected [name, dtype in {sorted(DTYPES)}, shape]", f"tensors.{i}") from None
        count = 1
        for s in shape:
            count *= s
        size = count * dt.itemsize
        if offset + size > len(data):
            raise WireError(f"tensor {name}: {size} bytes announced, {len(data) - offset} left", name)
        raw = bytearray(data[offset : offset + size])
        tensors[name] = (torch.frombuffer(raw, dtype=dt) if size else torch.empty(0, dtype=dt)).reshape(shape)
        offset += size
    if offset != len(data):
        raise WireError(f"{len(data) - offset} bytes after the last tensor")
    return header, tensors


def encode_features(feats: torch.Tensor | None, codec: str) -> dict[str, torch.Tensor]:
    """Tensors carrying features [n, H] in ``codec`` (float16, or int8 with per-row scales)."""
    if feats is None or len(feats) == 0:
        return {}
    x = feats.detach().float()
    if codec == "float16":
        return {"features": x.clamp(-65504, 65504).to(torch.float16)}
    if codec == "int8":
        scale = x.abs().amax(-1).clamp_min(1e-12) / 127.0
        q = torch.round(x / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return {"features": q, "feature_scales": scale}
    raise ValueError(f"unknown feature codec {codec!r}; one of {FEATURE_CODECS}")


def decode_features(tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Float32 features [n, H] from ``encode_features``'s tensors (None when there are none)."""
    f = tensors.get("features")
    if f is None or f.numel() == 0:
        return None
    if f.dtype == torch.int8:
        scale = tensors.get("feature_scales")
        if scale is None or scale.shape != f.shape[:1]:
            raise WireError("int8 features need feature_scales, one per row", "feature_scales")
        return f.float() * scale.float()[:, None]
    return f.float()
