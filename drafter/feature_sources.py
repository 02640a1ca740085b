"""The verifier-side halves of the drafters: what each drafter kind reads from the target and
how that becomes the feature it drafts from. They implement the verifier's ``FeatureSource``
protocol (:mod:`moa_serve.verifier.api`) by shape alone, so a verifier runs them without knowing
the drafter; :func:`moa_serve.drafter.registry.load_feature_source` picks one per checkpoint.

* :class:`MoAFeatures` — MoA's ``FeatureHead`` (LSA + ``Ekv2E``) over a position's per-layer K/V,
  read back from the target's cache (so any cached position's feature can be recomputed).
* :class:`HiddenFeatures` — EAGLE-style: the target's last hidden state (after its final norm)
  of each newly verified position, passed through unchanged.

A drafter that reads no features (prompt lookup, an independent drafter) has none: the verifier
then uses its own ``NoFeatures``.
"""

from __future__ import annotations

from typing import Callable

import torch

from moa_serve.drafter.moa_model import FeatureHead
from moa_serve.kernels.packed import for_inference


class MoAFeatures:
    """MoA's feature head over the per-layer K/V of the target's cache. ``latest_only``: the
    drafter's cross-attention reads only the freshest verified feature (``cross_attention_latest_only``),
    so only each span's last position is computed."""

    from_cache = True

    def __init__(self, head: FeatureHead, latest_only: bool = False):
        self.head = head
        self.latest_only = bool(latest_only)

    def prepared(self, device, dtype) -> MoAFeatures:
        return MoAFeatures(for_inference(self.head, device, dtype), self.latest_only)

    def rows(self, spans) -> tuple[list[int], list[int], list[int]]:
        """The (slot, position) pairs the head reads for these spans, and how many each span has."""
        if self.latest_only:
            spans = [(slot, max(start, end - 1), end) for slot, start, end in spans]
        slots = [slot for slot, start, end in spans for _ in range(start, end)]
        positions = [p for _, start, end in spans for p in range(start, end)]
        return slots, positions, [end - start for _, start, end in spans]

    def inputs(self, cache, spans, hidden) -> tuple[torch.Tensor, list[int]]:
        """Every span's per-layer K/V in one gather from the cache."""
        slots, positions, sizes = self.rows(spans)
        device = cache.k.device
        kv = cache.per_layer_kv_at(torch.tensor(slots, device=device), torch.tensor(positions, device=device))
        return kv, sizes

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(inputs)


class HiddenFeatures:
    """EAGLE-style features: the target's final hidden states of the positions a forward computed
    (they cannot be recomputed from the cache)."""

    from_cache = False
    latest_only = False

    def prepared(self, device, dtype) -> HiddenFeatures:
        return self

    def inputs(self, cache, spans, hidden: list[Callable[[], torch.Tensor]]) -> tuple[torch.Tensor, list[int]]:
        rows = [h() for h in hidden]
        return torch.cat(rows), [r.shape[0] for r in rows]

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs
