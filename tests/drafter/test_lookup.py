"""Prompt lookup and the hybrid proposer: the n-gram index, the proposer protocol (deltas,
resync, release), the hybrid's split between lookup and model drafts, and losslessness (greedy
identity, and sampling with one-hot drafts following the target's distribution)."""

import random

import pytest
import torch

from moa_serve.drafter.checkpoint import load_draft_vocab
from moa_serve.drafter.lookup import HybridProposer, NgramIndex, PromptLookupProposer
from moa_serve.drafter.registry import load_feature_source, load_proposer
from moa_serve.drafter.spec import DrafterNotFoundError, DrafterSpec
from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.protocol import DraftRequest, DraftResult
from moa_serve.sampling import SamplingParams
from moa_serve.verifier.acceptance import accept_sampling
from tests.engine.test_lossless import NEW_TOKENS, STORY_PROMPTS, hf_greedy
from tests.engine.test_sampling import exact_two_token_distribution, tv, tv_bound


def naive_lookup(tokens, k, min_n, max_n):
    """The definition, by brute force: the latest earlier occurrence of the longest suffix."""
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        for i in range(end - 2, n - 2, -1):
            if tokens[i - n + 1 : i + 1] == tokens[end - n :]:
                return tokens[i + 1 : i + 1 + k], n
    return [], 0


def test_index_proposes_the_latest_occurrence_of_the_longest_suffix():
    idx = NgramIndex(1, 3)
    idx.set_tokens([5, 6, 7, 1, 5, 6, 8, 2, 9, 5, 6])
    # "5 6" occurred twice before: the latest (followed by 8 2 9) wins
    assert idx.propose(3) == ([8, 2, 9], 2)
    idx.set_tokens([5, 6, 7, 1, 5, 6, 8, 2, 9, 6, 7])
    assert idx.propose(2) == ([1, 5], 2)  # "6 7" at positions 1-2
    idx.set_tokens([1, 2, 3, 4])
    assert idx.propose(4) == ([], 0)  # no earlier occurrence of any suffix


def test_index_follows_appends_and_rewrites_like_a_rebuild():
    rng = random.Random(0)
    tokens = []
    inc = NgramIndex(2, 4)
    for step in range(300):
        if step % 37 == 36:  # a rewrite (rollback to a shorter, different history)
            tokens = tokens[: rng.randrange(len(tokens) + 1)]
        tokens = tokens + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        inc.set_tokens(tokens)
        assert inc.propose(5) == naive_lookup(tokens, 5, 2, 4)


def req(sid, tokens, k=4, base=0, **kw):
    return DraftRequest(sid, list(tokens), k, base=base, **kw)


def test_lookup_proposer_speaks_the_delta_protocol():
    p = PromptLookupProposer(min_n=2, max_n=3, max_sessions=2, max_model_len=64)
    (r,) = p.propose([req("a", [1, 2, 3, 4, 1, 2])])
    assert r.drafts == [3, 4, 1, 2] and r.probs is None and not r.resync
    (r,) = p.propose([req("a", [3], base=6)])  # delta: copy[:6] + [3]
    assert r.drafts == [4, 1, 2, 3]
    (r,) = p.propose([req("a", [9], base=20)])  # more than it holds: resync, nothing changed
    assert r.resync and r.drafts == []
    (r,) = p.propose([req("b", [7], base=3)])  # a session it never saw
    assert r.resync
    p.propose([req("b", [1, 2, 1]), req("c", [5, 5])])  # third session: "a" (least recent) evicted
    assert set(p.sessions) == {"b", "c"} and p.table.stats["evicted"] == 1
    p.release("b")
    assert set(p.sessions) == {"c"}


def test_lookup_never_drafts_past_the_context():
    p = PromptLookupProposer(min_n=1, max_n=2, max_model_len=8)
    (r,) = p.propose([req("a", [1, 2, 1, 2, 1, 2, 1], k=5)])
    assert len(r.drafts) == 2  # 7 committed + 2 drafts: the verifier's 9th token is the last one


class RecordingModel:
    """A model proposer stand-in: drafts [100 + i ...], records what it was asked."""

    needs_features = True
    draft_vocab = None

    def __init__(self, resync=()):
        self.asked, self.sessions, self.max_sessions, self.resync = [], {}, 8, set(resync)

    def propose(self, requests):
        self.asked.append([(r.session_id, r.num_drafts) for r in requests])
        out = []
        for r in requests:
            self.sessions[r.session_id] = True
            if r.session_id in self.resync:
                out.append(DraftResult(r.session_id, [], resync=True))
            else:
                out.append(
                    DraftResult(
                        r.session_id,
                        [100 + i for i in range(r.num_drafts)],
                        probs=torch.full((r.num_drafts, 4), 0.25) if r.num_drafts else None,
                    )
                )
        return out

    def release(self, session_id):
        self.sessions.pop(session_id, None)


