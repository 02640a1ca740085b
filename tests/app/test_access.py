"""Who may call the HTTP API and how much (``app/access.py``, ``app/auth.py``, ``app/limits.py``), on
the in-process FastAPI app over a fake round service and fake client-server sessions that record
every call:

* with API keys set, a call without a key, with a wrong one or another scheme gets 401 on every
  operation of the OpenAPI schema but the open ones, and nothing runs: no readiness check, no
  tokenization, no session, no client-server call; with the key every route serves;
* keys: compared with every configured key in constant time, read from the config, $MOA_API_KEYS
  and a key file that is re-read when it changes, never logged; an open API warns once;
* a body over the cap gets 413 before the route runs, from its Content-Length or after at most
  the cap's worth of chunks of a body that would be far larger (in ASGI and over real HTTP);
* max_tokens, stop strings, n / best_of: a 400 naming the field; a key at its concurrency
  limit gets 429 with Retry-After while other keys and reads go on;
* 401 / 413 / 429 are in the schema, the bearer scheme while keys are set; schemathesis with the
  key finds no undocumented status and no route that ignores the key;
* the official ``openai`` client, ``Transport`` and ``moa client`` send the key."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import select
import socket
import time
from types import SimpleNamespace

import httpx
import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from transformers import AutoTokenizer

from moa_serve.app import access as access_mod
from moa_serve.app import auth, state
from moa_serve.app.access import OPEN_PATHS, OPEN_WARNING, Access
from moa_serve.app.auth import HttpAuthConfig, KeyRing
from moa_serve.app.frontend import Frontend, Speculation
from moa_serve.app.http import create_app
from moa_serve.app.limits import MAX_STOP_CHARS, MAX_STOP_STRINGS, HttpLimitsConfig
from moa_serve.app.schemas import MAX_CHOICES
from moa_serve.engine.events import TokenEvent
from moa_serve.engine.round_stats import ServiceStats
from tests.conftest import SMOLLM
from tests.support.asgi import http_scope

KEY, OTHER = "sk-test-key-one-0123456789abcdef", "sk-test-key-two-fedcba9876543210"
AUTH = {"Authorization": f"Bearer {KEY}"}
SID = "abcdefgh12345678"
GENERATIONS = {
    "/v1/generate": {"prompt": "Once upon a time", "max_tokens": 4},
    "/v1/completions": {"prompt": "Once upon a time", "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Tell a story"}], "max_tokens": 4},
}


class RecordingService:
    """A round service that records what reaches it; ``gate`` holds every session's stream until set."""

    queue_depth = active_sessions = 0

    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self.stats = ServiceStats()
        self.sessions = []
        self.gate: asyncio.Event | None = None

    def submit(self, session):
        self.sessions.append(session)
        return session

    async def stream(self, tracked):
        if self.gate is not None:
            await self.gate.wait()
        yield TokenEvent(self.tokens[:2])
        yield TokenEvent(self.tokens[2:], "length")

    def abort(self, tracked):
        pass


class RecordingSessions:
    """Client-server sessions (``state["cs"]``) that record every call."""

    def __init__(self):
        self.calls = []

    async def identity(self):
        self.calls.append("identity")
        return SimpleNamespace(as_dict=lambda: {"model": "smollm"})

    async def create(self, ids, **kwargs):
        self.calls.append("create")
        raise AssertionError("not reached in these tests")

    async def verify(self, *args):
        self.calls.append("verify")
        raise AssertionError("not reached in these tests")

    def close(self, session_id):
        self.calls.append("close")
        return False


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(SMOLLM))


class Served(SimpleNamespace):
    def ran_nothing(self) -> bool:
        return not self.service.sessions and not self.cs.calls and not self.tokenized and not self.checks


