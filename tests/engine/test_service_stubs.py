"""RoundService against awaiting fake pools that speak the delta protocol (``base`` + ``tokens``,
``resync``, chunked prefill, ``needs_features_from``) over a deterministic toy "model": groups
interleave on ``asyncio.sleep``, so ordering, failure and timeout defects show up without Ray
and without real models.

The toy target's greedy next token is a function of the whole prefix; the fake feature of
position p is the number p, so the fake drafter checks that it got the right positions."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Container

import pytest
import torch

from moa_serve.drafter.lookup import LookupTable
from moa_serve.engine import round_steps
from moa_serve.engine.feature_policy import RecomputedFeatures
from moa_serve.engine.options import RoundOptions
from moa_serve.engine.round_service import RoundService
from moa_serve.engine.round_stats import Observer
from moa_serve.engine.session import FeatureStore, Session
from moa_serve.protocol import DraftResult, VerifyResult

VOCAB = 97


def next_token(seq: list[int]) -> int:
    return (seq[-1] * 31 + (seq[-2] if len(seq) > 1 else 0) * 7 + len(seq)) % VOCAB


def reference(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


def fake_features(start: int, end: int) -> torch.Tensor:
    return torch.arange(start, end, dtype=torch.float32)[:, None].repeat(1, 3)


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class _FakePool:
    """What both fakes share: a delay per call, scripted events by call number (1-based):
    ``fail_on[n] = exc`` raises, ``hang_on`` computes then hangs (the call "ran there" but times
    out here), ``evict_on[n] = sid`` forgets a session first; ``fail_groups`` always raise."""

    def __init__(self, delay: float = 0.0, reverse: bool = False):
        self.delay, self.reverse = delay, reverse
        self.copies: dict[str, list[int]] = {}
        self.calls: list[tuple] = []  # (group, requests)
        self.fail_on: dict[int, Exception] = {}
        self.fail_groups: dict = {}
        self.hang_on: set[int] = set()
        self.evict_on: dict[int, str] = {}
        self.errors: list[str] = []

    async def __call__(self, group, reqs):
        self.calls.append((group, list(reqs)))
        n = len(self.calls)
        await asyncio.sleep(self.delay)
        if group in self.fail_groups:
            raise self.fail_groups[group]
        if n in self.fail_on:
            raise self.fail_on[n]
        if n in self.evict_on:
            self.evict(self.evict_on[n])
        out = [self._one(q) for q in reqs]
        if n in self.hang_on:
            await asyncio.sleep(3600)
        return out[::-1] if self.reverse else out

    def _copy(self, q) -> list[int] | None:
        """The replica's copy after this request, or None when it lacks ``base`` tokens."""
        old = self.copies.get(q.session_id)
        if q.base > (len(old) if old is not None else 0):
            return None
        return (old or [])[: q.base] + list(q.tokens)


class FakeVerifier(_FakePool):
    def __init__(self, chunk: int = 0, **kw):
        super().__init__(**kw)
        self.chunk = chunk  # committed tokens prefilled per call (0: all at once)
        self.cached: dict[str, int] = {}
        self.token_rounds: dict[str, int] = {}  # results that carried tokens, per session

    def evict(self, sid: str) -> None:
        self.copies.pop(sid, None)
        self.cached.pop(sid, None)

    def _one(self, q) -> VerifyResult:
        old = self.copies.get(q.session_id) or []
        copy = self._copy(q)
        if copy is None:
            return VerifyResult(q.session_id, [], 0, 0, None, resync=True)
        cached = min(self.cached.get(q.session_id, 0), _lcp(old, copy), len(copy) - 1)
        self.copies[q.session_id] = copy
        if self.chunk and len(copy) - cached > self.chunk + 1:  # a chunk of the prompt, nothing else
            if q.drafts:
                self.errors.append(f"{q.session_id}: drafts while prefilling")
            end = cached + self.chunk
            self.cached[q.session_id] = end
            return VerifyResult(
                q.session_id,
                [],
                0,
                cached,
                fake_features(cached, end),
                num_computed=self.chunk,
                prefill_remaining=len(copy) - end,
            )
        seq, acc = list(copy), []
        for d in q.drafts:
            if d != next_token(seq):
                break
            acc.append(d)
            seq.append(d)
        new = acc + [next_token(seq)]
        end = len(copy) + len(acc)  # positions now cached (the new bonus token is not)
        # multi-step decoding, as the runner does it: more tokens, their features not attached
        forwards = 1
        while (
            (not q.drafts or not q.want_features)
            and forwards < q.decode_steps
            and (q.max_tokens <= 0 or len(new) < q.max_tokens)
            and new[-1] not in q.stop_token_ids
        ):
            new.append(next_token(seq + new))
            forwards += 1
        self.cached[q.session_id] = end + len(new) - 1 - len(acc)
        self.copies[q.session_id] = copy + new
        self.token_rounds[q.session_id] = self.token_rounds.get(q.session_id, 0) + 1
        start = cached  # features of the newly cached positions, or from where the sender lacks them
        if q.want_features and q.features_from is not None:
            start = max(0, min(start, q.features_from))
        feats = fake_features(start, end) if q.want_features else None
        # as the runner counts it: each extra decode step computes one more position
        return VerifyResult(
            q.session_id,
            new,
            len(acc),
            start,
            feats,
            num_computed=len(copy) - cached + len(q.drafts) + len(new) - 1 - len(acc),
        )


