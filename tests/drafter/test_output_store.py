"""The output store (the target's earlier replies, looked up by the context's last tokens): what
it proposes, what it refuses to guess, how it is read from packed replies, how prompt lookup falls
back on it, the drafter specs that turn it on, and losslessness through the engine."""

import gzip
import json

import pytest

from moa_serve.drafter.lookup import LookupTable, PromptLookupProposer
from moa_serve.drafter.outputs import OutputStore, load_output_store, read_replies
from moa_serve.drafter.spec import DrafterNotFoundError, DrafterSpec
from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.protocol import DraftRequest
from tests.engine.test_lossless import NEW_TOKENS, STORY_PROMPTS, hf_greedy


class WordTokenizer:
    """Texts of integers separated by spaces: the integers are the ids."""

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[int(w) for w in t.split()] for t in texts]}


def test_the_longest_suffix_found_is_continued_by_its_majority():
    store = OutputStore([[1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [7, 3, 4, 6, 8], [5, 5, 3, 4, 6, 8, 1]], min_n=2, max_n=3)
    # "3 4" occurs 4 times, followed by 5 once and by 6 three times; after "3 4 6": 8 twice (then 1 once)
    assert store.propose([0, 3, 4], 3) == ([6, 8, 1], 2)
    # the longer suffix "2 3 4" (twice: 5 and 6, a tie: the smaller id first) is preferred to "3 4"
    drafts, n = store.propose([2, 3, 4], 1)
    assert n == 3 and drafts in ([5], [6])
    assert store.propose([4, 4], 3) == ([], 0)  # "4 4" never occurred
    assert store.propose([3], 3) == ([], 0)  # shorter than min_n
    assert store.propose([3, 4], 0) == ([], 0)
    assert len(store) == 22 and store.num_sequences == 4


def test_no_continuation_crosses_from_one_reply_into_the_next():
    store = OutputStore([[1, 2, 3], [4, 5, 6]], min_n=2, max_n=2)
    assert store.propose([2, 3], 3) == ([], 0)  # "2 3" ends its reply: nothing followed it
    assert store.propose([1, 2], 5) == ([3], 2)  # stops at the end of the reply


def test_confidence_and_support_decide_how_far_to_guess():
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 5], [1, 2, 7, 8]]
    # after "1 2": 3 in 3 of 4, then 5 in 2 of 3
    assert OutputStore(seqs, min_n=2, max_n=2).propose([1, 2], 3) == ([3, 5], 2)
    assert OutputStore(seqs, min_n=2, max_n=2, min_confidence=0.7).propose([1, 2], 3) == ([3], 2)
    assert OutputStore(seqs, min_n=2, max_n=2, min_confidence=0.8).propose([1, 2], 3) == ([], 0)
    assert OutputStore(seqs, min_n=2, max_n=2, min_support=3).propose([1, 2], 3) == ([3], 2)
    assert OutputStore(seqs, min_n=2, max_n=2, min_support=5).propose([1, 2], 3) == ([], 0)
    with pytest.raises(ValueError, match="min_n"):
        OutputStore(seqs, min_n=3, max_n=2)
    with pytest.raises(ValueError, match="min_confidence"):
        OutputStore(seqs, min_confidence=1.5)


def test_the_hashed_index_agrees_with_a_brute_force_count():
    import random
    from collections import Counter

    rng = random.Random(0)
    seqs = [[rng.randrange(5) for _ in range(rng.randrange(3, 30))] for _ in range(60)]
    store = OutputStore(seqs, min_n=2, max_n=4)
    for _ in range(200):
        ctx = [rng.randrange(5) for _ in range(6)]
        for n in range(4, 1, -1):  # the definition: the longest suffix with a continuation somewhere
            follow = Counter(s[i + n] for s in seqs for i in range(len(s) - n) if s[i : i + n] == ctx[-n:])
            if follow:
                break
        drafts, got_n = store.propose(ctx, 1)
        if not follow:
            assert (drafts, got_n) == ([], 0)
        else:
            top = max(follow.values())
            assert got_n == n and follow[drafts[0]] == top


