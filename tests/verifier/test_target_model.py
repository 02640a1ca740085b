"""The target model behind the torch runner: its logits equal Hugging Face's, the K/V of rejected
drafts is rolled back, and a replica that does not hold a session re-prefills it to the same tokens."""

import pytest
import torch

from moa_serve.model.kv_cache import PackedBatch
from moa_serve.model.target import TargetModel
from moa_serve.model_files import load_state_dict, read_config
from moa_serve.protocol import VerifyRequest
from moa_serve.verifier.torch.runner import TorchTargetRunner


@pytest.fixture(scope="module")
def target(stories_path):
    return TargetModel.from_state_dict(read_config(stories_path), load_state_dict(stories_path), torch.float32)


def test_logits_match_transformers(stories_path, target):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(stories_path), dtype=torch.float32).eval()
    toks = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache(2, 64)
    slot = cache.allocate()
    with torch.no_grad():
        ours = target.lm_head(target.forward_packed(toks[0], PackedBatch(cache, [slot], [0], [30])))[None]
        ref = hf(toks).logits
    assert torch.allclose(ours, ref, atol=1e-4)


def test_kv_rollback_after_rejected_drafts(target):
    runner = TorchTargetRunner(target, max_sessions=2, max_model_len=128)
    prompt = list(range(3, 20))
    (r0,) = runner.verify([VerifyRequest("a", prompt)])
    committed = prompt + r0.tokens
    wrong = [(r0.tokens[0] + 7) % 512, 11, 12]  # the first draft is wrong: everything rolls back
    (r1,) = runner.verify([VerifyRequest("a", committed, wrong)])
    assert r1.num_accepted == 0 and len(r1.tokens) == 1
    slot = runner.sessions["a"].slot
    assert int(runner.cache.lengths[slot]) == len(committed)  # the drafts' K/V are not kept
    fresh = TorchTargetRunner(target, max_sessions=1, max_model_len=128)
    fresh.verify([VerifyRequest("b", committed + r1.tokens)])
    fs = fresh.sessions["b"].slot
    n = len(committed)
    assert torch.allclose(runner.cache.k[:, slot, :, :n], fresh.cache.k[:, fs, :, :n], atol=1e-5)
    # the next round continues exactly as a fresh session would
    (r2,) = runner.verify([VerifyRequest("a", committed + r1.tokens)])
    (f2,) = fresh.verify([VerifyRequest("b", committed + r1.tokens)])
    assert r2.tokens == f2.tokens


def test_verifier_reprefills_a_session_it_does_not_hold(target):
    a = TorchTargetRunner(target, max_sessions=2, max_model_len=128)
    b = TorchTargetRunner(target, max_sessions=2, max_model_len=128)
    toks = list(range(5, 25))
    (ra,) = a.verify([VerifyRequest("s", toks)])
    (ra2,) = a.verify([VerifyRequest("s", toks + ra.tokens)])
    (rb,) = b.verify([VerifyRequest("s", toks + ra.tokens)])  # another replica: full prefill
    assert ra2.tokens == rb.tokens and rb.num_computed == len(toks) + 1
