"""What the client-server handshake compares: short digests of the target, the tokenizer and the
drafter checkpoint, computable on both sides from what each side holds.

* target — its architecture plus the final norm and a sample of the embedding rows, rounded to
  bfloat16 first so that a float32 device and a bfloat16 server agree. The device holds only
  the target parts its drafter borrows (embeddings, LM head, final norm), the server the whole
  target: both hold these.
* tokenizer — the vocabulary, the special tokens and the chat template.
* drafter — the checkpoint's bytes. The server's verifier computes the features with *its*
  drafter's feature head (MoA's LSA), so a client's drafter must be that very checkpoint (with or
  without prompt lookup in front of it: ``hybrid:<checkpoint>`` reads the same features).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from moa_serve.drafter.spec import DrafterSpec, resolve_drafter_path
from moa_serve.model.target import TargetArch

DIGEST_CHARS = 16
EMBED_ROWS = 64


def _digest(h) -> str:
    return h.hexdigest()[:DIGEST_CHARS]


def _bf16_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy().tobytes()


def target_fingerprint(arch: TargetArch, embed_weight: torch.Tensor, norm_weight: torch.Tensor) -> str:
    h = hashlib.sha256(json.dumps(dataclasses.asdict(arch), sort_keys=True).encode())
    step = max(1, embed_weight.shape[0] // EMBED_ROWS)
    h.update(_bf16_bytes(norm_weight))
    h.update(_bf16_bytes(embed_weight[::step]))
    return _digest(h)


def model_fingerprint(model) -> str:
    """Of a loaded ``TargetModel`` (the verifier) or ``TargetParts`` (the device)."""
    embed = model.model.embed_tokens if hasattr(model, "model") else model.embed_tokens
    norm = model.model.norm if hasattr(model, "model") else model.norm
    return target_fingerprint(model.arch, embed.weight, norm.weight)


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode())
    special = {k: str(v) for k, v in sorted(getattr(tokenizer, "special_tokens_map", {}).items())}
    h.update(json.dumps(special, sort_keys=True).encode())
    h.update(str(getattr(tokenizer, "chat_template", None) or "").encode())
    return _digest(h)


def drafter_fingerprint(drafter: str | Path) -> str:
    """Of what the server's features depend on: the trained checkpoint of a drafter spec
    (``hybrid:<checkpoint>`` fingerprints as its checkpoint — prompt lookup changes which
    drafts the device proposes, not the features it reads; pure ``lookup`` reads none)."""
    ckpt = DrafterSpec.parse(str(drafter)).checkpoint
    if ckpt is None:
        return _digest(hashlib.sha256(b"lookup+"))
    h = hashlib.sha256()
    path = resolve_drafter_path(ckpt)
    h.update(json.dumps(json.loads((path / "config.json").read_text()), sort_keys=True).encode())
    with open(path / "model.safetensors", "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return _digest(h)
