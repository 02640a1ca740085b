"""RoundService rounds against the awaiting stub pools (tests/support/service_stubs.py): the delta
protocol end to end (chunked prefill, reordered results, resync), the speculation width as the batch
grows, round profiles for observers, and group keys."""

import asyncio

import pytest

from moa_serve.engine import round_loop
from moa_serve.engine.options import RoundOptions
from moa_serve.engine.pool_calls import Pools
from moa_serve.engine.round_service import RoundService
from moa_serve.engine.round_stats import Observer
from tests.support.service_stubs import (
    FakeDrafter,
    FakeRelease,
    FakeVerifier,
    collect,
    fake_features,
    make_service,
    make_session,
    reference,
    requests_of,
    run_all,
)


# ---------------------------------------------------------------------- protocol end to end
def test_deltas_chunked_prefill_and_reordered_results_keep_every_token():
    verifier = FakeVerifier(chunk=4, delay=0.01, reverse=True)
    drafter = FakeDrafter(wrong_every=4, delay=0.005, reverse=True)
    ss = [make_session(i, prompt_len=5 + 2 * i) for i in range(6)]

    async def main():
        svc, _ = make_service(
            verifier, drafter, groups=["r0/0", "r0/1"], max_sessions_per_round=3, speculation_token_budget=0
        )
        outs = await run_all(svc, ss)
        return outs, svc.stats

    outs, stats = asyncio.run(main())
    assert [o[0] for o in outs] == [reference(s.prompt, 20) for s in ss]  # results matched by id, not order
    assert verifier.errors == [] and drafter.errors == []
    assert {g for g, _ in verifier.calls} == {"r0/0", "r0/1"}
    for s in ss:
        vq, dq = requests_of(verifier, s.id), requests_of(drafter, s.id)
        assert [q.base == 0 for q in vq].count(True) == 1 and [q.base == 0 for q in dq].count(True) == 1
        assert all(len(q.tokens) <= s.num_speculative_tokens + 1 for q in vq + dq if q.base > 0)  # deltas only
        pos = drafter.received[s.id]
        assert pos == sorted(set(pos)) and pos[0] == 0  # every feature sent once, in order
        assert s.rounds == verifier.token_rounds[s.id]  # prefill chunks are not rounds
        assert s.mean_accepted_length > 1.0
    assert stats.prefill_rounds == sum(max(0, (len(s.prompt) - 2) // 4) for s in ss)
    assert stats.completed == 6 and stats.resyncs == 0 and stats.multi_session_rounds > 0


def test_replicas_that_lost_a_session_resync():
    verifier = FakeVerifier(delay=0.002)
    drafter = FakeDrafter(delay=0.001)
    verifier.evict_on = {4: "s0"}  # the verifier replica lost s0 (restart, LRU eviction)
    drafter.evict_on = {3: "s1"}

    async def main():
        svc, _ = make_service(verifier, drafter, num_groups=1)
        ss = [make_session(0), make_session(1)]
        outs = await run_all(svc, ss)
        return ss, outs, svc.stats

    ss, outs, stats = asyncio.run(main())
    assert [o[0] for o in outs] == [reference(s.prompt, 20) for s in ss]
    assert drafter.errors == []
    # the verify resync went again, whole, in a follow-up call of the same round
    follow = verifier.calls[4][1]
    assert [(q.session_id, q.base, len(q.tokens)) for q in follow] == [("s0", 0, len(follow[0].tokens))]
    assert follow[0].tokens[:6] == ss[0].prompt
    # the drafter resync: base 0 next time, and every feature again
    s1 = requests_of(drafter, "s1")
    i = next(i for i, q in enumerate(s1) if q.base == 0 and i > 0)
    assert s1[i].base == 0
    assert stats.resyncs >= 2 and stats.drafter_resyncs >= 1


# ---------------------------------------------------------------------- speculation policy
def test_speculation_cap_shrinks_with_the_batch():
    assert round_loop.speculation_cap(32, 1) == 31
    assert [round_loop.speculation_cap(32, n) for n in (4, 8, 16, 32, 64)] == [7, 3, 1, 0, 0]
    assert round_loop.speculation_cap(0, 64) is None
    s = make_session(0, k=5)
    s.features.add(0, fake_features(0, 6))
    assert s.speculation_length(None) == 5 and s.speculation_length(2) == 2 and s.speculation_length(0) == 0
    s.adaptive_speculation, s.accept_ema = True, 0.0  # nothing accepted lately: 1, whatever the cap
    assert s.speculation_length(3) == 1


def test_service_shrinks_k_as_the_batch_grows_and_turns_it_off():
    verifier = FakeVerifier(delay=0.002)
    drafter = FakeDrafter(delay=0.001)

    async def main(budget):
        svc, _ = make_service(
            verifier, drafter, num_groups=1, max_sessions_per_round=8, speculation_token_budget=budget
        )
        ss = [make_session(i, max_new=8 + 6 * (i == 0), k=4) for i in range(8)]
        outs = await run_all(svc, ss)
        return ss, outs

    ss, outs = asyncio.run(main(16))  # 8 sessions: at most 1 draft each; s0 alone at the end: 4
    assert [o[0] for o in outs] == [reference(s.prompt, len(o[0])) for s, o in zip(ss, outs)]
    widths = [(len(reqs), max(q.num_drafts for q in reqs)) for _, reqs in drafter.calls]
    assert all(k <= 16 // n - 1 for n, k in widths if n > 1)
    assert (1, 4) in widths
    drafter.calls.clear()
    asyncio.run(main(8))  # 8 sessions, budget 8: no drafting at all while all 8 run
    assert all(len(reqs) < 8 for _, reqs in drafter.calls)


# ---------------------------------------------------------------------- stats and observers
def test_round_profile_and_an_observer_with_the_old_signature():
    class OldObserver(Observer):  # deployments/metrics.py's PrometheusObserver shape
        def __init__(self):
            self.rounds = []

        def round_done(self, group, sessions, draft_s, verify_s, round_s):
            self.rounds.append((group, sessions))

    class NewObserver(Observer):
        def __init__(self):
            self.profiles = []

        def round_profile(self, profile):
            self.profiles.append(profile)

    async def main(obs):
        svc, _ = make_service(FakeVerifier(chunk=4, delay=0.001), FakeDrafter(), groups=["x"], observer=obs)
        await collect(svc, svc.submit(make_session(0, prompt_len=12)))
        await svc.stop()
        return svc.stats

    old = OldObserver()
    stats = asyncio.run(main(old))
    assert old.rounds and old.rounds[0] == ("x", 1)
    new = NewObserver()
    asyncio.run(main(new))
    p = new.profiles
    assert p[0].prefill_sessions == 1 and p[0].tokens == 0 and sum(x.tokens for x in p) == 20
    assert all(x.round_s >= x.verify_s > 0 for x in p)
    d = stats.as_dict()
    assert d["prefill_rounds"] == 2 and d["resyncs"] == 0
    assert {"mean_draft_ms", "mean_verify_ms", "mean_commit_ms", "mean_round_ms", "verify_s"} <= set(d)


def test_group_keys_must_be_distinct():
    with pytest.raises(ValueError):
        RoundService(Pools(FakeVerifier(), None, FakeRelease()), groups=["a", "a"])
    assert RoundService(Pools(FakeVerifier(), None, FakeRelease()), RoundOptions(num_groups=3)).groups == [0, 1, 2]
