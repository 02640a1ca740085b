"""The target's log-probabilities of generated and prompt tokens (stories260k, float32): from the
verify forward's logits, the same with speculation on and off (drafts accepted in part, tree
alternatives, multi-step decoding, chunked prefill), and equal to a transformers forward of the
same weights."""

import pytest
import torch

from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.engine.session import Session
from moa_serve.grammar import GrammarSpec
from moa_serve.protocol import VerifyRequest
from moa_serve.sampling import SamplingParams
from moa_serve.verifier.torch.runner import RunnerOptions, TorchTargetRunner
from tests.support.oracles import TreeOracle

PROMPTS = ["Once upon a time", "The little dog", "Lily went to the park and", "Sam had a red ball. He"]
NEW_TOKENS = 16
TOP = 5
# against transformers: float32 sums in another order (its SDPA, our attention kernel)
ATOL, RTOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def plain(stories_path):
    return SpeculativeEngine.load(str(stories_path), None, "float32", max_sessions=8)


@pytest.fixture(scope="module")
def hf(stories_path):
    from transformers import AutoModelForCausalLM

    torch.set_float32_matmul_precision("highest")
    return AutoModelForCausalLM.from_pretrained(str(stories_path), dtype=torch.float32).eval()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row p is the distribution of the token at position p + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def sessions(engine, prompts, **kw) -> list[Session]:
    out = []
    for p in prompts:
        s = engine.new_session(p, NEW_TOKENS, **kw)
        s.logprobs, s.score_prompt = TOP, True
        out.append(s)
    return out


def values(lps) -> list[tuple[float, list[int]]]:
    return [(x.logprob, [t for t, _ in x.top]) for x in lps]


def close(a: float, b: float) -> bool:
    return abs(a - b) <= ATOL + RTOL * abs(b)


def assert_same(a, b):
    """Speculation on and off: the same tokens ranked, values within 1e-5 (the rows of a position
    are computed in forwards of other sizes, which round the last bits of float32 differently)."""
    assert len(a) == len(b)
    for (va, ta), (vb, tb) in zip(values(a), values(b)):
        assert abs(va - vb) <= 1e-5 and ta == tb


@pytest.fixture(scope="module")
def reference(plain):
    prompts = [plain.tokenizer.encode(p) for p in PROMPTS]
    ss = sessions(plain, prompts)
    plain.generate_sessions(ss)
    return prompts, ss


def test_plain_logprobs_equal_a_transformers_forward(reference, hf):
    prompts, ss = reference
    for p, s in zip(prompts, ss):
        assert len(s.token_logprobs) == len(s.generated) == NEW_TOKENS
        assert len(s.prompt_logprobs) == len(p) - 1
        ref = hf_logprobs(hf, s.tokens)
        for pos in range(1, len(s.tokens)):
            got = s.prompt_logprobs[pos - 1] if pos < len(p) else s.token_logprobs[pos - len(p)]
            assert close(got.logprob, ref[pos - 1, s.tokens[pos]].item())
            top = ref[pos - 1].topk(TOP)
            assert [t for t, _ in got.top] == top.indices.tolist()
            assert all(close(a, b) for (_, a), b in zip(got.top, top.values.tolist()))
        # greedy: every generated token is the most likely one
        assert all(x.top[0][0] == t for x, t in zip(s.token_logprobs, s.generated))


@pytest.mark.parametrize("error_rate", [0.0, 0.4])
def test_speculation_gives_the_same_logprobs(plain, reference, error_rate):
    prompts, want = reference
    refs = {tuple(p): s.generated for p, s in zip(prompts, want)}
    before = plain.verifier.stats["alternatives_accepted"]
    spec = SpeculativeEngine(plain.verifier, TreeOracle(refs, error_rate), plain.tokenizer, plain.stop_ids, max_batch=4)
    got = sessions(spec, prompts, num_speculative_tokens=4)
    spec.generate_sessions(got)
    for g, w in zip(got, want):
        assert g.generated == w.generated and g.accepted > 0
        assert_same(g.token_logprobs, w.token_logprobs)
        assert_same(g.prompt_logprobs, w.prompt_logprobs)
    if error_rate:
        assert plain.verifier.stats["alternatives_accepted"] > before


def test_sampled_tokens_carry_the_targets_raw_logprobs(plain, hf):
    prompt = plain.tokenizer.encode(PROMPTS[0])
    (s,) = sessions(plain, [prompt], sampling=SamplingParams(temperature=0.7, top_p=0.9, seed=3))
    plain.generate_sessions([s])
    ref = hf_logprobs(hf, s.tokens)
    for i, (t, x) in enumerate(zip(s.generated, s.token_logprobs)):
        assert close(x.logprob, ref[len(prompt) + i - 1, t].item())


def test_chunked_prefill_and_multi_step_decoding(stories_path, reference):
    """The runner alone: a prompt scored over several prefill chunks, then tokens from one call of
    several forwards, equal those of the engine."""
    prompts, want = reference
    runner = TorchTargetRunner(
        str(stories_path), "float32", max_sessions=2, options=RunnerOptions(max_num_batched_tokens=4)
    )
    prompt, s = prompts[2], want[2]
    scores, tokens, lps, base = [], [], [], 0
    committed = list(prompt)
    for _ in range(10):
        (r,) = runner.verify(
            [
                VerifyRequest(
                    "a", committed[base:], want_features=False, base=base, logprobs=TOP, score_from=1 + len(scores)
                )
            ]
        )
        base = len(committed)
        if r.scores:
            assert r.scores_start == 1 + len(scores)
            scores += r.scores
        if r.tokens:
            tokens += r.tokens
            lps += r.logprobs
            committed += r.tokens
            break
    assert len(scores) == len(prompt) - 1
    assert_same(scores, s.prompt_logprobs)
    (r,) = runner.verify(
        [VerifyRequest("a", [], want_features=False, base=len(committed), logprobs=TOP, decode_steps=5, max_tokens=5)]
    )
    assert len(r.tokens) == len(r.logprobs) == 5
    tokens += r.tokens
    lps += r.logprobs
    assert tokens == s.generated[: len(tokens)]
    assert_same(lps, s.token_logprobs[: len(lps)])


def test_under_a_grammar_the_logprobs_are_the_targets_raw_ones(plain, hf):
    """The grammar masks the choice, not the log-probabilities: the digits a regex forces carry the
    target's unconstrained values, and the top alternatives include the tokens it forbade."""
    prompt = plain.tokenizer.encode(PROMPTS[0])
    s = plain.new_session(prompt, NEW_TOKENS, grammar=GrammarSpec("regex", "[0-9]{4}"))
    s.logprobs = TOP
    plain.generate_sessions([s])
    assert plain.tokenizer.decode(s.generated).strip()[:4].isdigit()
    ref = hf_logprobs(hf, s.tokens)
    for i, (t, x) in enumerate(zip(s.generated, s.token_logprobs)):
        assert close(x.logprob, ref[len(prompt) + i - 1, t].item())
        assert [a for a, _ in x.top] == ref[len(prompt) + i - 1].topk(TOP).indices.tolist()
    assert any(x.top[0][0] != t for x, t in zip(s.token_logprobs, s.generated))
