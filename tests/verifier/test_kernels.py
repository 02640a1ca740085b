"""Packed-weight kernels: the de-quantization is exact, the matmul agrees with float64, a row's
output is bitwise the same whatever shares the call, and a SmolLM2 target from its GGUF gets
packed layers that decode exactly like the float32 target at greedy."""

import pytest
import torch

from moa_serve.kernels import cpu as cpu_kernels
from moa_serve.kernels.packed import PackedLinear, PackedMatrix, pack_target

pytestmark = pytest.mark.skipif(
    cpu_kernels.library() is None, reason=f"packed kernels unavailable here: {cpu_kernels.unavailable_reason()}"
)


def _random_packed(kind: str, n: int, k: int, seed: int = 0) -> PackedMatrix:
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()  # fp16 scales, as GGUF
    if kind == "q4_1":
        m = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
        qs = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        return PackedMatrix("q4_1", qs, d, m)
    qs = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return PackedMatrix("q8_0", qs, d, None)


def _reference_dequant(p: PackedMatrix) -> torch.Tensor:
    """GGUF's formulas written out in torch (gguf-py: (d * q) + m for Q4_1, d * q for Q8_0)."""
    n, k = p.shape
    if p.kind == "q4_1":
        q = p.qs.reshape(n, k // 32, 16).to(torch.int32)
        q = torch.cat([q & 15, q >> 4], -1).float()  # low nibbles are elements 0-15, high 16-31
        return (p.d[..., None] * q + p.m[..., None]).reshape(n, k)
    return (p.d[..., None] * p.qs.reshape(n, k // 32, 32).float()).reshape(n, k)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_dequantization_is_bitwise_gguf(kind):
    p = _random_packed(kind, 37, 96)
    assert torch.equal(p.dequantize(), _reference_dequant(p))
    ids = torch.tensor([5, 0, 36, 5])
    assert torch.equal(cpu_kernels.dequantize_rows(kind, p.qs, p.d, p.m, ids), _reference_dequant(p)[ids])


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 63, 64, 65, 130])
def test_matmul_matches_float64(kind, rows):
    p = _random_packed(kind, 75, 160, seed=rows)  # odd N: the last weight-row block is short
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(1))
    y = PackedLinear(p)(x)
    ref = x.double() @ _reference_dequant(p).double().T
    assert y.shape == (rows, 75) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def assert_rows_batch_invariant(lin, x: torch.Tensor) -> None:
    """Each row of ``lin(x)`` (x: 130 rows) is bitwise the same alone, in windows of 5 and 16
    rows at any position, and with 1 thread."""
    full = lin(x)
    for i in (0, 3, 4, 63, 64, 129):
        assert torch.equal(lin(x[i : i + 1]), full[i : i + 1])
        assert torch.equal(lin(x[max(0, i - 2) : i + 3])[min(i, 2)], full[i])
        assert torch.equal(lin(x[max(0, i - 8) : i + 8])[min(i, 8)], full[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(lin(x), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_a_rows_output_does_not_depend_on_the_batch(kind):
    """Batch invariance: each row alone, in a batch of 130, at any position, with 1 or 2 threads."""
    lin = PackedLinear(_random_packed(kind, 64, 256))
    assert_rows_batch_invariant(lin, torch.randn(130, 256, generator=torch.Generator().manual_seed(2)))


needs_bf16_products = pytest.mark.skipif(
    not cpu_kernels.bf16_dot_available(),
    reason="matmul precision medium needs AVX512-BF16 (avx512f/bw/vl + avx512_bf16); this CPU multiplies in float32",
)


def _with_bf16_products(p: PackedMatrix) -> PackedMatrix:
    return PackedMatrix(p.kind, p.qs, p.d, p.m, products="bfloat16")


def _random_any(kind: str, n: int, k: int, seed: int = 0) -> PackedMatrix:
    if kind == "bf16":
        return PackedMatrix.from_bf16(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).bfloat16())
    return _random_packed(kind, n, k, seed)


@needs_bf16_products
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "bf16"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 65])
def test_bf16_products_are_the_matmul_of_the_bf16_rounded_operands(kind, rows):
    """Matmul precision medium: x and W rounded to bfloat16 (nearest even, as torch rounds), their
    products summed in float32 — against float64 over the same rounded operands."""
    p = _random_any(kind, 75, 160, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(1))
    y = PackedLinear(_with_bf16_products(p))(x)
    ref = x.bfloat16().double() @ p.dequantize().bfloat16().double().T
    assert y.shape == (rows, 75) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    if kind != "bf16":  # (bf16 weights need no rounding, but x still does)
        assert not torch.equal(y, PackedLinear(p)(x))  # not the float32 products
    assert not torch.equal(y.double(), x.double() @ p.dequantize().double().T)


