"""`moa netem`: the TCP proxy emulating the paper's network settings (127.0.0.1 only)."""

import argparse
import os
import random
import re
import signal
import socket
import socketserver
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moa_serve.commands.netem import register
from moa_serve.measure.netem import PROFILES, Link, Profile, delay_schedule, link_seed, netem_proxy

REPO = Path(__file__).resolve().parents[2]


class _Echo(socketserver.BaseRequestHandler):
    """Echo until EOF, then half-close: both directions and the FIN cross the proxy."""

    def handle(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
            self.request.shutdown(socket.SHUT_WR)
        except OSError:  # the proxy reset the connection (a cut)
            pass


@pytest.fixture
def echo():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server.server_address
    server.shutdown()
    server.server_close()
    thread.join()


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def transfer(addr, payload: bytes) -> bytes:
    """Send ``payload`` (then EOF) through an echo, return everything read back until EOF."""
    with socket.create_connection(addr, timeout=30) as s:

        def send() -> None:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        sender.join()
    return b"".join(chunks)


def echo_works(sock: socket.socket) -> bool:
    sock.sendall(b"ping")
    return recv_exactly(sock, 4) == b"ping"


def ping_pong(addr, rounds: int, size: int = 32) -> list[float]:
    rtts = []
    with socket.create_connection(addr, timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(rounds):
            msg = bytes([i]) * size
            t0 = time.monotonic()
            s.sendall(msg)
            assert recv_exactly(s, size) == msg
            rtts.append(time.monotonic() - t0)
    return rtts


@pytest.mark.parametrize("profile", ["local", "wan", "4g"])
def test_bytes_pass_unchanged_in_both_directions(echo, profile):
    payload = random.Random(1).randbytes(300_000)
    with netem_proxy(profile, echo, seed=1) as link:
        assert transfer(link.address, payload) == payload
        assert link.stats.bytes_up == link.stats.bytes_down == len(payload)
        assert link.stats.connections == 1


def test_4g_round_trips_follow_the_seeded_delays(echo):
    rounds = 12
    with netem_proxy("4g", echo, seed=7) as link:
        rtts = ping_pong(link.address, rounds)
        conn = link.proxy.history[0]
        up, down = conn.up.delays[:rounds], conn.down.delays[:rounds]
    # each direction of connection 0 drew exactly the delays its seed gives
    assert up == delay_schedule("4g", 7, 0, "up", rounds)
    assert down == delay_schedule("4g", 7, 0, "down", rounds)
    # every round trip took at least its two drawn one-way delays (lower bounds only)
    for rtt, u, d in zip(rtts, up, down, strict=True):
        assert rtt >= u + d - 1e-3
    # the seed-7 draws are what N(21 ms, 19 ms) truncated at 0 gives: ~45 ms per round trip
    assert 0.025 < statistics.mean(u + d for u, d in zip(up, down)) < 0.07
    assert statistics.mean(rtts) >= 0.025


def test_same_seed_same_delays_other_seed_other_delays(echo):
    def delays(seed: int) -> tuple[list[float], list[float]]:
        with netem_proxy("4g", echo, seed=seed) as link:
            ping_pong(link.address, 5)
            ping_pong(link.address, 5)
            return [c.up.delays[:5] + c.down.delays[:5] for c in link.proxy.history][:2]

    first, again, other = delays(3), delays(3), delays(4)
    assert first == again
    assert first[0] != first[1]  # every connection has its own draws
    assert first != other


def test_link_schedule_is_ordered_paced_truncated_and_seeded():
    prof = Profile("t", delay_mean_ms=20, delay_std_ms=30, bandwidth_mbit=8.0)  # 1e6 bytes/s
    a, b, c = Link(prof, "s"), Link(prof, "s"), Link(prof, "other")
    times = [a.schedule(i * 0.0005, 1000) for i in range(300)]
    assert times == [b.schedule(i * 0.0005, 1000) for i in range(300)]
    assert times != [c.schedule(i * 0.0005, 1000) for i in range(300)]
    assert times == sorted(times)  # a later chunk never overtakes an earlier one
    assert all(t >= (i + 1) * 1000 / 1e6 for i, t in enumerate(times))  # serialized at the bandwidth
    assert min(a.delays) == 0.0 and all(d >= 0 for d in a.delays)  # N(20, 30) truncated at 0
    assert a.stats.stalls == 0


def test_a_drop_stalls_for_one_retransmission_timeout():
    link = Link(Profile("lossy", loss=0.99), link_seed(0, 0, "up"))
    assert link.schedule(1.0, 100) >= 1.2
    assert link.stats.stalls == 1 and link.stats.segments == 1


def test_bandwidth_paces_a_1mib_transfer_on_20_mbit(echo):
    payload = bytes(1 << 20)
    with netem_proxy(Profile("20mbit", bandwidth_mbit=20.0), echo) as addr:
        t0 = time.monotonic()
        assert transfer(addr, payload) == payload
        elapsed = time.monotonic() - t0
    assert elapsed >= len(payload) / (20e6 / 8)  # 0.42 s at least (lower bound only)


def test_loss_stalls_happen_at_the_configured_rate(echo):
    lossy = Profile("lossy", loss=0.05, stall_ms=1.0)  # many drops, short stalls: a fast test
    payload = random.Random(2).randbytes(1 << 20)
    with netem_proxy(lossy, echo, seed=5) as link:
        assert transfer(link.address, payload) == payload
        stats = link.stats
    assert stats.segments >= 2 * len(payload) // 1460  # both directions, one draw per segment
    assert 0.03 <= stats.stalls / stats.segments <= 0.07
    assert stats.stall_s == pytest.approx(stats.stalls * 0.001)


def test_blackhole_cut_times_out_and_restore_lets_new_connections_through(echo):
    with netem_proxy("local", echo) as link:
        old = socket.create_connection(link.address, timeout=5)
        assert echo_works(old)
        link.cut("blackhole")
        old.settimeout(0.3)
        old.sendall(b"lost")
        with pytest.raises(TimeoutError):
            old.recv(4)
        during = socket.create_connection(link.address, timeout=0.3)  # accepted, never forwarded
        during.sendall(b"lost")
        with pytest.raises(TimeoutError):
            during.recv(4)
        assert link.proxy.is_cut == "blackhole"

        link.restore()
        for sock in (old, during):  # the outage outlived them: reset
            sock.settimeout(5)
            with pytest.raises(ConnectionResetError):
                sock.recv(4)
            sock.close()
        with socket.create_connection(link.address, timeout=5) as fresh:
            assert echo_works(fresh)
        assert link.stats.cuts == 1


def test_reset_cut_resets_connections_refuses_new_ones_until_restore(echo):
    with netem_proxy("local", echo) as link:
        address = link.address
        with socket.create_connection(address, timeout=5) as s:
            assert echo_works(s)
            link.cut("reset")
            with pytest.raises(ConnectionResetError):
                s.recv(4)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(address, timeout=5)
        link.restore()
        assert link.address == address
        with socket.create_connection(address, timeout=5) as s:
            assert echo_works(s)


def test_cut_after_counts_from_the_first_connection(echo):
    with netem_proxy("local", echo, cut_after=0.3, cut_mode="reset") as link:
        time.sleep(0.4)  # no connection yet: the clock has not started
        t0 = time.monotonic()
        with socket.create_connection(link.address, timeout=5) as s:
            assert echo_works(s)
            with pytest.raises(ConnectionResetError):
                s.recv(4)
        assert time.monotonic() - t0 >= 0.3
        assert link.proxy.is_cut == "reset"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moa")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


GOOD = ["netem", "--profile", "4g", "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:8000"]


def _with(option: str, value: str) -> list[str]:
    argv = list(GOOD)
    if option in argv:
        argv[argv.index(option) + 1] = value
    else:
        argv += [option, value]
    return argv


def test_cli_parses_good_arguments(capsys):
    args = _parser().parse_args(GOOD + ["--seed", "3", "--cut-after", "2.5", "--cut-mode", "reset"])
    assert (args.profile, args.listen, args.upstream) == ("4g", ("127.0.0.1", 0), ("127.0.0.1", 8000))
    assert (args.seed, args.cut_after, args.cut_mode) == (3, 2.5, "reset")
    assert set(PROFILES) == {"local", "wan", "5g", "4g"}
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["netem", "--help"])
    assert exc.value.code == 0
    assert "4g: delay N(21, 19) ms each way, 20 Mbit/s, loss 0.10%" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (_with("--profile", "3g"), "argument --profile: invalid choice: '3g'"),
        (_with("--listen", "8000"), "argument --listen: expected HOST:PORT"),
        (_with("--listen", "127.0.0.1:70000"), "argument --listen: expected HOST:PORT"),
        (_with("--upstream", "127.0.0.1:0"), "argument --upstream: expected HOST:PORT with a port in 1..65535"),
        (_with("--cut-after", "-1"), "argument --cut-after: must be a finite number of seconds >= 0"),
        (_with("--cut-after", "soon"), "argument --cut-after: expected a number of seconds"),
        (_with("--cut-mode", "drop"), "argument --cut-mode: invalid choice: 'drop'"),
        (GOOD[:-2], "the following arguments are required: --upstream"),
    ],
)
def test_cli_rejects_bad_arguments_clearly(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_moa_command_has_netem(capsys):
    from moa_serve.cli import build_parser

    args = build_parser().parse_args(GOOD)
    assert (args.command, args.profile) == ("netem", "4g")
    with pytest.raises(SystemExit):
        build_parser().parse_args(_with("--profile", "3g"))
    assert "argument --profile: invalid choice: '3g'" in capsys.readouterr().err


def test_cli_serves_until_sigint_and_prints_a_summary(echo):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moa_serve.commands.netem",
            "--profile",
            "wan",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            f"{echo[0]}:{echo[1]}",
            "--seed",
            "1",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        assert match, line
        assert transfer(("127.0.0.1", int(match.group(1))), b"hello netem") == b"hello netem"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "netem: 1 connections, 11 B up, 11 B down" in err
