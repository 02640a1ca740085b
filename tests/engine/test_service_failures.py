"""RoundService under failures, with the awaiting stub pools (tests/support/service_stubs.py): a
failed round errors only its own batch, timeouts are retried whole, lost features are recomputed or
rebuilt, a slow drafter degrades to plain decoding, bounded retries, releases retried then given up."""

import asyncio
import dataclasses

from tests.support.service_stubs import (
    FakeDrafter,
    FakeVerifier,
    collect,
    make_service,
    make_session,
    reference,
    requests_of,
    run_all,
)


def test_a_failed_round_errors_only_its_own_batch():
    verifier = FakeVerifier(delay=0.05)
    verifier.fail_on = {1: ValueError("bad request")}

    async def main():
        svc, _ = make_service(verifier, None, num_groups=1, max_sessions_per_round=4)
        a = asyncio.create_task(collect(svc, svc.submit(make_session(0))))
        await asyncio.sleep(0.01)  # a's round is in flight
        b = asyncio.create_task(collect(svc, svc.submit(make_session(1, max_new=3))))  # admitted during it
        outs = await asyncio.gather(a, b)
        await svc.stop()
        return outs

    (a_toks, a_finish), (b_toks, b_finish) = asyncio.run(main())
    assert a_toks == [] and a_finish.startswith("error: ValueError: bad request")
    assert b_finish == "length" and b_toks == reference(make_session(1).prompt, 3)


def test_verify_timeout_is_retried_whole_and_features_are_rebuilt():
    verifier = FakeVerifier(delay=0.002)
    drafter = FakeDrafter(delay=0.001, wrong_every=3)
    verifier.hang_on = {4}  # computed there, never answered here

    async def main():
        svc, _ = make_service(verifier, drafter, num_groups=1, verify_timeout_s=0.2)
        ss = [make_session(0), make_session(1, prompt_len=9)]
        outs = await run_all(svc, ss)
        return ss, outs, svc.stats

    ss, outs, stats = asyncio.run(main())
    assert [o[0] for o in outs] == [reference(s.prompt, 20) for s in ss]
    assert stats.verify_retries == 1
    assert all(q.base == 0 for q in verifier.calls[4][1])  # the retry resent whole token lists
    assert drafter.errors == []


class LossyVerifier(FakeVerifier):
    """Loses the features of its third call on the way; ``recompute``: serves ``features_from``
    from its cache (MoA's per-layer K/V) or not (EAGLE-style hidden states are gone)."""

    def __init__(self, recompute: bool, **kw):
        super().__init__(**kw)
        self.recompute = recompute

    def _one(self, q):
        if not self.recompute:
            q = dataclasses.replace(q, features_from=None)
        r = super()._one(q)
        if len(self.calls) == 3:
            r.features = None  # computed there, never arrived here
        return r


def run_one_session(verifier, drafter):
    """One session through a one-group service: (session, (tokens, finish), stats, release)."""

    async def main():
        svc, release = make_service(verifier, drafter, num_groups=1)
        s = make_session(0)
        out = await collect(svc, svc.submit(s))
        await svc.stop()
        return s, out, svc.stats, release

    return asyncio.run(main())


def test_features_lost_on_the_way_are_recomputed_from_the_cache():
    verifier, drafter = LossyVerifier(recompute=True, delay=0.001), FakeDrafter()
    s, (toks, _), stats, _ = run_one_session(verifier, drafter)
    assert toks == reference(s.prompt, 20) and drafter.errors == []
    assert stats.resyncs == 0  # the next verify asked from the first missing position
    received = drafter.received[s.id]
    assert received == list(range(len(received)))


def test_features_lost_on_the_way_are_rebuilt_by_a_re_prefill():
    verifier, drafter = LossyVerifier(recompute=False, delay=0.001), FakeDrafter()
    s, (toks, _), stats, release = run_one_session(verifier, drafter)
    assert toks == reference(s.prompt, 20) and drafter.errors == []
    assert stats.resyncs == 1 and release.released[0] == "s0"  # released on both pools mid-way
    restart = [q for q in requests_of(verifier, "s0")[1:] if q.base == 0]
    assert len(restart) == 1 and restart[0].tokens[:6] == s.prompt


