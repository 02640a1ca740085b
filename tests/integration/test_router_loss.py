"""A Router replica that dies mid-generation loses nothing: the Gateway resumes each of its
streams on another Router replica from the tokens it already received.

First without Ray (the Gateway's ``StreamService`` over two in-process Router cores, one of which
dies), then the Ray Serve application end to end: two Router replicas, four concurrent greedy
streams, the busy Router replica killed."""

import asyncio
import json
import threading
import time

import httpx
import pytest

from moa_serve.engine.lanes import LaneHub, LaneLink
from moa_serve.engine.session import Session
from moa_serve.engine.stream_service import StreamService
from moa_serve.sampling import SamplingParams
from tests.support.service_stubs import FakeVerifier, make_service, make_session, reference


# ---------------------------------------------------------------------- the core, without Ray
class ReplicaDied(ConnectionError):
    """What a handle raises when the replica serving the call died (Ray: ActorDiedError)."""


class RouterCore:
    """One Router replica: its round service behind a ``LaneHub``. With ``die_after``, its lane
    links break after that many batches, as the links of a replica that died do."""

    def __init__(self, die_after: int | None = None):
        self.service, _ = make_service(FakeVerifier(), max_sessions_per_round=8)
        self.hub = LaneHub(self.service)
        self.die_after = die_after
        self.started: list[Session] = []

    async def connect(self, link: str):
        n = 0
        async for batch in self.hub.connect(link):
            if self.die_after is not None and n == self.die_after:
                raise ReplicaDied("the actor died unexpectedly")
            n += 1
            yield batch

    def start(self, session: Session, link: str) -> None:
        self.started.append(session)
        self.hub.start(session, link)


def gateway(routers: list[RouterCore]) -> StreamService:
    """The Gateway's side: one lane whose link goes to the first Router replica not known dead
    (as the affinity router moves the lane when its replica dies)."""
    live = [0]

    async def connect(link: str):
        core = routers[live[0]]
        try:
            async for batch in core.connect(link):
                yield batch
        except ReplicaDied:
            live[0] += 1
            raise

    async def start(session: Session, link: str) -> None:
        routers[live[0]].start(session, link)

    async def cancel(session_id: str) -> None:
        routers[live[0]].hub.cancel(session_id)

    return StreamService(LaneLink(connect, start, cancel).open, max_sessions=8, retry_backoff_s=0.01)


def test_streams_of_a_dead_router_resume_on_a_sibling_with_the_same_tokens():
    async def main():
        dying, sibling = RouterCore(die_after=6), RouterCore()
        service = gateway([dying, sibling])
        sessions = [make_session(i, max_new=40, k=0) for i in range(4)]
        tracked = [service.submit(s) for s in sessions]

        async def stream(t):
            return [ev async for ev in service.stream(t)]

        events = await asyncio.gather(*(stream(t) for t in tracked))
        for core in (dying, sibling):
            await core.service.stop()
        return sessions, events, service, dying, sibling

    sessions, events, service, dying, sibling = asyncio.run(main())
    assert dying.service.stats.aborted == 4  # its lane link closed: its sessions were aborted there
    for s, evs in zip(sessions, events):
        streamed = [tok for ev in evs for tok in ev.tokens]
        assert streamed == reference(s.prompt, 40)  # nothing repeated, nothing missing
        assert evs[-1].finish_reason == "length" and s.generated == streamed
    assert service.stats.stream_retries == 4 and service.stats.completed == 4
    assert len(sibling.started) == 4
    for resumed in sibling.started:  # the sibling went on from what the gateway had received
        original = next(s for s in sessions if s.tokens[: len(resumed.prompt)] == resumed.prompt)
        received = len(resumed.prompt) - len(original.prompt)
        assert received > 0 and resumed.prompt == original.tokens[: len(resumed.prompt)]
        assert resumed.max_new_tokens == 40 - received


def test_a_session_stopped_at_the_gateway_is_aborted_on_its_router():
    async def main():
        router = RouterCore()
        service = gateway([router])
        t = service.submit(make_session(0, max_new=200, k=0))
        async for ev in service.stream(t):
            if len(t.session.generated) >= 5:
                service.abort(t)  # a stop string, a client gone
                break
        for _ in range(50):
            if router.service.stats.aborted:
                break
            await asyncio.sleep(0.01)
        await router.service.stop()
        return router, t

    router, t = asyncio.run(main())
    assert router.service.stats.aborted == 1 and t.session.finish_reason == "abort"