def test_few_occurrences_counted_in_python_draft_as_numpy_counts_them(monkeypatch):
    """The walk counts a suffix's occurrences with NumPy while they are many and in Python once
    they are few: drafts, runners-up and their order are the same whichever counts."""
    import random

    from moa_serve.drafter import outputs

    rng = random.Random(3)
    # a small vocabulary: suffixes with hundreds of occurrences, ties, replies ending mid-walk
    store = OutputStore([[rng.randrange(6) for _ in range(rng.randrange(2, 40))] for _ in range(300)], min_n=2, max_n=4)
    contexts = [[rng.randrange(6) for _ in range(rng.randrange(2, 8))] for _ in range(300)]
    settings = [((), 0.0, None, None), ((), 0.0, 3, 0.5), ((4, 3, 2), 0.02, None, None), ((6, 2), 0.0, 2, 0.3)]

    def proposals(few: int) -> list:
        monkeypatch.setattr(outputs, "_FEW", few)
        return [store.propose_tree(c, 5, *s) for s in settings for c in contexts]

    numpy_only, python_soon, python_only = proposals(-1), proposals(outputs._FEW), proposals(10**9)
    assert numpy_only == python_soon == python_only
    assert sum(bool(d) for d, _, _ in numpy_only) > 200 and sum(any(a) for _, _, a in numpy_only) > 50


def test_replies_are_read_from_packs_and_chat_files(tmp_path):
    packed = tmp_path / "packs" / "m-replies.jsonl.gz"
    packed.parent.mkdir()
    with gzip.open(packed, "wt") as fh:
        fh.write(json.dumps({"file": "a", "row": 1, "prompt_sha": "x", "reply": "1 2 3"}) + "\n")
        fh.write(json.dumps({"file": "a", "row": 2, "prompt_sha": "y", "replies": ["4 5", "6 7"]}) + "\n\n")
    chat = tmp_path / "packs" / "chat.jsonl"
    chat.write_text(
        json.dumps({"messages": [{"role": "user", "content": "9 9"}, {"role": "assistant", "content": "1 2 8"}]}) + "\n"
    )
    assert read_replies(packed) == ["1 2 3", "4 5", "6 7"]
    assert sorted(read_replies(tmp_path / "packs")) == ["1 2 3", "1 2 8", "4 5", "6 7"]
    store = load_output_store("some/M", WordTokenizer(), source=tmp_path / "packs")
    assert store.num_sequences == 4 and len(store) == 10
    with pytest.raises(FileNotFoundError, match="no .jsonl"):
        read_replies(tmp_path / "nothing-here")
    with pytest.raises(FileNotFoundError, match="packed outputs"):
        load_output_store("no-such-model-anywhere", WordTokenizer())


def test_prompt_lookup_falls_back_on_the_store_where_the_context_has_no_match():
    store = OutputStore([[10, 11, 12, 13, 14]], min_n=2, max_n=3)
    table = LookupTable(min_n=2, max_n=3, store=store)
    # the session's own tokens repeat: its lookup wins, with a positive match length
    assert table.draft_match("a", [10, 11, 5, 10, 11], 2) == ([5, 10], 2)
    # no match in the context: the store's, reported as the negative suffix length
    assert table.draft_match("b", [1, 10, 11, 12], 2) == ([13, 14], -3)
    assert table.draft_match("c", [1, 2, 3], 2) == ([], 0)
    assert table.stats["from_outputs"] == 2 and table.stats["unmatched"] == 1
    p = PromptLookupProposer(min_n=2, max_n=3, store=store)
    (r,) = p.propose([DraftRequest("s", [7, 11, 12], 4)])
    assert r.drafts == [13, 14]


def test_drafter_specs_with_outputs():
    assert DrafterSpec.parse("lookup+outputs") == DrafterSpec(lookup=True, outputs=True)
    assert DrafterSpec.parse("hybrid+outputs:x-moa") == DrafterSpec(lookup=True, outputs=True, checkpoint="x-moa")
    assert all(DrafterSpec.parse(t).outputs for t in ("lookup+outputs", "hybrid+outputs:x-moa"))
    assert not any(DrafterSpec.parse(t).outputs for t in ("lookup", "hybrid:x-moa", None, "x-moa"))
    with pytest.raises(DrafterNotFoundError, match=r"hybrid\+outputs:"):
        DrafterSpec.parse("hybrid+outputs:")


