"""A draft call's steps, all in one CUDA graph: no host round trip per step.

The first step (MoA's; an EAGLE-style first step reads the fed positions' hidden states and stays
planned) feeds each session its new committed tokens (its accepted drafts and the target's token:
ragged), right-aligned in blocks of one of a few widths (``FEED_WIDTHS``; the padding rows
write only the cache's scratch column), and each session's last row drafts; a longer feed (a
prompt, a catch-up) runs the first step as planned and the rest from here. Every later step feeds
one token per session — the one the last step picked — through the draft head
(MoA: SA layer, then CA over the session's verified features; EAGLE-style: fc over the token and
the last step's output, then its layer; independent: its layers), the LM head and an argmax.
Those steps have fixed shapes for a fixed batch size, so for a batch padded to one of a few sizes
the whole loop of ``steps`` steps is captured once and replayed: the picked tokens never leave the
device between steps, and one transfer at the end of the call brings every draft to the host.

Inputs sit in preallocated device buffers (per row: first token, slot, its cache position, whether
it is a real row, where it is stored, one proposer-specific position — MoA: its last feature — and
one hidden-size vector carried into the steps — MoA: the single-feature CA output; EAGLE-style: the
first step's output). Attention reads its context length from those buffers (the batch-invariant
kernels of ``moa_serve.model.kv_cache.invariant_attention``), so one graph serves every context length.
Padding rows and steps past the cache's end write only the cache's scratch column. The proposer
supplies the step (``_static_step``); sampling, trees and TLI keep the planned per-step loop. On a
CPU the same code runs uncaptured (``graphs=False``), which is how the tests compare it with the
planned loop.
"""

from __future__ import annotations

import logging

import torch

from moa_serve.model import cuda_graphs

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
# tokens a session feeds at the first step (its accepted drafts and the target's token), padded up
# to one of these; a longer feed (a prompt, a catch-up) runs the first step as planned
FEED_WIDTHS = (1, 2, 4, 8)


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
        # the first step's rows, each session's feed right-aligned in a block of the feed width:
        # token, slot, position, where its K/V is stored (the scratch column for padding), its session's row
        self._feed = torch.zeros(5, rows * FEED_WIDTHS[-1], dtype=torch.long, device=self.device)
        self._graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if graphs else None
        self.stats = {"static_draft_calls": 0, "static_first_steps": 0, "draft_graph_captures": 0}

    def size_for(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    @staticmethod
    def width_for(n: int) -> int | None:
        return next((w for w in FEED_WIDTHS if w >= n), None)

    def with_first_step(
        self,
        feed: list[list[int]],
        slots: list[int],
        starts: list[int],
        steps: int,
        extra: list[int] | None = None,
        carry: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Feeds each session its new tokens (``feed[i]`` at cache positions ``starts[i]`` ...) and
        drafts ``steps`` tokens after them, the whole call from one graph: [B, steps] target ids on
        the device. None: too many sessions or too long a feed (the caller plans the first step)."""
        b = len(slots)
        size, width = self.size_for(b), self.width_for(max(len(f) for f in feed))
        if size is None or width is None or steps < 1:
            return None
        max_len = self.p.static_cache.max_len
        rows = [[], [], [], [], []]
        for i in range(size):
            toks = feed[i] if i < b else []
            pad = width - len(toks)
            start = starts[i] if i < b else 0
            rows[0] += [0] * pad + toks
            rows[1] += [slots[i] if i < b else slots[0]] * width
            rows[2] += [0] * pad + [min(start + t, max_len) for t in range(len(toks))]
            rows[3] += [max_len] * pad + [min(start + t, max_len) for t in range(len(toks))]
            rows[4] += [i] * width
        n = size * width
        self._feed[:, :n].copy_(torch.tensor(rows, dtype=torch.long))
        self.stats["static_first_steps"] += 1
        after = [st + len(f) for st, f in zip(starts, feed)]  # where the first drafted token goes
        return self._launch(size, b, None, slots, after, steps - 1, extra, carry, width)

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
        return self._launch(size, b, first, slots, positions, steps, extra, carry, 0)

    def _launch(self, size, b, first, slots, positions, steps, extra, carry, width) -> torch.Tensor:
        """Fills the per-session inputs and runs (or replays) the body for this key. ``width`` 0:
        the steps start from ``first``; else from the first step over the feed rows already filled."""
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
        if first is not None:
            self._inputs[0, :b].copy_(first)
        if carry is not None:
            self._carry[:b].copy_(carry.reshape(b, -1))
        self.stats["static_draft_calls"] += 1
        key = (size, steps, carry is not None, width)
        if not self.use_graphs:
            return self._body(*key)[:b]
        entry = self._graphs.get(key) or self._capture(key)
        if entry is None:
            return self._body(*key)[:b]
        graph, out = entry
        graph.replay()
        return out[:b]

    def _body(self, size: int, steps: int, carried: bool, width: int) -> torch.Tensor:
        p = self.p
        max_len = p.static_cache.max_len
        first, slots, pos0, real, store0, extra = self._inputs[:, :size]
        tokens, carry = first, (self._carry[:size] if carried else None)
        picked = []
        if width:  # the first step: every session's feed rows, then each session's last row drafts
            f_tokens, f_slots, f_positions, f_store, owner = self._feed[:, : size * width]
            x, _ = p._static_step(
                f_tokens, f_slots, f_positions, f_store, extra[owner], None if carry is None else carry[owner]
            )
            tokens = self._pick(p, x.view(size, width, -1)[:, -1])
            picked.append(tokens)
        for j in range(steps):
            # past the cache's end (a session whose room ends before the batch's last step) the
            # writes go to the scratch column and the reads stop there; those drafts are dropped
            positions = (pos0 + j * real).clamp(max=max_len)
            store_at = (store0 + j * real).clamp(max=max_len)
            x, carry = p._static_step(tokens, slots, positions, store_at, extra, carry)
            tokens = self._pick(p, x)
            picked.append(tokens)
        return torch.stack(picked, 1)

    @staticmethod
    def _pick(p, x: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens (target ids) from hidden states before the LM head."""
        tokens = p._logits(x).argmax(-1)
        return p.draft_vocab[tokens] if p.draft_vocab is not None else tokens

    def _capture(self, key):
        try:
            graph, out = cuda_graphs.capture(lambda: self._body(*key), self.device, self._pool)
        except RuntimeError as exc:  # an op that cannot be captured: draft on, uncaptured, and say why
            log.warning(
                "CUDA graph capture of %d draft steps (first-step feed width %d) for %d rows failed (%s); "
                "drafting without graphs",
                key[1],
                key[3],
                key[0],
                exc,
            )
            self.use_graphs = False
            return None
        self._graphs[key] = (graph, out)
        self.stats["draft_graph_captures"] += 1
        return graph, out
