"""A draft call's steps after the first, all in one CUDA graph: no host round trip per step.

After the first step (which feeds each session its new committed tokens: ragged, run as planned),
every step feeds one token per session — the one the last step picked — through the draft head
(MoA: SA layer, then CA over the session's verified features; EAGLE-style: fc over the token and
the last step's output, then its layer; independent: its layers), the LM head and an argmax.
Those steps have fixed shapes for a fixed batch size, so for a batch padded to one of a few sizes
the whole loop of ``steps`` steps is captured once and replayed: the picked tokens never leave the
device between steps, and one transfer at the end of the call brings every draft to the host.

Inputs sit in preallocated device buffers (per row: first token, slot, its cache position, whether
it is a real row, where it is stored, one proposer-specific position — MoA: its last feature — and
one hidden-size vector carried into the steps — MoA: the single-feature CA output; EAGLE-style: the
first step's output). Attention reads its context length from those buffers (the batch-invariant
kernels of ``moa_serve.kv_cache.invariant_attention``), so one graph serves every context length.
Padding rows and steps past the cache's end write only the cache's scratch column. The proposer
supplies the step (``_static_step``); sampling, trees and TLI keep the planned per-step loop. On a
CPU the same code runs uncaptured (``graphs=False``), which is how the tests compare it with the
planned loop.
"""

from __future__ import annotations

import logging

import torch

from moa_serve import cuda_graphs

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
        # per row: first token, slot, cache position of the first token, 1 for a real row (0: padding),
        # its store position (the scratch column for padding), the proposer's own position (MoA: last feature)
        self._inputs = torch.zeros(6, rows, dtype=torch.long, device=self.device)
        self._carry = torch.zeros(rows, hidden, dtype=proposer.dtype, device=self.device)
        self._graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if graphs else None
        self.stats = {"static_draft_calls": 0, "draft_graph_captures": 0}

    def size_for(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def __call__(
        self,
        first: torch.Tensor,
        slots: list[int],
        positions: list[int],
        steps: int,
        extra: list[int] | None = None,
        carry: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Drafts ``steps`` more tokens for each session after ``first`` (its last pick, [B] on the
        device): [B, steps] target ids on the device. ``positions``: the cache position ``first``
        takes; ``extra`` and ``carry`` ([B, hidden]): the proposer's own inputs (see the module).
        None: too many sessions."""
        b = len(slots)
        size = self.size_for(b)
        if size is None:
            return None
        cache = self.p.static_cache
        pad = size - b
        host = torch.tensor(
            [
                [0] * size,
                slots + [slots[0]] * pad,
                positions + [0] * pad,
                [1] * b + [0] * pad,
                [min(x, cache.max_len) for x in positions] + [cache.max_len] * pad,
                (extra or [0] * b) + [0] * pad,
            ],
            dtype=torch.long,
        )
        self._inputs[:, :size].copy_(host)  # one host->device transfer (then the first tokens, on the device)
        self._inputs[0, :b].copy_(first)
        if carry is not None:
            self._carry[:b].copy_(carry.reshape(b, -1))
        self.stats["static_draft_calls"] += 1
        key = (size, steps, carry is not None)
        if not self.use_graphs:
            return self._body(*key)[:b]
        entry = self._graphs.get(key) or self._capture(key)
        if entry is None:
            return self._body(*key)[:b]
        graph, out = entry
        graph.replay()
        return out[:b]

    def _body(self, size: int, steps: int, carried: bool) -> torch.Tensor:
        p = self.p
        max_len = p.static_cache.max_len
        first, slots, pos0, real, store0, extra = self._inputs[:, :size]
        tokens, carry = first, (self._carry[:size] if carried else None)
        picked = []
        for j in range(steps):
            # past the cache's end (a session whose room ends before the batch's last step) the
            # writes go to the scratch column and the reads stop there; those drafts are dropped
            positions = (pos0 + j * real).clamp(max=max_len)
            store_at = (store0 + j * real).clamp(max=max_len)
            x, carry = p._static_step(tokens, slots, positions, store_at, extra, carry)
            tokens = p._logits(x).argmax(-1)
            if p.draft_vocab is not None:
                tokens = p.draft_vocab[tokens]
            picked.append(tokens)
        return torch.stack(picked, 1)

    def _capture(self, key):
        try:
            graph, out = cuda_graphs.capture(lambda: self._body(*key), self.device, self._pool)
        except RuntimeError as exc:  # an op that cannot be captured: draft on, uncaptured, and say why
            log.warning(
                "CUDA graph capture of %d draft steps for %d rows failed (%s); drafting without graphs",
                key[1],
                key[0],
                exc,
            )
            self.use_graphs = False
            return None
        self._graphs[key] = (graph, out)
        self.stats["draft_graph_captures"] += 1
        return graph, out