def test_the_shipped_packs_make_a_store_for_smollm2():
    from moa_serve.drafter.outputs import output_store_for, packed_outputs

    packs = packed_outputs("HuggingFaceTB/SmolLM2-135M-Instruct")  # drafter/selfdistill/manifest.json
    assert [p.name for p in packs] == [
        "smollm2-135m-instruct-first-turns.jsonl.gz",
        "smollm2-135m-instruct-all-turns.jsonl.gz",
    ]
    assert all(p.is_file() for p in packs)
    assert packed_outputs("some/Other-Model") == []  # no manifest entry: no packs, whatever files lie there
    store = output_store_for("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert len(store) > 900_000 and store.num_sequences > 10_000


@pytest.fixture(scope="module")
def stories_ref(stories_path):
    plain = SpeculativeEngine.load(str(stories_path), None, "float32", max_sessions=8)
    prompts = [plain.tokenizer.encode(p) for p in STORY_PROMPTS]
    return plain.tokenizer, prompts, hf_greedy(stories_path, prompts, 2 * NEW_TOKENS)


@pytest.mark.parametrize("contents", ["the target's own", "unrelated"])
def test_lookup_with_outputs_is_lossless(stories_path, stories_drafter, stories_ref, tmp_path, monkeypatch, contents):
    """Greedy through ``lookup+outputs`` and ``hybrid+outputs:`` is the target's output, whether
    the store holds the target's continuations (drafts accepted) or unrelated text (rejected)."""
    import moa_serve.drafter.outputs as outputs

    tok, prompts, ref = stories_ref
    texts = (
        [tok.decode(r) for r in ref]
        if contents == "the target's own"
        else ["Once upon a time there was a purple cat who ate the moon and sang."] * 3
    )
    path = tmp_path / "outputs.jsonl"
    path.write_text("".join(json.dumps({"reply": t}) + "\n" for t in texts))
    monkeypatch.setenv("MOA_OUTPUTS", str(path))
    monkeypatch.setattr(outputs, "_CACHE", {})
    for drafter in ("lookup+outputs", f"hybrid+outputs:{stories_drafter}"):
        engine = SpeculativeEngine.load(str(stories_path), drafter, "float32", max_sessions=8)
        outs = engine.generate(prompts, 2 * NEW_TOKENS, num_speculative_tokens=4)
        assert [o.token_ids for o in outs] == ref
        table = engine.proposer.table if drafter == "lookup+outputs" else engine.proposer.lookup.table
        assert table.stats["from_outputs"] > 0  # the store drafted
        if contents == "the target's own":
            assert min(o.mean_accepted_length for o in outs) > 1.5


def test_a_store_in_front_of_a_model_drafts_only_where_it_is_sure():
    """``lookup+outputs`` takes any suffix of 2+ tokens; ``hybrid+outputs:`` leaves to the model
    what a 2-token suffix or a split vote would guess."""
    from moa_serve.drafter.outputs import GATE_ALONE, GATE_BEFORE_MODEL

    store = OutputStore([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 6], [9, 2, 3, 5], [7, 8, 6, 6]], min_n=2, max_n=4)
    alone = LookupTable(store=store, store_gate=GATE_ALONE)
    before = LookupTable(store=store, store_gate=GATE_BEFORE_MODEL)
    assert alone.draft_match("a", [0, 7, 8], 3) == ([6, 6], -2)
    assert before.draft_match("a", [0, 7, 8], 3) == ([], 0)  # a 2-token suffix: the model's turn
    assert alone.draft_match("b", [0, 2, 3], 2) == ([5], -2)  # after "2 3": 5 in 2 of 4
    assert before.draft_match("b", [1, 2, 3], 2) == ([], 0)  # after "1 2 3": 4, 5, 6 once each
    assert before.draft_match("c", [9, 2, 3], 2) == ([5], -3)


def test_the_router_looks_the_store_up_only_for_outputs_specs():
    import yaml

    from moa_serve.deployments.config import AppConfig
    from moa_serve.deployments.router import router_lookup
    from moa_serve.drafter.outputs import GATE_ALONE, GATE_BEFORE_MODEL
    from tests.conftest import REPO

    args = yaml.safe_load((REPO / "deployments/configs/local-cpu.yaml").read_text())["applications"][0]["args"]
    table = lambda drafter: router_lookup(AppConfig.model_validate({**args, "drafter": drafter}), 8, 2048)  # noqa: E731
    assert table("lookup").store is None
    alone = table("lookup+outputs")
    assert alone.store is not None and alone.store_gate == GATE_ALONE and len(alone.store) > 900_000
    both = table("hybrid+outputs:smollm2-135m-instruct-moa")
    assert both.store is alone.store and both.store_gate == GATE_BEFORE_MODEL  # built once per process
    assert table("smollm2-135m-instruct-moa") is None


