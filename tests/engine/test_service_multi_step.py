"""Several tokens per verify call in RoundService, with the awaiting stub pools
(tests/support/service_stubs.py): multi-step rounds and where they stop, a newcomer cutting the
running multi-step call short, and lookahead (the next verify call sent before the current returns)."""

import asyncio
import dataclasses

import pytest

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
