"""Tree drafts in the verifier: alternatives verified beside the chain of drafts (greedy).

An alternative at depth i shares the position of draft i and sees what it sees but not draft i
itself; its K/V is stored past the chain and moved into place when the target accepts it. The
output must be the target's own greedy continuation whatever the drafts and alternatives, and the
cache left behind (hence every later token and feature) must be the one plain decoding leaves."""

import pytest
import torch

from moa_serve.drafter.feature_sources import HiddenFeatures
from moa_serve.kernels import cpu as cpu_kernels
from moa_serve.model.target import TargetModel
from moa_serve.model_files import load_state_dict, read_config
from moa_serve.protocol import VerifyRequest
from moa_serve.verifier.torch.runner import TorchTargetRunner


@pytest.fixture(scope="module")
def target(stories_path):
    return TargetModel.from_state_dict(read_config(stories_path), load_state_dict(stories_path), torch.float32)


def miss(t: int) -> int:
    return (t + 1) % 512


def runner_for(target, path: str, features: bool = True) -> TorchTargetRunner:
    r = TorchTargetRunner(target, max_sessions=2, max_model_len=256, features=HiddenFeatures() if features else None)
    if path == "torch":
        r.attention_kernel = False  # masks over torch's attention instead of the kernel's store_at
    elif not r.attention_kernel:
        pytest.skip(f"attention kernel unavailable: {cpu_kernels.unavailable_reason()}")
    return r


