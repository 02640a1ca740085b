"""Greedy speculative output must be token-for-token the target's own greedy output."""

from pathlib import Path

import pytest
import torch

from moa_serve.engine.in_process import SpeculativeEngine
from tests.support.oracles import NoisyOracle
from tools.prompts import STORY_PROMPTS

NEW_TOKENS = 24


def hf_greedy(path, prompts, max_new_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False)
        outs.append(out[0, len(p) :].tolist())
    return outs


@pytest.fixture(scope="module")
def stories_setup(stories_path, stories_drafter):
    spec = SpeculativeEngine.load(str(stories_path), str(stories_drafter), "float32", max_sessions=8)
    prompts = [spec.tokenizer.encode(p) for p in STORY_PROMPTS]
    return spec, prompts, hf_greedy(stories_path, prompts, NEW_TOKENS)


def test_twenty_prompts_one_at_a_time(stories_setup):
    spec, prompts, ref = stories_setup
    assert len(prompts) >= 20
    for p, r in zip(prompts, ref):
        out = spec.generate([p], NEW_TOKENS, num_speculative_tokens=4)[0]
        assert out.token_ids == r


def test_twenty_prompts_batched_in_one_forward(stories_setup):
    spec, prompts, ref = stories_setup
    calls = []
    verify = spec.verifier.verify
    spec.verifier.verify = lambda reqs: (calls.append(len(reqs)), verify(reqs))[1]
    try:
        outs = spec.generate(prompts, NEW_TOKENS, num_speculative_tokens=3)
    finally:
        spec.verifier.verify = verify
    assert max(calls) >= 4 and len({len(p) for p in prompts[:8]}) >= 4  # ragged sessions shared rounds
    assert [o.token_ids for o in outs] == ref


@pytest.mark.parametrize("error_rate", [0.0, 0.3])
def test_partial_acceptance_keeps_identity(stories_setup, error_rate):
    spec, prompts, ref = stories_setup
    oracle = NoisyOracle(prompts, ref, error_rate)
    engine = SpeculativeEngine(spec.verifier, oracle, spec.tokenizer, spec.stop_ids, max_batch=6)
    outs = engine.generate(prompts, NEW_TOKENS, num_speculative_tokens=5)
    assert [o.token_ids for o in outs] == ref
    taus = [o.mean_accepted_length for o in outs]
    if error_rate == 0.0:
        assert min(taus) > 3.0  # whole draft blocks were accepted
    else:
        assert 1.0 < sum(taus) / len(taus) < 6.0


def test_vanilla_engine_matches_reference(stories_path, stories_setup):
    _, prompts, ref = stories_setup
    vanilla = SpeculativeEngine.load(str(stories_path), None, "float32", max_sessions=8)
    outs = vanilla.generate(prompts[:8], NEW_TOKENS)
    assert [o.token_ids for o in outs] == ref[:8]
    assert all(o.mean_accepted_length == 1.0 for o in outs)


@pytest.mark.slow
def test_smollm2_random_drafter_matches_hf(tmp_path):
    from moa_serve.drafter.checkpoint import init_drafter
    from tests.conftest import SMOLLM

    name = "HuggingFaceTB/SmolLM2-135M-Instruct"
    drafter = init_drafter(name, tmp_path / "d", seed=1)
    spec = SpeculativeEngine.load(name, str(drafter), "float32", max_sessions=4)
    texts = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain photosynthesis in one sentence.",
    ]
    prompts = [
        spec.tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for t in texts
    ]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(SMOLLM), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32
    ).eval()
    outs = spec.generate(prompts, 24, num_speculative_tokens=4)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p) :].tolist()
        assert o.token_ids == ref


def test_adaptive_speculation_shrinks_k_for_a_bad_drafter_and_keeps_identity(stories_setup):
    spec, prompts, ref = stories_setup
    bad = NoisyOracle(prompts, ref, error_rate=1.0)  # every draft is wrong
    engine = SpeculativeEngine(spec.verifier, bad, spec.tokenizer, spec.stop_ids, max_batch=4)
    fixed = engine.generate(prompts[:4], NEW_TOKENS, num_speculative_tokens=5)
    adaptive = engine.generate(prompts[:4], NEW_TOKENS, num_speculative_tokens=5, adaptive_speculation=True)
    assert [o.token_ids for o in adaptive] == [o.token_ids for o in fixed] == ref[:4]
    assert all(a.drafted_tokens < f.drafted_tokens / 3 for a, f in zip(adaptive, fixed))
    good = NoisyOracle(prompts, ref, error_rate=0.0)
    engine = SpeculativeEngine(spec.verifier, good, spec.tokenizer, spec.stop_ids, max_batch=4)
    full = engine.generate(prompts[:4], NEW_TOKENS, num_speculative_tokens=5, adaptive_speculation=True)
    assert [o.token_ids for o in full] == ref[:4]
    assert min(o.mean_accepted_length for o in full) > 3.0  # a good drafter keeps its long drafts


def test_tree_drafts_batched_keep_identity_and_accept_alternatives(stories_setup):
    """Tree drafts (the drafter's runners-up verified beside its chain), ragged sessions in one
    forward: the output is still the target's greedy one, and alternatives do get accepted."""
    spec, prompts, ref = stories_setup
    before = spec.verifier.stats["alternatives_accepted"]
    spec.proposer.branching = (4, 2, 2)
    try:
        outs = spec.generate(prompts[:8], NEW_TOKENS, num_speculative_tokens=4)
    finally:
        spec.proposer.branching = ()
    assert [o.token_ids for o in outs] == ref[:8]
    assert spec.verifier.stats["alternatives_accepted"] > before


def test_smollm2_tree_drafts_through_the_fused_packed_target_match_plain_decoding():
    """SmolLM2 from its GGUF: the target runs as one fused kernel call per forward, alternatives
    stored past the chain (``store_at``): the shipped MoA drafter's tree drafts give the tokens of
    plain decoding, and accepting them raises tokens per round."""
    name = "HuggingFaceTB/SmolLM2-135M-Instruct"
    ckpt = str(Path(__file__).resolve().parents[2] / "drafter" / "checkpoints" / "smollm2-135m-instruct-moa")
    spec = SpeculativeEngine.load(name, ckpt, "float32", max_sessions=2)
    if getattr(spec.verifier.model, "fused_stack", None) is None:
        pytest.skip("the fused packed target is not available here")
    texts = ["Explain photosynthesis in two sentences.", "List three uses of copper and say why."]
    prompts = [
        spec.tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for t in texts
    ]
    plain = SpeculativeEngine(spec.verifier, None, spec.tokenizer, spec.stop_ids, 2)
    want = [o.token_ids for o in plain.generate(prompts, 40)]
    chain = spec.generate(prompts, 40, num_speculative_tokens=5)
    spec.proposer.branching = (4, 2)
    tree = spec.generate(prompts, 40, num_speculative_tokens=5)
    assert [o.token_ids for o in chain] == want and [o.token_ids for o in tree] == want
    assert spec.verifier.stats["alternatives_accepted"] > 0
    assert sum(o.rounds for o in tree) < sum(o.rounds for o in chain)
