"""Admission by expected wait (``moa_serve/engine/admission.py``): the measured time per round and
tokens per round, the seats played forward for the requests queued ahead, and ``StreamService``
refusing at once (with that wait as Retry-After) a request that would wait longer than
``max_queue_wait_s``, without Ray."""

import asyncio

import pytest

from moa_serve.engine.admission import RoundClock, expected_wait_s, next_seat_s, retry_after_s
from moa_serve.engine.events import QueueFullError
from moa_serve.engine.session import Session
from moa_serve.engine.stream_service import StreamService
from moa_serve.protocol import Update


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def timed(token_s: float, running: int = 1, tokens: int = 1) -> RoundClock:
    """A clock that measured rounds of ``tokens`` tokens per session at ``token_s`` seconds per
    token while ``running`` sessions held seats."""
    clock = Clock()
    rc = RoundClock(clock=clock)
    rc.started("s")
    clock.t += 30.0  # the first round (queue and prefill) is not timed
    rc.committed("s", 50, running)
    for _ in range(40):
        clock.t += token_s * tokens
        rc.committed("s", tokens, running)
    return rc


def test_no_estimate_before_a_round_was_timed_and_none_needed_while_a_seat_is_free():
    rc = RoundClock()
    assert expected_wait_s(rc, [10], [], 0) is None
    assert expected_wait_s(rc, [10, 10], [5, 5], 3) == 0.0


def test_the_time_per_token_grows_with_the_seats_taken_from_where_it_was_measured():
    rc = timed(0.1, running=2, tokens=4)
    assert rc.seconds_per_token(1) == pytest.approx(0.1) and rc.seconds_per_token(2) == pytest.approx(0.1)
    assert rc.seconds_per_token(8) == pytest.approx(0.4)  # a burst: four times the sessions per round
    busy = timed(0.4, running=8)
    assert busy.seconds_per_token(8) == pytest.approx(0.4) and busy.seconds_per_token(2) == pytest.approx(0.4)


def test_the_seats_are_played_forward_for_the_requests_queued_ahead():
    rc = timed(0.5, running=2)  # 0.5 s per token at two sessions
    # two seats, their sessions may generate 4 and 10 more tokens; nobody ahead: the first frees after 2 s
    assert expected_wait_s(rc, [4, 10], [], 0) == pytest.approx(2.0)
    # one request of 6 tokens ahead takes that seat (2 s + 3 s); the newcomer gets the other at 5 s
    assert expected_wait_s(rc, [4, 10], [6], 0) == pytest.approx(5.0)
    # a free seat goes to the request ahead; the newcomer waits for the first running session, at the
    # pace of three seats taken (0.75 s per token)
    assert expected_wait_s(rc, [4, 10], [6], 1) == pytest.approx(3.0)
    # a refused request may find room when the first seat frees: its Retry-After
    assert next_seat_s(rc, [4, 10]) == pytest.approx(2.0) and next_seat_s(rc, []) is None
    assert retry_after_s(0.2) == 1 and retry_after_s(4.01) == 5


def test_the_stream_service_refuses_at_once_a_request_that_would_wait_too_long():
    async def main():
        gate = asyncio.Event()

        async def streams(session):
            for i in range(session.max_new_tokens):
                await asyncio.sleep(0.01)  # a round every 10 ms, one token each
                yield Update([1], "length" if i == session.max_new_tokens - 1 else None, 0, 0)
                if i >= 4:  # a few timed rounds, then the sessions hold their seats
                    await gate.wait()
            await asyncio.Event().wait()

        service = StreamService(streams, max_sessions=2, max_queued=100, max_queue_wait_s=0.5)
        running = [service.submit(Session(f"r{i}", [5], 100)) for i in range(2)]
        await asyncio.sleep(0.1)  # their first rounds are timed; then they hold their seats
        refused = []
        queued = []
        for i in range(5):
            try:
                queued.append(service.submit(Session(f"q{i}", [5], 100)))
            except QueueFullError as exc:
                refused.append(exc)
        assert not queued and len(refused) == 5  # ~99 rounds of 10 ms ahead: ~1 s > 0.5 s
        assert refused[-1].retry_after_s == 1  # at most max_queue_wait_s, whole seconds
        assert "max_queue_wait_s" in str(refused[0])
        assert service.stats.refused_by_wait == 5
        gate.set()
        for t in running:  # the admitted are served
            assert [ev async for ev in service.stream(t)][-1].finish_reason == "length"

    asyncio.run(main())


def test_an_admitted_request_is_served_and_without_max_queue_wait_s_only_the_queue_bounds_admission():
    async def main():
        async def streams(session):
            for i in range(session.max_new_tokens):
                await asyncio.sleep(0.005)
                yield Update([1], "length" if i == session.max_new_tokens - 1 else None, 0, 0)
            await asyncio.Event().wait()

        service = StreamService(streams, max_sessions=1, max_queued=3)
        held = [service.submit(Session(f"s{i}", [5], 50)) for i in range(4)]
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFullError) as refused:
            service.submit(Session("full", [5], 1))
        assert refused.value.retry_after_s is None
        assert service.stats.refused_by_wait == 0
        for t in held:
            assert [ev async for ev in service.stream(t)][-1].finish_reason == "length"

    asyncio.run(main())


def test_before_any_round_was_timed_a_request_that_finds_every_seat_taken_is_refused():
    async def main():
        async def streams(session):
            await asyncio.Event().wait()
            yield

        service = StreamService(streams, max_sessions=1, max_queued=10, max_queue_wait_s=5.0)
        service.submit(Session("seated", [5], 10))
        with pytest.raises(QueueFullError) as refused:
            service.submit(Session("unknown wait", [5], 10))
        assert refused.value.retry_after_s is None and service.queue_depth == 0  # the configured Retry-After

    asyncio.run(main())
