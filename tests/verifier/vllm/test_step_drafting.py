"""StepDrafting: the per-engine-step bookkeeping between a self-scheduling verifier (vLLM) and a
draft source, without vLLM."""

import pytest
import torch

from moa_serve.engine.governor import SpeculationGovernor
from moa_serve.protocol import DraftResult
from moa_serve.verifier.vllm.feature_cache import PrefixFeatures
from moa_serve.verifier.vllm.step_drafting import FeatureBuffer, StepDrafting, StepFeatures, StepRow


class Source:
    """Records every call; drafts [100 + len(tokens the session holds)] * k; scripted answers."""

    def __init__(self):
        self.calls, self.released = [], []
        self.held: dict[str, list[int]] = {}
        self.features: dict[str, int] = {}
        self.answers: list[dict] = []  # per call: {session: "resync" | ("features", p) | "raise"}
        self.fail = False

    def propose(self, requests):
        self.calls.append(requests)
        script = self.answers.pop(0) if self.answers else {}
        if self.fail or "raise" in script.values():
            raise ConnectionError("drafter replica gone")
        out = []
        for r in requests:
            what = script.get(r.session_id)
            if what == "resync":
                out.append(DraftResult(r.session_id, [], resync=True, needs_features_from=0))
                continue
            held = self.held.setdefault(r.session_id, [])
            assert r.base <= len(held), "a delta against tokens the source does not hold"
            self.held[r.session_id] = held[: r.base] + list(r.tokens)
            if isinstance(what, tuple):
                out.append(DraftResult(r.session_id, [], needs_features_from=what[1]))
                continue
            n = r.features.shape[0] if r.features is not None else 0
            self.features[r.session_id] = r.feature_start + n
            out.append(DraftResult(r.session_id, [100 + len(self.held[r.session_id])] * r.num_drafts))
        return out

    def release(self, session_ids):
        self.released.extend(session_ids)
        for sid in session_ids:
            self.held.pop(sid, None)


class Switch:
    """A governor whose answer the test sets."""

    def __init__(self, on=False):
        self.on = on

    def speculate(self, n):
        return self.on

    def next_speculates(self, n):
        return self.on

    def observe(self, *a):
        pass


def feats(start, end):
    return torch.arange(start, end, dtype=torch.float32)[:, None].repeat(1, 3)


def test_deltas_features_and_acceptance_accounting():
    src = Source()
    d = StepDrafting(src, num_drafts=3)
    # prefill of a 4-token prompt: features of positions 0..3, one token sampled
    out = d.step([StepRow("a", [1, 2, 3, 4, 7], 0, feats(0, 4))])
    assert out == [[105, 105, 105]]
    (r,) = src.calls[-1]
    assert (r.base, r.tokens, r.feature_start, r.features.shape[0]) == (0, [1, 2, 3, 4, 7], 0, 4)
    # the verify forward covered positions 4..7 (token 7 + 3 drafts); two drafts accepted + bonus:
    # positions 4..6 are verified, the rejected draft's position 7 is not
    out = d.step([StepRow("a", [1, 2, 3, 4, 7, 105, 105, 9], 4, feats(4, 7))])
    (r,) = src.calls[-1]
    assert (r.base, r.tokens, r.feature_start) == (5, [105, 105, 9], 4)
    assert torch.equal(r.features, feats(4, 7))
    assert src.held["a"] == [1, 2, 3, 4, 7, 105, 105, 9] and src.features["a"] == 7
    assert d.stats.verified_rounds == 1 and d.stats.accepted == 2 and d.stats.drafted == 6


def test_rows_mid_prefill_get_no_drafts_but_their_features_are_kept():
    src = Source()
    d = StepDrafting(src, num_drafts=2)
    assert d.step([StepRow("a", [1, 2, 3, 4, 5, 6], 0, feats(0, 3), sampled=False)]) == [[]]
    assert src.calls == []
    d.step([StepRow("a", [1, 2, 3, 4, 5, 6, 8], 3, feats(3, 6))])
    (r,) = src.calls[-1]
    assert r.feature_start == 0 and torch.equal(r.features, feats(0, 6))