def test_a_slow_drafter_past_its_timeout_degrades_to_plain_decoding():
    verifier = FakeVerifier(delay=0.002)
    drafter = FakeDrafter(delay=0.001)
    drafter.hang_on = {2}

    async def main():
        svc, _ = make_service(verifier, drafter, num_groups=1, draft_timeout_s=0.1)
        s = make_session(0)
        out = await collect(svc, svc.submit(s))
        await svc.stop()
        return s, out, svc.stats

    s, (toks, _), stats = asyncio.run(main())
    assert toks == reference(s.prompt, 20) and stats.draft_fallbacks == 1
    after = requests_of(drafter, "s0")[2]
    assert after.base == 0 and after.feature_start == 0  # a replacement replica gets everything


def test_kv_cache_full_is_retried_a_bounded_number_of_times_and_errors_only_its_group():
    verifier = FakeVerifier(delay=0.002)
    verifier.fail_groups = {"bad": RuntimeError("KV cache is full: no free session slot")}

    async def main():
        svc, _ = make_service(verifier, None, groups=["good", "bad"], max_sessions_per_round=1, verify_retries=3)
        outs = await asyncio.gather(*(collect(svc, svc.submit(make_session(i))) for i in range(2)))
        await svc.stop()
        return outs, svc.stats

    outs, stats = asyncio.run(main())
    finishes = sorted(f for _, f in outs)
    assert finishes[0].startswith("error: RuntimeError: KV cache is full") and finishes[1] == "length"
    assert sum(g == "bad" for g, _ in verifier.calls) == 4  # 1 call + 3 retries, not 30
    assert stats.verify_retries == 3


def test_a_bad_request_is_not_retried():
    verifier = FakeVerifier()
    verifier.fail_groups = {0: ValueError("no tokens to verify")}

    async def main():
        svc, _ = make_service(verifier, None, num_groups=1)
        out = await collect(svc, svc.submit(make_session(0)))
        await svc.stop()
        return out, svc.stats

    (_, finish), stats = asyncio.run(main())
    assert finish.startswith("error: ValueError") and len(verifier.calls) == 1 and stats.verify_retries == 0


def test_failed_releases_are_retried_then_given_up():
    async def run(fail: int, attempts: int):
        verifier = FakeVerifier(delay=0.001)
        svc, release = make_service(verifier, None, num_groups=1, release_attempts=attempts)
        release.fail = fail
        await asyncio.gather(*(collect(svc, svc.submit(make_session(i, max_new=3))) for i in range(3)))
        for _ in range(200):
            if svc.pending_releases == 0:
                break
            await asyncio.sleep(0.01)
        await svc.stop()
        return svc, release, verifier

    svc, release, verifier = asyncio.run(run(fail=2, attempts=5))
    assert sorted(release.released) == ["s0", "s1", "s2"] and verifier.copies == {}
    assert svc.stats.release_failures == 2 and svc.stats.releases_dropped == 0
    svc, release, _ = asyncio.run(run(fail=100, attempts=3))
    assert svc.pending_releases == 0 and svc.stats.releases_dropped == 3 and release.released == []


def test_rounds_do_not_wait_for_a_slow_release_and_stop_lets_it_finish():
    async def main():
        verifier = FakeVerifier(delay=0.002)
        svc, release = make_service(verifier, None, num_groups=1)
        release.delay = 0.5  # a pool slow to answer: the next session's rounds go on meanwhile
        first = await collect(svc, svc.submit(make_session(0, max_new=3)))
        second = await collect(svc, svc.submit(make_session(1, max_new=6)))
        released_while_second_ran = list(release.released)
        await svc.stop()
        return first, second, released_while_second_ran, release.released

    first, second, early, released = asyncio.run(main())
    assert first == (reference(make_session(0).prompt, 3), "length")
    assert second == (reference(make_session(1).prompt, 6), "length")
    assert early == []  # s1's rounds all ran while s0's release was still on its way
    assert released == ["s0"]  # stopping waited for the release in flight
