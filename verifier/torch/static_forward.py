"""The target's packed forward at fixed shapes, replayed from CUDA graphs.

A verify call's forward is a few hundred small kernels for an 8B model; launched one by one from
Python they cost more host time than the GPU spends on them (the GPU check: tools/gpu/README.md).
Here the forward is captured once per *row count* and replayed:

* every input lives in one preallocated device buffer (token ids, cache slot, rotary position and
  where its K/V is written, one row per token), filled by one host→device copy per call;
* a call of n tokens runs at the smallest captured size >= n; the padding rows are token 0 at
  position 0 writing into the cache's scratch column, and attend to nothing real, so they change
  no other row (the kernels are batch-invariant: ``PackedBatch.static``);
* the KV cache is read and written through those buffers (slot and position per token), and the
  attention kernel reads each token's context length from the device, so one graph serves every
  context length and every mix of decode steps, drafts, tree alternatives and prefill chunks.

The graph holds only the forward (embeddings, layers, final norm); the caller's LM head, argmax
and acceptance run after it on the rows it needs. The packing is flat (tokens of all sessions one
after another), so graphs are keyed by the number of tokens, not by (sessions, tokens per
session): fewer graphs for the same coverage. Calls larger than the largest size run eagerly.

On a CPU the same buffers and padding run without capture (``graphs=False``): the tests check
that path token for token against the planned eager one.
"""

from __future__ import annotations

import logging

import torch

from moa_serve.model import cuda_graphs
from moa_serve.model.kv_cache import PackedBatch, SlotKVCache

log = logging.getLogger(__name__)

# row counts captured (vLLM's cudagraph sizes follow the same pattern: dense at small batches)
GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def packed_layout(starts: list[int], lens: list[int], twins: list[list[int]]) -> tuple[list[int], list[int]]:
    """Rotary positions and K/V store positions of a packed call (``PackedBatch``'s layout):
    session i's chain tokens sit at starts[i] ...; alternative j shares the position of chain
    token twins[i][j] and is stored after the chain."""
    positions, store = [], []
    for a, n, tw in zip(starts, lens, twins):
        chain = n - len(tw)
        positions.extend(range(a, a + chain))
        positions.extend(a + j for j in tw)
        store.extend(range(a, a + n))
    return positions, store


class StaticForward:
    """``TargetModel.forward_packed`` over fixed-address buffers, one CUDA graph per row count."""

    def __init__(
        self,
        model,
        cache: SlotKVCache,
        max_tokens: int,
        graphs: bool,
        sizes: tuple[int, ...] = GRAPH_SIZES,
        stats: dict | None = None,
    ):
        """``stats``: a dict to count into (static_calls, graph_captures, eager_calls)."""
        self.model = model
        self.cache = cache
        self.sizes = sorted(s for s in sizes if s <= max_tokens) or [max_tokens]
        self.device = cache.k.device
        self.use_graphs = graphs
        rows = self.sizes[-1]
        # rows of the one input buffer: token id, slot, rotary position, where its K/V is written
        self._inputs = torch.zeros(4, rows, dtype=torch.long, device=self.device)
        pinned = self.device.type == "cuda"
        self._staging = torch.zeros(4, rows, dtype=torch.long, pin_memory=pinned)
        self._copied = torch.cuda.Event() if pinned else None  # the staging buffer may be refilled
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if graphs else None
        self.stats = stats if stats is not None else {}
        for key in ("static_calls", "graph_captures", "eager_calls"):
            self.stats.setdefault(key, 0)

    def size_for(self, n: int) -> int | None:
        """The row count a call of ``n`` tokens runs at (None: too large, run it eagerly)."""
        for s in self.sizes:
            if s >= n:
                return s
        return None

    def __call__(
        self, tokens: list[int], token_slots: list[int], positions: list[int], store_at: list[int]
    ) -> torch.Tensor | None:
        """Final-norm hidden states [n, H] of the n tokens (a view of the graph's output: valid
        until the next call), or None when n is above every size."""
        n = len(tokens)
        if n and max(store_at) >= self.cache.max_len:  # as PackedBatch: never into the scratch column
            raise ValueError(f"positions up to {max(store_at)} exceed the cache ({self.cache.max_len})")
        size = self.size_for(n)
        if size is None or n == 0:
            self.stats["eager_calls"] += 1
            return None
        self._fill(size, tokens, token_slots, positions, store_at)
        self.stats["static_calls"] += 1
        if not self.use_graphs:
            return self._body(size)[:n]
        entry = self._graphs.get(size)
        if entry is None:
            entry = self._capture(size)
        if entry is None:  # capture failed: this replica runs the fixed shapes uncaptured
            return self._body(size)[:n]
        graph, out = entry
        graph.replay()
        return out[:n]

    def _fill(self, size: int, tokens, token_slots, positions, store_at) -> None:
        n = len(tokens)
        pad = size - n
        rows = [
            tokens + [0] * pad,
            token_slots + [token_slots[0]] * pad,
            positions + [0] * pad,
            store_at + [self.cache.max_len] * pad,
        ]
        if self._copied is not None:
            self._copied.synchronize()  # the last call's copy has left the staging buffer
        self._staging[:, :size] = torch.tensor(rows, dtype=torch.long)
        self._inputs[:, :size].copy_(self._staging[:, :size], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _body(self, size: int) -> torch.Tensor:
        tokens, slots, positions, store_at = self._inputs[:, :size]
        batch = PackedBatch.static(self.cache, slots, positions, store_at)
        return self.model.forward_packed(tokens, batch)

    def _capture(self, size: int):
        """Captures the forward at ``size`` rows during a real call (the capture's warm-up run writes
        this call's K/V; the caller's replay writes the same again). None where capture fails: the
        replica then runs its fixed shapes uncaptured, and says why."""
        try:
            graph, out = cuda_graphs.capture(lambda: self._body(size), self.device, self._pool)
        except RuntimeError as exc:
            log.warning(
                "CUDA graph capture of the %d-row forward failed (%s); this replica runs its "
                "fixed-shape forwards without graphs",
                size,
                exc,
            )
            self.use_graphs = False
            self.stats["graph_capture_failed"] = str(exc)[:300]
            return None
        self._graphs[size] = (graph, out)
        self.stats["graph_captures"] += 1
        return graph, out
