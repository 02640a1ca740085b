"""A per-slot key/value cache for ragged batches (one slot per session).

Each slot is a rectangle of ``max_len`` positions; a session's valid length is
``lengths[slot]``. Rolling back rejected draft positions is setting the length: the stale
entries are masked out and overwritten by the next write. One extra scratch position
absorbs the writes of padded query positions.
"""

from __future__ import annotations

import torch


class SlotKVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 max_len: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_layers, num_slots, num_kv_heads, max_len + 1, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.lengths = torch.zeros(num_slots, dtype=torch.long)
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("KV cache is full: no free session slot")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0
        self._free.append(slot)

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """slots [B], positions [B, T] (positions >= max_len go to the scratch column),
        k/v [B, KVH, T, hd]."""
        pos = positions.clamp(max=self.max_len)
        self.k[layer, slots[:, None], :, pos] = k.transpose(1, 2)
        self.v[layer, slots[:, None], :, pos] = v.transpose(1, 2)

    def read(self, layer: int, slots: torch.Tensor, length: int):
        """Keys/values of positions [0, length) -> [B, KVH, length, hd] each (a view, no copy,
        for a single session)."""
        if len(slots) == 1:
            s = int(slots[0])
            return self.k[layer, s:s + 1, :, :length], self.v[layer, s:s + 1, :, :length]
        return (torch.index_select(self.k[layer, :, :, :length], 0, slots),  # 3x faster than k[layer, slots]
                torch.index_select(self.v[layer, :, :, :length], 0, slots))

    def per_layer_kv(self, slot: int, start: int, end: int) -> torch.Tensor:
        """For positions [start, end) of one slot: [n, num_layers, KVH * 2 * hd], each layer's
        vector being, per KV head, that head's key followed by its value (the layout of the
        reference implementation's ``torch.cat((k, v), -1)``)."""
        k = self.k[:, slot, :, start:end]  # [L, KVH, n, hd]
        v = self.v[:, slot, :, start:end]
        kv = torch.cat((k, v), dim=-1)  # [L, KVH, n, 2hd]
        n_layers, heads, n, width = kv.shape
        return kv.permute(2, 0, 1, 3).reshape(n, n_layers, heads * width)


    def positions_for(self, slots: torch.Tensor, width: int) -> torch.Tensor:
        """Positions [B, width] of the next ``width`` tokens of each slot."""
        return self.lengths[slots][:, None] + torch.arange(width)[None, :]

    def run_layers(self, layers, x: torch.Tensor, cos, sin, slots: torch.Tensor, query_lens: torch.Tensor,
                   first_layer: int = 0) -> torch.Tensor:
        """Runs decoder ``layers`` over a ragged batch x [B, T, H] whose session b's tokens sit at
        positions lengths[slot_b] + t (t < query_lens[b]); each layer writes its keys/values to
        cache layer ``first_layer + i`` and attends causally over the slot's cached prefix.
        Lengths are not advanced: the caller commits what it keeps."""
        starts = self.lengths[slots]
        positions = self.positions_for(slots, x.shape[1])
        total = int((starts + query_lens).max())
        # a single query per session that sees its whole prefix needs no mask
        single = x.shape[1] == 1 and bool((starts + query_lens == total).all())
        mask = None if single else ragged_causal_mask(starts, query_lens, total).to(x.device)
        for i, layer in enumerate(layers):
            def kv_and_mask(k, v, li=first_layer + i):
                self.write(li, slots, positions, k, v)
                k_all, v_all = self.read(li, slots, total)
                return k_all, v_all, mask
            x = layer(x, cos, sin, kv_and_mask)
        return x


def ragged_causal_mask(lengths: torch.Tensor, query_lens: torch.Tensor, total: int) -> torch.Tensor:
    """Bool mask [B, 1, T, total] for queries at positions lengths[b] + t: a query sees every
    cached position before it and itself; padded queries (t >= query_lens[b]) see the same
    (their outputs are discarded)."""
    t = int(query_lens.max())
    q_pos = lengths[:, None] + torch.arange(t)[None, :]  # [B, T]
    k_pos = torch.arange(total)
    return (k_pos[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)