# ---------------------------------------------------------------------- tree drafts from the store
def test_the_store_offers_its_runners_up_as_alternatives():
    from moa_serve.drafter.spec import TreeShape

    store = OutputStore([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 5], [1, 2, 7, 8], [1, 2, 6]], min_n=2, max_n=2)
    # after "1 2": 3 (3 of 5), then 6 and 7 once each (ties: the smaller id first); after "1 2 3": 5, then 4
    assert store.propose_tree([1, 2], 3, (3, 2)) == ([3, 5], 2, [[6, 7], [4]])
    assert store.propose_tree([1, 2], 3, (2,)) == ([3, 5], 2, [[6], []])
    # dynamic: 6 and 7 are worth 0.2, 4 is worth 0.6 x 1/3 = 0.2; 0.25 keeps none, 0.15 all
    assert store.propose_tree([1, 2], 3, (3, 2), min_value=0.25) == ([3, 5], 2, [[], []])
    assert store.propose_tree([1, 2], 3, (3, 2), min_value=0.15) == ([3, 5], 2, [[6, 7], [4]])
    assert store.propose_tree([1, 2], 3, ()) == ([3, 5], 2, [[], []])
    table = LookupTable(min_n=2, max_n=3, store=store)
    idx = table.get("s", create=True)
    idx.set_tokens([9, 1, 2])
    assert table.propose_tree(idx, 3, TreeShape((3, 2))) == ([3, 5], -2, [[6, 7], [4]])
    idx.set_tokens([9, 8, 7])  # no match anywhere: nothing at all
    assert table.propose_tree(idx, 3, TreeShape((3, 2))) == ([], 0, [])


def test_lookup_proposers_send_store_alternatives_for_greedy_sessions_only():
    from moa_serve.drafter.lookup import HybridProposer
    from moa_serve.drafter.spec import TreeShape
    from moa_serve.sampling import SamplingParams
    from tests.drafter.test_lookup import RecordingModel

    store = OutputStore([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 5], [1, 2, 6]], min_n=2, max_n=2)
    p = PromptLookupProposer(min_n=2, max_n=3, store=store)
    p.set_tree(TreeShape((2, 2)))
    greedy, sampled = p.propose(
        [
            DraftRequest("g", [8, 1, 2], 3),
            DraftRequest("s", [8, 1, 2], 3, sampling=SamplingParams(temperature=0.7, seed=1)),
        ]
    )
    assert greedy.drafts == [3, 5] and greedy.alternatives == [[6], [4]]
    assert sampled.drafts == [3, 5] and sampled.alternatives == []
    (own,) = p.propose([DraftRequest("o", [1, 2, 9, 1, 2], 3)])  # the session's own n-gram: a chain
    assert own.drafts == [9, 1, 2] and own.alternatives == []
    with pytest.raises(ValueError, match="chains only"):
        PromptLookupProposer().set_tree(TreeShape((2,)))
    PromptLookupProposer().set_tree(TreeShape())  # a chain is always fine
    model = RecordingModel()
    model.set_tree = lambda shape: setattr(model, "shape", shape)
    h = HybridProposer(PromptLookupProposer(min_n=2, max_n=3, store=store), model)
    h.set_tree(TreeShape((2, 2)))
    assert model.shape == TreeShape((2, 2))
    (r,) = h.propose([DraftRequest("h", [8, 1, 2], 3)])
    assert r.drafts == [3, 5] and r.alternatives == [[6], [4]] and r.probs is None


def test_tree_drafts_from_the_store_are_lossless_and_rescue_rounds(stories_path, stories_ref, monkeypatch):
    """A store whose majority is wrong every third token and whose runner-up is the target's: the
    alternatives are accepted, and greedy output stays the target's."""
    import moa_serve.drafter.outputs as outputs
    from moa_serve.drafter.spec import TreeShape

    tok, prompts, ref = stories_ref
    vocab = 512  # stories260k
    wrong = [[(t + 1) % vocab if i % 3 == 2 else t for i, t in enumerate(r)] for r in ref]
    store = OutputStore(
        [list(p) + r for p, r in zip(prompts, ref)] + [list(p) + w for p, w in zip(prompts, wrong)] * 2,
        min_n=2,
        max_n=6,
    )
    monkeypatch.setattr(outputs, "output_store_for", lambda target: store)
    engine = SpeculativeEngine.load(str(stories_path), "lookup+outputs", "float32", max_sessions=8)
    engine.proposer.set_tree(TreeShape((2, 2, 2, 2)))
    outs = engine.generate(prompts, 2 * NEW_TOKENS, num_speculative_tokens=4)
    assert [o.token_ids for o in outs] == ref
    assert engine.verifier.stats["alternatives_accepted"] > 0
