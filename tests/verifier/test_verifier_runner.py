"""The verifier runner's serving behaviour: one packed forward for decode steps and prefill
chunks, chunked prefill against Hugging Face greedy, the context limit, token deltas with
resync, LRU eviction when the cache is full."""

import pytest
import torch

from moa_serve.model.target import TargetModel
from moa_serve.model_files import load_state_dict, read_config
from moa_serve.protocol import VerifyRequest
from moa_serve.verifier.torch.runner import RunnerOptions, TorchTargetRunner
from moa_serve.verifier.torch.slots import ContextTooLongError, common_prefix


@pytest.fixture(scope="module")
def target(stories_path):
    return TargetModel.from_state_dict(read_config(stories_path), load_state_dict(stories_path), torch.float32)


@pytest.fixture(scope="module")
def hf(stories_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(stories_path), dtype=torch.float32).eval()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode(runner: TorchTargetRunner, sessions: dict[str, list[int]], steps: int) -> dict[str, list[int]]:
    """Drives sessions with deltas (base = tokens the replica holds) until each has ``steps`` tokens."""
    out = {sid: [] for sid in sessions}
    held = {sid: 0 for sid in sessions}
    calls = 0
    while any(len(o) < steps for o in out.values()):
        calls += 1
        assert calls < 10 * steps, "no progress"
        live = [sid for sid in sessions if len(out[sid]) < steps]
        reqs = []
        for sid in live:
            full = sessions[sid] + out[sid]
            reqs.append(VerifyRequest(sid, full[held[sid] :], base=held[sid], want_features=False))
        for r in runner.verify(reqs):
            assert not r.resync
            full = sessions[r.session_id] + out[r.session_id]
            if r.tokens:
                out[r.session_id] += r.tokens
                held[r.session_id] = len(full) + len(r.tokens)
            else:  # still prefilling: the replica holds the whole committed list already
                assert r.prefill_remaining > 0
                held[r.session_id] = len(full)
    return {sid: o[:steps] for sid, o in out.items()}


def test_prompts_longer_than_the_chunk_match_hf_greedy(target, hf):
    runner = TorchTargetRunner(
        target, max_sessions=4, max_model_len=256, options=RunnerOptions(max_num_batched_tokens=40)
    )
    prompts = {"long": prompt_of(150, 1), "mid": prompt_of(70, 2), "short": prompt_of(9, 3)}
    got = decode(runner, prompts, 12)
    for sid, p in prompts.items():
        assert got[sid] == hf_greedy(hf, p, 12), sid


def test_a_long_prefill_does_not_stall_a_decoding_session(target):
    runner = TorchTargetRunner(
        target, max_sessions=4, max_model_len=256, options=RunnerOptions(max_num_batched_tokens=64)
    )
    short = prompt_of(8, 4)
    (r,) = runner.verify([VerifyRequest("d", short)])
    committed = short + r.tokens
    results = runner.verify([VerifyRequest("d", committed), VerifyRequest("p", prompt_of(200, 5))])
    decoded, prefilling = results
    assert len(decoded.tokens) == 1  # the decode step answered in the same forward
    assert prefilling.tokens == [] and prefilling.prefill_remaining > 0
    assert prefilling.num_computed + decoded.num_computed == 64  # the budget, filled


def test_generation_up_to_the_context_limit(target, hf):
    limit = 48
    runner = TorchTargetRunner(target, max_sessions=2, max_model_len=limit)
    prompt = prompt_of(30, 6)
    got = decode(runner, {"s": prompt}, limit - len(prompt))["s"]
    assert got == hf_greedy(hf, prompt, limit - len(prompt))
    with pytest.raises(ContextTooLongError):
        runner.verify([VerifyRequest("s", prompt + got + [5], base=0)])


def test_unknown_session_with_a_delta_answers_resync(target):
    runner = TorchTargetRunner(target, max_sessions=2, max_model_len=128)
    (r,) = runner.verify([VerifyRequest("x", [5, 6], base=10)])
    assert r.resync and r.tokens == [] and "x" not in runner.sessions