def generate(runner: TorchTargetRunner, prompt: list[int], n: int, draft) -> tuple[list[int], dict, list[int]]:
    """Rounds until n tokens: ``draft(round, reference_next)`` gives (drafts, alternatives) from the
    plain continuation. Returns the tokens, the features by position and each round's accepted count."""
    tokens, held, feats, accepted = list(prompt), 0, {}, []
    rnd = 0
    while len(tokens) - len(prompt) < n:
        drafts, alts = draft(rnd, len(tokens) - len(prompt)) if rnd else ([], [])
        (r,) = runner.verify([VerifyRequest("s", tokens[held:], drafts, base=held, alternatives=alts)])
        held = len(tokens) + len(r.tokens)
        tokens += r.tokens
        accepted.append(r.num_accepted)
        if r.features is not None:
            for i, f in enumerate(r.features):
                feats[r.feature_start + i] = f
        rnd += 1
    return tokens[len(prompt) : len(prompt) + n], feats, accepted


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_alternatives_give_the_plain_continuation_and_cache(target, path):
    prompt = torch.randint(3, 512, (24,), generator=torch.Generator().manual_seed(7)).tolist()
    plain_runner = runner_for(target, path)
    want, want_feats, _ = generate(plain_runner, prompt, 40, lambda r, at: ([], []))

    def tree(rnd: int, at: int):
        ref = want[at : at + 4] + [0] * 4
        kind = rnd % 4
        if kind == 0:  # draft 1 wrong, the right token among its alternatives: 1 + the target's next
            return [miss(ref[0]), ref[1], ref[2]], [[miss(ref[0] + 5), ref[0]], [miss(ref[1])]]
        if kind == 1:  # two right, the third wrong with its alternative right
            return [ref[0], ref[1], miss(ref[2])], [[miss(ref[0])], [], [ref[2], miss(ref[2] + 9)]]
        if kind == 2:  # all right: alternatives never used
            return ref[:3], [[miss(ref[0])], [miss(ref[1])], [miss(ref[2])]]
        return [miss(ref[0])], [[miss(ref[0] + 3)]]  # wrong, and no alternative is right

    tree_runner = runner_for(target, path)
    got, feats, accepted = generate(tree_runner, prompt, 40, tree)
    assert got == want
    # round r is of kind r % 4: two drafts and the alternative (3), all three drafts, none, the
    # alternative alone (1)
    assert accepted[1:5] == [3, 3, 0, 1]
    assert accepted[5:9] == [3, 3, 0, 1]
    assert set(want_feats) <= set(feats)  # the last round may overshoot the 40 tokens
    # hidden states pass torch's final norm, whose reduction order follows the batch's shape
    for p in want_feats:
        assert torch.allclose(feats[p], want_feats[p], rtol=1e-5, atol=1e-5), f"feature of position {p} differs"
    # the cache left behind is what plain decoding wrote (up to torch's matmuls of another batch
    # shape: this model is not packed; the kernel's part is bitwise, see below)
    n = len(prompt) + 39
    slot, other = tree_runner.sessions["s"].slot, plain_runner.sessions["s"].slot
    for mine, theirs in ((tree_runner.cache.k, plain_runner.cache.k), (tree_runner.cache.v, plain_runner.cache.v)):
        torch.testing.assert_close(mine[:, slot, :, :n], theirs[:, other, :, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_attends_a_stored_elsewhere_token_as_in_its_chain(dtype):
    """A token whose K/V is stored at ``store_at`` (past the chain) and whose position holds another
    token's K/V gets, bitwise, the output it gets with its K/V at its own position."""
    if cpu_kernels.library() is None:
        pytest.skip(cpu_kernels.unavailable_reason())
    g = torch.Generator().manual_seed(0)
    slots_n, kvh, heads, max_len, hd = 3, 2, 6, 64, 16
    k = torch.randn(slots_n, kvh, max_len, hd, generator=g).to(dtype)
    v = torch.randn(slots_n, kvh, max_len, hd, generator=g).to(dtype)
    q = torch.randn(4, heads, hd, generator=g)
    slots = torch.tensor([0, 1, 2, 0])
    positions = torch.tensor([9, 17, 30, 8])  # 17 and 30 cover a full last block of 8 and a partial one
    plain = cpu_kernels.attention(q, k, v, slots, positions)
    moved_k, moved_v, store_at = k.clone(), v.clone(), positions.clone()
    for t, at in ((1, 40), (2, 41)):
        s, p = int(slots[t]), int(positions[t])
        moved_k[s, :, at], moved_v[s, :, at] = k[s, :, p], v[s, :, p]
        moved_k[s, :, p], moved_v[s, :, p] = torch.randn(kvh, hd, generator=g), torch.randn(kvh, hd, generator=g)
        store_at[t] = at
    got = cpu_kernels.attention(q, moved_k, moved_v, slots, positions, store_at)
    assert torch.equal(got[[0, 3]], plain[[0, 3]])
    assert torch.equal(got[1], plain[1]) and torch.equal(got[2], plain[2])


def test_alternatives_are_ignored_when_sampling(target):
    from moa_serve.sampling import SamplingParams

    runner = runner_for(target, "kernel", features=False)
    prompt = list(range(5, 30))
    (first,) = runner.verify([VerifyRequest("s", prompt, want_features=False)])
    nxt = first.tokens[0]
    params = SamplingParams(temperature=0.8, seed=3)
    (r,) = runner.verify(
        [
            VerifyRequest(
                "s", [nxt], [miss(nxt)], base=len(prompt), want_features=False, sampling=params, alternatives=[[nxt]]
            )
        ]
    )
    assert r.num_accepted <= 1 and len(r.tokens) == r.num_accepted + 1
    assert runner.stats["alternatives_accepted"] == 0


def test_alternatives_without_room_in_the_context_are_dropped(target):
    runner = TorchTargetRunner(target, max_sessions=1, max_model_len=32)
    prompt = list(range(5, 34))  # 29 tokens + 2 drafts fit; 3 alternatives more do not
    (r,) = runner.verify([VerifyRequest("s", prompt, [7, 8], want_features=False, alternatives=[[9, 10], [11]])])
    assert 1 <= len(r.tokens) <= 3


def test_a_rounds_alternatives_are_trimmed_deepest_first_to_its_budget():
    from moa_serve.engine.round_loop import trim_alternatives
    from moa_serve.protocol import DraftResult

    def round_():
        return {
            "a": DraftResult("a", [1, 2, 3], alternatives=[[4, 5, 6], [7], [8, 9]]),
            "b": DraftResult("b", [1, 2], alternatives=[[4, 5], [6]]),
        }

    d = round_()  # 2 sessions: 2 + 5 drafts + 9 alternatives = 16 tokens
    assert trim_alternatives(d, 2, 0) == 0 and trim_alternatives(d, 2, 16) == 0
    assert d["a"].alternatives == [[4, 5, 6], [7], [8, 9]]
    d = round_()
    assert trim_alternatives(d, 2, 12) == 4  # the depth-3 pair, then depth 2's from a and b
    assert d["a"].alternatives == [[4, 5, 6], [], []] and d["b"].alternatives == [[4, 5], []]
    d = round_()
    assert trim_alternatives(d, 2, 5) == 9  # nothing left to drop but chains, which stay
    assert d["a"].drafts == [1, 2, 3] and all(not a for r in d.values() for a in r.alternatives)
