"""Client-server mode, server side without a client: the wire format, remote sessions in the
RoundService (sharing verify calls with local sessions), ClientSessions' idempotent rounds,
resyncs and TTL, and the HTTP API's 4xx bodies naming the field."""

import asyncio
import json

import pytest
import torch

from moa_serve.app import state
from moa_serve.client.adaptive import KController, best_k, expected_tokens
from moa_serve.client_server import wire
from moa_serve.client_server.sessions import ClientSessions, CSError, Resync
from moa_serve.engine.feature_policy import AlwaysFeatures
from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.engine.options import RoundOptions
from moa_serve.engine.pool_calls import Pools
from moa_serve.engine.round_service import RoundService
from moa_serve.engine.session import Session
from moa_serve.sampling import GREEDY, SamplingParams
from tests.support.cs_harness import Server
from tests.support.json_numbers import NOT_FINITE_OR_EXTREME


@pytest.fixture(scope="module")
def server(stories_path, stories_drafter):
    return Server(stories_path, stories_drafter)


@pytest.fixture(scope="module")
def reference(stories_path):
    """Plain target decoding (the engine with drafter none)."""
    engine = SpeculativeEngine.load(str(stories_path), None, "float32")

    def ref(prompt, n):
        return engine.generate([prompt], n, ignore_eos=True)[0].token_ids

    return ref


def prints(srv) -> dict:
    i = srv.identity
    return {"target": i.target, "tokenizer": i.tokenizer, "drafter": i.drafter}


# ---------------------------------------------------------------------- wire
def test_frames_round_trip_and_feature_codecs():
    feats = torch.randn(5, 64) * 3
    for codec, tol in (("float16", 1e-2), ("int8", 3 * feats.abs().max().item() / 127)):
        tensors = wire.encode_features(feats, codec)
        header, back = wire.unpack(wire.pack({"round": 3, "tokens": [1, 2]}, tensors))
        assert header == {"round": 3, "tokens": [1, 2]}
        assert torch.allclose(wire.decode_features(back), feats, atol=tol)
    fp16 = len(wire.pack({}, wire.encode_features(feats, "float16")))
    int8 = len(wire.pack({}, wire.encode_features(feats, "int8")))
    assert fp16 - int8 >= 5 * 64 - 5 * 4 - 64  # int8: one byte per value plus a float32 scale per row
    assert wire.unpack(wire.pack({"a": 1}))[1] == {} and wire.decode_features({}) is None
    data = wire.pack({"x": 1}, {"draft_probs": torch.ones(2, 3)})
    for bad, param in (
        (data[:-1], "draft_probs"),
        (data + b"\0", "body"),
        (b"\x01", "body"),
        (b"\xff\xff\x00\x00{}", "body"),
    ):
        with pytest.raises(wire.WireError) as err:
            wire.unpack(bad)
        assert err.value.param == param


def test_adaptive_k_follows_round_trip_and_acceptance():
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 5) == 6.0
    # a slow link makes drafting nearly free: draft many; a poor drafter on a fast link: few
    assert best_k(0.8, draft_s=0.005, round_trip_s=0.2, k_max=8) == 8
    assert best_k(0.1, draft_s=0.02, round_trip_s=0.01, k_max=8) == 1
    slow, fast = KController(8), KController(8)
    assert slow.k() == 4  # before any measurement
    for _ in range(20):
        slow.observe(4, 4, 0.02, 0.25)  # every draft accepted, 250 ms round trips
        fast.observe(4, 0, 0.04, 0.01)  # nothing accepted, 10 ms round trips
    assert slow.k() == 8 and fast.k() == 1
    assert KController(6, adaptive=False).k() == 6