def test_full_cache_evicts_the_least_recently_used_idle_session(target, hf):
    runner = TorchTargetRunner(target, max_sessions=2, max_model_len=128)
    prompts = {sid: prompt_of(12, i) for i, sid in enumerate("abc")}
    first = {}
    for sid in "ab":
        (r,) = runner.verify([VerifyRequest(sid, prompts[sid])])
        first[sid] = r.tokens
    (rc,) = runner.verify([VerifyRequest("c", prompts["c"])])  # evicts "a", the least recently used
    assert set(runner.sessions) == {"b", "c"} and runner.stats["evictions"] == 1
    a_full = prompts["a"] + first["a"]
    (again,) = runner.verify([VerifyRequest("a", [], base=len(a_full))])
    assert again.resync
    (ra,) = runner.verify([VerifyRequest("a", a_full)])  # the router resends everything: re-prefill
    assert first["a"] + ra.tokens == hf_greedy(hf, prompts["a"], 2)


def test_skipped_features_are_recomputed_from_the_cache(target, stories_drafter):
    """A session that skipped drafter features for some rounds asks for them from where it stopped
    (``features_from``): they equal, position by position, the ones computed round by round."""
    from moa_serve.drafter.registry import load_feature_source

    def run(skip: set[int]) -> torch.Tensor:
        runner = TorchTargetRunner(
            target, torch.float32, max_sessions=2, max_model_len=256, features=load_feature_source(str(stories_drafter))
        )
        prompt, held, feats = prompt_of(20, 3), 0, {}
        tokens = list(prompt)
        for step in range(8):
            want = step not in skip
            have = max(feats) + 1 if feats else 0
            (r,) = runner.verify(
                [VerifyRequest("s", tokens[held:], base=held, want_features=want, features_from=have if want else None)]
            )
            held = len(tokens) + len(r.tokens)
            tokens += r.tokens
            if r.features is not None:
                for i, f in enumerate(r.features):
                    feats.setdefault(r.feature_start + i, f)
        assert sorted(feats) == list(range(len(tokens) - 1))  # every verified position, no hole
        return torch.stack([feats[p] for p in sorted(feats)])

    # the same positions' features (a feature-head batch of another size may round differently)
    torch.testing.assert_close(run(skip={2, 3, 4}), run(skip=set()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", [None, 5])
def test_multi_step_decoding_gives_the_single_step_tokens(target, seed):
    """decode_steps=4: up to four tokens per call, the same tokens as one per call (greedy, and
    seeded sampling: each token's generator depends on its position only), stopping at a stop
    token and never past the steps asked."""
    from moa_serve.sampling import SamplingParams

    params = SamplingParams() if seed is None else SamplingParams(temperature=0.9, seed=seed)

    def run(steps: int, stop: tuple[int, ...] = ()) -> tuple[list[int], int]:
        runner = TorchTargetRunner(target, torch.float32, max_sessions=2, max_model_len=256)
        tokens, held, calls, out = prompt_of(12, 7), 0, 0, []
        while len(out) < 24 and not (out and out[-1] in stop):
            (r,) = runner.verify(
                [
                    VerifyRequest(
                        "s",
                        tokens[held:],
                        base=held,
                        sampling=params,
                        want_features=False,
                        decode_steps=steps,
                        stop_token_ids=stop,
                    )
                ]
            )
            calls += 1
            assert 1 <= len(r.tokens) <= steps
            held = len(tokens) + len(r.tokens)
            tokens += r.tokens
            out += r.tokens
        return out, calls

    single, calls1 = run(1)
    multi, calls4 = run(4)
    assert multi[:24] == single[:24] and calls4 < calls1
    stop = (single[5],)
    stopped, _ = run(4, stop)
    assert stopped == single[: single.index(single[5]) + 1]


def test_a_cut_ends_multi_step_decoding_after_the_forward_in_progress(target):
    """``cut_steps`` (another thread: a newcomer waits for the next call): the running call
    returns after its current forward, with the tokens so far, which are the tokens plain
    decoding gives; the cut is spent by that call, the next one decodes all its steps."""
    runner = TorchTargetRunner(target, torch.float32, max_sessions=2, max_model_len=256)
    tokens = prompt_of(12, 3)
    (r,) = runner.verify([VerifyRequest("s", tokens, want_features=False)])  # the prompt
    tokens += r.tokens
    runner.cut_steps()
    (cut,) = runner.verify([VerifyRequest("s", [], base=len(tokens), want_features=False, decode_steps=4)])
    assert len(cut.tokens) == 1 and runner.stats["steps_cut"] == 1
    tokens += cut.tokens
    (full,) = runner.verify([VerifyRequest("s", [], base=len(tokens), want_features=False, decode_steps=4)])
    assert len(full.tokens) == 4 and runner.stats["steps_cut"] == 1
    tokens += full.tokens
    plain = TorchTargetRunner(target, torch.float32, max_sessions=2, max_model_len=256)
    assert decode(plain, {"s": tokens[:12]}, 6)["s"] == tokens[12:]
    runner.cut_steps()  # a call that fails spends the cut too
    with pytest.raises(ValueError):
        runner.verify([VerifyRequest("s", [], base=len(tokens), want_features=False)] * 2)
    (after,) = runner.verify([VerifyRequest("s", [], base=len(tokens), want_features=False, decode_steps=4)])
    assert len(after.tokens) == 4 and runner.stats["steps_cut"] == 1


def test_a_released_sessions_prefix_is_reused_and_decodes_the_same(target, hf):
    """Prefix caching: a new session whose prompt extends a finished one's tokens takes over its
    slot and prefills only the rest; the tokens equal Hugging Face greedy and a runner without it."""
    shared = prompt_of(40, 7)
    runner = TorchTargetRunner(target, max_sessions=2, max_model_len=256)
    first = decode(runner, {"a": shared}, 4)["a"]
    runner.release("a")
    assert runner.free_slots == 2 and len(runner.retained) == 1
    follow_up = shared + first + prompt_of(6, 8)  # a multi-turn chat resends its history
    (r,) = runner.verify([VerifyRequest("b", follow_up, want_features=False)])
    # only the new turn is prefilled, and "a"'s last token (answered, never fed: not in the cache)
    assert r.num_computed == 6 + 1
    assert runner.stats["prefix_hits"] == 1 and runner.stats["prefix_tokens"] == len(shared) + 3
    got = decode(runner, {"b": follow_up}, 6)["b"]  # "b" continues from what it holds
    plain = TorchTargetRunner(target, max_sessions=2, max_model_len=256, options=RunnerOptions(prefix_caching=False))
    assert got == decode(plain, {"b": follow_up}, 6)["b"] == hf_greedy(hf, follow_up, 6)
    assert plain.stats["prefix_hits"] == 0 and not plain.retained


def test_a_repeated_prompt_prefills_one_token(target, hf):
    prompt = prompt_of(30, 9)
    runner = TorchTargetRunner(target, max_sessions=2, max_model_len=128)
    (a,) = runner.verify([VerifyRequest("a", prompt, want_features=False)])
    runner.release("a")
    (b,) = runner.verify([VerifyRequest("b", prompt, want_features=False)])
    assert b.num_computed == 1 and b.tokens == a.tokens == hf_greedy(hf, prompt, 1)


def test_a_shared_prefix_is_copied_from_a_live_session(target, hf):
    system = prompt_of(24, 10)  # e.g. a chat template's system prompt
    prompts = {"a": system + prompt_of(5, 11), "b": system + prompt_of(7, 12)}
    runner = TorchTargetRunner(target, max_sessions=2, max_model_len=128)
    (ra,) = runner.verify([VerifyRequest("a", prompts["a"], want_features=False)])
    (rb,) = runner.verify([VerifyRequest("b", prompts["b"], want_features=False)])
    assert rb.num_computed == 7 and runner.stats["prefix_tokens"] == 24
    assert runner.sessions["a"].slot != runner.sessions["b"].slot
    got = decode(runner, {"a": prompts["a"] + ra.tokens, "b": prompts["b"] + rb.tokens}, 4)
    for sid, first in (("a", ra.tokens), ("b", rb.tokens)):
        assert first + got[sid] == hf_greedy(hf, prompts[sid], 5), sid


def test_a_retained_prompt_outlives_prompts_that_share_only_its_system_prompt(target, hf):
    """A new session that shares only the system prompt with a retained one copies those positions
    and leaves the retained prompt in place, so a later repeat of it prefills one token; a finished
    repeat replaces its older copy instead of holding a second slot."""
    system = prompt_of(24, 10)
    a, b = system + prompt_of(9, 11), system + prompt_of(6, 12)
    runner = TorchTargetRunner(target, max_sessions=4, max_model_len=128)
    first = decode(runner, {"a": a}, 3)["a"]
    runner.release("a")
    (rb,) = runner.verify([VerifyRequest("b", b, want_features=False)])
    assert rb.num_computed == 6 and len(runner.retained) == 1  # b copied the 24 shared positions
    runner.release("b")
    (again,) = runner.verify([VerifyRequest("a2", a, want_features=False)])
    assert again.num_computed == 1 and again.tokens == first[:1] == hf_greedy(hf, a, 1)
    assert len(runner.retained) == 2  # a's and b's prefixes, a's copied into a2's slot
    decode(runner, {"a2": a + again.tokens}, 3)
    runner.release("a2")  # holds all a's retained positions and more: a's old slot is given back
    assert len(runner.retained) == 2 and runner.cache.num_free == 2


def test_retained_slots_give_way_to_new_sessions(target):
    runner = TorchTargetRunner(target, max_sessions=2, max_model_len=128)
    for sid in "ab":
        runner.verify([VerifyRequest(sid, prompt_of(12, ord(sid)), want_features=False)])
        runner.release(sid)
    assert runner.cache.num_free == 0 and runner.free_slots == 2
    for sid in "cd":  # unrelated prompts: the retained slots are given back, nothing is evicted
        runner.verify([VerifyRequest(sid, prompt_of(12, ord(sid)), want_features=False)])
    assert set(runner.sessions) == {"c", "d"} and not runner.retained
    assert runner.stats["evictions"] == 0 and runner.stats["prefix_hits"] == 0


def test_a_reused_prefix_still_sends_every_positions_features(target, stories_drafter):
    """MoA features come from the cache: a session that reused a prefix gets the features of every
    position from 0, equal to those of a session that prefilled it all."""
    from moa_serve.drafter.registry import load_feature_source

    head = load_feature_source(str(stories_drafter))
    prompt = prompt_of(20, 13)
    feats = {}
    for caching in (True, False):
        runner = TorchTargetRunner(
            target,
            torch.float32,
            max_sessions=2,
            max_model_len=128,
            features=head,
            options=RunnerOptions(prefix_caching=caching),
        )
        runner.verify([VerifyRequest("a", prompt[:15], want_features=True, features_from=0)])
        runner.release("a")
        (r,) = runner.verify([VerifyRequest("b", prompt, want_features=True, features_from=0)])
        assert r.num_computed == (5 if caching else 20)
        assert r.feature_start == 0 and len(r.features) == len(prompt)
        feats[caching] = r.features
    torch.testing.assert_close(feats[True], feats[False], rtol=1e-5, atol=1e-6)


def test_a_latest_only_feature_head_computes_only_each_spans_last_feature(target, stories_path, tmp_path):
    """A drafter whose CA reads only the freshest feature: the verifier computes the feature of the
    last position of each span (the prompt, each round's accepted drafts) — equal to the full
    head's there — and zeros for the others, which that drafter never reads."""
    from moa_serve.drafter.checkpoint import init_drafter
    from moa_serve.drafter.registry import load_feature_source

    ckpt = init_drafter(str(stories_path), tmp_path / "latest", seed=2, cross_attention_latest_only=True)
    head = load_feature_source(str(ckpt))
    assert head.latest_only
    runs = {}
    for latest in (True, False):
        head.latest_only = latest
        runner = TorchTargetRunner(target, torch.float32, max_sessions=2, max_model_len=128, features=head)
        assert runner.latest_feature_only is latest
        prompt = prompt_of(20, 7)
        (r0,) = runner.verify([VerifyRequest("s", prompt, want_features=True, features_from=0)])
        (r1,) = runner.verify([VerifyRequest("s", r0.tokens + [5, 6, 7], base=len(prompt), want_features=True)])
        runs[latest] = (r0, r1)
    for lat, full in zip(runs[True], runs[False]):
        assert lat.tokens == full.tokens and lat.feature_start == full.feature_start
        assert lat.features.shape == full.features.shape
        torch.testing.assert_close(lat.features[-1], full.features[-1], rtol=1e-5, atol=1e-6)
        assert not lat.features[:-1].any() and full.features[:-1].abs().sum() > 0
    assert len(runs[True][0].features) == 20


def test_a_drafted_session_goes_on_decoding_after_its_drafts(target, hf):
    """decode_steps with drafts and no features (prompt lookup): the accepted drafts, the
    correction, then one token of the target's own per further forward (decode_steps forwards in
    all), never past max_tokens; the same as plain greedy."""
    prompt = prompt_of(20, 14)
    want = hf_greedy(hf, prompt, 12)
    runner = TorchTargetRunner(target, max_sessions=2, max_model_len=128)
    miss = lambda t: (t + 1) % 512  # noqa: E731 - any other token
    # two accepted then a miss; a miss at once; a draft rejected here that the next step would match
    # (the steps after the drafts must not compare against them again)
    late = [want[1]] if want[1] != want[0] else [miss(want[0])]
    for drafts, n_acc in (([want[0], want[1], miss(want[2])], 2), ([miss(want[0]), want[1]], 0), (late, 0)):
        for steps, cap in ((6, 0), (6, 4), (3, 0)):
            runner.release("s")
            (r,) = runner.verify(
                [VerifyRequest("s", prompt, drafts, want_features=False, decode_steps=steps, max_tokens=cap)]
            )
            n = min(n_acc + steps, cap or 99)  # accepted drafts + correction + steps - 1 more
            assert r.num_accepted == n_acc and r.tokens == want[:n]
            (nxt,) = runner.verify([VerifyRequest("s", [], base=len(prompt) + n, want_features=False)])
            assert nxt.tokens == [want[n]]  # the cache holds what the n tokens left behind


def test_common_prefix_matches_a_plain_scan():
    g = torch.Generator().manual_seed(15)
    for _ in range(300):
        n = int(torch.randint(0, 300, (1,), generator=g))
        a = torch.randint(0, 3, (n,), generator=g).tolist()
        cut = int(torch.randint(0, n + 1, (1,), generator=g))
        b = a[:cut] + torch.randint(0, 3, (int(torch.randint(0, 50, (1,), generator=g)),), generator=g).tolist()
        limit = int(torch.randint(0, 320, (1,), generator=g))
        want = 0
        while want < min(len(a), len(b), limit) and a[want] == b[want]:
            want += 1
        assert common_prefix(a, b, limit) == want


def test_features_read_a_bf16_kv_cache(stories_path, stories_drafter):
    """A float32 target over a bfloat16 KV cache (kv_cache_dtype) hands the MoA feature head the
    cached K/V widened back to float32: features of every prompt position, float32, close to those
    of a float32 cache (the K/V differ by one bf16 rounding)."""
    from moa_serve.drafter.registry import load_feature_source

    feats = {}
    for kv in ("float32", "bfloat16"):
        runner = TorchTargetRunner(
            str(stories_path),
            "float32",
            max_sessions=1,
            max_model_len=128,
            features=load_feature_source(str(stories_drafter)),
            options=RunnerOptions(kv_cache_dtype=kv),
        )
        assert runner.cache.k.dtype == getattr(torch, kv)
        prompt = prompt_of(12, 1)
        (r,) = runner.verify([VerifyRequest("s", prompt)])
        assert r.feature_start == 0 and r.features.shape[0] == len(prompt) and r.features.dtype == torch.float32
        feats[kv] = r.features
    torch.testing.assert_close(feats["bfloat16"], feats["float32"], rtol=0.05, atol=0.05)


def test_choices_of_one_prompt_in_one_call_share_its_prefill(target, hf):
    """n > 1: the sessions of one prompt arrive in the same call; the first prefills it, the others
    answer ``resync`` and, sent again (the round's follow-up call), copy its K/V."""
    prompt = prompt_of(30, 21)
    runner = TorchTargetRunner(target, max_sessions=4, max_model_len=128)
    first = runner.verify([VerifyRequest(f"c{i}", prompt, want_features=False) for i in range(3)])
    assert [r.resync for r in first] == [False, True, True] and runner.stats["prefix_waits"] == 2
    again = runner.verify([VerifyRequest(f"c{i}", prompt, want_features=False) for i in (1, 2)])
    assert [r.num_computed for r in again] == [1, 1] and runner.stats["prefix_tokens"] == 2 * 29
    assert {tuple(r.tokens) for r in first[:1] + again} == {tuple(hf_greedy(hf, prompt, 1))}
