"""Drafter features of token prefixes the verifier has seen, for a verifier with a prefix cache.

vLLM's prefix caching skips the forward of every full KV block a new request shares with an
earlier one (a system prompt, the earlier turns of a chat, a repeated question), so the verifier
never computes those positions' K/V again — nor the drafter features derived from them. The
features of a position depend only on the tokens up to it (the target is causal), so they can be
kept the same way vLLM keeps the blocks: per block of ``block_size`` tokens, under a hash chained
over the blocks before it, least recently used dropped first. A request whose forward begins past
position 0 gets its prefix's features from here; if any block is missing (never computed: the
speculation governor had drafting off then), it decodes without drafts.

A wrong hit (a hash collision) would only give the drafter wrong features: acceptance, not
output, depends on them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch


def block_hash(previous: int | None, block: Sequence[int]) -> int:
    return hash((previous, tuple(int(x) for x in block)))


class PrefixFeatures:
    def __init__(self, block_size: int, max_positions: int = 32768):
        if block_size < 1 or max_positions < block_size:
            raise ValueError("block_size must be >= 1 and max_positions >= block_size")
        self.block_size = block_size
        self.max_blocks = max_positions // block_size
        self._blocks: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0  # lookups of a prefix (positions found / not found)

    def __len__(self) -> int:
        return len(self._blocks)

    def remember(
        self, tokens: Sequence[int], features: torch.Tensor, done: tuple[int, int | None]
    ) -> tuple[int, int | None]:
        """Stores the full blocks of ``features`` (positions 0.. of ``tokens``) after the first
        ``done[0]`` blocks, whose chain ends in hash ``done[1]``; returns the new (blocks, hash)."""
        blocks, h = done
        size = self.block_size
        while (blocks + 1) * size <= min(features.shape[0], len(tokens)):
            h = block_hash(h, tokens[blocks * size : (blocks + 1) * size])
            if h in self._blocks:
                self._blocks.move_to_end(h)
            else:
                self._blocks[h] = features[blocks * size : (blocks + 1) * size].clone()
                if len(self._blocks) > self.max_blocks:
                    self._blocks.popitem(last=False)
            blocks += 1
        return blocks, h

    def lookup(self, tokens: Sequence[int], length: int) -> tuple[torch.Tensor, tuple[int, int | None]] | None:
        """Features of positions [0, length) of ``tokens`` and the chain state to go on with, or
        None unless ``length`` is a whole number of blocks all held."""
        size = self.block_size
        if length <= 0 or length % size or length > len(tokens):
            self.misses += 1
            return None
        h, parts = None, []
        for b in range(length // size):
            h = block_hash(h, tokens[b * size : (b + 1) * size])
            part = self._blocks.get(h)
            if part is None:
                self.misses += 1
                return None
            self._blocks.move_to_end(h)
            parts.append(part)
        self.hits += 1
        return torch.cat(parts), (length // size, h)