# ---------------------------------------------------------------------- RoundService
def test_remote_sessions_share_verify_calls_with_local_ones(stories_path, stories_drafter, reference):
    engine = SpeculativeEngine.load(str(stories_path), str(stories_drafter), "float32", max_sessions=8)
    calls = []

    async def verify(g, reqs):
        calls.append({r.session_id for r in reqs})
        await asyncio.sleep(0)  # a pool call suspends (Ray, HTTP): other tasks run meanwhile
        return engine.verifier.verify(reqs)

    async def draft(g, reqs):
        assert not any(r.session_id.startswith("remote") for r in reqs)  # the client drafts those
        return engine.proposer.propose(reqs)

    async def release(g, ids):
        for i in ids:
            engine.release(i)

    tok = engine.tokenizer
    prompts = [tok.encode(p) for p in ("Once upon a time", "The little dog", "One day")]
    ref = [reference(p, 24) for p in prompts]

    async def main():
        svc = RoundService(Pools(verify, draft, release), RoundOptions(speculation_governor=False))
        local = [
            Session(f"local{i}", p, 24, num_speculative_tokens=3, max_model_len=512) for i, p in enumerate(prompts[:2])
        ]
        remote = Session("remote0", prompts[2], 24, max_model_len=512)
        tracked = [svc.submit(s) for s in local]
        rt = svc.submit(remote, remote=True)

        async def collect(t):
            return [tok for ev in [ev async for ev in svc.stream(t)] for tok in ev.tokens]

        async def drive_remote():
            out, k = [], 0
            while not remote.finished:
                # drafts: the right next token every other round, a wrong one otherwise
                full = remote.prompt + ref[2]
                n = len(remote.tokens)
                drafts = [full[n]] if k % 2 else [(full[n] + 1) % 512]
                ev = await svc.verify_remote(rt, drafts)
                out += ev.tokens
                k += 1
            return out

        outs = await asyncio.gather(*(collect(t) for t in tracked), drive_remote())
        await svc.stop()
        return outs, svc.stats

    outs, stats = asyncio.run(main())
    assert outs == ref
    assert any("remote0" in c and len(c) > 1 for c in calls)  # one forward for everybody
    assert stats.completed == 3


def test_a_queued_remote_session_waits_for_room_and_can_be_aborted(server):
    prompt = server.tokenizer.encode("One day")

    async def verify(g, reqs):
        await asyncio.sleep(0)  # a pool call suspends (Ray, HTTP): other tasks run meanwhile
        return await server.service.calls.verify_fn(g, reqs)

    async def main():
        svc = RoundService(
            Pools(verify, None, server.service.calls.release_fn),
            RoundOptions(speculation_governor=False, max_sessions_per_round=1, max_queued=4),
            features=AlwaysFeatures(),
        )
        busy = svc.submit(Session("busy", prompt, 400, max_model_len=512))
        queued = svc.submit(Session("queued", prompt, 8, max_model_len=512), remote=True)
        first = asyncio.ensure_future(svc.verify_remote(queued, []))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not first.done() and svc.queue_depth == 1  # no room in the group yet
        svc.abort(queued)
        assert (await asyncio.wait_for(first, 5)).finish_reason == "abort"
        svc.abort(busy)
        await svc.stop()

    asyncio.run(main())


# ---------------------------------------------------------------------- ClientSessions
def _sessions(server, **kw):
    svc = RoundService(
        Pools(server.service.calls.verify_fn, None, server.service.calls.release_fn),
        RoundOptions(speculation_governor=False),
        features=AlwaysFeatures(),
    )
    return ClientSessions(svc, server.identity, **kw), svc


def test_rounds_are_idempotent_and_other_lengths_resync(server, reference):
    prompt = server.tokenizer.encode("Lily went to the park and")
    ref = reference(prompt, 12)

    async def main():
        cs, svc = _sessions(server)
        sid, r0 = await cs.create(prompt, fingerprints=prints(server), max_tokens=12, sampling=GREEDY)
        assert r0.tokens == ref[:1] and r0.feature_start == 0 and r0.features.shape == (len(prompt), 64)
        n = len(prompt) + 1
        r1 = await cs.verify(sid, 1, n, ref[1:4])
        assert r1.tokens == ref[1:5] and r1.accepted == 3  # three drafts right, then the bonus token
        assert r1.feature_start == len(prompt) and len(r1.features) == 4  # the newly committed positions
        again = await cs.verify(sid, 1, n, ref[1:4])  # the response was lost: the same answer, once
        assert again is r1 and cs.stats["replays"] == 1
        n += 4
        # a retry that arrives while its round still runs awaits that very round
        a, b = await asyncio.gather(cs.verify(sid, 2, n, [ref[5], 0]), cs.verify(sid, 2, n, [ref[5], 0]))
        assert a is b and a.tokens == ref[5:7] and a.accepted == 1
        assert len(svc._active[0][0].session.tokens) == n + 2  # committed once
        for bad_round, bad_len, expect in ((1, n - 4, n + 2), (4, n + 2, n + 2), (3, n, n + 2)):
            with pytest.raises(Resync) as err:
                await cs.verify(sid, bad_round, bad_len, [])
            assert err.value.status == 409 and err.value.extra == {"expected_length": expect, "expected_round": 3}
        with pytest.raises(Resync) as err:
            await cs.verify("nobody-knows-it", 1, n, [])
        assert err.value.extra["expected_length"] == 0
        # a resync: everything committed so far as a new session; only the missing features come back
        sid2, r = await cs.create(
            prompt + ref[:7], fingerprints=prints(server), max_tokens=5, sampling=GREEDY, features_from=len(prompt) + 6
        )
        assert r.tokens == ref[7:8] and r.feature_start == len(prompt) + 6 and len(r.features) == 1
        assert cs.close(sid) and not cs.close(sid) and cs.close(sid2)
        await asyncio.sleep(0)
        await svc.stop()

    asyncio.run(main())