class FakeDrafter(_FakePool):
    def __init__(self, wrong_every: int = 0, **kw):
        super().__init__(**kw)
        self.wrong_every = wrong_every  # every n-th draft is wrong
        self.held: dict[str, int] = {}
        self.received: dict[str, list[int]] = {}  # feature positions received, per session
        self._n = 0

    def evict(self, sid: str) -> None:
        self.copies.pop(sid, None)
        self.held.pop(sid, None)

    def _one(self, q) -> DraftResult:
        copy = self._copy(q)
        if copy is None:
            return DraftResult(q.session_id, [], resync=True)
        self.copies[q.session_id] = copy
        held = self.held.get(q.session_id, 0)
        if q.feature_start > held:
            return DraftResult(q.session_id, [], needs_features_from=held)
        if q.features is not None:
            if not torch.equal(q.features, fake_features(q.feature_start, q.feature_start + len(q.features))):
                self.errors.append(f"{q.session_id}: features from {q.feature_start} are not those positions")
            self.held[q.session_id] = q.feature_start + len(q.features)
            self.received.setdefault(q.session_id, []).extend(range(q.feature_start, self.held[q.session_id]))
        drafts, seq = [], list(copy)
        for _ in range(q.num_drafts):
            self._n += 1
            t = next_token(seq)
            if self.wrong_every and self._n % self.wrong_every == 0:
                t = (t + 1) % VOCAB
            drafts.append(t)
            seq.append(t)
        return DraftResult(q.session_id, drafts)


class FakeRelease:
    def __init__(self, *pools, fail: int = 0):
        self.pools, self.fail = pools, fail
        self.released: list[str] = []
        self.calls = 0

    async def __call__(self, group, ids):
        self.calls += 1
        await asyncio.sleep(0.001)
        if self.fail:
            self.fail -= 1
            raise ConnectionError("release failed")
        for sid in ids:
            for p in self.pools:
                p.evict(sid)
        self.released += ids


def make_session(i: int, prompt_len: int = 6, max_new: int = 20, k: int = 3) -> Session:
    prompt = [(i * 13 + j * 5 + 1) % VOCAB for j in range(prompt_len)]
    return Session(f"s{i}", prompt, max_new, num_speculative_tokens=k, max_model_len=256)


def make_service(verifier, drafter=None, **kw):
    release = FakeRelease(*(p for p in (verifier, drafter) if p is not None))
    kw.setdefault("retry_backoff_s", 0.01)
    kw.setdefault("speculation_governor", False)  # these tests follow every round's drafts
    extra = {k: kw.pop(k) for k in ("features", "lookup", "groups", "observer", "cut") if k in kw}
    return RoundService(verifier, drafter, release, RoundOptions(**kw), **extra), release


async def run_all(svc, sessions):
    """Every session to completion through ``svc``, which is then stopped: their (tokens, finish)."""
    outs = await asyncio.gather(*(collect(svc, svc.submit(s)) for s in sessions))
    await svc.stop()
    return outs


async def collect(svc, tracked) -> tuple[list[int], str]:
    toks, finish = [], None
    async for ev in svc.stream(tracked):
        toks += ev.tokens
        finish = ev.finish_reason
    return toks, finish


