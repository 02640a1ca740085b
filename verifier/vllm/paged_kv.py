"""The target's per-layer post-RoPE keys and values read back from vLLM's paged KV cache.

Every forward writes each layer's keys (after RoPE) and values into the paged cache at the
step's slot mapping: exactly the K/V a MoA drafter's Layer Self-Attention reads. Gathering them
there after the step, through that slot mapping, leaves the forward as vLLM builds it (its own
model class, compiled or captured in CUDA graphs), costs a forward nothing, and costs a step only
when a request drafts from it.

Where a backend puts a token inside a block is its own affair: the CPU kernels store a block's
keys transposed (per attention ISA), GPU backends may put the block axis second. ``CacheLayout``
finds out once per engine, with the backend's own cache-writing function — the
``do_kv_cache_update`` the forward calls — on a one-block scratch cache: it writes keys and
values whose elements name their (slot, head, channel) and reads back where each one landed. A
cache that is not a plain permutation of them (a quantized cache, a layout that mixes values) is
refused with the reason (``CacheLayoutError``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class CacheLayoutError(RuntimeError):
    """The paged cache cannot give the K/V back as the forward computed them."""


def attention_layers(model: torch.nn.Module) -> list:
    """vLLM's attention layers of a model, in forward order (each holds its ``kv_cache``)."""
    from vllm.model_executor.layers.attention.attention import Attention

    return [m for m in model.modules() if isinstance(m, Attention)]


def _cache_of(layer) -> torch.Tensor:
    kv = layer.kv_cache
    return kv[0] if isinstance(kv, (list, tuple)) else kv


# the largest integer every element code must reach exactly, by dtype (bf16 holds 8 significant bits)
_EXACT = {torch.float32: 2**24, torch.float16: 2**11, torch.bfloat16: 2**8}