def test_resync_and_missing_features_are_resent_in_the_same_step():
    src = Source()
    d = StepDrafting(src, num_drafts=2)
    d.step([StepRow("a", [1, 2, 3], 0, feats(0, 2)), StepRow("b", [4, 5], 0, feats(0, 1))])
    src.answers = [{"a": "resync", "b": ("features", 0)}]
    out = d.step([StepRow("a", [1, 2, 3, 9], 2, feats(2, 3)), StepRow("b", [4, 5, 6], 1, feats(1, 2))])
    assert len(src.calls) == 3  # the step's call, then one retry for both
    retry = {r.session_id: r for r in src.calls[-1]}
    assert retry["a"].base == 0 and retry["a"].tokens == [1, 2, 3, 9] and retry["a"].feature_start == 0
    assert torch.equal(retry["a"].features, feats(0, 3))
    assert retry["b"].base == 3 and retry["b"].tokens == [] and retry["b"].feature_start == 0
    assert out == [[104, 104], [103, 103]]
    assert d.stats.resyncs == 2


def test_source_failure_falls_back_to_target_only_then_resends_whole():
    src, now = Source(), [0.0]
    d = StepDrafting(src, num_drafts=2, retry_after_s=10.0, clock=lambda: now[0])
    d.step([StepRow("a", [1, 2, 3], 0, feats(0, 2))])
    src.fail = True
    assert d.step([StepRow("a", [1, 2, 3, 4], 2, feats(2, 3))]) == [[]]
    assert d.stats.failures == 1
    calls = len(src.calls)
    now[0] = 5.0  # still inside the retry window: no call at all
    assert d.step([StepRow("a", [1, 2, 3, 4, 5], 3, feats(3, 4))]) == [[]]
    assert len(src.calls) == calls and d.stats.skipped_steps == 1
    src.fail, now[0] = False, 11.0
    assert d.step([StepRow("a", [1, 2, 3, 4, 5, 6], 4, feats(4, 5))]) == [[106, 106]]
    (r,) = src.calls[-1]
    assert r.base == 0 and r.feature_start == 0 and torch.equal(r.features, feats(0, 5))


def test_finished_requests_are_released():
    src = Source()
    d = StepDrafting(src, num_drafts=1)
    d.step([StepRow("a", [1, 2], 0, feats(0, 1)), StepRow("b", [3, 4], 0, feats(0, 1))])
    d.step([StepRow("b", [3, 4, 5], 1, feats(1, 2))])
    assert src.released == ["a"] and set(d.tracks) == {"b"}


def test_a_gap_in_features_disables_drafting_for_that_request_only():
    src = Source()
    d = StepDrafting(src, num_drafts=1)
    # request "a" starts at position 8: its prefix came from a cache, the drafter lacks features
    out = d.step([StepRow("a", list(range(12)), 8, feats(8, 11)), StepRow("b", [1, 2], 0, feats(0, 1))])
    assert out[0] == [] and out[1] != []
    assert [r.session_id for r in src.calls[-1]] == ["b"]
    assert d.stats.features_missing == 1 and d.tracks["a"].features_broken


def test_prefix_cached_positions_get_their_features_from_the_store():
    """Request "b" shares the first 8 tokens (two blocks of 4) with "a": the verifier's prefix
    cache skips them, and the features "a" computed for them are sent to the source for "b";
    "c" shares only one block with what was stored and starts at 8: no drafts for it."""
    src = Source()
    store = PrefixFeatures(block_size=4)
    d = StepDrafting(src, num_drafts=1, features=StepFeatures(fn=lambda x: x * 10, prefix_cache=store))
    a = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    d.step([StepRow("a", a + [1], 0, feature_input=feats(0, 10))])
    assert len(store) == 2  # blocks [0, 4) and [4, 8); positions 8, 9 are not a full block
    d.step([])  # "a" finishes
    b = a[:8] + [20, 21, 22]
    assert d.step([StepRow("b", b + [2], 8, feature_input=feats(8, 11) + 100)]) == [[100 + 12]]
    (r,) = src.calls[-1]
    assert r.feature_start == 0 and torch.equal(r.features[:8], feats(0, 8) * 10)
    assert torch.equal(r.features[8:], (feats(8, 11) + 100) * 10)
    assert d.stats.prefix_restored == 1 and len(store) == 2  # b's blocks are a's
    c = a[:4] + [30, 31, 32, 33, 34]
    assert d.step([StepRow("c", c + [3], 8, feature_input=feats(8, 9))]) == [[]]
    assert d.stats.features_missing == 1 and store.misses == 1


