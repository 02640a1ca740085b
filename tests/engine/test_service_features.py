"""The drafter's features in RoundService, with the awaiting stub pools (tests/support/service_stubs.py):
the feature store sends only the tail and keeps no batch alive, rounds that will not draft skip the
features and catch up from the cache when drafting resumes, and a feature lag blocks drafting only
when the features are recomputed."""

import asyncio

import torch

from moa_serve.engine import round_loop
from moa_serve.engine.feature_policy import RecomputedFeatures
from moa_serve.engine.session import FeatureStore
from tests.support.service_stubs import (
    FakeDrafter,
    FakeVerifier,
    ScriptedGovernor,
    collect,
    fake_features,
    make_service,
    make_session,
    reference,
)


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
    assert round_loop.draft_requests([s], None, current_features=True) == []
    assert len(round_loop.draft_requests([s], None, current_features=False)) == 1