@dataclass(frozen=True)
class CacheLayout:
    """Where the cache keeps (slot offset t in its block, output column j) for a token of one
    layer. Columns are the feature head's layout: per KV head its key then its value
    (``SlotKVCache.per_layer_kv``). ``offsets[t, j]``: the element's offset from its block's
    start, in elements of the layer's cache tensor; a block starts ``block_stride`` elements after
    the previous one."""

    block_size: int
    block_stride: int
    offsets: torch.Tensor  # [block_size, num_kv_heads * 2 * head_dim] long

    @classmethod
    def probe(cls, layer, num_kv_heads: int, head_dim: int, num_blocks: int) -> "CacheLayout":
        """The layout of ``layer``'s cache, found with the backend's ``do_kv_cache_update``. The
        block axis is the one of ``num_blocks`` (the engine's cache blocks) or a multiple of it (a
        backend's kernel blocks may split the cache's)."""
        kv = _cache_of(layer)
        impl = layer.impl
        if not hasattr(impl, "do_kv_cache_update"):
            raise CacheLayoutError(f"{type(impl).__name__} writes its cache inside attention: no probe")
        if getattr(layer, "kv_cache_dtype", "auto") != "auto" or kv.dtype not in _EXACT:
            raise CacheLayoutError(f"a {getattr(layer, 'kv_cache_dtype', kv.dtype)} cache holds no exact K/V")
        block_dims = [d for d, size in enumerate(kv.shape) if size == num_blocks] or [
            d for d, size in enumerate(kv.shape) if size > num_blocks and size % num_blocks == 0
        ]
        if len(block_dims) != 1:
            raise CacheLayoutError(f"no single axis of {num_blocks} blocks in a cache of shape {tuple(kv.shape)}")
        bd = block_dims[0]
        num_blocks = kv.shape[bd]
        per_block = kv.numel() // num_blocks
        if per_block % (2 * num_kv_heads * head_dim):
            raise CacheLayoutError(f"a block of {per_block} elements is not keys and values of whole tokens")
        block_size = per_block // (2 * num_kv_heads * head_dim)
        if max(block_size, num_kv_heads, head_dim) > _EXACT[kv.dtype]:
            raise CacheLayoutError(f"a block of {block_size} tokens cannot be probed exactly in {kv.dtype}")
        shape = list(kv.shape)
        shape[bd] = 1
        scratch = torch.zeros(shape, dtype=kv.dtype, device=kv.device)
        slots = torch.arange(block_size, dtype=torch.long, device=kv.device)
        codes = (
            torch.arange(1, block_size + 1).view(-1, 1, 1).expand(block_size, num_kv_heads, head_dim),
            torch.arange(1, num_kv_heads + 1).view(1, -1, 1).expand(block_size, num_kv_heads, head_dim),
            torch.arange(1, head_dim + 1).view(1, 1, -1).expand(block_size, num_kv_heads, head_dim),
        )
        seen = []
        for code in codes:  # keys carry +code, values -code
            scratch.zero_()
            key = code.to(kv.dtype).to(kv.device).contiguous()
            impl.do_kv_cache_update(layer, key, (-key).contiguous(), scratch, slots)
            seen.append(scratch.flatten().float().round().long().cpu())
        t, h, d = seen
        written = t != 0
        if not torch.equal(written, h != 0) or not torch.equal(written, d != 0):
            raise CacheLayoutError("the probe's writes did not land as whole elements")
        if not (torch.equal(t.sign(), h.sign()) and torch.equal(t.sign(), d.sign())):
            raise CacheLayoutError("keys and values mixed within one element")
        where = written.nonzero().flatten()
        token, head, chan = t[where].abs() - 1, h[where].abs() - 1, d[where].abs() - 1
        is_value = (t[where] < 0).long()
        column = head * 2 * head_dim + is_value * head_dim + chan
        width = 2 * num_kv_heads * head_dim
        if where.numel() != block_size * width:
            raise CacheLayoutError(f"{where.numel()} elements written for {block_size * width} keys and values")
        flat = token * width + column
        offsets = torch.full((block_size * width,), -1, dtype=torch.long)
        # the scratch's element index -> its offset in the real cache (same axes, its own strides)
        multi = torch.stack(torch.unravel_index(where, tuple(shape)))  # [dims, n]
        strides = torch.tensor(kv.stride(), dtype=torch.long)
        real = (multi * strides[:, None]).sum(0) - multi[bd] * strides[bd]
        offsets[flat] = real
        if bool((offsets < 0).any()):
            raise CacheLayoutError("two keys or values landed on one element")
        return cls(block_size, kv.stride(bd), offsets.view(block_size, width).to(kv.device))


class PagedKV:
    """Gathers tokens' per-layer K/V from the paged caches of ``layers`` (one gather for all
    layers where their caches share one allocation, as vLLM allocates them)."""

    def __init__(self, layers: list, num_kv_heads: int, head_dim: int, num_blocks: int):
        if not layers:
            raise CacheLayoutError("the model has no vLLM attention layers")
        self.layers = layers
        self.layout = CacheLayout.probe(layers[0], num_kv_heads, head_dim, num_blocks)
        caches = [_cache_of(layer) for layer in layers]
        first = caches[0]
        if any(c.shape != first.shape or c.stride() != first.stride() or c.dtype != first.dtype for c in caches):
            raise CacheLayoutError("the layers' caches differ in shape or layout")
        self._storage: torch.Tensor | None = None
        self._bases: torch.Tensor | None = None
        if all(c.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for c in caches):
            # every element of the shared allocation, as one flat tensor; each layer from its offset
            self._storage = torch.empty(0, dtype=first.dtype, device=first.device).set_(first.untyped_storage())
            self._bases = torch.tensor([c.storage_offset() for c in caches], dtype=torch.long, device=first.device)
        self._caches = caches

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The K/V of the tokens at these cache slots: [n, num_layers, num_kv_heads * 2 *
        head_dim] (per KV head its key then its value), a new tensor."""
        lay = self.layout
        slots = slots.to(torch.long)
        within = (slots // lay.block_size)[:, None] * lay.block_stride + lay.offsets[slots % lay.block_size]
        if self._storage is not None:
            return self._storage.take(self._bases.view(1, -1, 1) + within[:, None, :])
        return torch.stack([torch.as_strided(c, (c.numel(),), (1,)).take(within) for c in self._caches], dim=1)