def test_prefix_store_is_lru_bounded_and_chained():
    store = PrefixFeatures(block_size=2, max_positions=4)  # two blocks
    x = feats(0, 6)
    assert store.remember([1, 2, 3, 4, 5, 6], x, (0, None))[0] == 3
    assert len(store) == 2 and store.lookup([1, 2, 3, 4], 4) is None  # block [1, 2] evicted
    # the same block after a different prefix is a different entry
    assert store.lookup([9, 9, 5, 6], 4) is None
    assert store.lookup([1, 2], 1) is None  # not a whole number of blocks


def test_sources_without_features_get_tokens_only():
    src = Source()
    d = StepDrafting(src, num_drafts=2, features=StepFeatures(needed=False))
    d.step([StepRow("a", [1, 2, 3])])
    (r,) = src.calls[-1]
    assert r.features is None and r.tokens == [1, 2, 3]


def test_governor_turns_drafting_off_when_drafting_steps_are_slower():
    """Steps that draft take 3 s for 2 tokens; steps that do not take 1 s for 1 token: the
    governor keeps the faster mode and only probes the other."""
    src, now = Source(), [0.0]
    gov = SpeculationGovernor(probe_every=4, max_probe_every=8, probe_rounds=2)
    d = StepDrafting(src, num_drafts=1, clock=lambda: now[0], governor=gov)
    tokens, drafted = [1, 2], []
    for _ in range(40):
        out = d.step([StepRow("a", list(tokens))])
        drafted.append(bool(out[0]))
        now[0] += 3.0 if out[0] else 1.0
        tokens += [7, 7] if out[0] else [7]
    assert sum(drafted[-20:]) <= 4  # mostly off once measured, with rare probes
    assert d.stats.governed_steps > 20


def test_feature_buffer_overwrites_rejected_positions_and_refuses_gaps():
    b = FeatureBuffer()
    assert b.put(0, feats(0, 100))  # grows past its initial capacity
    assert b.put(98, feats(50, 52))  # positions 98, 99 recomputed
    assert b.length == 100 and torch.equal(b.since(98), feats(50, 52))
    assert not b.put(101, feats(0, 1)) and b.length == 100
    assert b.since(100) is None


def test_cpu_expand_kernel_fix_writes_in_place_for_every_dtype():
    from moa_serve.verifier.vllm.expand_kernel_fix import expand_kernel

    cu = torch.tensor([2, 2, 5], dtype=torch.int32)
    for dtype in (torch.float32, torch.int32, torch.int64):
        out = torch.full((5,), -7, dtype=dtype)
        expand_kernel(out, torch.tensor([0.5 if dtype.is_floating_point else 3, 9, -1], dtype=dtype), cu, -1, 1)
        first = 0.5 if dtype.is_floating_point else 3
        assert out.tolist() == [first, first, 1, 1, 1]