def test_continuation_keeps_everything_but_the_committed_prefix():
    s = Session(
        "a",
        [1, 2, 3],
        10,
        SamplingParams(temperature=0.8, seed=7),
        num_speculative_tokens=2,
        stop_token_ids=frozenset({9}),
        max_model_len=64,
        adaptive_speculation=True,
    )
    s.commit([4, 5], drafted=2, accepted=1)
    rest = s.continuation("b")
    assert (rest.id, rest.prompt, rest.tokens, rest.max_new_tokens) == ("b", [1, 2, 3, 4, 5], [1, 2, 3, 4, 5], 8)
    assert rest.sampling == s.sampling and rest.stop_token_ids == s.stop_token_ids
    assert (rest.num_speculative_tokens, rest.max_model_len, rest.adaptive_speculation) == (2, 64, True)
    assert rest.rounds == rest.drafted == 0 and rest.num_features == 0


# ---------------------------------------------------------------------- the cluster
ray = pytest.importorskip("ray")

from tests.integration.test_cluster import app_args, serve_locally, target  # noqa: E402,F401 - fixtures

PROMPTS = ["Once upon a time", "The little dog", "Lily went to the park and", "One day, a boy named Tim"]
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def two_routers(target):  # noqa: F811 - the stories260k fixture of test_cluster
    from moa_serve.deployments.app import build_app

    args = app_args(target, "lookup", max_sessions_per_round=8, session_groups=1)
    args["router"]["autoscaling_config"] = {"min_replicas": 2, "max_replicas": 2}
    yield from serve_locally([(build_app(args), "moa", "/")], poll_s=0.5)


def stream_generate(base: str, prompt: str) -> dict:
    """One streaming /v1/generate: the text and token ids its deltas add up to, and the final event."""
    text, tokens, final = "", [], None
    with httpx.Client(base_url=base, timeout=300) as c:
        with c.stream(
            "POST",
            "/v1/generate",
            json={"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True},
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                ev = json.loads(line[6:])
                assert "error" not in ev, ev
                text += ev["text"]
                tokens += ev["token_ids"]
                final = ev if ev.get("finish_reason") else final
    return {"text": text, "token_ids": tokens, "final": final}


def kill_router(replica: str) -> None:
    named = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if "moa#Router#" in a["name"] and a["name"].endswith(replica)
    ]
    assert named, ray.util.list_named_actors(all_namespaces=True)
    ray.kill(ray.get_actor(named[0]["name"], namespace=named[0]["namespace"]), no_restart=True)


def test_killed_router_mid_generation_loses_nothing(two_routers):
    base = two_routers
    uninterrupted = [stream_generate(base, p) for p in PROMPTS]
    before = httpx.get(base + "/v1/stats").json()
    results: dict[int, dict] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, stream_generate(base, PROMPTS[i])))
        for i in range(len(PROMPTS))
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60  # a few rounds in, far from the end
    while httpx.get(base + "/v1/stats").json()["rounds"] < before["rounds"] + 6 and time.monotonic() < deadline:
        time.sleep(0.02)
    mid_generation = all(t.is_alive() for t in threads)
    kill_router(before["router_replica"])
    for t in threads:
        t.join(300)
    assert mid_generation, "the generations ended before the Router was killed"
    for i, ref in enumerate(uninterrupted):
        got = results[i]
        assert got["token_ids"] == ref["token_ids"] and got["text"] == ref["text"]
        assert got["final"]["usage"]["completion_tokens"] == MAX_TOKENS
    stats = httpx.get(base + "/v1/stats").json()
    assert stats["router_replica"] != before["router_replica"]
    assert stats["gateway"]["stream_retries"] - before["gateway"]["stream_retries"] >= len(PROMPTS)


def test_client_server_sessions_go_through_the_gateway(two_routers):
    from moa_serve.client_server import wire

    with httpx.Client(base_url=two_routers, timeout=60) as c:
        ident = c.get("/v1/cs").json()
        fp = {"target": ident["target"], "tokenizer": ident["tokenizer"]}
        r = c.post(
            "/v1/cs/sessions",
            json={"token_ids": [1, 403, 407], "max_tokens": 8, "fingerprints": fp, "want_features": False},
        )
        assert r.status_code == 200, r.text
        header, _ = wire.unpack(r.content)
        sid, n = header["session_id"], header["committed_length"]
        for rnd in (1, 2):  # rounds land on the Router replica holding the session
            r = c.post(f"/v1/cs/sessions/{sid}/verify", json={"round": rnd, "committed_length": n})
            assert r.status_code == 200, r.text
            n = wire.unpack(r.content)[0]["committed_length"]
        assert n == 3 + 3
        assert c.delete(f"/v1/cs/sessions/{sid}").json() == {"id": sid, "deleted": True}
        r = c.post(f"/v1/cs/sessions/{sid}/verify", json={"round": 3, "committed_length": n})
        assert r.status_code == 409 and r.json()["error"]["type"] == "resync"