def requests_of(pool, sid):
    return [q for _, reqs in pool.calls for q in reqs if q.session_id == sid]


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


# ---------------------------------------------------------------------- the concurrency defects
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


# ---------------------------------------------------------------------- speculation policy
def test_speculation_cap_shrinks_with_the_batch():
    assert round_steps.speculation_cap(32, 1) == 31
    assert [round_steps.speculation_cap(32, n) for n in (4, 8, 16, 32, 64)] == [7, 3, 1, 0, 0]
    assert round_steps.speculation_cap(0, 64) is None
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


# ---------------------------------------------------------------------- features
def test_feature_store_sends_only_the_tail(monkeypatch):
    fs = FeatureStore()
    for p in range(0, 300, 3):
        assert fs.add(p, fake_features(p, p + 3))
    assert len(fs) == 300 and not fs.add(301, fake_features(301, 302))  # a hole is refused
    seen = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda ts, *a, **k: (seen.append(len(ts)), real_cat(ts, *a, **k))[1])
    assert torch.equal(fs.since(292), fake_features(292, 300)) and max(seen) <= 3
    assert torch.equal(fs.since(0), fake_features(0, 300))  # a drafter resync still gets everything
    fs.add(100, fake_features(100, 104))  # a re-prefill recomputed from 100
    assert len(fs) == 104 and torch.equal(fs.since(97), fake_features(97, 104))
    fs.truncate(0)
    assert len(fs) == 0 and fs.since(0) is None


def test_batch_feature_views_are_not_kept_alive():
    batch = fake_features(0, 1000)
    fs = FeatureStore()
    fs.add(0, batch[:2])
    assert fs.since(0).untyped_storage().nbytes() < batch.untyped_storage().nbytes()


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
        RoundService(FakeVerifier(), None, FakeRelease(), groups=["a", "a"])
    assert RoundService(FakeVerifier(), None, FakeRelease(), RoundOptions(num_groups=3)).groups == [0, 1, 2]


class ScriptedGovernor:
    """Speculation on/off by round number (1-based), as a SpeculationGovernor would decide;
    ``observed``: whether each round it was shown speculated."""

    def __init__(self, on_rounds: Container[int]):
        self.on_rounds, self.rounds = on_rounds, 0
        self.observed: list[bool] = []

    def speculate(self, sessions: int, cap: int | None = None) -> bool:
        self.rounds += 1
        return self.rounds in self.on_rounds

    def next_speculates(self, sessions: int, cap: int | None = None) -> bool:
        return self.rounds + 1 in self.on_rounds

    def observe(self, sessions, speculated, seconds, tokens, draft_s=0.0) -> None:
        self.observed.append(speculated)

    def snapshot(self) -> dict:
        return {}


def test_rounds_that_will_not_draft_skip_features_and_catch_up_from_the_cache_when_drafting_resumes():
    """With speculation off (governor) the verify asks for no drafter features; the round before
    drafting resumes asks for them from the first position the session lacks, and the drafter
    gets every position exactly once, in order. Output is the target's own."""

    async def main():
        verifier, drafter = FakeVerifier(), FakeDrafter()
        svc, _ = make_service(
            verifier, drafter, speculation_governor=True, features=RecomputedFeatures(), speculation_token_budget=0
        )
        gov = ScriptedGovernor(on_rounds={1, 2, 3, 9, 10, 11, 12, 13, 14, 15, 16})
        svc.rounds.governors = {g: gov for g in svc.groups}
        s = make_session(0, max_new=40, k=2)
        toks, finish = await collect(svc, svc.submit(s))
        await svc.stop()
        return verifier, drafter, s, toks, finish

    verifier, drafter, s, toks, finish = asyncio.run(main())
    assert toks == reference(s.prompt, 40) and finish == "length"
    assert not verifier.errors and not drafter.errors
    calls = [reqs[0] for _, reqs in verifier.calls]
    wants = [q.want_features for q in calls]
    # rounds 1-3 draft (round 1 prefills); 4-7 neither draft nor fetch features; round 8 fetches
    # them (round 9 drafts) from where the session stopped holding them
    assert wants[:3] == [True] * 3 and wants[3:7] == [False] * 4 and wants[7] is True
    assert calls[7].features_from is not None and calls[7].features_from < calls[7].base
    assert not calls[7].drafts  # lagging features: the catch-up round does not draft
    assert calls[8].drafts  # round 9 drafts again
    received = drafter.received[s.id]
    assert received == list(range(len(received)))  # every position once, in order, no hole