def test_lazy_features_run_the_head_only_for_sessions_that_draft():
    """With a feature_fn, rows carry the head's inputs; steps without drafts (governor off)
    compute nothing, and the next draft call computes every pending position at once."""
    src, calls = Source(), []

    def head(x):
        calls.append(x.shape[0])
        return x * 10

    gov = Switch(on=False)
    d = StepDrafting(src, num_drafts=2, features=StepFeatures(fn=head), governor=gov)
    d.step([StepRow("a", [1, 2, 3, 4], 0, feature_input=feats(0, 3))])
    d.step([StepRow("a", [1, 2, 3, 4, 5], 3, feature_input=feats(3, 4))])
    assert calls == [] and src.calls == []
    gov.on = True
    d.step([StepRow("a", [1, 2, 3, 4, 5, 6], 4, feature_input=feats(4, 5))])
    assert calls == [5]
    (r,) = src.calls[-1]
    assert r.feature_start == 0 and torch.equal(r.features, feats(0, 5) * 10)
    d.step([StepRow("a", [1, 2, 3, 4, 5, 6, 7], 5, feature_input=feats(5, 6))])
    assert calls == [5, 1] and torch.equal(src.calls[-1][0].features, feats(5, 6) * 10)


def test_a_latest_only_drafter_gets_the_head_run_on_each_requests_last_position_only():
    """latest_feature_only: one head row per drafting request (its newest verified position,
    however long the backlog), sent alone; the older positions are never computed nor sent."""
    src, calls = Source(), []

    def head(x):
        calls.append(x.shape[0])
        return x * 10

    d = StepDrafting(src, num_drafts=2, features=StepFeatures(fn=head, latest_only=True))
    d.step(
        [
            StepRow("a", [1, 2, 3, 4, 5], 0, feature_input=feats(0, 4)),
            StepRow("b", [1, 2, 3], 0, feature_input=feats(0, 2)),
        ]
    )
    assert calls == [2]  # one row each, in one call
    ra, rb = src.calls[-1]
    assert (ra.feature_start, rb.feature_start) == (3, 1)
    assert torch.equal(ra.features, feats(3, 4) * 10) and torch.equal(rb.features, feats(1, 2) * 10)
    d.step(
        [
            StepRow("a", [1, 2, 3, 4, 5, 6, 7], 4, feature_input=feats(4, 6)),
            StepRow("b", [1, 2, 3, 4], 2, feature_input=feats(2, 3)),
        ]
    )
    assert calls == [2, 2]
    ra, rb = src.calls[-1]
    assert (ra.feature_start, rb.feature_start) == (5, 2)
    assert torch.equal(ra.features, feats(5, 6) * 10) and torch.equal(rb.features, feats(2, 3) * 10)


def test_a_latest_only_drafter_resumes_after_any_pause_without_a_backlog():
    """Steps the governor runs plain compute no features and never drop a request (one input row
    is kept, replaced each step); when speculation resumes, only the newest position's feature is
    computed. A drafter that asks for features again gets that newest one."""
    src, calls = Source(), []

    def head(x):
        calls.append(x.shape[0])
        return x * 10

    gov = Switch(on=False)
    d = StepDrafting(
        src, num_drafts=1, features=StepFeatures(fn=head, latest_only=True, max_pending_positions=4), governor=gov
    )
    toks = list(range(1, 80))
    d.step([StepRow("a", toks, 0, feature_input=feats(0, 78))])  # a prefill far past the cap
    for pos in range(78, 90):
        toks = toks + [9]
        d.step([StepRow("a", toks, pos, feature_input=feats(pos, pos + 1))])
    assert calls == [] and src.calls == [] and not d.tracks["a"].features_broken
    assert d.stats.dropped_features == 0
    gov.on = True
    toks = toks + [9]
    d.step([StepRow("a", toks, 90, feature_input=feats(90, 91))])
    assert calls == [1]
    (r,) = src.calls[-1]
    assert r.base == 0 and r.tokens == toks and r.feature_start == 90
    assert torch.equal(r.features, feats(90, 91) * 10)
    # the source lost the features (e.g. a new replica): the newest one is sent again
    src.answers.append({"a": ("features", 0)})
    toks = toks + [9]
    d.step([StepRow("a", toks, 91, feature_input=feats(91, 92))])
    retry = src.calls[-1][0]
    assert retry.feature_start == 91 and torch.equal(retry.features, feats(91, 92) * 10)


