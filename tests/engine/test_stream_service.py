"""StreamService: the Router's service for backend vllm (one verifier stream per session), with
stub streams: commits and events, stop conditions, errors, admission bounds, aborts."""

import asyncio

import pytest

from moa_serve.engine.events import QueueFullError
from moa_serve.engine.session import Session
from moa_serve.engine.stream_service import StreamService
from moa_serve.protocol import Update

STOP = 7


class Streams:
    """A stub verifier: each session's stream yields the scripted updates, then waits forever
    (a session must end on its own finish, not on the stream running dry)."""

    def __init__(self, script=None, block=False):
        self.script = script or (
            lambda s: [Update([1], None, 0, 0), Update([2, 3], None, 4, 1), Update([4], "length", 8, 3)]
        )
        self.block = block  # streams wait for release() before their first update
        self.release = asyncio.Event()
        self.opened: list[str] = []
        self.closed: list[str] = []

    async def __call__(self, session):
        self.opened.append(session.id)
        try:
            if self.block:
                await self.release.wait()
            for u in self.script(session):
                await asyncio.sleep(0)
                yield u
            await asyncio.Event().wait()
        finally:
            self.closed.append(session.id)


def session(sid, n=4, stops=frozenset({STOP})):
    return Session(sid, [5, 6], n, num_speculative_tokens=4, stop_token_ids=stops)


async def collect(service, tracked):
    return [ev async for ev in service.stream(tracked)]


def test_updates_become_commits_and_events():
    async def main():
        streams = Streams()
        service = StreamService(streams, max_sessions=4)
        t = service.submit(session("a"))
        events = await collect(service, t)
        assert [e.tokens for e in events] == [[1], [2, 3], [4]]
        assert events[-1].finish_reason == "length" and t.session.generated == [1, 2, 3, 4]
        assert t.session.stats() == {
            "rounds": 3,
            "drafted_tokens": 8,
            "accepted_tokens": 3,
            "mean_accepted_length": 1.3333,
        }
        await asyncio.sleep(0)
        assert streams.closed == ["a"] and service.active_sessions == 0
        s = service.stats.as_dict()
        assert (s["completed"], s["updates"], s["tokens"], s["drafted"], s["accepted"]) == (1, 3, 4, 8, 3)

    asyncio.run(main())


def test_a_stop_token_ends_the_session_here_and_closes_its_stream():
    async def main():
        streams = Streams(lambda s: [Update([1, STOP, 9], None), Update([10], None)])
        service = StreamService(streams, max_sessions=4)
        t = service.submit(session("a", n=10))
        events = await collect(service, t)
        assert events[-1].tokens == [1, STOP] and events[-1].finish_reason == "stop"
        await asyncio.sleep(0)
        assert streams.closed == ["a"]

    asyncio.run(main())


def test_an_error_update_errors_only_its_session():
    async def main():
        streams = Streams(
            lambda s: (
                [Update([1]), Update([], "error: RuntimeError: engine died")]
                if s.id == "bad"
                else [Update([1, 2, 3, 4], "length")]
            )
        )
        service = StreamService(streams, max_sessions=4)
        bad, good = service.submit(session("bad")), service.submit(session("good"))
        bad_events, good_events = await asyncio.gather(collect(service, bad), collect(service, good))
        assert bad_events[-1].finish_reason == "error: RuntimeError: engine died"
        assert bad.session.finish_reason == "error"
        assert good_events[-1].finish_reason == "length" and good.session.generated == [1, 2, 3, 4]
        assert service.stats.errors == 1

    asyncio.run(main())


def test_a_lost_stream_resumes_from_the_committed_tokens():
    async def main():
        seen = []

        async def flaky(s):
            seen.append(list(s.tokens))
            if len(seen) == 1:
                yield Update([1, 2], None, 4, 1)
                raise ConnectionError("replica died")
            yield Update([3], None, 4, 3)  # a new stream counts from its own start
            yield Update([4], "length", 4, 3)

        service = StreamService(flaky, max_sessions=1, retry_backoff_s=0)
        t = service.submit(session("a"))
        events = await asyncio.wait_for(collect(service, t), 5)
        assert seen == [[5, 6], [5, 6, 1, 2]]
        assert [e.tokens for e in events] == [[1, 2], [3], [4]] and events[-1].finish_reason == "length"
        assert t.session.generated == [1, 2, 3, 4] and t.session.stats()["drafted_tokens"] == 8
        assert service.stats.stream_retries == 1 and service.stats.errors == 0

    asyncio.run(main())


def test_a_stream_that_keeps_ending_early_is_an_error_not_a_hang():
    async def main():
        async def short(s):
            yield Update([1])

        service = StreamService(short, max_sessions=1, stream_retries=2, retry_backoff_s=0)
        t = service.submit(session("a"))
        events = await asyncio.wait_for(collect(service, t), 5)
        assert events[-1].finish_reason.startswith("error: ConnectionError: the verifier's stream ended")
        assert t.session.generated == [1, 1, 1] and service.stats.stream_retries == 2

    asyncio.run(main())


def test_admission_is_bounded_and_an_abort_admits_the_next():
    async def main():
        streams = Streams(block=True)
        service = StreamService(streams, max_sessions=2, max_queued=1)
        a, b, c = (service.submit(session(x)) for x in "abc")
        with pytest.raises(QueueFullError):
            service.submit(session("d"))
        await asyncio.sleep(0)
        assert service.active_sessions == 2 and service.queue_depth == 1 and streams.opened == ["a", "b"]
        service.abort(a)
        await asyncio.sleep(0.01)
        assert a.session.finish_reason == "abort" and "a" in streams.closed
        assert streams.opened == ["a", "b", "c"] and service.queue_depth == 0
        streams.release.set()
        done = await asyncio.gather(collect(service, b), collect(service, c))
        assert all(events[-1].finish_reason == "length" for events in done)
        assert (await collect(service, a))[-1].finish_reason == "abort"

    asyncio.run(main())


def test_a_consumer_that_goes_away_aborts_its_session():
    async def main():
        streams = Streams(block=True)
        service = StreamService(streams, max_sessions=2)
        t = service.submit(session("a"))
        gen = service.stream(t)
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await gen.aclose()
        await asyncio.sleep(0.01)
        assert t.session.finish_reason == "abort" and streams.closed == ["a"] and service.active_sessions == 0

    asyncio.run(main())


def test_client_server_sessions_are_refused():
    async def main():
        service = StreamService(Streams(), max_sessions=1)
        with pytest.raises(ValueError, match="backend: torch"):
            service.submit(session("a"), remote=True)

    asyncio.run(main())