def test_feature_lag_blocks_drafting_only_when_recomputing():
    s = make_session(0)
    s.tokens.extend([1, 2, 3])
    s.features.add(0, fake_features(0, 4))
    assert s.features_lag == len(s.tokens) - 1 - 4
    assert round_steps.draft_requests([s], None, current_features=True) == []
    assert len(round_steps.draft_requests([s], None, current_features=False)) == 1


def test_multi_step_rounds_commit_several_tokens_per_verify_call_and_stop_where_asked():
    async def main(stop):
        verifier = FakeVerifier()
        svc, _ = make_service(verifier, None, decode_steps=4)
        s = make_session(0, max_new=22)
        s.stop_token_ids = frozenset(stop)
        toks, finish = await collect(svc, svc.submit(s))
        await svc.stop()
        return verifier, s, toks, finish, svc

    verifier, s, toks, finish, svc = asyncio.run(main(()))
    assert toks == reference(s.prompt, 22) and finish == "length" and not verifier.errors
    steps = [q.decode_steps for _, reqs in verifier.calls for q in reqs]
    assert steps == [1, 4, 4, 4, 4, 4, 1]  # the prefill round alone; never past max_new (1+5*4+1 = 22)
    assert svc.stats.reprefills == 0  # several tokens of a multi-step round are not a re-prefill
    stop = reference(s.prompt, 22)[9]
    verifier, s, toks, finish, svc = asyncio.run(main((stop,)))
    assert toks == reference(s.prompt, 22)[: reference(s.prompt, 22).index(stop) + 1] and finish == "stop"


def test_multi_step_is_not_used_while_drafting_or_with_a_queue():
    async def main():
        verifier, drafter = FakeVerifier(), FakeDrafter()
        svc, _ = make_service(verifier, drafter, decode_steps=4)
        outs = await asyncio.gather(*(collect(svc, svc.submit(make_session(i))) for i in range(3)))
        await svc.stop()
        return verifier, outs

    verifier, outs = asyncio.run(main())
    for i, (toks, _) in enumerate(outs):
        assert toks == reference(make_session(i).prompt, 20)
    drafting_calls = [reqs for _, reqs in verifier.calls if any(q.drafts for q in reqs)]
    assert drafting_calls and all(q.decode_steps == 1 for reqs in drafting_calls for q in reqs)


class CuttableVerifier(FakeVerifier):
    """Honours ``cut``: a call in flight when it arrives decodes a single step."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.cut_asked: list = []
        self.cut_short = 0  # requests for several steps that decoded one
        self._cut = False

    async def cut(self, group) -> None:
        self.cut_asked.append(group)
        self._cut = True

    def _one(self, q):
        if self._cut and q.decode_steps > 1:
            self.cut_short += 1
            q = dataclasses.replace(q, decode_steps=1)
        return super()._one(q)

    async def __call__(self, group, reqs):
        try:
            return await super().__call__(group, reqs)
        finally:
            self._cut = False


def test_a_newcomer_cuts_the_running_multi_step_call_short():
    """A session admitted while its group's multi-step verify call runs asks the verifier, once,
    to end that call's steps early: its prompt goes out in the next call instead of after all
    the steps. Nobody's tokens change."""

    async def main():
        verifier = CuttableVerifier(delay=0.02)
        svc, _ = make_service(verifier, None, decode_steps=4, cut=verifier.cut)
        first = asyncio.ensure_future(collect(svc, svc.submit(make_session(0, max_new=40))))
        while len(verifier.calls) < 3:  # the prompt, then multi-step calls
            await asyncio.sleep(0.005)
        second = collect(svc, svc.submit(make_session(1, max_new=12)))
        outs = await asyncio.gather(first, second)
        await svc.stop()
        return verifier, svc, outs

    verifier, svc, outs = asyncio.run(main())
    assert [o[0] for o in outs] == [reference(make_session(0).prompt, 40), reference(make_session(1).prompt, 12)]
    assert verifier.cut_asked == [svc.groups[0]] and svc.stats.steps_cut == 1
    assert verifier.cut_short == 1  # the call running when s1 came: four steps asked, one decoded