def test_a_latest_only_drafter_skips_capture_while_the_governor_keeps_drafting_off():
    """wants_features (asked before each forward) is False only for a latest-only drafter whose
    governor will not draft next; if the governor then drafts anyway, a request whose newest
    position was not captured waits a step instead of drafting from a stale feature."""
    src, gov = Source(), Switch(on=False)
    d = StepDrafting(src, num_drafts=1, features=StepFeatures(fn=lambda x: x, latest_only=True), governor=gov)
    assert not d.wants_features(4)
    assert StepDrafting(src, num_drafts=1, features=StepFeatures(fn=lambda x: x), governor=gov).wants_features(4)
    assert StepDrafting(src, num_drafts=1, features=StepFeatures(fn=lambda x: x, latest_only=True)).wants_features(4)
    toks = [1, 2, 3, 4, 5]
    d.step([StepRow("a", toks, 0, feature_input=feats(0, 4))])
    gov.on = True
    assert d.wants_features(4)
    toks = toks + [6]
    assert d.step([StepRow("a", toks, 4)]) == [[]]  # this step was not captured: no draft
    assert src.calls == []
    toks = toks + [7]
    assert d.step([StepRow("a", toks, 5, feature_input=feats(5, 6))]) != [[]]
    (r,) = src.calls[-1]
    assert r.feature_start == 5 and torch.equal(r.features, feats(5, 6))


def test_lazy_features_are_dropped_past_the_cap():
    src = Source()

    d = StepDrafting(
        src, num_drafts=1, features=StepFeatures(fn=lambda x: x, max_pending_positions=4), governor=Switch(on=False)
    )
    toks = [1, 2]
    for pos in range(0, 6):
        toks.append(9)
        d.step([StepRow("a", list(toks), pos, feature_input=feats(pos, pos + 1))])
    assert d.stats.dropped_features == 1 and d.tracks["a"].features_broken
    assert d.tracks["a"].pending.length == 0


def test_a_long_prefill_keeps_its_features_while_speculation_is_in_force():
    """A prompt longer than the cap is not dropped when the step drafts: its features are
    computed (one head call) and sent; without a governor (drafts every step) likewise for a
    row still mid-prefill."""
    src = Source()
    heads = []
    d = StepDrafting(
        src,
        num_drafts=2,
        features=StepFeatures(fn=lambda x: heads.append(x.shape[0]) or x * 10, max_pending_positions=4),
    )
    prompt = list(range(1, 11))  # 10 positions > cap 4
    assert d.step([StepRow("a", prompt + [7], 0, feature_input=feats(0, 10))]) == [[111, 111]]
    assert not d.tracks["a"].features_broken and d.stats.dropped_features == 0
    (r,) = src.calls[-1]
    assert r.feature_start == 0 and torch.equal(r.features, feats(0, 10) * 10)
    # mid-prefill (nothing sampled, no drafts asked): computed anyway, in its own head call
    d.step(
        [
            StepRow("b", prompt[:8], 0, feature_input=feats(0, 8), sampled=False),
            StepRow("a", prompt + [7, 8], 10, feature_input=feats(10, 11)),
        ]
    )
    assert not d.tracks["b"].features_broken and d.tracks["b"].features.length == 8
    assert d.tracks["b"].pending.length == 0 and heads[-2:] == [8, 1]


