"""bfloat16 targets on CPU: bf16 weights behind the fixed-order kernel and the bf16 attention
kernel make a token's logits bitwise the same whatever shares the verify call, so greedy
speculative output is the target's own greedy output, bit for bit, in bf16 too."""

import pytest
import torch

from moa_serve.kernels import cpu as cpu_kernels
from moa_serve.kernels.packed import PackedLinear, PackedMatrix, pack_target
from moa_serve.model.kv_cache import PackedBatch
from moa_serve.protocol import VerifyRequest
from moa_serve.verifier.torch.runner import TorchTargetRunner
from tests.verifier.test_kernels import assert_rows_batch_invariant

needs_kernels = pytest.mark.skipif(
    cpu_kernels.library() is None, reason=f"packed kernels unavailable here: {cpu_kernels.unavailable_reason()}"
)
SMOLLM = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _bf16(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


# ------------------------------------------------------------------ kernels
@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 65, 130])
def test_bf16_matmul_matches_float64_and_rounds_once(rows):
    w = _bf16(75, 160, scale=0.05)  # odd N: the last weight-row block is short
    x = _bf16(rows, 160, seed=rows)
    lin = PackedLinear(PackedMatrix.from_bf16(w))
    y = lin(x)
    assert y.shape == (rows, 75) and y.dtype == torch.bfloat16
    ref = x.double() @ w.double().T
    torch.testing.assert_close(y.double(), ref, rtol=8e-3, atol=1e-3)  # one bf16 rounding of the sum
    y32 = lin(x.float())  # float32 in: float32 out, the sums before rounding
    assert y32.dtype == torch.float32 and torch.equal(y32.bfloat16(), y)
    torch.testing.assert_close(y32.double(), ref, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_bf16_rows_do_not_depend_on_the_batch():
    lin = PackedLinear(PackedMatrix.from_bf16(_bf16(64, 256, scale=0.05)), bias=_bf16(64, seed=5))
    assert_rows_batch_invariant(lin, _bf16(130, 256, seed=2))


def test_bf16_packed_matrix_shares_the_weight_and_stacks():
    w = _bf16(40, 64)
    p = PackedMatrix.from_bf16(w)
    assert p.shape == (40, 64) and p.qs.data_ptr() == w.data_ptr() and p.nbytes == 40 * 64 * 2
    assert torch.equal(p.dequantize(), w.float())
    both = PackedMatrix.cat([p, p.rows(torch.tensor([3, 1]))])
    assert both.shape == (42, 64) and torch.equal(both.dequantize()[40:], w[[3, 1]].float())
    with pytest.raises(ValueError, match="multiple of 32"):
        PackedMatrix.from_bf16(_bf16(4, 48))


@needs_kernels
def test_bf16_attention_kernel_is_the_float32_kernel_on_the_widened_cache():
    """Widening bf16 is exact, so the bf16 kernel computes what the float32 kernel computes on
    a float32 copy of the cache; each token's output is the same alone or in the batch."""
    slots, kv_heads, max_len, hd, heads = 4, 2, 40, 16, 6
    k, v = _bf16(slots, kv_heads, max_len, hd, seed=1), _bf16(slots, kv_heads, max_len, hd, seed=2)
    q = _bf16(7, heads, hd, seed=3)
    tok_slots = torch.tensor([0, 0, 0, 2, 3, 3, 1])
    positions = torch.tensor([5, 6, 7, 0, 30, 31, 12])
    out = cpu_kernels.attention(q, k, v, tok_slots, positions)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, cpu_kernels.attention(q.float(), k.float(), v.float(), tok_slots, positions).bfloat16())
    for i in range(7):
        assert torch.equal(
            cpu_kernels.attention(q[i : i + 1], k, v, tok_slots[i : i + 1], positions[i : i + 1])[0], out[i]
        )


# ------------------------------------------------------------------ a bf16 target through the runner
def _bf16_runner(path, max_sessions=3, max_model_len=512):
    return TorchTargetRunner(str(path), "bfloat16", max_sessions=max_sessions, max_model_len=max_model_len)


def _prefill(runner, prompts):
    model, cache = runner.model, runner.cache
    for slot, p in enumerate(prompts):
        model.forward_packed(torch.tensor(p), PackedBatch(cache, [slot], [0], [len(p)], kernel=runner.attention_kernel))


def _logits(runner, prompts, items):
    """Logits of ``items`` ((slot, new tokens) after each slot's prompt) in one packed forward."""
    batch = PackedBatch(
        runner.cache,
        [s for s, _ in items],
        [len(prompts[s]) for s, _ in items],
        [len(t) for _, t in items],
        kernel=runner.attention_kernel,
    )
    tokens = torch.tensor([x for _, t in items for x in t])
    return runner.model.lm_head(runner.model.forward_packed(tokens, batch))


def _assert_invariant(runner, prompts, drafts, others):
    with torch.inference_mode():
        _prefill(runner, prompts)
        alone = _logits(runner, prompts, [(0, drafts[:1])])
        with_drafts = _logits(runner, prompts, [(0, drafts)])
        beside = _logits(runner, prompts, [(1, others[0]), (0, drafts), (2, others[1])])
        singles = _logits(runner, prompts, [(2, others[1][:1]), (1, others[0][:1]), (0, drafts[:1])])
    assert alone.dtype == torch.bfloat16
    assert torch.equal(alone[0], with_drafts[0])
    n = len(others[0])
    assert torch.equal(with_drafts, beside[n : n + len(drafts)])
    assert torch.equal(alone[0], singles[2])