# ---------------------------------------------------------------------- lookahead (verify-call pipelining)
class OverlapVerifier(FakeVerifier):
    """Counts how many verify calls were in flight at once."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.in_flight = self.most_in_flight = 0

    async def __call__(self, group, reqs):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await super().__call__(group, reqs)
        finally:
            self.in_flight -= 1


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_lookahead_calls_overlap_and_keep_every_token_stop_and_length(decode_steps):
    """With lookahead, draft-free rounds send the next verify call before the current one returns
    (two calls in flight), continuing from the predicted lengths with no tokens sent; every session
    still gets exactly the reference tokens, ends at its stop token or length, and the results of a
    session that stopped before the end of the previous call are dropped, not streamed."""
    ss = [make_session(i, max_new=9 + 5 * i) for i in range(4)]
    stop = reference(ss[1].prompt, ss[1].max_new_tokens)[6]
    ss[1].stop_token_ids = frozenset({stop})

    async def main():
        verifier = OverlapVerifier(delay=0.002, reverse=True)
        svc, _ = make_service(
            verifier,
            None,
            lookahead=True,
            decode_steps=decode_steps,
            multi_step_max_sessions=64,
            speculation_token_budget=0,
        )
        outs = await run_all(svc, ss)
        return verifier, outs, svc.stats

    verifier, outs, stats = asyncio.run(main())
    for s, (toks, finish) in zip(ss, outs):
        ref = reference(s.prompt, s.max_new_tokens)
        if s.stop_token_ids:
            assert toks == ref[: ref.index(stop) + 1] and finish == "stop"
        else:
            assert toks == ref and finish == "length"
    assert verifier.errors == [] and verifier.most_in_flight == 2  # never more than one call ahead
    assert stats.lookahead_calls > 3 and stats.lookahead_failures == 0 and stats.completed == 4
    ahead = [q for _, reqs in verifier.calls for q in reqs if q.base > 0 and not q.tokens]
    assert ahead and all(not q.want_features and not q.drafts for q in ahead)
    assert stats.lookahead_discarded > 0  # the stopped session's row in the call already sent


def test_lookahead_admits_newcomers_and_survives_a_failed_call():
    """A session arriving while calls are sent ahead is admitted (its prefill round is not sent
    ahead); a lookahead call that fails makes its sessions resend their tokens, nothing lost or
    repeated."""

    async def main():
        verifier = OverlapVerifier(delay=0.002)
        verifier.fail_on[4] = ConnectionError("verifier replica died")
        svc, _ = make_service(verifier, None, lookahead=True, speculation_token_budget=0)
        first = [svc.submit(make_session(i, max_new=30)) for i in range(2)]
        tasks = [asyncio.ensure_future(collect(svc, t)) for t in first]
        await asyncio.sleep(0.02)
        late = make_session(7, max_new=12)
        outs = await asyncio.gather(*tasks, collect(svc, svc.submit(late)))
        await svc.stop()
        return verifier, outs, svc.stats

    verifier, outs, stats = asyncio.run(main())
    assert [o[0] for o in outs] == [reference(make_session(i, max_new=30).prompt, 30) for i in range(2)] + [
        reference(make_session(7).prompt, 12)
    ]
    assert stats.lookahead_calls > 0 and stats.lookahead_failures + stats.verify_retries >= 1
    assert requests_of(verifier, "s7")[0].base == 0 and verifier.errors == []


def test_lookahead_is_off_by_default_and_while_drafting():
    async def main(**kw):
        verifier = OverlapVerifier(delay=0.001)
        svc, _ = make_service(verifier, FakeDrafter(), **kw)
        outs = await asyncio.gather(*(collect(svc, svc.submit(make_session(i))) for i in range(3)))
        await svc.stop()
        return verifier, outs, svc.stats

    for kw in ({}, {"lookahead": True}):  # off; on, but every round drafts
        verifier, outs, stats = asyncio.run(main(**kw))
        assert [o[0] for o in outs] == [reference(make_session(i).prompt, 20) for i in range(3)]
        assert stats.lookahead_calls == 0 and verifier.most_in_flight == 1


# ---------------------------------------------------------------------- prompt lookup in the service
class SpyLookup(LookupTable):
    """A real lookup table that logs the drafts it gives, interleaved with the drafter's calls."""

    def __init__(self, log, **kw):
        super().__init__(**kw)
        self.log = log

    def draft_match(self, session_id, tokens, num_drafts, keep=frozenset()):
        drafts, match = super().draft_match(session_id, tokens, num_drafts, keep)
        if drafts:
            self.log.append(("lookup", session_id))
        return drafts, match