def test_the_governor_is_not_charged_for_catching_up_on_features():
    """After steps without drafts, the first drafting step computes the features of every position
    verified meanwhile; that catching-up is a cost of the pause, not of speculating, and is left
    out of the seconds the governor gets for the step (here the head takes 1 s per position)."""
    now = [0.0]

    def head(x):
        now[0] += x.shape[0]
        return x

    class Gov:
        on = False
        seen = []

        def speculate(self, n):
            return self.on

        def next_speculates(self, n):
            return self.on

        def observe(self, n, drafted, seconds, tokens, draft_s=0.0):
            self.seen.append((drafted, seconds))

    gov = Gov()
    d = StepDrafting(Source(), num_drafts=1, features=StepFeatures(fn=head), governor=gov, clock=lambda: now[0])
    toks = [1, 2, 3]
    d.step([StepRow("a", list(toks), 0, feature_input=feats(0, 2))])  # prefill: 2 positions, no drafts
    for pos in (2, 3, 4):
        now[0] += 10.0  # a plain step
        toks.append(9)
        d.step([StepRow("a", list(toks), pos, feature_input=feats(pos, pos + 1))])
    gov.on = True
    now[0] += 10.0
    toks.append(9)
    d.step([StepRow("a", list(toks), 5, feature_input=feats(5, 6))])  # head: 6 positions, 1 of them fresh
    now[0] += 10.0
    toks.append(9)
    d.step([StepRow("a", list(toks), 6, feature_input=feats(6, 7))])
    assert gov.seen[-1] == (True, 10.0 + 1.0)  # the step's own position counted, the 5 of the pause not


def test_the_governor_sees_the_steps_batch_not_only_the_requests_that_can_draft():
    """Three of four requests lost their features (a prefix-cache miss): the step still verifies
    four, and costs what a step of four costs; a request mid-prefill does not count."""

    class Gov:
        asked = []

        def speculate(self, n):
            self.asked.append(n)
            return True

        def next_speculates(self, n):
            return True

        def observe(self, n, drafted, seconds, tokens, draft_s=0.0):
            self.asked.append(("observe", n))

    gov = Gov()
    d = StepDrafting(Source(), num_drafts=1, governor=gov)
    rows = [StepRow(s, list(range(12)), 8, feats(8, 11)) for s in "abc"]  # features missing: no drafts
    rows += [StepRow("d", [1, 2], 0, feats(0, 1)), StepRow("e", [1, 2, 3], 0, feats(0, 3), sampled=False)]
    out = d.step(rows)
    assert [bool(x) for x in out] == [False, False, False, True, False]
    d.step(rows[:4])  # "e" finished its prompt in a step of its own: not timed
    assert gov.asked == [4, ("observe", 4), 4]


def test_steps_that_carry_a_prompt_are_not_timed_and_drafting_steps_report_their_draft_call():
    """A forward holding a prefill chunk, or a request's first sampled token, costs what the prompt
    costs in either mode: the governor gets no timing of it. A step that drafted reports its draft
    call's seconds (they price the governor's probes)."""
    now = [0.0]

    class Slow(Source):
        def propose(self, requests):
            now[0] += 0.5
            return super().propose(requests)

    class Gov:
        seen = []

        def speculate(self, n):
            return True

        def next_speculates(self, n):
            return True

        def observe(self, n, drafted, seconds, tokens, draft_s=0.0):
            self.seen.append((n, drafted, seconds, tokens, draft_s))

    gov = Gov()
    d = StepDrafting(Slow(), num_drafts=1, governor=gov, clock=lambda: now[0])
    a = [1, 2, 3]
    d.step([StepRow("a", list(a))])  # a's prompt
    now[0] += 1.0
    a.append(7)
    d.step([StepRow("a", list(a))])  # timed: 1.5 s (a draft call of 0.5 s) for a's first step
    now[0] += 1.0
    a.append(7)
    d.step([StepRow("a", list(a)), StepRow("b", [4, 5, 6, 7], sampled=False)])  # b's first chunk: not timed
    now[0] += 1.0
    a.append(7)
    d.step([StepRow("a", list(a)), StepRow("b", [4, 5, 6, 7, 8])])  # b's first token: not timed
    now[0] += 1.0
    a.append(7)
    d.step([StepRow("a", list(a)), StepRow("b", [4, 5, 6, 7, 8, 9])])  # timed
    assert [(n, s, tok) for n, _, s, tok, _ in gov.seen] == [(1, 1.5, 1), (2, 1.5, 2)]
    assert all(drafted and draft_s == 0.5 for _, drafted, _, _, draft_s in gov.seen)