@pytest.fixture
def served(monkeypatch, tokenizer):
    """A frontend over the recording service, client-server sessions and a readiness check, all
    recording; API keys ``KEY`` and ``OTHER``."""
    monkeypatch.setattr(state, "_STATE", {})
    service = RecordingService(tokenizer.encode(" and they lived happily"))
    fe = Frontend(
        service,
        tokenizer,
        max_model_len=256,
        stop_token_ids=frozenset(),
        speculation=Speculation(enabled=True, num_speculative_tokens=3),
        model_name="smollm",
    )
    out = Served(service=service, cs=RecordingSessions(), tokenized=[], checks=[], frontend=fe)
    encode = fe.encode_prompt

    def counted(prompt, messages):
        out.tokenized.append(1)
        return encode(prompt, messages)

    monkeypatch.setattr(fe, "encode_prompt", counted)

    async def ready():
        out.checks.append(1)
        return True, {}

    state.install(
        frontend=fe,
        ready=ready,
        retry_after_s=3,
        stats=None,
        cs=out.cs,
        access=Access(KeyRing([KEY, OTHER]), max_model_len=256, vocab_size=len(tokenizer)),
    )
    return out


@pytest.fixture
def client(served):
    with TestClient(create_app(ready_wait_s=0.5), raise_server_exceptions=False) as c:
        yield c


def limit(**limits):
    """Installs ``http_limits`` (keys ``KEY`` and ``OTHER``) on the running app."""
    state.install(access=Access(KeyRing([KEY, OTHER]), HttpLimitsConfig(**limits), max_model_len=256, vocab_size=1000))


def operations(client) -> list[tuple[str, str, dict | None]]:
    """(method, path, JSON body) of every operation in the schema that a key protects."""
    out = []
    for path, ops in client.get("/openapi.json").json()["paths"].items():
        if path in OPEN_PATHS:
            continue
        for method in ops:
            body = (
                GENERATIONS.get(
                    path,
                    {"round": 1, "committed_length": 1, "draft_ids": []}
                    if path.endswith("/verify")
                    else {"prompt": "hi"},
                )
                if method == "post"
                else None
            )
            out.append((method.upper(), path.replace("{session_id}", SID), body))
    return out


# ---------------------------------------------------------------------- 401, before anything runs
def test_every_protected_operation_refuses_a_missing_or_wrong_key_and_runs_nothing(client, served):
    ops = operations(client)
    assert {p for _, p, _ in ops} >= {
        *GENERATIONS,
        "/v1/models",
        "/v1/stats",
        "/v1/cs",
        "/v1/cs/sessions",
        f"/v1/cs/sessions/{SID}/verify",
        f"/v1/cs/sessions/{SID}",
    }
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": f"Bearer {KEY[:-1]}"},
        {"Authorization": "Bearer"},
        {"X-Api-Key": KEY},
    ):
        for method, path, body in ops:
            r = client.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (method, path, headers, r.text)
            err = r.json()["error"]
            assert err["type"] == "authentication_error" and err["code"] == 401 and err["message"], err
            assert r.headers["www-authenticate"] == "Bearer"
            assert KEY not in r.text
    # a body that does not even parse: refused for the key, never read
    r = client.post("/v1/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 401
    assert served.ran_nothing(), served


def test_with_the_key_every_route_serves(client, served):
    for path, body in GENERATIONS.items():
        for key in (KEY, OTHER):
            r = client.post(path, json=body, headers={"Authorization": f"bearer {key}"})  # the scheme in any case
            assert r.status_code == 200, r.text
    assert len(served.service.sessions) == 6
    assert client.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "smollm"
    assert client.get("/v1/stats", headers=AUTH).status_code == 200
    assert client.get("/v1/cs", headers=AUTH).json() == {"model": "smollm"}
    assert client.delete(f"/v1/cs/sessions/{SID}", headers=AUTH).status_code == 404  # past the key: unknown session


def test_health_readiness_and_the_schema_stay_open(client, served):
    for path in ("/healthz", "/readyz", "/openapi.json", "/docs"):
        assert client.get(path).status_code == 200, path


# ---------------------------------------------------------------------- the keys
def test_a_key_is_compared_with_every_key_in_constant_time(monkeypatch):
    ring = KeyRing(["a" * 32, "b" * 32, "c" * 32])
    calls, compare = [], hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append(1) or compare(a, b))
    for presented, ok in (("a" * 32, True), ("c" * 32, True), ("a" * 31, False), ("", False), (None, False)):
        calls.clear()
        assert (ring.match(presented) is not None) == ok, presented
        assert len(calls) == (3 if presented is not None else 0)  # no early exit on the first match
    assert ring.match("a" * 32) != ring.match("b" * 32)  # distinct identities for the per-key limits
    assert "a" * 32 not in repr(ring) and repr(ring) == "KeyRing(3 keys)"


