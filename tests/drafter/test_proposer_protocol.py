"""The drafter side of the wire protocol: token deltas and resync, least-recently-used eviction
when the caches are full, q over the draft vocabulary, and drafter replicas that read only the
target tensors they need (any drafter kind)."""

import pytest
import torch

from moa_serve.drafter.baselines import EagleProposer, IndependentProposer
from moa_serve.drafter.checkpoint import DRAFT_VOCAB_KEY, load_draft_vocab, load_drafter
from moa_serve.drafter.moa_model import TargetParts
from moa_serve.drafter.proposer import MoAProposer
from moa_serve.drafter.registry import load_proposer
from moa_serve.drafter.spec import DrafterSpec
from moa_serve.model.target import TargetModel
from moa_serve.model_files import load_state_dict, read_config
from moa_serve.protocol import DraftRequest
from moa_serve.sampling import SamplingParams
from tests.conftest import REPO, SMOLLM

CHECKPOINTS = REPO / "drafter" / "checkpoints"
KINDS = ("moa", "eagle", "independent")


def smollm_drafter(kind: str) -> str:
    return str(CHECKPOINTS / f"smollm2-135m-instruct-{kind}")


@pytest.fixture(scope="module")
def stories_target(stories_path):
    return TargetModel.from_state_dict(read_config(stories_path), load_state_dict(stories_path), torch.float32)


@pytest.fixture(scope="module")
def smollm_target():
    if not (SMOLLM / "config.json").is_file():
        pytest.fail(f"SmolLM2 not found at {SMOLLM}")
    return TargetModel.from_state_dict(read_config(SMOLLM), load_state_dict(SMOLLM), torch.float32)


