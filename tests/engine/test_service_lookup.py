"""Prompt lookup in RoundService, with the awaiting stub pools (tests/support/service_stubs.py):
lookup drafts without a drafter pool, lookup-drafted sessions go on decoding in the same call, and
the hybrid sends the drafter only the sessions lookup did not draft."""

import asyncio

from moa_serve.drafter.lookup import LookupTable
from moa_serve.engine.session import Session
from tests.support.service_stubs import VOCAB, FakeDrafter, FakeVerifier, make_service, reference, run_all


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


def serve(verifier, drafter, lookup: LookupTable, sessions: list[Session], **kw):
    """Runs the sessions through a RoundService with this lookup table; returns it and the outputs."""

    async def main():
        svc, _ = make_service(verifier, drafter, lookup=lookup, **kw)
        return svc, await run_all(svc, sessions)

    return asyncio.run(main())


def test_prompt_lookup_drafts_in_the_service_without_a_drafter_pool():
    verifier = FakeVerifier()
    ss = [repetitive_session(i, needs_features=False) for i in range(3)]
    svc, outs = serve(verifier, None, SpyLookup([], min_n=2, max_n=4), ss)
    assert [o[0] for o in outs] == [reference(s.prompt, 16) for s in ss]
    first = [q for q in verifier.calls[0][1]]
    assert all(q.drafts == q.tokens[4:7] for q in first)  # the first round already drafts the repeat
    assert all(not q.want_features for _, reqs in verifier.calls for q in reqs)  # lookup needs none
    assert svc.lookup.sessions == {}  # finished sessions were dropped from the table


def test_lookup_drafted_sessions_go_on_decoding_in_the_same_call():
    """Multi-step with prompt lookup: a session whose lookup draft is verified keeps decoding in the
    same call up to decode_steps tokens (no features to keep up), and the text is unchanged."""

    verifier = FakeVerifier()
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
    # single-token matches: drafts in later rounds too (mostly wrong ones: corrections then go on)
    _, outs = serve(verifier, None, SpyLookup([], min_n=1, max_n=3), ss, decode_steps=4)
    assert [o[0] for o in outs] == [reference(s.prompt, 40) for s in ss]
    multi = [q for _, reqs in verifier.calls for q in reqs if q.drafts and q.decode_steps == 4]
    assert multi and all(not q.want_features for q in multi)
    assert not verifier.errors


def test_hybrid_sends_the_drafter_only_the_sessions_lookup_did_not_draft():
    log = []
    verifier, drafter = LoggingVerifier(log), LoggingDrafter(log, wrong_every=2)
    ss = [repetitive_session(i, needs_features=True) for i in range(4)]
    _, outs = serve(verifier, drafter, SpyLookup(log, min_n=1, max_n=3), ss)
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
