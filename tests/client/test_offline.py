"""How fast the client-server client goes offline: the call deadline rule (a multiple of the
measured p99 round trip, floored, capped, or ``--timeout``), the total time of a call's attempts,
and a link cut through ``moa netem`` (blackhole and reset) while generating: the device writes
offline soon after the cut, completes the generation, and after the link is restored the offline
tail is verified and corrected."""

import contextlib
import socket
import threading
import time

import pytest

from moa_serve.client import DeviceDrafter, LinkPolicy, RemoteGenerator, Transport, Unreachable
from moa_serve.client.deadline import CallDeadline, percentile
from moa_serve.measure.netem import netem_proxy
from tests.support.cs_harness import OracleProposer

PROMPT = "Lily went to the park and"
MAX_NEW = 48
CUT_AFTER_TOKENS = 10
OFFLINE_BOUND_S = 30.0  # generous: a blackholed call used to be waited on for 3 x 60 s
OUTAGE_S = 1.5  # how long the link stays down after the first offline token


# ---------------------------------------------------------------------- the deadline rule
def test_percentile_is_nearest_rank():
    assert percentile([3.0], 99) == 3.0
    assert percentile(range(1, 101), 99) == 99
    assert percentile(range(1, 101), 50) == 50
    assert percentile([0.1] * 31 + [0.9], 99) == 0.9


def test_the_deadline_is_a_multiple_of_the_p99_round_trip_floored_and_capped():
    d = CallDeadline(multiple=4.0, floor_s=2.0, cap_s=30.0, first_s=15.0, window=32)
    assert d.seconds() == 15.0 and d.prefill_seconds() == 15.0  # nothing measured yet
    for _ in range(32):
        d.observe(0.1)
    assert d.seconds() == 2.0  # 4 x 0.1 s is below the floor
    assert d.prefill_seconds() == 15.0  # a prefill waits at least the first deadline
    d.observe(1.0)  # one slow call among the last 32 is the p99
    assert d.seconds() == pytest.approx(4.0) and d.p99_s == 1.0
    for _ in range(31):
        d.observe(0.1)
    assert d.seconds() == pytest.approx(4.0)  # still in the window
    d.observe(0.1)
    assert d.seconds() == 2.0  # out of the window: back to the floor
    d.observe(20.0)
    assert d.seconds() == 30.0 and d.prefill_seconds() == 30.0  # capped
    assert "p99 20000 ms" in d.describe()


def test_a_fixed_deadline_overrides_the_rule():
    d = CallDeadline(fixed_s=60.0)
    for _ in range(10):
        d.observe(0.05)
    assert d.seconds() == 60.0 and d.prefill_seconds() == 60.0 and d.describe() == "fixed 60 s"
    assert Transport("http://127.0.0.1:1", timeout_s=7.0).deadline.seconds() == 7.0
    with pytest.raises(ValueError):
        CallDeadline(fixed_s=0.0)
    with pytest.raises(ValueError):
        CallDeadline(floor_s=5.0, cap_s=1.0)


@contextlib.contextmanager
def silent_server():
    """A port that completes TCP handshakes (the kernel's backlog) and never answers: a blackhole."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def test_a_call_that_times_out_is_not_retried():
    with silent_server() as url:
        t = Transport(url, deadline=CallDeadline(fixed_s=1.0), backoff_s=0.0)
        t0 = time.perf_counter()
        with pytest.raises(Unreachable, match="deadline"):
            t.verify("s", {"round": 1})
        elapsed = time.perf_counter() - t0
        t.close()
    assert t.calls == 1 and t.retries == 0  # one attempt spent the deadline
    assert elapsed < 2.5  # three attempts would take 3 s


def test_fast_failures_are_retried_within_the_deadline():
    with silent_server() as url:
        pass  # closed: connections are refused at once
    t = Transport(url, deadline=CallDeadline(fixed_s=5.0), backoff_s=0.01)
    with pytest.raises(Unreachable):
        t.verify("s", {"round": 1})
    t.close()
    assert t.calls == 3 and t.retries == 2


# ---------------------------------------------------------------------- a cut link through netem
class CutRun:
    """Generates through a netem proxy: cuts the link once ``CUT_AFTER_TOKENS`` are verified,
    restores it ``OUTAGE_S`` after the first offline token; records when each happened."""

    def __init__(self, run, proxy, mode: str):
        self.run, self.proxy, self.mode = run, proxy, mode
        self.cut_at = self.offline_at = None
        self.restorer: threading.Timer | None = None
        self.events = []

    def drive(self):
        for ev in self.run:
            self.events.append(ev)
            if self.cut_at is None and self.run.generated >= CUT_AFTER_TOKENS:
                self.proxy.cut(self.mode)
                self.cut_at = time.perf_counter()
            if ev.kind == "offline" and self.offline_at is None:
                self.offline_at = time.perf_counter()
                self.restorer = threading.Timer(OUTAGE_S, self.proxy.restore)
                self.restorer.start()
        if self.restorer is not None:
            self.restorer.join()
        return self.run.result()


@pytest.mark.parametrize("mode", ["blackhole", "reset"])
def test_a_cut_4g_link_goes_offline_soon_completes_and_corrects_the_tail(server, device, plain, mode):
    srv, uv = server
    ids = device.tokenizer.encode(PROMPT)
    ref = plain.generate([ids], MAX_NEW, ignore_eos=True)[0].token_ids
    # K = 4 fixed and a right drafter: 5 tokens per round, so the cut comes after 11 verified;
    # the drafter is wrong at a position it writes offline: the correction comes on reconnection
    first_wrong = 11 + 3
    dev = DeviceDrafter(
        OracleProposer(ids + ref, 512, {len(ids) + first_wrong}), device.tokenizer, device.fingerprints, "oracle"
    )
    with netem_proxy("4g", ("127.0.0.1", uv.port), seed=0) as px:
        t = Transport(f"http://{px.host}:{px.port}", backoff_s=0.05)  # the deadline follows the link
        gen = RemoteGenerator(
            dev,
            t,
            num_speculative_tokens=4,
            adaptive_k=False,
            link=LinkPolicy(reconnect_backoff_s=0.1, max_backoff_s=1.0, final_reconnects=20),
        )
        cut = CutRun(gen.start(ids, MAX_NEW, ignore_eos=True), px, mode)
        try:
            res = cut.drive()
        finally:
            t.close()
    assert cut.cut_at is not None and cut.offline_at is not None
    assert cut.offline_at - cut.cut_at < OFFLINE_BOUND_S
    assert res.first_offline_s is not None and res.disconnections >= 1
    offline = [e for e in cut.events if e.kind == "offline"]
    assert offline[0].position == 11
    # the generation completes: every token written, then verified once the link came back
    assert res.num_tokens == MAX_NEW and res.offline_tokens == 0 and res.offline_generated > 0
    corrections = [e for e in cut.events if e.kind == "correction"]
    assert corrections and corrections[0].position == first_wrong
    assert corrections[0].tokens[:1] == ref[first_wrong : first_wrong + 1]
    assert res.token_ids == ref  # the output is the target's own