def _feats(n: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


class _Router:
    """What the Router keeps per session for one drafter replica: committed tokens, how many of
    them the replica holds (base) and how many features it has."""

    def __init__(self, feature_dim: int):
        self.tokens, self.base, self.sent, self.feats, self.dim = {}, {}, {}, {}, feature_dim

    def add(self, sid: str, prompt: list[int], seed: int):
        self.tokens[sid], self.base[sid], self.sent[sid] = list(prompt), 0, 0
        self.feats[sid] = _feats(200, self.dim, seed)

    def request(self, sid: str, k: int, delta: bool = True) -> DraftRequest:
        toks, base = self.tokens[sid], self.base[sid] if delta else 0
        n = len(toks) - 1  # features of every verified position but the last
        return DraftRequest(sid, toks[base:], k, self.sent[sid], self.feats[sid][self.sent[sid] : n], base=base)

    def delivered(self, res):
        s = res.session_id
        if res.resync:
            self.base[s] = 0
        else:
            self.base[s] = len(self.tokens[s])
        if res.needs_features_from is not None:
            self.sent[s] = res.needs_features_from
        elif not res.resync:
            self.sent[s] = len(self.tokens[s]) - 1

    def commit(self, sid: str, new: list[int]):
        self.tokens[sid].extend(new)


# ----------------------------------------------------------------------------- deltas and resync
@pytest.mark.parametrize("kind", KINDS)
def test_deltas_draft_exactly_what_full_lists_draft(kind, smollm_target):
    """Rounds sent as deltas (with rollbacks of rejected drafts) draft the same tokens as the same
    rounds sent as whole committed lists, for every drafter kind; the replica's copy is the
    committed list."""
    a = load_proposer(smollm_drafter(kind), target_model=smollm_target, max_sessions=3, max_model_len=128)
    b = load_proposer(smollm_drafter(kind), target_model=smollm_target, max_sessions=3, max_model_len=128)
    ra, rb = _Router(576), _Router(576)
    prompts = {"x": [1, 504, 3300, 281, 1345, 30], "y": [1, 88, 2020, 1900, 17, 420, 4950, 11, 279]}
    for i, (sid, p) in enumerate(prompts.items()):
        ra.add(sid, p, i)
        rb.add(sid, p, i)
    for rnd in range(4):
        ks = {"x": 3, "y": 1 + rnd}
        got = a.propose([ra.request(s, ks[s]) for s in prompts])
        want = b.propose([rb.request(s, ks[s], delta=False) for s in prompts])
        assert [r.drafts for r in got] == [r.drafts for r in want]
        assert all(len(r.drafts) == ks[r.session_id] and not r.resync for r in got)
        for res in got:
            ra.delivered(res)
            rb.delivered(res)
            new = res.drafts[: rnd % 3] + [(res.drafts[0] + 1 + rnd) % 49152]  # some accepted, then a fix
            ra.commit(res.session_id, new)
            rb.commit(res.session_id, new)
        if rnd < 3:
            assert ra.base["x"] < len(ra.tokens["x"])  # the next request really is a delta
    for sid in prompts:
        assert a.sessions[sid].committed == ra.tokens[sid][: ra.base[sid]]


@pytest.mark.parametrize("kind", KINDS)
def test_static_draft_steps_draft_what_the_planned_loop_drafts(kind, smollm_target):
    """A call's steps after the first as fixed shapes (drafter/static_steps.py: one CUDA graph per
    call on a GPU, run uncaptured here) draft the planned per-step loop's tokens, for every drafter
    kind, over ragged rounds whose sessions want different numbers of drafts."""
    planned = load_proposer(smollm_drafter(kind), target_model=smollm_target, max_sessions=3, max_model_len=128)
    static = load_proposer(smollm_drafter(kind), target_model=smollm_target, max_sessions=3, max_model_len=128)
    assert planned.static_steps is None and static.use_static_steps(graphs=False)
    ra, rb = _Router(576), _Router(576)
    prompts = {"x": [1, 504, 3300, 281, 1345, 30], "y": [1, 88, 2020, 1900, 17, 420, 4950, 11, 279], "z": [1, 2020, 30]}
    for i, (sid, p) in enumerate(prompts.items()):
        ra.add(sid, p, i)
        rb.add(sid, p, i)
    for rnd in range(4):
        ks = {"x": 4, "y": 2 + rnd, "z": 1 + rnd % 2}
        got = static.propose([ra.request(s, ks[s]) for s in prompts])
        want = planned.propose([rb.request(s, ks[s]) for s in prompts])
        assert [r.drafts for r in got] == [r.drafts for r in want]
        for res in got:
            ra.delivered(res)
            rb.delivered(res)
            new = res.drafts[: rnd % 3] + [(res.drafts[0] + 1 + rnd) % 49152]
            ra.commit(res.session_id, new)
            rb.commit(res.session_id, new)
    assert static.static_steps.stats["static_draft_calls"] == 4


@pytest.mark.parametrize("kind", KINDS)
def test_packed_fused_drafting_drafts_what_torch_layers_draft(kind, smollm_target, monkeypatch):
    """The shipped checkpoints are bf16, so a float32 CPU proposer reads them through the packed
    bf16 kernels with its decoder layers fused into one kernel call: over ragged rounds (sessions
    feeding different numbers of tokens, rollbacks), greedy and sampled, it drafts what the same
    weights draft through torch layers (packed linears, and plain float32 ``nn.Linear``), with
    the same q up to float32 summation order."""
    import moa_serve.drafter.proposer as proposer_module

    fused = load_proposer(smollm_drafter(kind), target_model=smollm_target, max_sessions=3, max_model_len=128)
    assert (fused.sa_fused if kind == "moa" else fused.fused) is not None
    monkeypatch.setenv("MOA_FUSED_LAYERS", "off")
    layers = load_proposer(smollm_drafter(kind), target_model=smollm_target, max_sessions=3, max_model_len=128)
    monkeypatch.setattr(proposer_module, "pack_bf16_exact", lambda module: {"packed": 0})
    plain = load_proposer(smollm_drafter(kind), target_model=smollm_target, max_sessions=3, max_model_len=128)
    assert (layers.sa_fused if kind == "moa" else layers.fused) is None
    from moa_serve.kernels.packed import PackedLinear

    assert not any(isinstance(m, PackedLinear) for m in (plain.head if kind == "moa" else plain.model).modules())
    props = (fused, layers, plain)
    routers = [_Router(576) for _ in props]
    prompts = {"x": [1, 504, 3300, 281, 1345, 30], "y": [1, 88, 2020, 1900, 17, 420, 4950, 11, 279]}
    sampled = SamplingParams(temperature=0.8, seed=11)
    for r in routers:
        for i, (sid, prompt) in enumerate(prompts.items()):
            r.add(sid, prompt, i)
    for rnd in range(4):
        out = []
        for prop, r in zip(props, routers):
            reqs = [r.request(sid, 4) for sid in prompts]
            reqs[1].sampling = sampled
            out.append(prop.propose(reqs))
        for got in out[1:]:
            assert [x.drafts for x in got] == [x.drafts for x in out[0]]
            assert torch.allclose(got[1].probs, out[0][1].probs, atol=1e-5)
        for r in routers:
            for res in out[0]:
                r.delivered(res)
                r.commit(res.session_id, res.drafts[: rnd % 3] + [(res.drafts[0] + 7 + rnd) % 49152])


def test_resync_when_the_replica_lacks_the_base(stories_drafter, stories_target):
    prop = MoAProposer.load(str(stories_drafter), target_model=stories_target, max_sessions=2, max_model_len=64)
    toks = list(range(40, 52))
    # unknown session with base > 0: resync, nothing allocated
    (res,) = prop.propose([DraftRequest("new", toks[5:], 3, 0, None, base=5)])
    assert res.resync and res.drafts == [] and res.probs is None and res.needs_features_from == 0
    assert "new" not in prop.sessions and prop.sa_cache.num_free == 2
    # a known session asked for more than it holds: resync, its copy untouched
    (res,) = prop.propose([DraftRequest("s", toks, 2, 0, _feats(11, 64, 0))])
    assert not res.resync and len(res.drafts) == 2
    before = list(prop.sessions["s"].committed)
    (res,) = prop.propose([DraftRequest("s", [7, 8], 2, 11, None, base=len(toks) + 1)])
    assert res.resync and res.drafts == [] and res.needs_features_from == 11  # its features are kept
    assert prop.sessions["s"].committed == before == toks
    # a shorter base than held is fine: copy[:base] + tokens
    (res,) = prop.propose([DraftRequest("s", toks[8:] + [9], 2, 11, _feats(1, 64, 1), base=8)])
    assert not res.resync and prop.sessions["s"].committed == toks + [9]


# ----------------------------------------------------------------------------- full caches
def test_full_cache_evicts_least_recently_used_session_not_in_the_call(stories_drafter, stories_target):
    def fresh():
        return MoAProposer.load(str(stories_drafter), target_model=stories_target, max_sessions=2, max_model_len=64)

    prop = fresh()
    toks = {sid: list(range(10 + 7 * i, 25 + 7 * i)) for i, sid in enumerate("abcd")}
    f = {sid: _feats(14, 64, i) for i, sid in enumerate("abcd")}

    def req(sid, delta=False, features=True):
        """The whole session (base 0), or a delta with nothing new (the replica holds it all)."""
        start = 14 if delta or not features else 0
        return DraftRequest(
            sid, [] if delta else toks[sid], 3, start, None if start else f[sid], base=15 if delta else 0
        )

    prop.propose([req("a")])
    prop.propose([req("b")])  # a is now the least recently used
    # c arrives in a call with a: b is evicted, not a (least recent, but part of the call)
    res = prop.propose([req("c"), req("a", delta=True)])
    assert [r.resync for r in res] == [False, False] and all(len(r.drafts) == 3 for r in res)
    assert list(prop.sessions) == ["c", "a"] and prop.stats["evicted"] == 1
    # the evicted session answers resync to a delta ...
    (rb,) = prop.propose([req("b", delta=True)])
    assert rb.resync and rb.needs_features_from == 0 and list(prop.sessions) == ["c", "a"]
    # ... asks for its features again when resent whole without them (evicting c) ...
    (rb,) = prop.propose([req("b", features=False)])
    assert rb.needs_features_from == 0 and rb.drafts == [] and list(prop.sessions) == ["a", "b"]
    # ... and is rebuilt from what the Router resends: it drafts what a fresh replica drafts
    (rb,) = prop.propose([req("b")])
    (want,) = fresh().propose([req("b")])
    assert rb.drafts == want.drafts and len(rb.drafts) == 3 and prop.stats["evicted"] == 2
    # a call whose own sessions need more slots than exist is refused, and changes nothing
    held = {sid: list(s.committed) for sid, s in prop.sessions.items()}
    with pytest.raises(RuntimeError, match="max_sessions=2"):
        prop.propose([req("a", delta=True), req("b", delta=True), req("d")])
    assert {sid: s.committed for sid, s in prop.sessions.items()} == held
    # a session this replica does not hold, sent as a delta, only gets resync: it needs no slot
    res = prop.propose([req("a", delta=True), req("b", delta=True), req("d", delta=True)])
    assert [r.resync for r in res] == [False, False, True] and list(prop.sessions) == ["a", "b"]


@pytest.mark.parametrize("cls", [EagleProposer, IndependentProposer])
def test_baselines_evict_and_resync(cls, smollm_target):
    kind = "eagle" if cls is EagleProposer else "independent"
    prop = cls.load(smollm_drafter(kind), target_model=smollm_target, max_sessions=1, max_model_len=64)
    toks = list(range(100, 110))
    hidden = _feats(9, 576, 0)
    (r1,) = prop.propose([DraftRequest("a", toks, 2, 0, hidden)])
    (r2,) = prop.propose([DraftRequest("b", toks, 2, 0, hidden)])  # evicts a
    assert r1.drafts == r2.drafts and len(r1.drafts) == 2 and list(prop.sessions) == ["b"]
    (r3,) = prop.propose([DraftRequest("a", [5], 2, 9, None, base=10)])
    assert r3.resync and list(prop.sessions) == ["b"]


# ----------------------------------------------------------------------------- sampling: q
def test_sampled_drafts_ship_q_over_the_draft_vocabulary(smollm_target, stories_drafter, stories_target):
    vocab = load_draft_vocab(smollm_drafter("moa"))
    _, state = load_drafter(smollm_drafter("moa"))
    assert torch.equal(vocab, state[DRAFT_VOCAB_KEY]) and vocab.dtype == torch.long and len(vocab) == 2048
    assert load_draft_vocab(str(stories_drafter)) is None
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    prop = load_proposer(smollm_drafter("moa"), target_model=smollm_target, max_sessions=2, max_model_len=64)
    toks = [1, 504, 3300, 281, 1345, 30, 2020]
    req = DraftRequest("s", toks, 4, 0, _feats(6, 576, 0), sampling=sp)
    (res,) = prop.propose([req, DraftRequest("g", toks, 4, 0, _feats(6, 576, 0))])[:1]
    assert res.probs.shape == (4, 2048) and res.probs.dtype == torch.float32
    assert torch.allclose(res.probs.sum(-1), torch.ones(4))
    index = {int(t): j for j, t in enumerate(vocab)}
    assert all(d in index and res.probs[i, index[d]] > 0 for i, d in enumerate(res.drafts))
    # the same seed drafts the same tokens with the same q (another replica, another round)
    other = load_proposer(smollm_drafter("moa"), target_model=smollm_target, max_sessions=2, max_model_len=64)
    (again,) = other.propose([req, DraftRequest("g", toks, 4, 0, _feats(6, 576, 0))])[:1]
    assert again.drafts == res.drafts and torch.equal(again.probs, res.probs)
    # greedy drafts ship no q; without a draft vocabulary q covers the target's vocabulary
    (g,) = prop.propose([DraftRequest("g2", toks, 2, 0, _feats(6, 576, 0))])
    assert g.probs is None
    small = MoAProposer.load(str(stories_drafter), target_model=stories_target, max_sessions=1, max_model_len=64)
    (s,) = small.propose([DraftRequest("s", list(range(30, 40)), 3, 0, _feats(9, 64, 0), sampling=sp)])
    assert s.probs.shape == (3, 512)


# ----------------------------------------------------------------------------- selective loading
def _assert_parts_equal(a: TargetParts, b: TargetParts):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    assert torch.equal(a.rotary.inv_freq, b.rotary.inv_freq)
    assert a.rotary.attention_scaling == b.rotary.attention_scaling and a.arch == b.arch
    assert (a.lm_head.weight is a.embed_tokens.weight) == (b.lm_head.weight is b.embed_tokens.weight)


@pytest.mark.parametrize("tli", [0, 2])
def test_selected_target_parts_equal_the_full_models(tli, stories_path, stories_target, tiny_model):
    _assert_parts_equal(TargetParts.load(str(stories_path), tli, torch.float32), TargetParts(stories_target, tli))
    # untied LM head (a random Llama saved by transformers)
    tiny = TargetModel.from_state_dict(read_config(tiny_model), load_state_dict(tiny_model), torch.bfloat16)
    sel = TargetParts.load(str(tiny_model), tli, torch.bfloat16)
    _assert_parts_equal(sel, TargetParts(tiny, tli))
    assert sel.lm_head.weight is not sel.embed_tokens.weight
    n = sum(p.numel() for p in sel.parameters())
    assert n < sum(p.numel() for p in tiny.parameters()) or tli == tiny.arch.num_layers


def test_smollm_parts_read_only_what_the_drafter_needs(smollm_target):
    """SmolLM2 ships only a GGUF: the cached safetensors conversion is read selectively."""
    sel = TargetParts.load("HuggingFaceTB/SmolLM2-135M-Instruct", 1, torch.float32)
    _assert_parts_equal(sel, TargetParts(smollm_target, 1))
    held = sum(p.numel() for p in {id(p): p for p in sel.parameters()}.values())
    full = sum(p.numel() for p in smollm_target.parameters())
    assert held < full / 3  # embeddings (tied LM head) + one layer + norm, not 30 layers


@pytest.mark.parametrize("kind", KINDS)
def test_any_drafter_kind_drafts_the_same_loaded_either_way(kind, smollm_target):
    """A drafter replica (target tensors read selectively) drafts exactly what the in-process
    engine's proposer (sharing the verifier's full target) drafts."""
    d = smollm_drafter(kind)
    assert DrafterSpec.parse(d).kind == kind
    alone = load_proposer(d, target="HuggingFaceTB/SmolLM2-135M-Instruct", max_sessions=2, max_model_len=64)
    shared = load_proposer(d, target_model=smollm_target, max_sessions=2, max_model_len=64)
    assert type(alone) is type(shared) and type(alone).__name__.lower().startswith(kind[:3])
    assert not any(p.data_ptr() == q.data_ptr() for p in alone.parts.parameters() for q in smollm_target.parameters())
    reqs = [
        DraftRequest("a", [1, 504, 3300, 281, 1345, 30], 4, 0, _feats(5, 576, 0)),
        DraftRequest("b", [1, 88, 2020, 1900, 17, 420, 4950, 11, 279], 2, 0, _feats(8, 576, 1)),
    ]
    assert [r.drafts for r in alone.propose(reqs)] == [r.drafts for r in shared.propose(reqs)]


def test_a_drafter_for_another_target_is_refused(stories_drafter):
    with pytest.raises(ValueError, match="another target"):
        load_proposer(str(stories_drafter), target="HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="load_proposer"):
        MoAProposer.load(smollm_drafter("eagle"), target="HuggingFaceTB/SmolLM2-135M-Instruct")


def test_drafts_stop_at_the_context_limit(stories_drafter, stories_target):
    prop = MoAProposer.load(str(stories_drafter), target_model=stories_target, max_sessions=1, max_model_len=32)
    (res,) = prop.propose([DraftRequest("s", list(range(10, 40)), 5, 0, _feats(29, 64, 0))])
    assert len(res.drafts) == 3  # positions 30, 31 fed for drafts 2, 3: the cache holds 32
    (res,) = prop.propose([DraftRequest("s", [7, 8, 9], 5, 29, _feats(3, 64, 1), base=30)])
    assert res.drafts == [] and not res.resync


@pytest.mark.parametrize("latest_only", [False, True])
def test_a_batch_drafts_what_each_session_drafts_alone(stories_path, stories_target, tmp_path, latest_only):
    """Sessions of different lengths and K in one call (the batch shrinks as sessions finish),
    with TLI: each drafts what it drafts alone (a latest-only drafter: also with its CA computed
    per query)."""
    from moa_serve.drafter.checkpoint import init_drafter

    d = str(
        init_drafter(
            str(stories_path),
            tmp_path / "tli",
            seed=3,
            target_layer_inference=1,
            cross_attention_latest_only=latest_only,
        )
    )
    batch = MoAProposer.load(d, target_model=stories_target, max_sessions=3, max_model_len=64)
    reqs = [
        DraftRequest(f"s{i}", list(range(20 + i, 31 + 4 * i)), k, 0, _feats(10 + 4 * i, 64, i))
        for i, k in enumerate((2, 5, 1))
    ]
    got = batch.propose(reqs)
    for r, g in zip(reqs, got):
        alone = MoAProposer.load(d, target_model=stories_target, max_sessions=1, max_model_len=64)
        assert alone.propose([r])[0].drafts == g.drafts and len(g.drafts) == r.num_drafts
    if latest_only:
        per_query = MoAProposer.load(d, target_model=stories_target, max_sessions=3, max_model_len=64)
        per_query.single_feature_ca = False
        assert [x.drafts for x in per_query.propose(reqs)] == [g.drafts for g in got]


@pytest.mark.parametrize("tli", [0, 1])
def test_a_latest_only_drafter_takes_the_newest_feature_past_a_gap(stories_path, stories_target, tmp_path, tli):
    """A drafter whose cross-attention reads only the latest verified feature drafts the same
    from the newest feature sent alone (feature_start past what it holds) as from every position's
    feature, and the same with its single-feature attention output precomputed as with the
    attention computed per query; a drafter that reads them all asks for the gap instead."""
    from moa_serve.drafter.checkpoint import init_drafter

    d = str(
        init_drafter(
            str(stories_path), tmp_path / "latest", seed=4, target_layer_inference=tli, cross_attention_latest_only=True
        )
    )
    full = MoAProposer.load(d, target_model=stories_target, max_sessions=1, max_model_len=64)
    full.single_feature_ca = False  # the cross-attention computed in full, query by query
    alone = MoAProposer.load(d, target_model=stories_target, max_sessions=1, max_model_len=64)
    assert alone.single_feature_ca  # its output precomputed once per call
    toks, feats = list(range(30, 42)), _feats(40, 64, 7)
    for rnd in range(3):
        n, sent = len(toks) - 1, full.sessions["s"].num_features if "s" in full.sessions else 0
        base = len(full.sessions["s"].committed) if "s" in full.sessions else 0
        (a,) = full.propose([DraftRequest("s", toks[base:], 3, sent, feats[sent:n], base=base)])
        (b,) = alone.propose([DraftRequest("s", toks[base:], 3, n - 1, feats[n - 1 : n], base=base)])
        assert a.needs_features_from is None and b.needs_features_from is None
        assert a.drafts == b.drafts and len(a.drafts) == 3
        toks += a.drafts[:rnd] + [(a.drafts[0] + 11 + rnd) % 512]
    reads_all = MoAProposer.load(
        str(init_drafter(str(stories_path), tmp_path / "all", seed=4)),
        target_model=stories_target,
        max_sessions=1,
        max_model_len=64,
    )
    (c,) = reads_all.propose([DraftRequest("s", toks, 3, len(toks) - 2, feats[len(toks) - 2 : len(toks) - 1])])
    assert c.drafts == [] and c.needs_features_from == 0


# ----------------------------------------------------------------------------- tree drafts
def test_tree_drafts_add_the_runners_up_of_greedy_sessions_only(stories_drafter, stories_target):
    prop = MoAProposer.load(str(stories_drafter), target_model=stories_target, max_sessions=2, max_model_len=64)
    toks = list(range(40, 52))
    (chain,) = prop.propose([DraftRequest("a", toks, 4, 0, _feats(11, 64, 0))])
    prop.branching = (3, 2)
    greedy, sampled = prop.propose(
        [
            DraftRequest("a", toks, 4, 0, _feats(11, 64, 0)),
            DraftRequest("b", toks, 4, 0, _feats(11, 64, 0), sampling=SamplingParams(temperature=0.7, seed=1)),
        ]
    )
    assert greedy.drafts == chain.drafts and chain.alternatives == []  # the chain is the same one
    assert [len(a) for a in greedy.alternatives] == [2, 1, 0, 0]
    for depth, alts in enumerate(greedy.alternatives[:2]):
        assert greedy.drafts[depth] not in alts and len(set(alts)) == len(alts)
    assert sampled.alternatives == [] and len(sampled.drafts) == 4
    # a dynamic tree keeps a subset of those: the candidates the drafter rates highly enough
    from moa_serve.drafter.spec import TreeShape

    kept = {}
    for least in (1e-9, 0.01, 0.999):
        prop.set_tree(TreeShape((3, 2), least))
        (res,) = prop.propose([DraftRequest("a", toks, 4, 0, _feats(11, 64, 0))])
        assert res.drafts == chain.drafts
        assert all(set(a) <= set(b) for a, b in zip(res.alternatives, greedy.alternatives))
        kept[least] = sum(map(len, res.alternatives))
    assert kept[1e-9] == 3 and kept[0.999] == 0 and kept[0.01] <= 3


def test_branching_is_parsed_and_checked():
    from moa_serve.drafter.spec import parse_branching

    assert parse_branching("4-2-2").widths == (4, 2, 2) and parse_branching("4-1-1").widths == (4,)
    assert parse_branching("chain") == parse_branching("") == parse_branching("1") == parse_branching(None)
    assert not parse_branching("chain") and parse_branching("chain").label == "chain"
    dyn = parse_branching("8-3-2@0.05")
    assert dyn.widths == (8, 3, 2) and dyn.min_value == 0.05 and dyn.label == "8-3-2@0.05"
    assert parse_branching(dyn) is dyn and parse_branching((4, 2)).label == "4-2"
    for bad in ("4,2", "0-2", "99", "x", "4-2@x", "4-2@1.5"):
        with pytest.raises(ValueError, match="branching"):
            parse_branching(bad)
