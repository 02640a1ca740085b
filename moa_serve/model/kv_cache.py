"""A per-slot key/value cache for ragged batches (one slot per session).

Each slot is a rectangle of ``max_len`` positions; a session's valid length is
``lengths[slot]``. Rolling back rejected draft positions is setting the length: the stale
entries are masked out and overwritten by the next write. One extra scratch position
absorbs the writes of padded query positions.
"""

from __future__ import annotations

import heapq

import torch

from moa_serve.kernels import cpu as cpu_kernels
from moa_serve.kernels import gpu_invariant
from moa_serve.model.layers import sdpa


class SlotKVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        shape = (num_layers, num_slots, num_kv_heads, max_len + 1, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        # lengths stay on the host whatever the cache's device: planning reads them every call, and
        # a host tensor is read without waiting for the device
        self.lengths = torch.zeros(num_slots, dtype=torch.long)
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # a heap: the lowest free slot first keeps live slots dense

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("KV cache is full: no free session slot")
        slot = heapq.heappop(self._free)
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0
        heapq.heappush(self._free, slot)

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
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
            return self.k[layer, s : s + 1, :, :length], self.v[layer, s : s + 1, :, :length]
        slots = slots.to(self.k.device)  # index_select wants its index on the tensor's device
        return (
            torch.index_select(self.k[layer, :, :, :length], 0, slots),  # faster than k[layer, slots] on a CPU
            torch.index_select(self.v[layer, :, :, :length], 0, slots),
        )

    def per_layer_kv_at(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """For n (slot, position) pairs, in one gather: [n, num_layers, KVH * 2 * hd], each layer's
        vector being, per KV head, that head's key followed by its value (the layout of the
        reference implementation's ``torch.cat((k, v), -1)``)."""
        kv = torch.cat((self.k[:, slots, :, positions], self.v[:, slots, :, positions]), dim=-1)  # [n, L, KVH, 2hd]
        return kv.reshape(kv.shape[0], kv.shape[1], -1)

    def positions_for(self, slots: torch.Tensor, width: int) -> torch.Tensor:
        """Positions [B, width] of the next ``width`` tokens of each slot."""
        return self.lengths[slots][:, None] + torch.arange(width)[None, :]

    def run_layers(
        self, layers, x: torch.Tensor, cos, sin, slots: torch.Tensor, query_lens: torch.Tensor, first_layer: int = 0
    ) -> torch.Tensor:
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


class PackedBatch:
    """Attention for sequences packed along one token axis (no padding in the matmuls), as
    vLLM's ``max_num_batched_tokens`` batches mix decode steps and prefill chunks.

    Sequence i has ``lens[i]`` new tokens at positions ``starts[i] ...`` of cache slot
    ``slots[i]``. Short sequences (decode steps with their drafts) attend together in one call
    over a *view* of the cache covering their slot range (no gather: slots are allocated lowest
    first, so live slots are dense; rows of slots in the range but not in the batch are padding);
    each long sequence (a prefill chunk) attends alone over its slot. The plan is built once per
    forward and reused by every layer.

    Tree drafts: a sequence may end with *alternatives* (``twins``): tokens verified beside the
    draft at a given depth of its chain. Alternative j of sequence i has the position of the chain
    token ``twins[i][j]`` (an index among the sequence's tokens before its alternatives) and sees
    what that token sees but not the token itself; its K/V is stored after the chain
    (``store_at``), and the runner moves it into place if the target accepts it."""

    SHORT = 16  # sequences with at most this many new tokens attend in the shared call

    def __init__(
        self,
        cache: SlotKVCache,
        slots: list[int],
        starts: list[int],
        lens: list[int],
        device: torch.device | str = "cpu",
        kernel: bool = False,
        twins: list[list[int]] | None = None,
    ):
        """``kernel``: attend with the batch-invariant kernels (``moa_serve.kernels.cpu.attention`` on a
        CPU cache of float32 or bfloat16, ``gpu_invariant.attention`` on a GPU): every token alone
        over its own slot, in a fixed order, so its output does not depend on the batch.
        ``twins``: per sequence, the chain index each of its trailing alternatives shares a position
        with (empty or None: a plain chain)."""
        self.cache = cache
        self.kernel = kernel
        self.n = sum(lens)
        offsets = [0]
        for n in lens[:-1]:
            offsets.append(offsets[-1] + n)
        twins = twins or [[] for _ in lens]
        pos, store = [], []
        for a, n, tw in zip(starts, lens, twins):
            chain = n - len(tw)
            if any(not 0 <= j < chain for j in tw):
                raise ValueError(f"an alternative must share the position of a chain token (0..{chain - 1}); got {tw}")
            pos.append(torch.cat((torch.arange(a, a + chain), a + torch.tensor(tw, dtype=torch.long))))
            store.append(torch.arange(a, a + n))
        self.positions = torch.cat(pos).to(device)  # rotary positions
        self.token_slots = torch.cat([torch.full((n,), s) for s, n in zip(slots, lens)]).to(device)
        store_at = torch.cat(store).to(device)  # where each token's K/V is written
        self.store_at = store_at if any(twins) else None
        self._write_at = store_at  # every token's (the kernels take None for a plain batch)
        if int(store_at.max()) >= cache.max_len:
            raise ValueError(f"positions up to {int(store_at.max())} exceed the cache ({cache.max_len})")
        self.short, self.long = None, []
        if kernel:
            return
        short = [i for i, n in enumerate(lens) if n <= self.SHORT]
        if short:
            lo, hi = min(slots[i] for i in short), max(slots[i] for i in short) + 1
            width = max(lens[i] for i in short)
            total = max(starts[i] + lens[i] for i in short)
            rows = hi - lo
            gather = torch.full((rows, width), self.n, dtype=torch.long)  # index n = a zero row
            q_pos = torch.zeros(rows, width, dtype=torch.long)  # padding queries see position 0 only
            q_at = torch.zeros(rows, width, dtype=torch.long)
            for i in short:
                r = slots[i] - lo
                gather[r, : lens[i]] = torch.arange(offsets[i], offsets[i] + lens[i])
                q_pos[r, : lens[i]] = pos[i]
                q_at[r, : lens[i]] = store[i]
            flat = gather.flatten()
            real = (flat < self.n).nonzero().flatten()
            mask = _sees(
                torch.arange(total)[None, None, :], q_pos[:, :, None], q_at[:, :, None]
            )  # [rows, width, total]
            self.short = dict(
                lo=lo,
                hi=hi,
                width=width,
                total=total,
                gather=flat.to(device),
                real=real.to(device),
                dest=flat[real].to(device),
                mask=mask.to(device),
            )
        for i, n in enumerate(lens):
            if n > self.SHORT:
                a = starts[i]
                mask = _sees(torch.arange(a + n)[None, :], pos[i][:, None], store[i][:, None])  # [n, a+n]
                self.long.append(dict(slot=slots[i], offset=offsets[i], n=n, total=a + n, mask=mask.to(device)))

    @classmethod
    def static(
        cls, cache: SlotKVCache, token_slots: torch.Tensor, positions: torch.Tensor, store_at: torch.Tensor
    ) -> "PackedBatch":
        """A batch over per-token tensors the caller already holds on the device (fixed-address
        buffers of a captured step): token i has rotary position ``positions[i]``, attends to keys
        0..positions[i]-1 of slot ``token_slots[i]`` and to its own K/V, written at ``store_at[i]``
        (``cache.max_len``, the scratch column, for padding rows). Always the batch-invariant
        kernels; nothing is planned on the host."""
        batch = cls.__new__(cls)
        batch.cache, batch.kernel, batch.n = cache, True, positions.shape[0]
        batch.positions, batch.token_slots = positions, token_slots
        batch.store_at = batch._write_at = store_at
        batch.short, batch.long = None, []
        return batch

    def attention(self, layer: int):
        """The ``attention`` callable of ``DecoderLayer.forward_packed`` for cache layer ``layer``;
        with the Triton kernels it also has ``from_qkv`` (the layer's fused q/k/v output in, rope
        and the cache writes in one kernel)."""

        def attend_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            c = self.cache
            c.k[layer, self.token_slots, :, self._write_at] = k.to(c.k.dtype)  # a bf16 cache under a float32 model
            c.v[layer, self.token_slots, :, self._write_at] = v.to(c.v.dtype)
            if self.kernel:
                return invariant_attention(q, c.k[layer], c.v[layer], self.token_slots, self.positions, self.store_at)
            n, heads, hd = q.shape
            kv_heads = k.shape[1]
            groups = heads // kv_heads
            out = torch.empty_like(q)
            if self.short is not None:
                p = self.short
                rows, width, total = p["hi"] - p["lo"], p["width"], p["total"]
                qp = torch.cat((q, q.new_zeros(1, heads, hd)))[p["gather"]]  # [rows*width, H, hd]
                # fold the query heads sharing a KV head into the query axis (no K/V copies)
                qp = (
                    qp.view(rows, width, kv_heads, groups, hd)
                    .permute(0, 2, 3, 1, 4)
                    .reshape(rows, kv_heads, groups * width, hd)
                )
                mask = (
                    p["mask"][:, None, None]
                    .expand(rows, 1, groups, width, total)
                    .reshape(rows, 1, groups * width, total)
                )
                keys = c.k[layer, p["lo"] : p["hi"], :, :total]
                values = c.v[layer, p["lo"] : p["hi"], :, :total]
                o = sdpa(qp, keys, values, mask)
                o = o.view(rows, kv_heads, groups, width, hd).permute(0, 3, 1, 2, 4).reshape(rows * width, heads, hd)
                out[p["dest"]] = o[p["real"]]
            for p in self.long:
                a, m = p["offset"], p["n"]
                ql = q[a : a + m].view(m, kv_heads, groups, hd).permute(1, 2, 0, 3).reshape(1, kv_heads, groups * m, hd)
                mask = p["mask"][None, None].expand(1, groups, m, p["total"]).reshape(1, 1, groups * m, p["total"])
                s = p["slot"]
                o = sdpa(ql, c.k[layer, s : s + 1, :, : p["total"]], c.v[layer, s : s + 1, :, : p["total"]], mask)
                out[a : a + m] = o.view(kv_heads, groups, m, hd).permute(2, 0, 1, 3).reshape(m, heads, hd)
            return out

        if self.kernel and gpu_invariant.available(self.cache.k.device):  # the Triton kernels

            def from_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
                """The layer's fused q/k/v output [n, (H + 2 KVH) hd] to attention outputs: rope and
                the cache writes in one kernel, then the batch-invariant attention."""
                c = self.cache
                q = gpu_invariant.rope_store(qkv, cos, sin, c.k[layer], c.v[layer], self.token_slots, self._write_at)
                return invariant_attention(q, c.k[layer], c.v[layer], self.token_slots, self.positions, self.store_at)

            attend_packed.from_qkv = from_qkv
        return attend_packed


def invariant_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    store_at: torch.Tensor | None,
) -> torch.Tensor:
    """Batch-invariant attention of packed tokens over one slot-cache layer (the contract of
    ``moa_serve.kernels.cpu.attention``): the C kernel on a CPU, the Triton kernel on a GPU (and on a
    CPU under Triton's interpreter, which is how the tests reach it)."""
    if q.device.type == "cpu" and not gpu_invariant.available("cpu"):
        return cpu_kernels.attention(q, k, v, slots, positions, store_at)
    return gpu_invariant.attention(q, k, v, slots, positions, store_at)


def _sees(k_pos: torch.Tensor, q_pos: torch.Tensor, q_at: torch.Tensor) -> torch.Tensor:
    """Which cached positions a query at rotary position ``q_pos`` whose K/V is stored at ``q_at``
    attends to: every position before its own, and itself (for a chain token q_at == q_pos)."""
    return (k_pos < q_pos) | (k_pos == q_at)