class LoggingDrafter(FakeDrafter):
    def __init__(self, log, **kw):
        super().__init__(**kw)
        self.log = log

    async def __call__(self, group, reqs):
        self.log.append(("drafter", {q.session_id for q in reqs if q.num_drafts}))
        return await super().__call__(group, reqs)


class LoggingVerifier(FakeVerifier):
    def __init__(self, log, **kw):
        super().__init__(**kw)
        self.log = log

    async def __call__(self, group, reqs):
        self.log.append(("verify", None))  # the end of a round's drafting
        return await super().__call__(group, reqs)


def repetitive_session(i: int, needs_features: bool) -> Session:
    prompt = [(i * 11 + j) % VOCAB for j in range(4)] * 2  # its last tokens occurred before
    return Session(
        f"s{i}", prompt, 16, num_speculative_tokens=3, max_model_len=256, drafter_needs_features=needs_features
    )


def test_prompt_lookup_drafts_in_the_service_without_a_drafter_pool():
    log = []

    async def main():
        verifier = FakeVerifier()
        svc, _ = make_service(verifier, None, lookup=SpyLookup(log, min_n=2, max_n=4))
        ss = [repetitive_session(i, needs_features=False) for i in range(3)]
        outs = await run_all(svc, ss)
        return verifier, svc, ss, outs

    verifier, svc, ss, outs = asyncio.run(main())
    assert [o[0] for o in outs] == [reference(s.prompt, 16) for s in ss]
    first = [q for q in verifier.calls[0][1]]
    assert all(q.drafts == q.tokens[4:7] for q in first)  # the first round already drafts the repeat
    assert all(not q.want_features for _, reqs in verifier.calls for q in reqs)  # lookup needs none
    assert svc.lookup.sessions == {}  # finished sessions were dropped from the table


def test_lookup_drafted_sessions_go_on_decoding_in_the_same_call():
    """Multi-step with prompt lookup: a session whose lookup draft is verified keeps decoding in the
    same call up to decode_steps tokens (no features to keep up), and the text is unchanged."""

    async def main():
        verifier = FakeVerifier()
        # single-token matches: drafts in later rounds too (mostly wrong ones: corrections then go on)
        svc, _ = make_service(verifier, None, lookup=SpyLookup([], min_n=1, max_n=3), decode_steps=4)
        ss = [
            Session(
                f"s{i}",
                [(i * 11 + j) % VOCAB for j in range(4)] * 2,
                40,
                num_speculative_tokens=3,
                max_model_len=256,
                drafter_needs_features=False,
            )
            for i in range(2)
        ]
        outs = await run_all(svc, ss)
        return verifier, ss, outs

    verifier, ss, outs = asyncio.run(main())
    assert [o[0] for o in outs] == [reference(s.prompt, 40) for s in ss]
    multi = [q for _, reqs in verifier.calls for q in reqs if q.drafts and q.decode_steps == 4]
    assert multi and all(not q.want_features for q in multi)
    assert not verifier.errors


def test_hybrid_sends_the_drafter_only_the_sessions_lookup_did_not_draft():
    log = []

    async def main():
        verifier, drafter = LoggingVerifier(log), LoggingDrafter(log, wrong_every=2)
        svc, _ = make_service(verifier, drafter, lookup=SpyLookup(log, min_n=1, max_n=3))
        ss = [repetitive_session(i, needs_features=True) for i in range(4)]
        outs = await run_all(svc, ss)
        return verifier, drafter, ss, outs

    verifier, drafter, ss, outs = asyncio.run(main())
    assert [o[0] for o in outs] == [reference(s.prompt, 16) for s in ss]
    assert not verifier.errors and not drafter.errors
    assert {k for k, _ in log} == {"lookup", "drafter", "verify"}  # both drafted
    matched = set()
    for kind, what in log:
        if kind == "lookup":
            matched.add(what)
        elif kind == "drafter":
            assert not (what & matched)  # a session drafted by lookup is not drafted again that round
        else:
            matched = set()
    # the drafter caught up on skipped rounds through the deltas: every feature once, in order
    for s in ss:
        pos = drafter.received[s.id]
        assert pos == sorted(set(pos)) and pos[0] == 0