def test_idle_sessions_expire_and_free_their_caches(server):
    prompt = server.tokenizer.encode("The sun was")
    now = [0.0]

    async def main():
        cs, svc = _sessions(server, ttl_s=60.0, clock=lambda: now[0])
        sid, r0 = await cs.create(prompt, fingerprints=prints(server), max_tokens=8, sampling=GREEDY)
        assert svc.active_sessions == 1
        now[0] += 30
        await cs.verify(sid, 1, len(prompt) + 1, [])  # used: its idle time starts again
        now[0] += 59
        cs._sweep()
        assert sid in cs.entries
        now[0] += 2
        with pytest.raises(Resync) as err:
            await cs.verify(sid, 2, len(prompt) + 2, [])
        assert err.value.extra["expected_length"] == 0 and cs.stats["expired"] == 1
        for _ in range(50):  # the group loop drops the aborted session and releases its caches
            if svc.active_sessions == 0 and svc.pending_releases == 0:
                break
            await asyncio.sleep(0.01)
        assert svc.active_sessions == 0 and sid not in server.runner.sessions
        await svc.stop()

    asyncio.run(main())


def test_sampling_rounds_need_the_drafters_distribution(server):
    prompt = server.tokenizer.encode("Once upon a time")

    async def main():
        cs, svc = _sessions(server)
        sid, r0 = await cs.create(
            prompt, fingerprints=prints(server), max_tokens=8, sampling=SamplingParams(temperature=0.8, seed=1)
        )
        n = len(prompt) + 1
        for probs, msg in (
            (None, "needs the drafter's distribution"),
            (torch.ones(1, 7), "shape"),
            (torch.full((2, 512), -1.0), "non-negative"),
        ):
            with pytest.raises(CSError, match=msg) as err:
                await cs.verify(sid, 1, n, [5, 6], probs)
            assert err.value.param == "draft_probs"
        r1 = await cs.verify(sid, 1, n, [5, 6], torch.full((2, 512), 1 / 512))
        assert 1 <= len(r1.tokens) <= 3 and r1.accepted == len(r1.tokens) - 1
        await svc.stop()

    asyncio.run(main())


def test_sessions_waiting_for_a_seat_take_those_of_idle_client_server_sessions(server, reference):
    """Clients that open sessions and go away (or sit between rounds) must not hold every round
    seat until their TTL: a session waiting for a seat takes the one idle longest, whose client's
    next call resyncs; the client that was used more recently keeps its session."""
    prompt = server.tokenizer.encode("Once upon a time")

    async def main():
        svc = RoundService(
            Pools(server.service.calls.verify_fn, None, server.service.calls.release_fn),
            RoundOptions(speculation_governor=False, max_sessions_per_round=2),
            features=AlwaysFeatures(),
        )
        cs = ClientSessions(svc, server.identity)
        old, _ = await cs.create(prompt, fingerprints=prints(server), max_tokens=8, sampling=GREEDY)
        kept, r0 = await cs.create(prompt, fingerprints=prints(server), max_tokens=8, sampling=GREEDY)
        assert svc.active_sessions == 2
        local = svc.submit(Session("local", prompt, 6, max_model_len=512))
        tokens = await asyncio.wait_for(_collect(svc, local), timeout=30)
        assert tokens == reference(prompt, 6)
        assert cs.stats["reclaimed"] == 1 and old not in cs.entries and kept in cs.entries
        with pytest.raises(Resync):
            await cs.verify(old, 1, len(prompt) + 1, [])
        r1 = await cs.verify(kept, 1, len(prompt) + 1, [])
        assert r1.round == 1 and r1.tokens == reference(prompt, 2)[1:]
        await svc.stop()

    asyncio.run(main())


