"""The drafter's feature head over cached positions at fixed row counts, replayed from CUDA graphs.

A feature source that reads the target's KV cache (MoA: the LSA and ``Ekv2E`` over each position's
per-layer K/V) runs after every verify call over the positions it newly holds: a few dozen small
kernels for one row, launched one by one from Python. Here the gather from the cache and the head
are captured once per row count and replayed, as the target's forward is (``StaticForward``):

* the (slot, position) of each row sits in one preallocated device buffer, filled by one host->device
  copy per call;
* a call of n rows runs at the smallest captured size >= n; padding rows read position 0 of the
  first row's slot and their features are dropped (the head works on each row alone: the LSA's
  attention runs across a position's layers, never across positions);
* calls larger than the largest size run eagerly.

On a CPU the same buffers and padding run without capture (``graphs=False``).
"""

from __future__ import annotations

import logging

import torch

from moa_serve.model import cuda_graphs
from moa_serve.model.kv_cache import SlotKVCache
from moa_serve.verifier.torch.static_forward import GRAPH_SIZES

log = logging.getLogger(__name__)


class StaticFeatures:
    """``source(cache.per_layer_kv_at(slots, positions))`` over fixed-address buffers, one CUDA graph
    per row count."""

    def __init__(self, source, cache: SlotKVCache, dtype: torch.dtype, max_rows: int, graphs: bool, stats: dict):
        self.source, self.cache, self.dtype = source, cache, dtype
        self.sizes = sorted(s for s in GRAPH_SIZES if s <= max_rows) or [max_rows]
        self.device = cache.k.device
        self.use_graphs = graphs
        self._rows = torch.zeros(2, self.sizes[-1], dtype=torch.long, device=self.device)  # slot, position
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if graphs else None
        self.stats = stats
        for key in ("static_feature_calls", "feature_graph_captures"):
            self.stats.setdefault(key, 0)

    def __call__(self, slots: list[int], positions: list[int]) -> torch.Tensor | None:
        """Features [n, F] of the n (slot, position) rows (a view of the graph's output: valid until
        the next call), or None when n is 0 or above every size (the caller runs the head eagerly)."""
        n = len(slots)
        size = next((s for s in self.sizes if s >= n), None)
        if size is None or n == 0:
            return None
        pad = size - n
        self._rows[:, :size].copy_(torch.tensor([slots + [slots[0]] * pad, positions + [0] * pad], dtype=torch.long))
        self.stats["static_feature_calls"] += 1
        if not self.use_graphs:
            return self._body(size)[:n]
        entry = self._graphs.get(size) or self._capture(size)
        if entry is None:
            return self._body(size)[:n]
        graph, out = entry
        graph.replay()
        return out[:n]

    def _body(self, size: int) -> torch.Tensor:
        slots, positions = self._rows[:, :size]
        return self.source(self.cache.per_layer_kv_at(slots, positions).to(self.dtype))

    def _capture(self, size: int):
        try:
            graph, out = cuda_graphs.capture(lambda: self._body(size), self.device, self._pool)
        except RuntimeError as exc:  # an op that cannot be captured: the head runs uncaptured, and says why
            log.warning(
                "CUDA graph capture of the %d-row feature head failed (%s); running it without graphs", size, exc
            )
            self.use_graphs = False
            return None
        self._graphs[size] = (graph, out)
        self.stats["feature_graph_captures"] += 1
        return graph, out
