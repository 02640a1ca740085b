"""StepLoop: one thread drives a step-wise engine for requests from any thread (stub engine)."""

import threading
import time

import pytest

from moa_serve.protocol import Update
from moa_serve.verifier.vllm.step_loop import StepLoop


class StubEngine:
    """Emits one token per step per request (its position), finishing at max_new_tokens."""

    def __init__(self, fail_at_step: int | None = None):
        self.requests: dict[str, list] = {}  # id -> [prompt, produced, max]
        self.aborted: list[str] = []
        self.steps = 0
        self.fail_at_step = fail_at_step
        self.threads: set[str] = set()

    def add(self, prompt, max_new_tokens, sampling, ignore_eos, request_id=None):
        self.threads.add(threading.current_thread().name)
        if not prompt:
            raise ValueError("empty prompt")
        self.requests[request_id] = [prompt, 0, max_new_tokens]
        return request_id

    def step(self):
        self.threads.add(threading.current_thread().name)
        self.steps += 1
        if self.fail_at_step == self.steps:
            raise RuntimeError("boom")
        moved = []
        for rid, r in list(self.requests.items()):
            r[1] += 1
            done = r[1] >= r[2]
            moved.append((rid, [100 + r[1]], "length" if done else None))
            if done:
                del self.requests[rid]
        time.sleep(0.002)
        return moved

    def abort(self, ids):
        for rid in ids:
            self.aborted.append(rid)
            self.requests.pop(rid, None)

    def has_unfinished(self):
        return bool(self.requests)

    def request_counts(self, rid):
        return (4, 2)


class Collector:
    def __init__(self):
        self.updates: list[Update] = []
        self.done = threading.Event()

    def __call__(self, u: Update):
        self.updates.append(u)
        if u.finish_reason is not None:
            self.done.set()

    @property
    def tokens(self):
        return [t for u in self.updates for t in u.tokens]


@pytest.fixture
def engine():
    return StubEngine()


def run(loop, rid, prompt, n):
    c = Collector()
    loop.submit(rid, prompt, n, c)
    return c


def test_requests_from_other_threads_stream_their_tokens_in_order(engine):
    loop = StepLoop(engine).start()
    try:
        a, b = run(loop, "a", [1, 2], 5), run(loop, "b", [3], 3)
        assert a.done.wait(5) and b.done.wait(5)
        assert a.tokens == [101, 102, 103, 104, 105] and b.tokens == [101, 102, 103]
        assert a.updates[-1].finish_reason == "length" and all(u.finish_reason is None for u in a.updates[:-1])
        assert a.updates[-1].drafted == 4 and a.updates[-1].accepted == 2
        assert engine.threads == {"engine-steps"}  # the engine is touched by one thread only
        assert loop.running == 0 and loop.stats.finished == 2
    finally:
        loop.stop()


def test_abort_stops_a_running_request_and_tells_its_sink(engine):
    loop = StepLoop(engine).start()
    try:
        c = run(loop, "long", [1], 10_000)
        deadline = time.time() + 5
        while not c.updates and time.time() < deadline:
            time.sleep(0.005)
        loop.abort("long")
        assert c.done.wait(5)
        assert c.updates[-1].finish_reason == "abort" and "long" in engine.aborted
        assert loop.running == 0 and loop.stats.aborted == 1
        loop.abort("unknown")  # nothing happens
        assert run(loop, "next", [1], 2).done.wait(5)
    finally:
        loop.stop()


def test_a_request_the_engine_refuses_fails_alone(engine):
    loop = StepLoop(engine).start()
    try:
        bad, good = run(loop, "bad", [], 3), run(loop, "good", [1], 3)
        assert bad.done.wait(5) and good.done.wait(5)
        assert bad.updates == [Update([], "error: ValueError: empty prompt")]
        assert good.tokens == [101, 102, 103]
        assert loop.stats.rejected == 1
    finally:
        loop.stop()


def test_a_failing_step_errors_the_requests_in_flight_and_the_loop_goes_on():
    engine = StubEngine(fail_at_step=2)
    loop = StepLoop(engine).start()
    try:
        c = run(loop, "x", [1], 5)
        assert c.done.wait(5)
        assert c.updates[-1].finish_reason == "error: RuntimeError: boom" and "x" in engine.aborted
        later = run(loop, "y", [1], 2)
        assert later.done.wait(5) and later.tokens == [101, 102]
        assert loop.stats.step_failures == 1
    finally:
        loop.stop()


def test_stop_aborts_what_is_in_flight_and_refuses_new_requests(engine):
    loop = StepLoop(engine).start()
    c = run(loop, "long", [1], 10_000)
    time.sleep(0.05)
    loop.stop()
    assert c.done.is_set() and c.updates[-1].finish_reason == "abort"
    with pytest.raises(RuntimeError):
        loop.submit("z", [1], 1, Collector())