async def _collect(svc, tracked) -> list[int]:
    return [tok async for ev in svc.stream(tracked) for tok in ev.tokens]


# ---------------------------------------------------------------------- HTTP
@pytest.fixture()
def api(server):
    from fastapi.testclient import TestClient

    from moa_serve.app.http import create_app

    svc = RoundService(
        Pools(server.service.calls.verify_fn, None, server.service.calls.release_fn),
        RoundOptions(speculation_governor=False),
        features=AlwaysFeatures(),
    )
    cs = ClientSessions(svc, server.identity)
    state.install(cs=cs, frontend=server.frontend)
    try:
        with TestClient(create_app()) as client:
            yield client
    finally:
        state.install(cs=None, frontend=None)


def test_http_create_verify_delete_speak_frames(api, server, reference):
    ident = api.get("/v1/cs").json()
    assert ident["target"] == server.identity.target and ident["drafter_kind"] == "moa"
    r = api.post(
        "/v1/cs/sessions",
        json={
            "prompt": "Once upon a time",
            "max_tokens": 6,
            "ignore_eos": True,
            "fingerprints": prints(server),
            "feature_codec": "int8",
        },
    )
    assert r.status_code == 200 and r.headers["content-type"] == wire.MEDIA_TYPE
    header, tensors = wire.unpack(r.content)
    prompt = server.tokenizer.encode("Once upon a time")
    ref = reference(prompt, 6)
    assert header["tokens"] == ref[:1] and tensors["features"].dtype == torch.int8
    assert wire.decode_features(tensors).shape == (len(prompt), 64)
    sid = header["session_id"]
    body = {"round": 1, "committed_length": len(prompt) + 1, "draft_ids": ref[1:3]}
    r = api.post(f"/v1/cs/sessions/{sid}/verify", content=wire.pack(body), headers={"content-type": wire.MEDIA_TYPE})
    header, _ = wire.unpack(r.content)
    assert header["tokens"] == ref[1:4] and header["accepted"] == 2 and header["round"] == 1
    assert api.delete(f"/v1/cs/sessions/{sid}").json() == {"id": sid, "deleted": True}
    r = api.delete(f"/v1/cs/sessions/{sid}")
    assert r.status_code == 404 and r.json()["error"]["param"] == "session_id"


def _create(server, **kw):
    return {"token_ids": [1, 400, 300], "max_tokens": 4, "fingerprints": prints(server), **kw}


@pytest.mark.parametrize(
    "body, param",
    [
        ("{not json", "body"),
        ({"token_ids": [1, 2]}, "fingerprints"),
        ("unknown_field", "colour"),
        ("token_out_of_vocab", "token_ids.2"),
        ("negative_temperature", "temperature"),
        ("both_inputs", "body"),
        ("bad_codec", "feature_codec"),
        ("other_drafter", "fingerprints.drafter"),
        ("other_tokenizer", "fingerprints.tokenizer"),
        ("bad_session_id", "session_id"),
        ("too_long", "token_ids"),
    ],
)
def test_bad_create_is_a_400_naming_the_field(api, server, body, param):
    cases = {
        "unknown_field": _create(server, colour="red"),
        "token_out_of_vocab": _create(server, token_ids=[1, 2, 512]),
        "negative_temperature": _create(server, temperature=-1),
        "both_inputs": _create(server, prompt="hi"),
        "bad_codec": _create(server, feature_codec="float64"),
        "other_drafter": _create(server, fingerprints={**prints(server), "drafter": "0123456789abcdef"}),
        "other_tokenizer": _create(server, fingerprints={**prints(server), "tokenizer": "x"}),
        "bad_session_id": _create(server, session_id="no spaces allowed"),
        "too_long": _create(server, token_ids=[5] * 512),
    }
    body = cases.get(body, body) if isinstance(body, str) else body
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
    r = api.post("/v1/cs/sessions", **kw)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and err["message"] and err["type"]
    if param.startswith("fingerprints."):
        assert err["type"] == "fingerprint_mismatch"