def test_vllm_bench_configs_name_engines_and_their_scheduling():
    from moa_serve.measure.vllm_bench_report import markdown
    from moa_serve.measure.vllm_bench_run import BenchConfig, _configs

    assert _configs("vllm,none, none@sync,ngram,x-moa,x-moa@fixed,x-moa@fullk,none@eager,x-moa@hooks") == [
        BenchConfig("vllm", alone=True),
        BenchConfig("none"),
        BenchConfig("none@sync", async_scheduling=False),
        BenchConfig("ngram", ngram=True),
        BenchConfig("x-moa", "x-moa", governed=True, adaptive=True),
        BenchConfig("x-moa@fixed", "x-moa"),
        BenchConfig("x-moa@fullk", "x-moa", governed=True),
        BenchConfig("none@eager", enforce_eager=True),
        BenchConfig("x-moa@hooks", "x-moa", governed=True, adaptive=True, feature_hooks=True),
    ]
    with pytest.raises(ValueError, match="unknown modifier"):
        _configs("none@graphs")
    with pytest.raises(ValueError, match="needs a drafter"):
        _configs("none@hooks")
    row = dict(users=16, tokens_per_s=10.0, tau=1.0, latency_p50_s=1.0, requests=3)
    md = markdown(
        {
            "rows": [
                {**row, "config": "none", "async_scheduling": True},
                {**row, "config": "none@sync", "async_scheduling": False, "tokens_per_s": 9.0},
            ]
        }
    )
    assert "| 16 | none | on | 10.0 | 1.00× |" in md and "| 16 | none@sync | off | 9.0 | 0.90× |" in md
    # repeated cells: each compared with the reference's cell of its own repeat (a machine that
    # slowed down in the second repeat slowed both), the ratios' geometric mean and range
    md = markdown(
        {
            "rows": [
                {**row, "config": "none", "repeat": 0, "tokens_per_s": 10.0},
                {**row, "config": "x", "repeat": 0, "tokens_per_s": 9.0, "drafting_steps": 1, "governed_steps": 9},
                {**row, "config": "x", "repeat": 1, "tokens_per_s": 8.8, "drafting_steps": 3, "governed_steps": 7},
                {**row, "config": "none", "repeat": 1, "tokens_per_s": 8.0, "requests": 2},
            ]
        }
    )
    assert "| 16 | none |  | 9.0 | 1.00× (1.00–1.00) | 1.0 | 1.0 | 5 |  |  |" in md
    assert "| 16 | x |  | 8.9 | 0.99× (0.90–1.10) | 1.0 | 1.0 | 6 | 4/16 |  |" in md  # drafts not counted
    cells = [
        {**row, "config": "x", "drafting_steps": 4, "governed_steps": 6, "drafts": 5},
        {**row, "config": "x", "repeat": 1, "drafting_steps": 0, "governed_steps": 9, "drafts": 0},
    ]
    assert "| 6 | 4/15 | 1.25 |" in markdown({"rows": cells})
    # net of steal: an engine whose steps lost a tenth of the machine to the hypervisor
    net = {"tokens_per_s_net": 10.0, "steal_percent": 0.0}
    cells = [{**row, **net, "config": "none"}, {**row, "config": "x", "tokens_per_s": 9.0, "tokens_per_s_net": 10.0}]
    cells[1]["steal_percent"] = 10.0
    assert "| 0.90× | 1.0 | 1.0 | 3 |  |  | 1.00× | 10.0 |" in markdown({"rows": cells})


class _CountingEngine:
    """add/step/abort/has_unfinished as the bench drives them: each step gives every running
    request ``per_step`` tokens, a request ends after ``length``; ``log`` records whose step ran."""

    def __init__(self, name: str, log: list, per_step: int = 1, length: int = 3):
        self.name, self.log, self.per_step, self.length = name, log, per_step, length
        self.running: dict[str, int] = {}
        self.ids = 0

    def add(self, prompt, max_new_tokens):
        self.ids += 1
        self.running[f"{self.name}{self.ids}"] = 0
        return f"{self.name}{self.ids}"

    def step(self):
        self.log.append(self.name)
        out = []
        for rid in list(self.running):
            self.running[rid] += self.per_step
            done = self.running[rid] >= self.length
            out.append((rid, [7] * self.per_step, "length" if done else None))
            if done:
                del self.running[rid]
        return out

    def abort(self, request_ids):
        for rid in request_ids:
            self.running.pop(rid, None)

    def has_unfinished(self):
        return bool(self.running)


