"""RoundService (the router's core) without Ray, over the real in-process verifier and drafter:
batching, drafter failure, queue bound, abort. (Concurrency defects with awaiting stub pools:
``test_service_*.py`` over tests/support/service_stubs.py.)"""

import asyncio

import pytest

from moa_serve.engine.events import QueueFullError
from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.engine.options import RoundOptions
from moa_serve.engine.pool_calls import Pools
from moa_serve.engine.round_service import RoundService
from moa_serve.engine.session import Session


@pytest.fixture(scope="module")
def engine(stories_path, stories_drafter):
    return SpeculativeEngine.load(str(stories_path), str(stories_drafter), "float32", max_sessions=16)


def make_service(engine, *, drafter_fails_on=(), **kw):
    calls = {"draft": 0}

    async def verify(group, reqs):
        return engine.verifier.verify(reqs)[::-1]  # results are matched by session id, not position

    async def draft(group, reqs):
        calls["draft"] += 1
        if calls["draft"] in drafter_fails_on:
            raise ConnectionError("drafter replica died")
        return engine.proposer.propose(reqs)

    async def release(group, ids):
        for i in ids:
            engine.release(i)

    kw.setdefault("speculation_governor", False)  # these tests follow every round's drafts
    kw.setdefault("decode_steps", 1)  # one token per draft-free round, as these tests count them
    groups = kw.pop("groups", None)
    return RoundService(Pools(verify, draft, release), RoundOptions(**kw), groups=groups)


def sessions(engine, n, max_new=20):
    prompts = ["Once upon a time", "The little dog", "Lily went to the park and", "One day", "The sun was"]
    return [
        Session(
            f"t{i}-{id(engine)}",
            engine.tokenizer.encode(prompts[i % len(prompts)]),
            max_new,
            num_speculative_tokens=3,
            max_model_len=engine.max_model_len,
        )
        for i in range(n)
    ]


async def collect(service, tracked):
    toks = []
    async for ev in service.stream(tracked):
        toks += ev.tokens
    return toks


def reference(engine, ss):
    return [
        r.token_ids for r in engine.generate([s.prompt for s in ss], ss[0].max_new_tokens, num_speculative_tokens=3)
    ]


def test_batched_rounds_with_a_failing_drafter_keep_every_token(engine):
    ss = sessions(engine, 5)
    ref = reference(engine, sessions(engine, 5))

    async def main():
        svc = make_service(
            engine,
            drafter_fails_on={2, 3, 7},
            groups=["r/0", "r/1"],
            max_sessions_per_round=4,
            speculation_token_budget=0,
        )
        outs = await asyncio.gather(*(collect(svc, svc.submit(s)) for s in ss))
        await svc.stop()
        return outs, svc.stats

    outs, stats = asyncio.run(main())
    assert outs == ref
    assert stats.draft_fallbacks == 3 and stats.multi_session_rounds > 0
    assert stats.completed == 5


def test_queue_bound_and_abort(engine):
    async def main():
        svc = make_service(engine, num_groups=1, max_sessions_per_round=1, max_queued=1)
        ss = sessions(engine, 3, max_new=40)
        first = svc.submit(ss[0])
        second = svc.submit(ss[1])  # waits in the queue
        with pytest.raises(QueueFullError):
            svc.submit(ss[2])
        svc.abort(second)  # leaving the queue frees its place
        assert svc.queue_depth == 0
        toks = await collect(svc, first)
        await svc.stop()
        return toks, svc.stats

    toks, stats = asyncio.run(main())
    assert len(toks) == 40 and stats.aborted == 1
