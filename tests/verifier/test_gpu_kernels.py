"""The batch-invariant GPU kernels (moa_serve/kernels/gpu_invariant.py), checked on a CPU under
Triton's interpreter: this file's ``interpreted`` tests run in a subprocess with
``TRITON_INTERPRET=1`` (the interpreter must be chosen before Triton compiles anything)."""

import os
import re

import pytest
import torch
import torch.nn.functional as F

from tests.support.scripts import run_python

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the subprocess of test_under_the_triton_interpreter")


def test_under_the_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = run_python(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "interpreted"], env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"\b11 passed", proc.stdout), proc.stdout[-2000:]


@interpreted
@pytest.mark.parametrize("bias", [False, True])
def test_interpreted_matmul_rows_do_not_depend_on_the_batch(bias):
    from moa_serve.kernels import gpu_invariant

    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 96, generator=g)
    w = torch.randn(48, 96, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    full = gpu_invariant.matmul(x, w, b)
    torch.testing.assert_close(full, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    for m in (1, 3, 33):  # rows 0..m-1 alone, then the same rows among 70
        assert torch.equal(gpu_invariant.matmul(x[:m], w, b), full[:m])
    assert torch.equal(gpu_invariant.matmul(x[5:6].reshape(1, 1, 96), w, b)[0, 0], full[5])


@interpreted
def test_interpreted_split_k_matmul_adds_its_ranges_in_a_fixed_order():
    from moa_serve.kernels import gpu_invariant

    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 200, generator=g)  # K = 200: the last range is a partial block
    w = torch.randn(24, 200, generator=g)
    b = torch.randn(24, generator=g)
    tiles = gpu_invariant.Tiles(block_m=16, block_n=16, block_k=32, split=3)
    full = gpu_invariant.matmul(x, w, b, tiles=tiles)
    torch.testing.assert_close(full, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    for m in (1, 17):
        assert torch.equal(gpu_invariant.matmul(x[:m], w, b, tiles=tiles), full[:m])


@interpreted
def test_interpreted_rms_norm_matches_the_module_row_by_row():
    from moa_serve.kernels import gpu_invariant
    from moa_serve.model.layers import RMSNorm

    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g))
    x = torch.randn(9, 96, generator=g)
    full = gpu_invariant.rms_norm(x, norm.weight, norm.eps)
    torch.testing.assert_close(full, norm(x), rtol=1e-5, atol=1e-5)
    for i in range(9):
        assert torch.equal(gpu_invariant.rms_norm(x[i : i + 1], norm.weight, norm.eps), full[i : i + 1])
    xb, wb = x.bfloat16(), norm.weight.detach().bfloat16()
    torch.testing.assert_close(
        gpu_invariant.rms_norm(xb, wb, norm.eps).float(), norm.bfloat16()(xb).float(), rtol=2e-2, atol=2e-2
    )  # rounding: 1-2 bfloat16 ulps


@interpreted
def test_interpreted_chunked_attention_matches_the_cpu_kernel_across_chunks():
    from moa_serve.kernels import cpu as cpu_kernels
    from moa_serve.kernels import gpu_invariant

    if cpu_kernels.library() is None:
        pytest.skip(cpu_kernels.unavailable_reason())
    g = torch.Generator().manual_seed(4)
    slots_n, kv_heads, length, hd, heads = 2, 2, 700, 16, 6  # chunks of 256 keys: 3 per slot
    assert gpu_invariant.attention_chunk(length + 1) == 256
    k = torch.randn(slots_n, kv_heads, length + 1, hd, generator=g)
    v = torch.randn(slots_n, kv_heads, length + 1, hd, generator=g)
    q = torch.randn(5, heads, hd, generator=g)
    slots = torch.tensor([0, 1, 0, 1, 1])
    positions = torch.tensor([0, 255, 256, 511, 690])  # first key, both sides of a chunk edge, the last chunk
    store_at = torch.tensor([0, 255, 256, 700, 690])  # token 3's own key sits in the scratch column
    got = gpu_invariant.chunked_slot_attention(q, k, v, slots, positions, store_at)
    torch.testing.assert_close(got, cpu_kernels.attention(q, k, v, slots, positions, store_at), rtol=1e-5, atol=1e-5)
    for i in range(5):
        assert torch.equal(
            gpu_invariant.chunked_slot_attention(
                q[i : i + 1], k, v, slots[i : i + 1], positions[i : i + 1], store_at[i : i + 1]
            ),
            got[i : i + 1],
        )