def test_hybrid_takes_lookup_drafts_where_the_text_repeats_and_model_drafts_elsewhere():
    model = RecordingModel()
    h = HybridProposer(PromptLookupProposer(min_n=2, max_n=4), model)
    res = h.propose([req("rep", [1, 2, 3, 1, 2], k=3), req("new", [4, 5, 6], k=3)])
    # the model still sees the matched session (tokens, features), asked for no drafts
    assert model.asked == [[("rep", 0), ("new", 3)]]
    by = {r.session_id: r for r in res}
    assert by["rep"].drafts == [3, 1, 2] and by["rep"].probs is None  # one-hot lookup drafts
    assert by["new"].drafts == [100, 101, 102] and by["new"].probs.shape == (3, 4)
    assert h.stats["lookup_drafts"] == 3 and h.stats["model_drafts"] == 3


def test_hybrid_starts_both_copies_over_on_resync():
    model = RecordingModel(resync={"x"})
    h = HybridProposer(PromptLookupProposer(), model)
    (r,) = h.propose([req("x", [1, 2, 1, 2])])
    assert r.resync and r.drafts == [] and "x" not in h.lookup.sessions
    # the lookup copy lost a session the model still holds: answered as a resync too
    model.resync.clear()
    h.propose([req("y", [1, 2, 3])])
    h.lookup.release("y")
    (r,) = h.propose([req("y", [1], base=3)])
    assert r.resync and r.drafts == []


def test_drafter_specs():
    assert DrafterSpec.parse("lookup") == DrafterSpec(lookup=True)
    assert DrafterSpec.parse("hybrid:smollm2-135m-instruct-moa") == DrafterSpec(
        True, False, "smollm2-135m-instruct-moa"
    )
    assert DrafterSpec.parse("smollm2-135m-instruct-moa") == DrafterSpec(checkpoint="smollm2-135m-instruct-moa")
    with pytest.raises(DrafterNotFoundError, match="hybrid:"):
        DrafterSpec.parse("hybrid:")
    assert DrafterSpec.parse("lookup").kind == "lookup"
    assert DrafterSpec.parse("hybrid:smollm2-135m-instruct-eagle").kind == "eagle"
    assert load_draft_vocab("lookup") is None and load_feature_source("lookup") is None
    assert isinstance(load_proposer("lookup", max_sessions=2), PromptLookupProposer)


@pytest.fixture(scope="module")
def stories(stories_path):
    plain = SpeculativeEngine.load(str(stories_path), None, "float32", max_sessions=8)
    prompts = [plain.tokenizer.encode(p) for p in STORY_PROMPTS]
    return plain, prompts, hf_greedy(stories_path, prompts, 2 * NEW_TOKENS)


@pytest.mark.parametrize("spec", ["lookup", "hybrid"])
def test_lookup_and_hybrid_greedy_output_is_the_targets(stories, stories_path, stories_drafter, spec):
    _, prompts, ref = stories
    drafter = "lookup" if spec == "lookup" else f"hybrid:{stories_drafter}"
    engine = SpeculativeEngine.load(str(stories_path), drafter, "float32", max_sessions=8)
    outs = engine.generate(prompts, 2 * NEW_TOKENS, num_speculative_tokens=4)
    assert [o.token_ids for o in outs] == ref
    assert max(o.mean_accepted_length for o in outs) > 1.0  # lookup drafts were accepted somewhere
    alone = engine.generate([prompts[3]], 2 * NEW_TOKENS, num_speculative_tokens=4)[0]
    assert alone.token_ids == ref[3]
    if spec == "hybrid":
        st = engine.proposer.stats
        assert st["lookup_drafts"] > 0 and st["model_drafts"] > 0


def test_one_hot_drafts_keep_rejection_sampling_exact():
    gen = torch.Generator().manual_seed(1)
    vocab, n = 6, 20000
    p = torch.softmax(torch.randn(3, vocab, generator=gen) * 2, -1)
    drafts = [2, 4]  # deterministic, as a lookup proposes them
    q = torch.zeros(2, vocab)
    q[[0, 1], drafts] = 1.0
    counts = torch.zeros(vocab)
    for _ in range(n):
        k, nxt = accept_sampling(p, q, drafts, gen)
        counts[drafts[0] if k > 0 else nxt] += 1
    assert tv(counts / n, p[0]) < tv_bound(p[0], n)


def test_engine_sampling_with_lookup_drafts_matches_the_target(tiny_model):
    spec = SpeculativeEngine.load(str(tiny_model), "lookup", "float32", max_sessions=16)
    params = SamplingParams(temperature=1.0)
    prompt = [1, 5, 9, 1, 5, 9, 1, 5]  # "1 5" repeats: the first round already drafts 9 1 5
    exact = exact_two_token_distribution(spec, prompt, params)
    n = 1500
    counts = torch.zeros(16 * 16)
    sessions = [
        spec.new_session(prompt, 3, params.model_copy(update={"seed": i}), 3, ignore_eos=True) for i in range(n)
    ]
    drafted = 0
    for res in spec.generate_sessions(sessions):
        counts[res.token_ids[0] * 16 + res.token_ids[1]] += 1
        drafted += res.drafted_tokens
    assert drafted > n  # lookup drafts were verified (q one-hot: the verifier got no probabilities)
    assert tv(counts / n, exact) < tv_bound(exact, n)