@needs_kernels
def test_tiny_bf16_target_is_packed_and_batch_invariant(tiny_model):
    runner = _bf16_runner(tiny_model)
    assert runner.packing["packed"] == 2 * 7 + 1 and not runner.packing["kept"] and runner.packing["fused"] == 4
    assert runner.attention_kernel and runner.cache.k.dtype == torch.bfloat16
    layer = runner.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, PackedLinear) and layer.mlp.gate_up.packed.kind == "bf16"
    # the unfused layers read the fused matrix's rows: one copy of the weights
    assert layer.self_attn.k_proj.packed.qs.data_ptr() == layer.self_attn.qkv.packed.qs[32:].data_ptr()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 16, (n,), generator=g).tolist() for n in (20, 45, 9)]
    _assert_invariant(runner, prompts, [11, 2, 3, 14, 5], ([7, 8, 9], [5]))


def test_bf16_without_kernels_runs_plain_torch(tiny_model, monkeypatch):
    """No AVX2 / no compiler / MOA_KERNELS=off: nothing is packed, torch attention, still verifies."""
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: "MOA_KERNELS=off")
    runner = _bf16_runner(tiny_model)
    assert runner.packing == {"packed": 0, "reason": "MOA_KERNELS=off"}
    assert not runner.attention_kernel
    assert not any(isinstance(m, PackedLinear) for m in runner.model.modules())
    out = runner.verify([VerifyRequest("a", [1, 2, 3, 4], drafts=[5, 6])])[0]
    assert 1 <= len(out.tokens) <= 3


@needs_kernels
def test_float32_model_is_not_packed_as_bf16(tiny_model):
    from moa_serve.model.target import TargetModel
    from moa_serve.model_files import load_state_dict, read_config

    model = TargetModel.from_state_dict(read_config(tiny_model), load_state_dict(tiny_model), torch.float32)
    report = pack_target(model, tiny_model)
    assert report["packed"] == 0 and "GGUF" in report["reason"]


@pytest.fixture(scope="module")
def smollm_bf16():
    from moa_serve.engine.in_process import SpeculativeEngine

    if cpu_kernels.library() is None:
        pytest.skip(f"packed kernels unavailable here: {cpu_kernels.unavailable_reason()}")
    return SpeculativeEngine.load(SMOLLM, None, "bfloat16", max_sessions=8, max_model_len=1024)


@pytest.mark.slow
def test_smollm2_bf16_logits_do_not_depend_on_drafts_or_neighbours():
    runner = _bf16_runner(SMOLLM, max_sessions=3, max_model_len=512)
    assert runner.packing["packed"] == 30 * 7 + 1 and runner.packing["fused"] == 60 and runner.attention_kernel
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (300, 280, 310)]
    _assert_invariant(runner, prompts, [11, 2000, 3000, 14, 5000], ([7, 8, 9, 10, 11], [5]))


QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "Name three primary colors.",
    "What is 12 times 7?",
    "Give me a tip for learning to code.",
    "Why is the sky blue?",
    "Describe a cat in two sentences.",
    "What does a CPU do?",
    "Translate 'hello' to Spanish.",
    "List three fruits that are red.",
    "How many days are in a leap year?",
    "What is the boiling point of water?",
    "Suggest a name for a pet goldfish.",
    "What is machine learning?",
    "Write a short greeting for a birthday card.",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet?",
    "How do plants drink water?",
    "Give one reason to exercise.",
    "What is an atom?",
    "Tell me a fun fact about octopuses.",
]
NEW_TOKENS = 24


@pytest.mark.slow
def test_smollm2_bf16_greedy_speculative_is_plain_greedy(smollm_bf16):
    """Greedy speculative decoding (an oracle proposing the reference with corruptions: partial
    acceptance and rollback at every depth) reproduces plain bf16 greedy decoding exactly, one
    session at a time and with sessions sharing verify calls."""
    from moa_serve.cli import prompt_tokens
    from moa_serve.engine.in_process import SpeculativeEngine
    from tests.support.oracles import NoisyOracle

    spec = smollm_bf16
    assert spec.verifier.attention_kernel and spec.verifier.packing["packed"] == 211
    prompts = [prompt_tokens(spec.tokenizer, q, chat=True) for q in QUESTIONS]
    assert len(prompts) >= 20
    plain = SpeculativeEngine(spec.verifier, None, spec.tokenizer, spec.stop_ids, max_batch=1)
    ref = [o.token_ids for o in plain.generate(prompts, NEW_TOKENS)]
    assert all(len(r) > 0 for r in ref)

    alone = SpeculativeEngine(
        spec.verifier, NoisyOracle(prompts, ref, 0.3, seed=1), spec.tokenizer, spec.stop_ids, max_batch=1
    )
    assert [o.token_ids for o in alone.generate(prompts, NEW_TOKENS, num_speculative_tokens=4)] == ref

    calls = []
    verify = spec.verifier.verify
    spec.verifier.verify = lambda reqs: (calls.append(len(reqs)), verify(reqs))[1]
    try:
        batched = SpeculativeEngine(
            spec.verifier, NoisyOracle(prompts, ref, 0.3, seed=2), spec.tokenizer, spec.stop_ids, max_batch=8
        )
        outs = batched.generate(prompts, NEW_TOKENS, num_speculative_tokens=4)
    finally:
        spec.verifier.verify = verify
    assert max(calls) >= 4  # sessions shared verify calls
    assert [o.token_ids for o in outs] == ref
    taus = [o.mean_accepted_length for o in outs]
    assert 1.0 < sum(taus) / len(taus)  # drafts were accepted, not just rejected