@interpreted
def test_interpreted_attention_takes_the_chunked_kernel_from_head_dim_16_in_bounded_launches(monkeypatch):
    """The verifier's GPU attention: the chunked kernel where head_dim allows tensor-core products
    (16 or more), the per-token kernel below; a batch longer than one launch runs in slices whose
    rows are bitwise the rows of a single launch."""
    from moa_serve.kernels import gpu_invariant

    g = torch.Generator().manual_seed(5)
    for hd, kernel in ((16, gpu_invariant.chunked_slot_attention), (8, gpu_invariant.slot_attention)):
        k = torch.randn(2, 2, 301, hd, generator=g)
        v = torch.randn(2, 2, 301, hd, generator=g)
        q = torch.randn(7, 4, hd, generator=g)
        slots = torch.tensor([0, 1, 1, 0, 1, 0, 0])
        positions = torch.tensor([0, 3, 255, 256, 299, 40, 41])
        store_at = torch.tensor([0, 3, 255, 256, 299, 300, 41])  # token 5's own key in the scratch column
        whole = gpu_invariant.attention(q, k, v, slots, positions, store_at)
        assert torch.equal(whole, kernel(q, k, v, slots, positions, store_at))
        monkeypatch.setattr(gpu_invariant, "CHUNKED_MAX_TOKENS", 3)  # 3 + 3 + 1 tokens
        assert torch.equal(gpu_invariant.attention(q, k, v, slots, positions, store_at), whole)
        monkeypatch.undo()
    assert gpu_invariant.attention_scratch_bytes(9, 2, 2, 8, 301) == 0
    assert gpu_invariant.attention_scratch_bytes(9, 2, 2, 16, 301) == 9 * 2 * 2 * 2 * 18 * 4  # 2 chunks of 256


@interpreted
def test_interpreted_verifier_on_the_chunked_attention_is_lossless():
    """A target of head_dim 16 (the chunked attention kernel) on the Triton matmuls, rope_store and
    the fixed-shape forward: speculative greedy output at partial acceptance is the same runner's plain
    greedy output, batched and alone."""
    import random

    from moa_serve.engine.in_process import SpeculativeEngine
    from moa_serve.verifier.torch.runner import RunnerOptions, TorchTargetRunner
    from tools.gpu.harness import TOY_LLAMA, random_target
    from tools.gpu.replay import ReplayProposer

    target = random_target(TOY_LLAMA, torch.bfloat16, torch.device("cpu"))
    assert target.arch.head_dim == 16
    runner = TorchTargetRunner(
        target,
        torch.bfloat16,
        "cpu",
        max_sessions=3,
        max_model_len=64,
        options=RunnerOptions(packed_weights="off", prefix_caching=False, static_forward="on"),
    )
    assert runner.attention_kernel and runner.packing["batch_invariant_matmuls"] > 0
    assert runner.packing["fused_projections"] > 0  # rope and the K/V store in one kernel (rope_store)
    g = random.Random(0)
    prompts = [[g.randrange(512) for _ in range(n)] for n in (5, 9, 7)]
    plain_engine = SpeculativeEngine(runner, None, None, frozenset(), max_batch=3)
    plain = [o.token_ids for o in plain_engine.generate(prompts, 8, ignore_eos=True)]
    assert [o.token_ids for o in plain_engine.generate(prompts[1:2], 8, ignore_eos=True)] == plain[1:2]
    proposer = ReplayProposer(prompts, plain, 0.3, 512, seed=1)
    spec = SpeculativeEngine(runner, proposer, None, frozenset(), max_batch=3)
    outs = spec.generate(prompts, 8, num_speculative_tokens=3, ignore_eos=True)
    assert [o.token_ids for o in outs] == plain
    assert 1.0 < sum(o.mean_accepted_length for o in outs) / 3 < 4.0  # partial acceptance
    assert runner.stats["static_calls"] > 0


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_rope_store_is_apply_rope_and_the_cache_writes(dtype):
    from moa_serve.kernels import gpu_invariant
    from moa_serve.model.layers import Rotary, apply_rope

    g = torch.Generator().manual_seed(6)
    n, heads, kv_heads, hd, slots_n, length = 5, 6, 2, 16, 3, 30
    qkv = torch.randn(n, (heads + 2 * kv_heads) * hd, generator=g).to(dtype)
    positions = torch.tensor([0, 7, 8, 29, 3])
    cos, sin = Rotary.plain(hd, 10000.0)(positions, dtype)  # [1, n, hd]
    cos, sin = cos[0][:, None], sin[0][:, None]  # [n, 1, hd], as a layer gets them
    slots = torch.tensor([2, 0, 0, 1, 2])
    store_at = torch.tensor([0, 7, 8, 30, 4])  # token 3 writes the scratch column, token 4 past its position
    k = torch.randn(slots_n, kv_heads, length + 1, hd, generator=g).to(dtype)
    v = torch.randn(slots_n, kv_heads, length + 1, hd, generator=g).to(dtype)
    want_k, want_v = k.clone(), v.clone()
    q, kk, vv = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    want_q = apply_rope(q.reshape(n, heads, hd), cos, sin)
    want_k[slots, :, store_at] = apply_rope(kk.reshape(n, kv_heads, hd), cos, sin)
    want_v[slots, :, store_at] = vv.reshape(n, kv_heads, hd)
    got_q = gpu_invariant.rope_store(qkv, cos, sin, k, v, slots, store_at)
    assert torch.equal(v, want_v)  # the values are copied
    if dtype == torch.float32:
        assert torch.equal(got_q, want_q) and torch.equal(k, want_k)
    else:  # the interpreter rounds float32 -> bfloat16 otherwise than a GPU and torch: within an ulp
        torch.testing.assert_close(got_q, want_q, rtol=2**-7, atol=2**-7)
        torch.testing.assert_close(k, want_k, rtol=2**-7, atol=2**-7)