def test_bad_verify_is_a_4xx_naming_the_field(api, server):
    r = api.post("/v1/cs/sessions", json=_create(server, max_tokens=8))
    sid = wire.unpack(r.content)[0]["session_id"]
    url = f"/v1/cs/sessions/{sid}/verify"
    frame = {"content-type": wire.MEDIA_TYPE}
    cases = [
        (api.post(url, json={"round": 0, "committed_length": 4}), 400, "round"),
        (api.post(url, json={"round": 1, "committed_length": 4, "draft_ids": [600]}), 400, "draft_ids.0"),
        (api.post(url, json={"round": 1, "committed_length": 4, "draft_ids": [1] * 65}), 400, "draft_ids"),
        (api.post(url, json={"round": 1, "committed_length": 4, "draft_id": [1]}), 400, "draft_id"),
        (
            api.post(url, json={"round": 1, "committed_length": 4, "draft_ids": [1], "alternatives": [[2], [3]]}),
            400,
            "alternatives",
        ),
        (
            api.post(url, json={"round": 1, "committed_length": 4, "draft_ids": [1], "alternatives": [[2, 600]]}),
            400,
            "alternatives.0.1",
        ),
        (
            api.post(
                url, json={"round": 1, "committed_length": 4, "draft_ids": [1, 2], "alternatives": [[3] * 20, [4] * 5]}
            ),
            400,
            "alternatives",
        ),
        (
            api.post(url, json={"round": 1, "committed_length": 4, "draft_ids": [1], "alternatives": [["x"]]}),
            400,
            "alternatives.0.0",
        ),
        (api.post(url, content=b"\x05\x00", headers=frame), 400, "body"),
        (
            api.post(
                url, content=wire.pack({"round": 1, "committed_length": 4}, {"junk": torch.ones(1)}), headers=frame
            ),
            400,
            "junk",
        ),
        (api.post(url, json={"round": 1, "committed_length": 9}), 409, "committed_length"),
        (
            api.post("/v1/cs/sessions/unknown-session/verify", json={"round": 1, "committed_length": 4}),
            409,
            "session_id",
        ),
    ]
    for r, status, param in cases:
        assert r.status_code == status and r.json()["error"]["param"] == param, r.json()
    resync = cases[-2][0].json()["error"]
    assert resync["type"] == "resync" and resync["expected_length"] == 4 and resync["expected_round"] == 1
    assert cases[-1][0].json()["error"]["expected_length"] == 0
    r = api.post(url, json={"round": 1, "committed_length": 4})  # the session is still fine
    assert r.status_code == 200 and json.loads(r.content[4 : 4 + int.from_bytes(r.content[:4], "little")])["round"] == 1
    # tree drafts are verified greedily: a sampling session is told to send a chain
    r = api.post("/v1/cs/sessions", json=_create(server, max_tokens=8, temperature=0.8, seed=1))
    url = f"/v1/cs/sessions/{wire.unpack(r.content)[0]['session_id']}/verify"
    r = api.post(url, json={"round": 1, "committed_length": 4, "draft_ids": [1], "alternatives": [[2]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "alternatives"


# ---------------------------------------------------------------------- sampling values the sampler cannot run
REFUSED = NOT_FINITE_OR_EXTREME
DENORMALS = ("2.225073858507e-311", "5e-324")


def _raw_json(body: dict, field: str, raw: str) -> str:
    """``body`` as JSON text with ``"field": raw`` written in as is (NaN, Infinity, 1e400 ...)."""
    return json.dumps(body)[:-1] + f', "{field}": {raw}}}'


def _as_frame(text: str) -> bytes:
    """The same message as a binary frame: its JSON header is the text, byte for byte."""
    head = text.encode()
    return len(head).to_bytes(4, "little") + head


@pytest.mark.parametrize("framed", [False, True], ids=["json", "frame"])
@pytest.mark.parametrize("raw", REFUSED.values(), ids=REFUSED.keys())
def test_a_float_sampling_value_the_model_cannot_run_is_a_400_naming_the_field_on_create(api, server, raw, framed):
    calls = len(server.verify_calls)
    for field in ("temperature", "top_p"):
        text = _raw_json(_create(server, max_tokens=4), field, raw)
        kw = (
            {"content": _as_frame(text), "headers": {"content-type": wire.MEDIA_TYPE}}
            if framed
            else {"content": text, "headers": {"content-type": "application/json"}}
        )
        r = api.post("/v1/cs/sessions", **kw)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field and err["type"] == "invalid_request_error", err
    assert len(server.verify_calls) == calls  # refused before any round


@pytest.mark.parametrize("framed", [False, True], ids=["json", "frame"])
@pytest.mark.parametrize("raw", DENORMALS)
def test_a_denormal_temperature_opens_a_greedy_session_and_a_denormal_top_p_a_sampling_one(api, server, raw, framed):
    def create(field, extra):
        text = _raw_json(_create(server, max_tokens=4, **extra), field, raw)
        kw = (
            {"content": _as_frame(text), "headers": {"content-type": wire.MEDIA_TYPE}}
            if framed
            else {"content": text, "headers": {"content-type": "application/json"}}
        )
        r = api.post("/v1/cs/sessions", **kw)
        assert r.status_code == 200, r.text
        header = wire.unpack(r.content)[0]
        assert r.headers["session-id"] == header["session_id"] and len(header["tokens"]) == 1
        return header["session_id"]

    greedy = create("temperature", {"top_p": 0.5})
    url = f"/v1/cs/sessions/{greedy}/verify"
    r = api.post(url, json={"round": 1, "committed_length": 4, "draft_ids": [5, 6], "alternatives": [[7]]})
    assert r.status_code == 200, r.text  # tree drafts: verified greedily, so the session is greedy
    sampling = create("top_p", {"temperature": 1.0, "seed": 1})
    url = f"/v1/cs/sessions/{sampling}/verify"
    r = api.post(
        url,
        content=wire.pack(
            {"round": 1, "committed_length": 4, "draft_ids": [5, 6]}, {"draft_probs": torch.full((2, 512), 1 / 512)}
        ),
        headers={"content-type": wire.MEDIA_TYPE},
    )
    header = wire.unpack(r.content)[0]
    assert r.status_code == 200 and 1 <= len(header["tokens"]) <= 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_draft_probs_that_are_not_finite_or_negative_are_a_400_and_denormal_or_huge_ones_run(api, server, dtype):
    r = api.post("/v1/cs/sessions", json=_create(server, max_tokens=16, temperature=0.8, seed=1))
    sid = wire.unpack(r.content)[0]["session_id"]
    url, frame = f"/v1/cs/sessions/{sid}/verify", {"content-type": wire.MEDIA_TYPE}
    n, rnd = 4, 1
    tiny = torch.finfo(dtype).smallest_normal / 4  # denormal in every dtype that travels
    for bad in (float("nan"), float("inf"), float("-inf"), -tiny, -1.0):
        probs = torch.full((2, 512), 1 / 512).to(dtype)
        probs[1, 7] = bad
        r = api.post(
            url,
            content=wire.pack({"round": rnd, "committed_length": n, "draft_ids": [5, 6]}, {"draft_probs": probs}),
            headers=frame,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "draft_probs", (bad, r.text)
    for field in ("round", "committed_length", "features_from"):  # integers: NaN, infinities, 1e400 are not
        for raw in ("NaN", "Infinity", "-Infinity", "1e400", "5e-324"):
            text = _raw_json({k: v for k, v in {"round": rnd, "committed_length": n}.items() if k != field}, field, raw)
            r = api.post(url, content=_as_frame(text), headers=frame)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, raw, r.text)
    for odd in (tiny, torch.finfo(dtype).max, 0.0):  # finite, non-negative: acceptance runs on them
        probs = torch.full((2, 512), odd, dtype=dtype)
        r = api.post(
            url,
            content=wire.pack({"round": rnd, "committed_length": n, "draft_ids": [5, 6]}, {"draft_probs": probs}),
            headers=frame,
        )
        assert r.status_code == 200, (odd, r.text)
        header = wire.unpack(r.content)[0]
        assert 1 <= len(header["tokens"]) <= 3 and header["round"] == rnd
        n, rnd = header["committed_length"], rnd + 1
        if header.get("finish_reason"):
            break
