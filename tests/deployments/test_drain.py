"""A Ray Pod's preStop (``deployments/drain.py``): it asks Ray to drain the node, then waits until
no Serve replica and no client connection is left there, or its deadline."""

from __future__ import annotations

import subprocess

from moa_serve.deployments import drain


def test_it_waits_until_the_replicas_and_the_connections_are_gone():
    replicas = iter([[11, 12], [12], [], []])
    connections = iter([3, 1, 1, 0])
    polls = []

    def count():
        polls.append(1)
        return next(connections)

    assert drain.wait_drained(None, poll_s=0, replicas=lambda: next(replicas), connections=count)
    assert len(polls) == 4  # not before the last stream had ended


def test_it_gives_up_at_its_deadline():
    assert not drain.wait_drained(0.05, poll_s=0.01, replicas=lambda: [11], connections=lambda: 0)


def test_it_asks_ray_to_drain_this_node(monkeypatch):
    seen = []

    def run(cmd, **kw):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(drain.subprocess, "run", run)
    assert drain.request_drain(600)
    [cmd] = seen
    assert cmd[1:3] == ["drain-node", "--reason"] and cmd[-2:] == ["--deadline-remaining-seconds", "600"]


def test_a_refused_drain_still_waits(monkeypatch, capsys):
    monkeypatch.setattr(
        drain.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "cannot drain the head")
    )
    monkeypatch.setattr(drain, "serve_replicas", lambda: [])
    monkeypatch.setattr(drain, "open_connections", lambda port=drain.SERVE_PORT: 0)
    assert drain.main(["--deadline-s", "5"]) == 0
    err = capsys.readouterr().err
    assert "cannot drain the head" in err and "drained" in err


def test_it_sees_this_machine_processes_and_connections():
    assert isinstance(drain.serve_replicas(), list)
    assert drain.open_connections(port=1) == 0
