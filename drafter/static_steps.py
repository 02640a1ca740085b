"""A MoA draft call's steps after the first, all in one CUDA graph: no host round trip per step.

After the first step (which feeds each session its new committed tokens: ragged, run as planned),
every step feeds one token per session — the one the last step picked — through the SA layer, the
CA layer over the session's verified features, the LM head and an argmax. Those steps have fixed
shapes for a fixed batch size, so for a batch padded to one of a few sizes the whole loop of
``steps`` steps is captured once and replayed: the picked tokens never leave the device between
steps, and one transfer at the end of the call brings every draft to the host.

Inputs sit in preallocated device buffers (per row: first token, slot, its SA position, whether it
is a real row, the position of its last feature). Attention reads its context length from those
buffers (the batch-invariant kernels of ``moa_serve.kv_cache.invariant_attention``), so one graph
serves every context length. Padding rows and steps past the cache's end write only the SA cache's
scratch column. Used for greedy chains of a drafter without Target Layer Inference; sampling,
trees and TLI keep the planned per-step loop. On a CPU the same code runs uncaptured
(``graphs=False``), which is how the tests compare it with the planned loop.
"""

from __future__ import annotations

import logging

import torch

from moa_serve.kv_cache import PackedBatch, invariant_attention

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


class StaticDraftSteps:
    def __init__(self, proposer, graphs: bool):
        self.p = proposer
        self.sizes = [s for s in BATCH_SIZES if s < proposer.max_sessions] + [proposer.max_sessions]
        self.device = proposer.device
        self.use_graphs = graphs
        rows = self.sizes[-1]
        hidden = proposer.cfg.target.hidden_size
        # per row: first token, slot, SA position of the first token, 1 for a real row (0: padding),
        # SA store position of the first token (the scratch column for padding), last feature position
        self._inputs = torch.zeros(6, rows, dtype=torch.long, device=self.device)
        self._single = torch.zeros(rows, 1, hidden, dtype=proposer.dtype, device=self.device)
        self._graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if graphs else None
        self.stats = {"static_draft_calls": 0, "draft_graph_captures": 0}

    def size_for(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def __call__(self, first: torch.Tensor, slots: list[int], positions: list[int], n_features: list[int],
                 steps: int, single: torch.Tensor | None) -> torch.Tensor | None:
        """Drafts ``steps`` more tokens for each session after ``first`` (its last pick, [B] on the
        device): [B, steps] target ids on the device. ``positions``: the SA position ``first``
        takes; ``n_features``: the session's verified features (all > 0); ``single``: the CA output
        when only the latest feature is read ([B, 1, hidden]), else None. None: too many sessions."""
        b = len(slots)
        size = self.size_for(b)
        if size is None:
            return None
        sa = self.p.sa_cache
        pad = size - b
        host = torch.tensor([[0] * size, slots + [slots[0]] * pad, positions + [0] * pad, [1] * b + [0] * pad,
                             [min(x, sa.max_len) for x in positions] + [sa.max_len] * pad,
                             [n - 1 for n in n_features] + [0] * pad], dtype=torch.long)
        self._inputs[:, :size].copy_(host)  # one host->device transfer (then the first tokens, on the device)
        self._inputs[0, :b].copy_(first)
        if single is not None:
            self._single[:b].copy_(single)
        self.stats["static_draft_calls"] += 1
        key = (size, steps, single is not None)
        if not self.use_graphs:
            return self._body(*key)[:b]
        entry = self._graphs.get(key) or self._capture(key)
        if entry is None:
            return self._body(*key)[:b]
        graph, out = entry
        graph.replay()
        return out[:b]

    def _body(self, size: int, steps: int, single: bool) -> torch.Tensor:
        p, head = self.p, self.p.head
        sa, ca = p.sa_cache, p.ca_cache
        first, slots, pos0, real, store0, last_feature = self._inputs[:, :size]
        tokens = first
        picked = []
        for j in range(steps):
            # past the cache's end (a session whose room ends before the batch's last step) the
            # writes go to the scratch column and the reads stop there; those drafts are dropped
            positions = (pos0 + j * real).clamp(max=sa.max_len)
            store_at = (store0 + j * real).clamp(max=sa.max_len)
            x = p.parts.embed_tokens(tokens)
            cos, sin = p.parts.rotary(positions, x.dtype)
            cos, sin = cos[0][:, None], sin[0][:, None]  # [N, 1, hd]: broadcast over heads
            x = head.self_attention.forward_packed(x, cos, sin,
                                                   PackedBatch.static(sa, slots, positions, store_at).attention(0))
            if single:
                x = head.cross_attention.forward_single_feature(x, self._single[:size, 0])
            else:
                x = head.cross_attention.forward_packed(
                    x, cos, sin, lambda q: invariant_attention(q, ca.k[0], ca.v[0], slots, last_feature, last_feature))
            tokens = p._logits(x).argmax(-1)
            if p.draft_vocab is not None:
                tokens = p.draft_vocab[tokens]
            picked.append(tokens)
        return torch.stack(picked, 1)

    def _capture(self, key):
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._body(*key)  # Triton compiles, the allocator warms up; writes are this call's own
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._body(*key)
        except RuntimeError as exc:
            log.warning("CUDA graph capture of %d draft steps for %d rows failed (%s); drafting without graphs",
                        key[1], key[0], exc)
            self.use_graphs = False
            return None
        self._graphs[key] = (graph, out)
        self.stats["draft_graph_captures"] += 1
        return graph, out