@needs_bf16_products
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "bf16"])
def test_bf16_products_are_batch_invariant(kind):
    """Each row bitwise the same alone (the path straight from the blocks), in 5 or 16 rows (the
    de-quantized buffer), at any position, with 1 or 2 threads."""
    lin = PackedLinear(_with_bf16_products(_random_any(kind, 64, 256)))
    assert_rows_batch_invariant(lin, torch.randn(130, 256, generator=torch.Generator().manual_seed(2)))


def test_bf16_products_without_the_instruction_are_refused(monkeypatch):
    """Where the CPU lacks AVX512-BF16 (here: switched off) a bf16-product matmul raises instead of
    computing something else; an unknown precision is refused by name."""
    monkeypatch.setenv("MOA_BF16_DOT", "off")
    assert not cpu_kernels.bf16_dot_available()
    p = _random_packed("q4_1", 8, 64)
    with pytest.raises(RuntimeError, match="AVX512-BF16"):
        PackedLinear(_with_bf16_products(p))(torch.randn(2, 64))
    with pytest.raises(ValueError, match="matmul_precision"):
        pack_target(torch.nn.Linear(2, 2), None, matmul_precision="lowest")


def _reference_int8_products(p: PackedMatrix, x: torch.Tensor) -> torch.Tensor:
    """Matmul precision low written out in float64: each 32-block of a row of x rounded to
    round(x * 127 / max|x|) with scale max|x| / 127 (float32, as llama.cpp's Q8 activations),
    times the weights' integers, scaled by both blocks' scales, plus Q4_1's m times the block's
    rounded sum."""
    n, k = p.shape
    xb = x.reshape(len(x), k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    qx = torch.round(xb * torch.where(amax != 0, 127 / amax, torch.zeros_like(amax))).double()
    dx = (amax / 127).double()[..., 0]  # [M, K/32]
    if p.kind == "q4_1":
        q = p.qs.reshape(n, k // 32, 16).to(torch.int32)
        qw = torch.cat([q & 15, q >> 4], -1).double()
    else:
        qw = p.qs.reshape(n, k // 32, 32).double()
    y = (torch.einsum("mbk,nbk->mnb", qx, qw) * dx[:, None] * p.d.double()[None]).sum(-1)
    if p.kind == "q4_1":
        y += (p.m.double()[None] * (dx * qx.sum(-1))[:, None]).sum(-1)
    return y


def _with_int8_products(p: PackedMatrix) -> PackedMatrix:
    return PackedMatrix(p.kind, p.qs, p.d, p.m, products="int8")


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 65])
def test_int8_products_are_llama_cpp_s_arithmetic(kind, rows):
    """Matmul precision low: x rounded per 32-block to 8 bits, integer products with the weights'
    own values — against float64 over the same rounded operands; N = 75 leaves a short group of 8
    weight rows; not the float32 products."""
    p = _random_packed(kind, 75, 160, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(1))
    x[0, :32] = 0.0  # an all-zero block: scale 0, no division by zero
    y = PackedLinear(_with_int8_products(p))(x)
    assert y.shape == (rows, 75) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), _reference_int8_products(p, x), rtol=1e-5, atol=1e-5)
    assert not torch.equal(y, PackedLinear(p)(x))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_int8_products_are_batch_invariant(kind):
    """Each row bitwise the same alone, in 5 or 16 rows (tiles of 4 plus a remainder), at any
    position, with 1 or 2 threads."""
    lin = PackedLinear(_with_int8_products(_random_packed(kind, 61, 256)))
    assert_rows_batch_invariant(lin, torch.randn(130, 256, generator=torch.Generator().manual_seed(2)))


