"""What the user's device holds in client-server mode: the drafter checkpoint, the few target
tensors it borrows (embeddings, LM head, final norm, + the last N layers for TLI: read alone from
the target's weight files, never the whole target), the tokenizer, and the fingerprints the
handshake compares."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moa_serve.client_server.fingerprint import drafter_fingerprint, model_fingerprint, tokenizer_fingerprint
from moa_serve.drafter.lookup import HybridProposer
from moa_serve.drafter.registry import load_proposer
from moa_serve.drafter.spec import DrafterSpec
from moa_serve.model_files import load_tokenizer, resolve_model_path


@dataclass
class DeviceDrafter:
    proposer: object  # a ProposerBase (MoA, EAGLE-style or independent) or a hybrid, one session
    tokenizer: object
    fingerprints: dict  # {"target", "tokenizer", "drafter"}
    name: str
    # the trained drafter alone (``proposer`` itself unless that is a prompt-lookup hybrid): it
    # drafts when sampling, where a copied draft has no distribution to send
    model: object = None

    def __post_init__(self):
        if self.model is None:
            self.model = self.proposer.model if isinstance(self.proposer, HybridProposer) else self.proposer

    @classmethod
    def load(
        cls,
        drafter: str,
        target: str | None = None,
        dtype: str = "float32",
        max_model_len: int = 2048,
        device: str = "cpu",
    ) -> "DeviceDrafter":
        spec = DrafterSpec.parse(drafter)
        if spec.checkpoint is None:
            raise ValueError(
                f"drafter {drafter!r}: a device drafts with a trained checkpoint (a checkpoint, or "
                "hybrid:<checkpoint> for prompt lookup in front of it), not prompt lookup alone"
            )
        proposer = load_proposer(
            spec, target=target, dtype=dtype, device=device, max_sessions=1, max_model_len=max_model_len
        )
        model = proposer.model if spec.lookup else proposer  # a hybrid's trained drafter
        tokenizer = load_tokenizer(resolve_model_path(target or model.cfg.target_name_or_path, weights=False))
        prints = {
            "target": model_fingerprint(model.parts),
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "drafter": drafter_fingerprint(drafter),
        }
        return cls(proposer, tokenizer, prints, drafter, model)

    @property
    def uses_lookup(self) -> bool:
        """Prompt lookup drafts first (a ``hybrid:<checkpoint>`` spec), the trained drafter elsewhere:
        the proposer is not the trained drafter itself."""
        return self.model is not self.proposer

    @property
    def needs_features(self) -> bool:
        return bool(getattr(self.proposer, "needs_features", True))

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    def weight_bytes(self) -> int:
        """Bytes of every weight the device holds (shared tensors counted once)."""
        seen, total = set(), 0
        modules = [self.model.parts] + [
            m for m in (getattr(self.model, "head", None), getattr(self.model, "model", None)) if m is not None
        ]
        for m in modules:
            for p in list(m.parameters()) + list(m.buffers()):
                if p.data_ptr() not in seen:
                    seen.add(p.data_ptr())
                    total += p.numel() * p.element_size()
        return total