def test_keys_from_the_config_the_environment_and_a_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# rotated monthly\n\nfile-key-1\n  file-key-2  \n")
    cfg = HttpAuthConfig.model_validate({"api_keys": ["yaml-key"], "api_keys_file": str(path)})
    ring = KeyRing.from_config(cfg, {auth.KEYS_ENV: "env-key-1, env-key-2"})
    for key in ("yaml-key", "file-key-1", "file-key-2", "env-key-1", "env-key-2"):
        assert ring.match(key) is not None, key
    assert ring.match("# rotated monthly") is None and len(ring) == 5
    assert "yaml-key" not in repr(cfg)  # a secret in the config model's repr too
    ring = KeyRing.from_config(None, {auth.KEYS_FILE_ENV: str(path)})
    assert ring.match("file-key-2") is not None and ring.file == str(path)
    assert not KeyRing.from_config(None, {}).enabled


def test_a_named_key_file_that_is_missing_or_empty_stops_the_start(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        KeyRing([], str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("# no key yet\n")
    with pytest.raises(ValueError, match="holds no key"):
        KeyRing([], str(tmp_path / "empty"))


def test_the_key_file_is_reread_when_it_changes_and_never_opens_the_api(monkeypatch, tmp_path, caplog, serve_log):
    monkeypatch.setattr(auth, "RELOAD_CHECK_S", 0.0)
    path = tmp_path / "keys"
    path.write_text("old-key\n")
    ring = KeyRing([], str(path))
    assert ring.match("old-key") is not None and ring.match("new-key") is None
    tmp = tmp_path / "keys.new"  # as a Secret volume updates: a new file swapped in
    tmp.write_text("old-key\nnew-key\n")
    os.replace(tmp, path)
    assert ring.match("new-key") is not None and ring.match("old-key") is not None
    tmp.write_text("new-key\n")
    os.replace(tmp, path)
    assert ring.match("old-key") is None and ring.match("new-key") is not None  # rotated out
    with caplog.at_level(logging.WARNING):
        path.write_text("")  # emptied, then gone: the keys held stay valid, the API stays closed
        assert ring.match("new-key") is not None and ring.enabled
        path.unlink()
        assert ring.match("new-key") is not None and ring.enabled
    assert "new-key" not in caplog.text and "old-key" not in caplog.text


@pytest.fixture
def serve_log(caplog, monkeypatch):
    """The Gateway's logger (``ray.serve``) into caplog, once, whether or not Ray stopped its propagation."""
    logger = logging.getLogger("ray.serve")
    monkeypatch.setattr(logger, "propagate", False)
    logger.addHandler(caplog.handler)
    yield
    logger.removeHandler(caplog.handler)


def test_an_open_api_warns_once_at_start_and_a_closed_one_does_not(caplog, monkeypatch, serve_log):
    monkeypatch.delenv(auth.KEYS_ENV, raising=False)
    monkeypatch.delenv(auth.KEYS_FILE_ENV, raising=False)
    cfg = SimpleNamespace(http_auth=HttpAuthConfig(), http_limits=HttpLimitsConfig())
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        assert not Access.for_gateway(cfg, 2048, 1000).keys.enabled
    assert [r.getMessage() for r in caplog.records] == [OPEN_WARNING]
    caplog.clear()
    monkeypatch.setenv(auth.KEYS_ENV, KEY)
    with caplog.at_level(logging.DEBUG, logger="ray.serve"):
        assert Access.for_gateway(cfg, 2048, 1000).keys.enabled
    assert not caplog.records


def test_no_key_reaches_a_log(client, served, caplog, serve_log):
    with caplog.at_level(logging.DEBUG):
        client.post("/v1/generate", json={"prompt": "x"}, headers={"Authorization": f"Bearer {KEY}x"})
        client.post("/v1/generate", json={"prompt": "x", "max_tokens": 2}, headers=AUTH)
    assert KEY not in caplog.text


# ---------------------------------------------------------------------- the body cap
class Upload:
    """An ASGI request whose body is ``chunks`` chunks of ``size`` bytes, made as they are asked for."""

    def __init__(self, chunks: int, size: int, content_length: bool):
        self.chunks, self.size, self.content_length = chunks, size, content_length
        self.pulled = 0
        self.status = None
        self.body = b""

    def scope(self, path: str) -> dict:
        headers = [(b"content-type", b"application/json"), (b"authorization", AUTH["Authorization"].encode())]
        if self.content_length:
            headers.append((b"content-length", str(self.chunks * self.size).encode()))
        return http_scope(path, headers)

    async def receive(self):
        if self.pulled == self.chunks:  # the whole body went: then the client goes away
            return {"type": "http.disconnect"}
        self.pulled += 1
        return {"type": "http.request", "body": b"x" * self.size, "more_body": self.pulled < self.chunks}

    async def send(self, message):
        if message["type"] == "http.response.start":
            self.status = message["status"]
        else:
            self.body += message.get("body", b"")


@pytest.mark.parametrize("content_length", [True, False])
def test_a_body_over_the_cap_is_413_before_the_route_and_is_not_held(served, content_length):
    app = create_app()
    cap = access_mod.current().caps.json
    mib = 1 << 20
    upload = Upload(200, mib, content_length)  # 200 MiB, made only as far as the server reads
    asyncio.run(app(upload.scope("/v1/generate"), upload.receive, upload.send))
    assert upload.status == 413, upload.body
    err = json.loads(upload.body)["error"]
    assert err["param"] == "body" and err["code"] == 413 and "http_limits.max_body_bytes" in err["message"]
    assert upload.pulled == (0 if content_length else cap // mib + 1)  # never more than the cap's worth
    assert served.ran_nothing()


def test_a_verify_frame_may_carry_the_drafters_distributions(served):
    caps = access_mod.current().caps
    assert caps.frame > caps.json >= 1 << 20
    app = create_app()
    chunk = 1 << 16
    n = (caps.json // chunk) + 2  # over the JSON cap, within the frame cap: reaches the route
    upload = Upload(n, chunk, True)
    asyncio.run(app(upload.scope(f"/v1/cs/sessions/{SID}/verify"), upload.receive, upload.send))
    assert upload.status == 400 and upload.pulled == n, upload.body  # read whole, then refused as a frame
    upload = Upload(caps.frame // chunk + 1, chunk, True)
    asyncio.run(app(upload.scope(f"/v1/cs/sessions/{SID}/verify"), upload.receive, upload.send))
    assert upload.status == 413 and "max_frame_bytes" in upload.body.decode() and upload.pulled == 0
    assert not served.cs.calls


def test_the_body_cap_is_configurable_and_sized_from_the_context(served, client):
    limit(max_body_bytes=4096)
    r = client.post("/v1/generate", json={"prompt": "x" * 5000}, headers=AUTH)
    assert r.status_code == 413 and r.headers["connection"] == "close"
    assert client.post("/v1/generate", json={"prompt": "x" * 100, "max_tokens": 2}, headers=AUTH).status_code == 200
    small, large = Access(max_model_len=2048).caps, Access(max_model_len=131072).caps
    assert small.json == 1 << 20 and large.json == 64 * 131072
    assert Access(max_model_len=2048, vocab_size=49152).caps.frame == (1 << 20) + 64 * 49152 * 4


def test_over_http_a_large_upload_is_cut_short_with_413(served):
    """Real HTTP (uvicorn): a client streams a 256 MiB body without Content-Length; the server
    answers 413 and closes after reading about the cap, not the body."""
    from moa_serve.measure.client_server_stack import UvicornThread

    http = UvicornThread(create_app(), (18650, 18750))
    chunk = b"%x\r\n" % (1 << 20) + b"x" * (1 << 20) + b"\r\n"
    sent, answer, pending, writing = 0, b"", memoryview(b""), True
    try:
        with socket.create_connection(("127.0.0.1", http.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
            )
            sock.setblocking(False)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and b"\r\n\r\n" not in answer:
                readable, writable, _ = select.select([sock], [sock] if writing else [], [], 0.5)
                if readable:
                    try:
                        data = sock.recv(65536)
                    except ConnectionResetError:
                        break
                    if not data:
                        break
                    answer += data
                elif writable:
                    if not pending:
                        if sent == 256:
                            writing = False
                            continue
                        pending, sent = memoryview(chunk), sent + 1
                    try:
                        pending = pending[sock.send(pending) :]
                    except BlockingIOError:
                        pass
                    except (BrokenPipeError, ConnectionResetError):
                        writing = False
    finally:
        http.stop()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent < 64, f"{sent} MiB went out before the server answered"
    assert served.ran_nothing()


# ---------------------------------------------------------------------- slow bodies, stalled readers
class Slow:
    """A POST from ``client`` whose body is announced (Content-Length: 100) and never sent, or,
    with ``prompt``, sent whole with the headers."""

    def __init__(self, client: str = "10.0.0.1", prompt: bool = False):
        self.client, self.prompt = client, prompt
        self.status, self.headers, self.body = None, {}, b""

    def scope(self) -> dict:
        body = json.dumps(GENERATIONS["/v1/generate"]).encode() if self.prompt else b"x" * 100
        self.payload = body
        return http_scope(
            "/v1/generate",
            [
                (b"content-type", b"application/json"),
                (b"authorization", AUTH["Authorization"].encode()),
                (b"content-length", str(len(body)).encode()),
            ],
            client=self.client,
        )

    async def receive(self):
        if self.prompt and self.payload is not None:
            body, self.payload = self.payload, None
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the body never comes (nor does the client go away)

    async def send(self, message):
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = {k.decode(): v.decode() for k, v in message["headers"]}
        else:
            self.body += message.get("body", b"")

    async def run(self, app):
        await app(self.scope(), self.receive, self.send)
        return self


def test_a_body_that_does_not_arrive_in_time_gets_408_and_the_connection_is_closed(served):
    limit(body_timeout_s=0.3)
    slow = asyncio.run(asyncio.wait_for(Slow().run(create_app()), 10))
    assert slow.status == 408 and slow.headers["connection"] == "close", slow.body
    err = json.loads(slow.body)["error"]
    assert err["param"] == "body" and "http_limits.body_timeout_s" in err["message"]
    assert served.ran_nothing()


def test_slow_bodies_are_bounded_per_client_and_a_client_that_sends_its_body_is_never_counted(served):
    limit(max_slow_requests_per_client=2, body_timeout_s=30)
    app = create_app()

    async def scenario():
        held = [asyncio.create_task(Slow().run(app)) for _ in range(2)]
        await asyncio.sleep(1.3)  # past the grace: both are slow requests of 10.0.0.1
        third = await asyncio.wait_for(Slow().run(app), 5)
        other_client = asyncio.create_task(Slow("10.0.0.2").run(app))
        prompt = await asyncio.wait_for(Slow(prompt=True).run(app), 10)  # the same address, its body at once
        await asyncio.sleep(1.3)
        assert not other_client.done() and not any(t.done() for t in held)
        for t in [*held, other_client]:
            t.cancel()
        await asyncio.gather(*held, other_client, return_exceptions=True)
        return third, prompt

    third, prompt = asyncio.run(scenario())
    assert third.status == 429 and third.headers["connection"] == "close" and third.headers["retry-after"] == "3"
    assert "max_slow_requests_per_client" in third.body.decode()
    assert prompt.status == 200, prompt.body
    assert access_mod.current().slow_clients.slow("10.0.0.1") == 0  # every slow request released its count


def test_a_body_streamed_in_chunks_is_never_a_slow_one(served):
    """A body whose bytes keep coming (a large upload over a slow link) is read to its end however
    long it takes within its time: its client is never counted among the slow ones."""
    limit(max_slow_requests_per_client=1, body_timeout_s=30)

    class Chunked(Slow):
        async def receive(self):
            await asyncio.sleep(0.2)
            body, self.payload = self.payload[:8], self.payload[8:]
            return {"type": "http.request", "body": body, "more_body": bool(self.payload)}

    async def scenario():
        app = create_app()
        held = asyncio.create_task(Slow().run(app))  # one slow request: the client is at its bound
        await asyncio.sleep(1.3)
        streamed = await asyncio.wait_for(Chunked(prompt=True).run(app), 30)  # ~2 s of 8-byte chunks
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        return streamed

    streamed = asyncio.run(scenario())
    assert streamed.status == 200, streamed.body


def test_a_stream_whose_client_stops_reading_is_ended_and_its_session_aborted(served, monkeypatch):
    limit(stalled_stream_timeout_s=0.3)
    aborted = []

    async def endless(tracked):
        while True:
            yield TokenEvent(served.service.tokens[:1])
            await asyncio.sleep(0.01)

    monkeypatch.setattr(served.service, "stream", endless)
    monkeypatch.setattr(served.service, "abort", aborted.append)
    reader = Slow(prompt=True)
    sent = []

    async def send(message):  # the first chunk goes out, then the client's TCP window is full
        sent.append(message)
        if message["type"] == "http.response.body" and len(sent) > 2:
            await asyncio.Event().wait()

    async def scenario():
        scope = reader.scope()
        reader.payload = json.dumps({**GENERATIONS["/v1/generate"], "stream": True, "max_tokens": 1000}).encode()
        scope["headers"][-1] = (b"content-length", str(len(reader.payload)).encode())
        await create_app()(scope, reader.receive, send)

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert sent[0]["status"] == 200 and len(aborted) == 1 and served.service.sessions


# ---------------------------------------------------------------------- limits on what a request asks for
@pytest.mark.parametrize("path", list(GENERATIONS))
def test_stop_strings_n_and_best_of_are_bounded_with_a_400_naming_the_field(client, served, path):
    body = GENERATIONS[path]
    refused = [
        ("stop", ["s"] * (MAX_STOP_STRINGS + 1)),
        ("stop", "s" * (MAX_STOP_CHARS + 1)),
        ("stop", ["s", "s" * (MAX_STOP_CHARS + 1)]),
    ]
    if path != "/v1/generate":
        refused += [("n", MAX_CHOICES + 1), ("best_of", 2)]
    for field, value in refused:
        r = client.post(path, json={**body, field: value}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    assert not served.service.sessions
    ok = {**body, "stop": [f"stop-{i}" + "s" * (MAX_STOP_CHARS - 8) for i in range(MAX_STOP_STRINGS)]}
    assert client.post(path, json=ok, headers=AUTH).status_code == 200


def test_max_tokens_over_the_cap_is_a_400_naming_the_field_and_a_default_is_capped(client, served):
    limit(max_tokens=8)
    for path, field in (
        ("/v1/generate", "max_tokens"),
        ("/v1/completions", "max_tokens"),
        ("/v1/chat/completions", "max_tokens"),
        ("/v1/chat/completions", "max_completion_tokens"),
    ):
        body = {k: v for k, v in GENERATIONS[path].items() if k != "max_tokens"}
        r = client.post(path, json={**body, field: 9}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert "http_limits.max_tokens" in r.json()["error"]["message"]
        assert client.post(path, json={**body, field: 8}, headers=AUTH).status_code == 200
        assert served.service.sessions[-1].max_new_tokens == 8
        assert client.post(path, json=body, headers=AUTH).status_code == 200  # the default (16..256): capped
        assert served.service.sessions[-1].max_new_tokens == 8
    r = client.post(
        "/v1/cs/sessions",
        json={"prompt": "hi", "max_tokens": 9, "fingerprints": {"target": "t", "tokenizer": "t", "drafter": None}},
        headers=AUTH,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "create" not in served.cs.calls


def test_a_key_at_its_concurrency_limit_gets_429_while_others_go_on(served):
    limit(max_concurrent_requests_per_key=1)
    app = create_app()

    async def scenario():
        served.service.gate = asyncio.Event()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            first = asyncio.create_task(c.post("/v1/generate", json=GENERATIONS["/v1/generate"], headers=AUTH))
            while not served.service.sessions:
                await asyncio.sleep(0.01)
            busy = await c.post("/v1/completions", json=GENERATIONS["/v1/completions"], headers=AUTH)
            stats = await c.get("/v1/stats", headers=AUTH)  # reads are not counted
            other = asyncio.create_task(
                c.post("/v1/generate", json=GENERATIONS["/v1/generate"], headers={"Authorization": f"Bearer {OTHER}"})
            )
            while len(served.service.sessions) < 2:
                await asyncio.sleep(0.01)
            served.service.gate.set()
            done = [await first, await other]
            again = await c.post("/v1/generate", json=GENERATIONS["/v1/generate"], headers=AUTH)
        return busy, stats, done, again

    busy, stats, done, again = asyncio.run(scenario())
    assert busy.status_code == 429 and busy.headers["retry-after"] == "3", busy.text
    assert busy.json()["error"]["type"] == "rate_limit_error" and "max_concurrent_requests_per_key" in busy.text
    assert stats.status_code == 200 and [r.status_code for r in done] == [200, 200] and again.status_code == 200
    assert len(served.service.sessions) == 3  # the refused request started nothing


# ---------------------------------------------------------------------- the schema
def test_the_schema_documents_401_413_429_and_the_bearer_scheme_while_keys_are_set(client, served):
    schema = client.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["apiKey"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "an API key of the server (docs/security.md)",
    }
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            responses = op["responses"]
            if path in OPEN_PATHS:
                assert "401" not in responses and "security" not in op, path
                continue
            assert op["security"] == [{"apiKey": []}] and "401" in responses, (method, path)
            assert ("413" in responses) == ("requestBody" in op), (method, path)
            if method == "post":
                assert "Retry-After" in responses["429"]["headers"], path
    state.install(access=Access())  # open: the statuses stay, the scheme goes
    schema = client.get("/openapi.json").json()
    assert "securitySchemes" not in schema.get("components", {})
    assert "401" in schema["paths"]["/v1/generate"]["post"]["responses"]


@pytest.fixture
def keyed_schema(served):
    served.frontend.max_model_len = 1 << 20  # no generated prompt fills the context (test_http_api.py says why)
    state.install(access=Access(KeyRing([KEY]), max_model_len=1 << 20, vocab_size=1000), ready=None, cs=None)
    return schemathesis.openapi.from_asgi("/openapi.json", create_app())


fuzzed = schemathesis.pytest.from_fixture("keyed_schema")


@fuzzed.parametrize()
@settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_schemathesis_with_the_key_no_undocumented_status_and_no_route_ignores_the_key(case):
    """Every default check with the key sent, ``ignored_auth`` included: it repeats a call that
    succeeded without the key and with a wrong one, and fails unless both are refused."""
    case.call_and_validate(headers=AUTH)


# ---------------------------------------------------------------------- clients that send the key
def test_the_official_openai_client_works_with_the_key(client, served):
    openai = pytest.importorskip("openai")
    ok = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=client, max_retries=0)
    chat = ok.chat.completions.create(model="smollm", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.choices[0].message.content
    stream = ok.completions.create(model="smollm", prompt="Hi", max_tokens=4, stream=True)
    assert "".join(c.choices[0].text for c in stream)
    assert [m.id for m in ok.models.list()] == ["smollm"]
    bad = openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=client, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="smollm", messages=[{"role": "user", "content": "Hi"}])
    assert len(served.service.sessions) == 2


def test_the_device_transport_sends_the_key(client, served):
    from moa_serve.client import ServerError, Transport

    assert Transport(http=client, timeout_s=5, api_key=KEY).info() == {"model": "smollm"}
    client.headers.pop("authorization", None)
    with pytest.raises(ServerError) as refused:
        Transport(http=client, timeout_s=5).info()
    assert refused.value.status == 401 and refused.value.kind == "authentication_error"
    assert served.cs.calls == ["identity"]


def test_moa_client_takes_the_key_from_its_flag_or_the_environment(monkeypatch):
    from moa_serve.cli import build_parser
    from moa_serve.client.cli import transport_of
    from moa_serve.client.transport import API_KEY_ENV

    argv = ["client", "generate", "--server", "http://127.0.0.1:9", "--prompt", "hi"]
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert "authorization" not in transport_of(build_parser().parse_args(argv)).http.headers
    monkeypatch.setenv(API_KEY_ENV, OTHER)
    assert transport_of(build_parser().parse_args(argv)).http.headers["authorization"] == f"Bearer {OTHER}"
    flagged = build_parser().parse_args(argv + ["--api-key", KEY])
    assert transport_of(flagged).http.headers["authorization"] == f"Bearer {KEY}"