def test_vllm_bench_interleaves_engines_one_step_each_and_times_each_alone():
    from moa_serve.measure.vllm_bench_run import interleaved

    log = []
    a, b = _CountingEngine("a", log), _CountingEngine("b", log, per_step=2, length=4)
    rows = interleaved({"a": a, "b": b}, [[1, 2]], users=2, duration_s=0.05, max_new_tokens=8)
    # turns alternate a,b then b,a: never more than two steps of one engine in a row
    assert len(log) >= 4 and "aaa" not in "".join(log) and "bbb" not in "".join(log)
    assert log[:4] == ["a", "b", "b", "a"]
    # every step moved each engine's 2 requests: tokens = steps x users x per_step; the time is the
    # engine's own steps, not the turns of the other
    steps_a, steps_b = log.count("a"), log.count("b")
    assert rows["a"]["tokens"] == 2 * steps_a and rows["b"]["tokens"] == 4 * steps_b
    assert rows["a"]["tau"] == 1.0 and rows["b"]["tau"] == 2.0
    assert rows["a"]["requests"] >= 2 * (steps_a // 3) and not a.running and not b.running
    # each engine's steps are also counted net of the hypervisor's share of the CPU during them
    for r in rows.values():
        assert r["steal_percent"] is None or 0 <= r["steal_percent"] <= 100
        assert r["tokens_per_s_net"] >= r["tokens_per_s"]


def test_the_step_clock_counts_only_seconds_inside_engine_steps():
    import time

    from moa_serve.verifier.vllm.engine import StepClock

    clock = StepClock()
    with clock:
        time.sleep(0.02)
        inside = clock()  # read from within a step (the proposer's moment)
    time.sleep(0.05)  # between steps: an idle server, another engine's step
    assert 0.02 <= inside and clock() == clock.spent and clock.spent < 0.045
    with clock:
        time.sleep(0.01)
    assert 0.03 <= clock() < 0.075


def test_a_chosen_draft_length_is_asked_of_the_source_and_learns_from_every_step():
    """With a ``DraftLength`` each drafting step asks the source for the chosen number of drafts
    (not K), and teaches it the verify forward's seconds by its rows (the step's time without its
    draft call), the draft call's seconds by its draft steps, and each request's acceptance."""
    from moa_serve.engine.draft_length import DraftLength

    now = [0.0]

    class Slow(Source):
        def propose(self, requests):
            now[0] += 0.5
            return super().propose(requests)

    class Recording(DraftLength):
        seen = []

        def choose(self, requests):
            return 2

        def observe_step(self, rows, seconds):
            self.seen.append(("step", rows, seconds))

        def observe_call(self, steps, seconds):
            self.seen.append(("call", steps, seconds))

        def observe_drafts(self, drafted, accepted):
            self.seen.append(("drafts", drafted, accepted))

    src, length = Slow(), Recording(4)
    d = StepDrafting(src, num_drafts=4, length=length, clock=lambda: now[0])
    a, b = [1, 2, 3], [4, 5]
    d.step([StepRow("a", list(a)), StepRow("b", list(b))])  # the prompts: not timed
    assert [r.num_drafts for r in src.calls[-1]] == [2, 2]
    now[0] += 1.0
    a += [7, 8]  # a's first draft accepted, b's rejected
    b += [9]
    out = d.step([StepRow("a", list(a)), StepRow("b", list(b))])
    assert [len(x) for x in out] == [2, 2]
    assert length.seen == [
        ("call", 2, 0.5),
        ("drafts", 2, 1),
        ("drafts", 2, 0),
        ("step", 2 + 4, 1.0),  # 1.5 s since the last step, 0.5 of them its draft call
        ("call", 2, 0.5),
    ]