@pytest.mark.skipif(
    not cpu_kernels.int8_vnni_in_use(), reason="the CPU has no AVX512-VNNI: only the AVX2 path runs here"
)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_int8_products_are_the_same_bits_with_vnni_and_avx2(kind):
    """VPDPBUSD (AVX512-VNNI) and VPMADDUBSW + VPMADDWD (AVX2) sum the same exact integer products:
    a machine with VNNI computes the tokens an AVX2-only machine computes."""
    lin = PackedLinear(_with_int8_products(_random_packed(kind, 61, 256)))
    x = torch.randn(21, 256, generator=torch.Generator().manual_seed(4))
    with_vnni = lin(x)
    lib = cpu_kernels.library()
    try:
        assert lib.moa_int8_vnni(0) == 0
        assert torch.equal(lin(x), with_vnni)
    finally:
        lib.moa_int8_vnni(1)


def test_int8_products_need_block_quantized_weights():
    p = PackedMatrix.from_bf16(torch.randn(8, 64).bfloat16())
    with pytest.raises(ValueError, match="Q4_1 / Q8_0"):
        PackedLinear(_with_int8_products(p))(torch.randn(2, 64))


def test_packed_linear_bias_shapes_and_dtype():
    p = _random_packed("q4_1", 8, 64)
    bias = torch.randn(8)
    lin = PackedLinear(p, bias)
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(lin(x), x @ _reference_dequant(p).T + bias, rtol=1e-5, atol=1e-5)
    assert lin(torch.zeros(0, 64)).shape == (0, 8)
    with pytest.raises(TypeError, match="float32"):
        lin(x.bfloat16())