def test_tile_config_splits_k_only_for_weights_too_narrow_to_fill_the_gpu():
    from moa_serve.kernels import gpu_invariant

    pytest.importorskip("triton")
    narrow = gpu_invariant.tile_config(4096, 14336)  # Llama-3-8B's down projection
    wide = gpu_invariant.tile_config(128256, 4096)  # its LM head
    assert narrow.split > 1 and wide.split == 1
    assert 14336 // narrow.block_k // narrow.split >= 8  # every range still loops over K
    assert gpu_invariant.attention_chunk(8193) == 512 and gpu_invariant.attention_chunk(600) == 256


@interpreted
def test_interpreted_slot_attention_matches_the_cpu_kernel():
    from moa_serve.kernels import cpu as cpu_kernels
    from moa_serve.kernels import gpu_invariant

    if cpu_kernels.library() is None:
        pytest.skip(cpu_kernels.unavailable_reason())
    g = torch.Generator().manual_seed(1)
    slots_n, kv_heads, length, hd, heads = 3, 2, 40, 16, 6
    k = torch.randn(slots_n, kv_heads, length + 1, hd, generator=g)
    v = torch.randn(slots_n, kv_heads, length + 1, hd, generator=g)
    q = torch.randn(6, heads, hd, generator=g)
    slots = torch.tensor([0, 0, 2, 1, 2, 1])
    positions = torch.tensor([3, 4, 0, 39, 7, 36])
    store_at = torch.tensor([3, 4, 0, 39, 40, 37])  # token 4 is an alternative stored past its chain
    got = gpu_invariant.slot_attention(q, k, v, slots, positions, store_at)
    torch.testing.assert_close(got, cpu_kernels.attention(q, k, v, slots, positions, store_at), rtol=1e-5, atol=1e-5)
    for i in range(6):  # each token alone: bitwise its row of the batch
        assert torch.equal(
            gpu_invariant.slot_attention(
                q[i : i + 1], k, v, slots[i : i + 1], positions[i : i + 1], store_at[i : i + 1]
            ),
            got[i : i + 1],
        )


@interpreted
def test_interpreted_verifier_on_the_gpu_kernels_is_lossless(stories_path, stories_drafter):
    """The whole verifier on the Triton kernels (matmuls and attention) and the fixed-shape forward,
    the drafter's later steps as fixed shapes on the Triton attention: speculative greedy output is
    the same runner's plain greedy output, batched or alone."""
    from moa_serve.engine.in_process import SpeculativeEngine
    from tests.engine.test_lossless import STORY_PROMPTS

    spec = SpeculativeEngine.load(
        str(stories_path), str(stories_drafter), "float32", max_sessions=4, packed_weights="off", static_forward="on"
    )
    runner = spec.verifier
    assert runner.attention_kernel and runner.packing["batch_invariant_matmuls"] > 0
    assert spec.proposer.use_static_steps(graphs=False)  # draft steps on the Triton attention too
    plain_engine = SpeculativeEngine(runner, None, spec.tokenizer, spec.stop_ids, 4)
    prompts = [spec.tokenizer.encode(p) for p in STORY_PROMPTS[:2]]
    plain = [o.token_ids for o in plain_engine.generate(prompts, 5)]
    assert [o.token_ids for o in spec.generate(prompts, 5, num_speculative_tokens=3)] == plain
    assert runner.stats["static_calls"] > 0 and spec.proposer.static_steps.stats["static_draft_calls"] > 0
    assert spec.generate(prompts[1:], 5, num_speculative_tokens=2)[0].token_ids == plain[1]