@pytest.mark.slow
def test_smollm2_gguf_target_is_packed_and_decodes_like_float32():
    from moa_serve.engine.in_process import SpeculativeEngine
    from moa_serve.model_files import resolve_model_path
    from moa_serve.sampling import SamplingParams

    path = resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    packed = SpeculativeEngine.load(str(path), None, "float32", packed_weights="auto")
    plain = SpeculativeEngine.load(str(path), None, "float32", packed_weights="off")
    report = packed.verifier.packing
    assert report["packed"] == 30 * 7 + 1 and not report["kept"]  # 210 Q4_1 matrices + the Q8_0 LM head
    assert report["bytes"] * 4 < report["dense_bytes"]
    assert isinstance(packed.verifier.model.model.layers[0].mlp.down_proj, PackedLinear)
    assert plain.verifier.packing["packed"] == 0
    from moa_serve.cli_args import prompt_tokens

    prompts = [
        prompt_tokens(packed.tokenizer, q, chat=True)
        for q in ("What is the capital of France?", "Write a haiku about the sea.")
    ]
    a = packed.generate(prompts, 48, SamplingParams())
    b = plain.generate(prompts, 48, SamplingParams())
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    # the layers' outputs agree to float32 rounding (the order of the sums differs)
    # (a seeded input: an unseeded one made the check flaky)
    h = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    layer_p, layer_f = packed.verifier.model.model.layers[3].mlp, plain.verifier.model.model.layers[3].mlp
    torch.testing.assert_close(layer_p(h), layer_f(h), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "precision,products", [pytest.param("medium", "bfloat16", marks=needs_bf16_products), ("low", "int8")]
)
@pytest.mark.parametrize("kv", ["auto", "bfloat16"], ids=["kv-float32", "kv-bf16"])
def test_smollm2_with_rounded_products_speculates_losslessly(kv, precision, products):
    """Matmul precision medium or low (and a bfloat16 KV cache) changes the target (bf16- or
    8-bit-rounded operands, K/V), not the guarantee: greedy speculative decoding (prompt lookup,
    drafts accepted) gives the same tokens as that target decoding alone, several sessions sharing
    each forward."""
    from moa_serve.cli_args import prompt_tokens
    from moa_serve.engine.in_process import SpeculativeEngine
    from moa_serve.model_files import resolve_model_path
    from moa_serve.sampling import SamplingParams

    path = str(resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct"))
    plain = SpeculativeEngine.load(path, None, "float32", matmul_precision=precision, kv_cache_dtype=kv)
    spec = SpeculativeEngine.load(path, "lookup", "float32", matmul_precision=precision, kv_cache_dtype=kv)
    assert plain.verifier.packing["matmul_precision"] == spec.verifier.packing["matmul_precision"] == precision
    assert spec.verifier.cache.k.dtype == (torch.bfloat16 if kv == "bfloat16" else torch.float32)
    down = spec.verifier.model.model.layers[0].mlp.down_proj
    assert isinstance(down, PackedLinear) and down.packed.products == products
    prompts = [
        prompt_tokens(plain.tokenizer, q, chat=True)
        for q in (
            "Copy this list twice, exactly: red apple, green pear, blue plum, yellow lemon.",
            "What is the capital of France?",
            "Write a haiku about the sea.",
        )
    ]
    a = plain.generate(prompts, 48, SamplingParams())
    b = spec.generate(prompts, 48, SamplingParams())
    assert [r.token_ids for r in b] == [r.token_ids for r in a]
    assert sum(r.accepted_tokens for r in b) > 0  # drafts were verified and kept


@pytest.mark.slow
def test_pack_target_refuses_what_it_cannot_pack(tmp_path, stories_path):
    from moa_serve.model.target import TargetModel
    from moa_serve.model_files import load_state_dict, read_config

    model = TargetModel.from_state_dict(read_config(stories_path), load_state_dict(stories_path), torch.float32)
    report = pack_target(model, stories_path)  # safetensors, no GGUF
    assert report["packed"] == 0 and "GGUF" in report["reason"]


@pytest.mark.parametrize(
    "kv_heads,heads,hd,cache_dtype",
    [
        (2, 6, 16, torch.float32),  # groups of 3 (SmolLM2's), one 16-dim chunk
        (2, 8, 40, torch.float32),  # groups of 4: head chunks 3 + 1; dims 32 + 8
        (1, 1, 64, torch.float32),  # no grouping
        (3, 9, 64, torch.bfloat16),  # SmolLM2's shape over a bf16 cache
    ],
)
def test_attention_kernel_matches_sdpa_and_is_batch_invariant(kv_heads, heads, hd, cache_dtype):
    from torch.nn import functional as F

    g = torch.Generator().manual_seed(3)
    slots, max_len = 4, 41  # 41: the last 8-position block of a full slot is partial
    k = torch.randn(slots, kv_heads, max_len, hd, generator=g).to(cache_dtype)
    v = torch.randn(slots, kv_heads, max_len, hd, generator=g).to(cache_dtype)
    q = torch.randn(8, heads, hd, generator=g)
    tok_slots = torch.tensor([0, 0, 0, 2, 3, 3, 1, 1])
    positions = torch.tensor([5, 6, 7, 0, 30, 31, 12, 40])
    out = cpu_kernels.attention(q, k, v, tok_slots, positions)
    for i in range(len(q)):
        s, p = int(tok_slots[i]), int(positions[i])
        keys = k[s, :, : p + 1].float().repeat_interleave(heads // kv_heads, 0)  # [H, p+1, hd]
        vals = v[s, :, : p + 1].float().repeat_interleave(heads // kv_heads, 0)
        ref = F.scaled_dot_product_attention(q[i][:, None], keys, vals)[:, 0]
        torch.testing.assert_close(out[i], ref, rtol=1e-5, atol=1e-5)
        # alone in the call (other head grouping, other tasks): bitwise the same
        assert torch.equal(
            cpu_kernels.attention(q[i : i + 1], k, v, tok_slots[i : i + 1], positions[i : i + 1])[0], out[i]
        )


def _quantize_q8_0(w: torch.Tensor) -> PackedMatrix:
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32)
    d = (blocks.abs().amax(-1) / 127).clamp_min(1e-8).half().float()
    qs = torch.round(blocks / d[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k)
    return PackedMatrix("q8_0", qs, d, None)


def _pack_all_linears_q8_0(model) -> None:
    from moa_serve.model.layers import Linear

    for name, module in list(model.named_modules()):
        for attr, child in list(module.named_children()):
            if isinstance(child, Linear) and child.in_features % 32 == 0:
                setattr(module, attr, PackedLinear(_quantize_q8_0(child.weight.detach()), child.bias))


def _tiny_packed_model(tiny_model, fused: bool, products: str = "float32"):
    from moa_serve.kernels.packed import FusedStack, fuse_projections
    from moa_serve.model.target import TargetModel
    from moa_serve.model_files import load_state_dict, read_config

    model = TargetModel.from_state_dict(read_config(tiny_model), load_state_dict(tiny_model), torch.float32)
    _pack_all_linears_q8_0(model)  # a random Llama has no GGUF: quantize its matrices here
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.packed.products = products
    if fused:
        fuse_projections(model.model.layers)
        model.fused_stack = FusedStack.build(model)
        assert model.fused_stack is not None
    return model


@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16], ids=["kv-float32", "kv-bf16"])
@pytest.mark.parametrize("products", ["float32", pytest.param("bfloat16", marks=needs_bf16_products), "int8"])
@pytest.mark.parametrize("fused", [False, True], ids=["per-layer", "fused-stack"])
def test_verify_logits_do_not_depend_on_drafts_or_neighbours(tiny_model, fused, products, kv, monkeypatch):
    """With the kernels, a token's logits are bitwise the same verified alone, with drafts after
    it, or beside other sessions (what makes greedy speculative output the target's own, bit for
    bit, whatever shares the round) — through torch layer by layer or the fused layer stack, with
    float32, bfloat16 (matmul precision medium) or 8-bit products (low), over a float32 or bfloat16
    KV cache."""
    from moa_serve.model.kv_cache import PackedBatch

    monkeypatch.delenv("MOA_FUSED_LAYERS", raising=False)  # the path under test, whatever the shell says

    model = _tiny_packed_model(tiny_model, fused, products)
    cache = model.new_cache(3, 128, kv)
    assert cache.k.dtype == kv
    prompts = [torch.randint(0, 16, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (20, 45, 9)]
    for slot, p in enumerate(prompts):
        model.forward_packed(torch.tensor(p), PackedBatch(cache, [slot], [0], [len(p)], kernel=True))

    def logits(items):
        batch = PackedBatch(
            cache, [s for s, _ in items], [len(prompts[s]) for s, _ in items], [len(t) for _, t in items], kernel=True
        )
        return model.lm_head(model.forward_packed(torch.tensor([x for _, t in items for x in t]), batch))

    drafts = [11, 2, 3, 14, 5]
    alone = logits([(0, drafts[:1])])
    with_drafts = logits([(0, drafts)])
    beside = logits([(1, [7, 8, 9]), (0, drafts), (2, [5])])
    assert isinstance(model.model.layers[0].mlp.down_proj, PackedLinear)
    assert torch.equal(alone[0], with_drafts[0])
    assert torch.equal(with_drafts, beside[3:8])


@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16], ids=["kv-float32", "kv-bf16"])
def test_fused_stack_computes_the_per_layer_forward(tiny_model, kv, monkeypatch):
    """The fused layer stack (one kernel call for all layers) gives the per-layer torch forward's
    hidden states and K/V cache to float32 rounding (over a bfloat16 cache: K/V to one bf16 rounding,
    written from values that differ in the last float32 bits), prefill chunks and decode steps mixed."""
    from moa_serve.model.kv_cache import PackedBatch

    monkeypatch.delenv("MOA_FUSED_LAYERS", raising=False)
    fused, plain = _tiny_packed_model(tiny_model, True), _tiny_packed_model(tiny_model, False)
    caches = {id(m): m.new_cache(3, 64, kv) for m in (fused, plain)}
    tol = dict(rtol=1e-4, atol=1e-5) if kv == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    g = torch.Generator().manual_seed(5)
    steps = [([0, 1], [0, 0], [12, 30]), ([0, 1, 2], [12, 30, 0], [1, 4, 7]), ([2, 0], [7, 13], [1, 1])]
    for slots, starts, lens in steps:
        tokens = torch.randint(0, 16, (sum(lens),), generator=g)
        out = []
        for m in (fused, plain):
            cache = caches[id(m)]
            out.append(m.forward_packed(tokens, PackedBatch(cache, slots, starts, lens, kernel=True)))
        torch.testing.assert_close(out[0], out[1], **tol)
    a, b = caches[id(fused)], caches[id(plain)]
    assert a.k.dtype == b.k.dtype == kv
    torch.testing.assert_close(a.k, b.k, **tol)
    torch.testing.assert_close(a.v, b.v, **tol)


def test_auto_dtype_on_a_cpu_is_float32_for_a_gguf_target_even_with_native_bf16(monkeypatch, tmp_path):
    """In float32 a GGUF target runs through the packed kernels (faster than bf16 even on CPUs
    with native bf16): ``auto`` picks float32 for it wherever bf16 is native;
    a target without a GGUF keeps the bf16 rule; GPUs stay bf16."""
    from moa_serve import model_files as models
    from tests.conftest import SMOLLM

    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: True)
    assert models.parse_dtype("auto", "cpu", SMOLLM) == torch.float32
    assert models.parse_dtype("auto", "cpu", tmp_path) == torch.bfloat16  # no GGUF there
    assert models.parse_dtype("auto", "cpu") == torch.bfloat16
    assert models.parse_dtype("auto", "cuda", SMOLLM) == torch.bfloat16
    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: False)
    assert models.parse_dtype("auto", "cpu", tmp_path) == torch.float32


def test_a_bf16_kv_cache_needs_the_attention_kernel_under_a_float32_target(tiny_model, monkeypatch):
    """torch's attention over a bf16 cache would need float32 queries cast down: a float32 runner is
    refused a bf16 cache where the kernels do not run, and an unknown cache dtype is refused by name."""
    from moa_serve.verifier.torch.runner import RunnerOptions, TorchTargetRunner

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        TorchTargetRunner(str(tiny_model), "float32", max_sessions=1, options=RunnerOptions(kv_cache_dtype="fp8"))
    runner = TorchTargetRunner(
        str(tiny_model), "float32", max_sessions=1, options=RunnerOptions(kv_cache_dtype="bfloat16")
    )
    assert runner.cache.k.dtype == torch.bfloat16 and runner.attention_kernel
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    with pytest.raises(
        ValueError, match="kv_cache_dtype bfloat16 with a float32 target needs the CPU attention kernel"
    ):
        TorchTargetRunner(str(tiny_model), "float32", max_sessions=1, options=RunnerOptions(kv_cache_dtype="bfloat16"))
