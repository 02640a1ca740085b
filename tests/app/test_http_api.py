"""The HTTP API's statuses against its OpenAPI schema, on the in-process FastAPI app over a fake
round service (the same routes, models and error handlers the Router mounts):

* schemathesis fuzzes every operation (a bounded number of examples): no server error, and every
  status, content type and body is one the schema documents (400 for bad input, never 422);
* before the pools are ready a generation gets 503 with Retry-After, a full queue 429 with
  Retry-After, a failed round 500, a server without a frontend yet 503 — each documented;
* every float sampling field (NaN, infinities, denormals, huge values) on every route: a 400
  naming the field, or what the value means (a temperature below the epsilon is greedy) — the
  fake service samples from a distribution warped with the session's parameters, as the
  verifier does, so a value the sampler cannot run fails here as it would on a server."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import schemathesis
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from starlette.requests import ClientDisconnect
from transformers import AutoTokenizer

from moa_serve.app import frontend as frontend_mod
from moa_serve.app import state
from moa_serve.app.frontend import Frontend, Speculation, Unsupported
from moa_serve.app.http import create_app
from moa_serve.engine.events import QueueFullError, TokenEvent
from moa_serve.engine.round_stats import ServiceStats
from moa_serve.protocol import TokenLogprobs
from moa_serve.sampling import SAMPLING_EPS, SEED_MAX, sample, warp_probs
from tests.conftest import SMOLLM
from tests.support.asgi import http_scope
from tests.support.json_numbers import NOT_FINITE_OR_EXTREME

# examples per operation: 30 keep CI to seconds; MOA_SCHEMATHESIS_EXAMPLES=2000 for a long local run
EXAMPLES = int(os.environ.get("MOA_SCHEMATHESIS_EXAMPLES", "30"))

GENERATION_ROUTES = [
    ("/v1/generate", {"prompt": "Once upon a time", "max_tokens": 4}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story"}], "max_tokens": 4}),
]


class FakeRoundService:
    """Answers every session with a few fixed tokens; ``full`` makes submit refuse (a full queue),
    ``fail`` makes the round end in an error event. A sampling session first draws a token from
    logits warped with its parameters, as the verifier does (an error there fails the request as
    a verifier error would); ``sampled`` records each session's parameters."""

    queue_depth = active_sessions = 0

    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self.stats = ServiceStats()
        self.full = self.fail = False
        self.submitted = 0
        self.sampled = []

    def submit(self, session):
        if self.full:
            raise QueueFullError("64 requests are waiting")
        self.submitted += 1
        return session

    async def stream(self, tracked):
        await asyncio.sleep(0)
        self.sampled.append(tracked.sampling)
        if not tracked.sampling.greedy:
            logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(0)) * 30
            sample(warp_probs(logits, tracked.sampling)[0], None)
        if self.fail:
            yield TokenEvent([], "error: RuntimeError: every verify retry failed")
            return
        yield TokenEvent(self.tokens[:2], None, *self.logprobs(tracked, self.tokens[:2], tracked.prompt))
        yield TokenEvent(self.tokens[2:], "length", self.logprobs(tracked, self.tokens[2:], [])[0])

    @staticmethod
    def logprobs(session, tokens: list[int], prompt: list[int]):
        """(log-probabilities of ``tokens``, of the prompt's tokens from position 1 on), as the
        session asks: each token's is -0.5, its alternatives' the token itself and the next id."""
        if session.logprobs is None:
            return None, None

        def one(t: int) -> TokenLogprobs:
            return TokenLogprobs(-0.5, [(t, -0.5), (t + 1, -1.5)][: session.logprobs])

        scores = [one(t) for t in prompt[1:]] if session.score_prompt else None
        return [one(t) for t in tokens], scores

    def abort(self, tracked):
        pass


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(SMOLLM))


@pytest.fixture
def service(tokenizer):
    return FakeRoundService(tokenizer.encode(" and they lived happily"))


def install_frontend(service, tokenizer, max_model_len: int) -> Frontend:
    frontend = Frontend(
        service,
        tokenizer,
        max_model_len=max_model_len,
        stop_token_ids=frozenset(),
        speculation=Speculation(enabled=True, num_speculative_tokens=3),
        model_name="smollm",
    )
    state.install(frontend=frontend, ready=None, retry_after_s=3, stats=None, cs=None)
    return frontend


@pytest.fixture
def served(monkeypatch, tokenizer, service):
    """Installs a frontend over the fake service, as the Router does; the state is restored after."""
    monkeypatch.setattr(state, "_STATE", {})
    return install_frontend(service, tokenizer, max_model_len=256)


@pytest.fixture
def client(served):
    with TestClient(create_app(ready_wait_s=0.5), raise_server_exceptions=False) as c:
        yield c


def documented(client: TestClient, path: str, method: str, status: int) -> dict:
    """The schema's entry for ``status`` of an operation (fails when it is not documented)."""
    responses = client.get("/openapi.json").json()["paths"][path][method]["responses"]
    assert str(status) in responses, f"{method.upper()} {path} answers {status}, undocumented: {sorted(responses)}"
    return responses[str(status)]


def assert_error(r, status: int, kind: str, retry_after: bool):
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["type"] == kind and body["code"] == status and body["message"]
    assert ("retry-after" in r.headers) == retry_after
    if retry_after:
        assert int(r.headers["retry-after"]) == 3


# ---------------------------------------------------------------------- the schema, fuzzed
@pytest.fixture
def api_schema(monkeypatch, tokenizer, service):
    """The app over a context no generated prompt fills, and a grammar engine that compiles every
    grammar: a prompt longer than the context, or a regular expression the engine cannot compile,
    is a documented 400 that the schema cannot foresee (it counts tokens, it compiles), tested on
    its own."""
    monkeypatch.setattr(state, "_STATE", {})
    monkeypatch.setattr(frontend_mod, "check", lambda spec: None)
    install_frontend(service, tokenizer, max_model_len=1 << 20)
    return schemathesis.openapi.from_asgi("/openapi.json", create_app())


fuzzed = schemathesis.pytest.from_fixture("api_schema")


@fuzzed.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 30,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_schemathesis_no_server_error_and_no_undocumented_status(case):
    """Every default check: no 5xx, documented statuses / content types / headers / bodies,
    schema-invalid input rejected (400), schema-valid input accepted. A longer run against a live
    server: docs/architecture.md."""
    case.call_and_validate()


def test_openapi_documents_400_not_422_and_retry_after(client):
    schema = client.get("/openapi.json").json()
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for path, operations in schema["paths"].items():
        for method, op in operations.items():
            assert "422" not in op["responses"], (method, path)
            for status in ("429", "503"):
                if status in op["responses"] and path != "/readyz":
                    assert "Retry-After" in op["responses"][status]["headers"], (method, path, status)
            if method == "post":
                assert op["responses"]["400"]["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/ErrorResponse"
                }, path
    for path, _ in GENERATION_ROUTES:
        responses = schema["paths"][path]["post"]["responses"]
        assert {"200", "400", "429", "500", "503"} <= set(responses)
        assert "text/event-stream" in responses["200"]["content"]


def test_openapi_describes_the_client_server_frames_and_links_a_sessions_calls(client):
    """The binary bodies have a documented layout and 400; the links take a stateful fuzzer from the
    handshake to create (the server's fingerprints) and from create (its Session-Id) to verify and
    DELETE: every link names an operation and parameters that exist, and reads fields the source
    answers."""
    import dataclasses

    from moa_serve.client_server.sessions import ServerIdentity

    schema = client.get("/openapi.json").json()
    ops = {
        op["operationId"]: (path, method, op) for path, item in schema["paths"].items() for method, op in item.items()
    }
    for op_id in ("cs_create_session", "cs_verify_round"):
        path, _, op = ops[op_id]
        frame = op["requestBody"]["content"]["application/octet-stream"]["schema"]
        assert frame["format"] == "binary" and "uint32, little-endian" in frame["description"]
        assert "application/json" in op["requestBody"]["content"]
        assert "malformed frame" in op["responses"]["400"]["description"]
        assert set(op["responses"]["200"]["content"]) == {"application/octet-stream"}, path
    handshake_fields = {f.name for f in dataclasses.fields(ServerIdentity)}
    create = ops["cs_create_session"][2]["responses"]["200"]
    assert create["headers"]["Session-Id"]["required"] is True
    links = {**ops["cs_identity"][2]["responses"]["200"]["links"], **create["links"]}
    assert {link["operationId"] for link in links.values()} == {
        "cs_create_session",
        "cs_verify_round",
        "cs_close_session",
    }
    for link in links.values():
        target = ops[link["operationId"]][2]
        for name, expr in link.get("parameters", {}).items():
            assert name in {p["name"] for p in target["parameters"]} and expr == "$response.header.Session-Id"
        for part, expr in link.get("requestBody", {}).get("fingerprints", {}).items():
            assert expr == f"$response.body#/{part}" and part in handshake_fields


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/generate", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/generate", {"prompt": "x", "colour": "red"}, "colour"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ("/v1/completions", {"prompt": "word " * 300}, "prompt"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": [1, 2, 10**9]}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], [3]]}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ("/v1/generate", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ],
)
def test_bad_input_is_a_documented_400_naming_the_field(client, path, body, param):
    r = client.post(path, json=body)
    assert_error(r, 400, "invalid_request_error", retry_after=False)
    assert r.json()["error"]["param"] == param
    documented(client, path, "post", 400)


def test_wrong_method_is_405_with_allow(client):
    r = client.get("/v1/generate")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["code"] == 405


# ---------------------------------------------------------------------- sampling values the sampler cannot run
FLOAT_FIELDS = {
    "/v1/generate": ("temperature", "top_p"),
    "/v1/completions": ("temperature", "top_p", "presence_penalty", "frequency_penalty"),
    "/v1/chat/completions": ("temperature", "top_p", "presence_penalty", "frequency_penalty"),
}
# as a client writes them in the JSON text
REFUSED = {**NOT_FINITE_OR_EXTREME, "negative": "-1"}
DENORMALS = ("2.225073858507e-311", "5e-324")


def post_raw(client, path: str, body: dict, field: str, raw: str):
    """POSTs ``body`` with ``"field": raw`` written into the JSON text as is."""
    text = json.dumps(body)[:-1] + f', "{field}": {raw}}}'
    return client.post(path, content=text, headers={"content-type": "application/json"})


@pytest.mark.parametrize("raw", REFUSED.values(), ids=REFUSED.keys())
@pytest.mark.parametrize("path, body", GENERATION_ROUTES)
def test_a_float_sampling_value_the_model_cannot_run_is_a_400_naming_the_field(client, service, path, body, raw):
    for field in FLOAT_FIELDS[path]:
        r = post_raw(client, path, body, field, raw)
        assert_error(r, 400, "invalid_request_error", retry_after=False)
        assert r.json()["error"]["param"] == field, (field, r.json())
    assert service.submitted == 0
    documented(client, path, "post", 400)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("raw", DENORMALS + ("1e-30", repr(SAMPLING_EPS / 2)))
@pytest.mark.parametrize("path, body", GENERATION_ROUTES)
def test_a_temperature_below_the_epsilon_is_greedy_on_every_route(client, service, path, body, raw, stream):
    """The input of the report: a denormal temperature reached the sampler and answered 500."""
    r = post_raw(client, path, {**body, "stream": stream, "top_p": 0.5}, "temperature", raw)
    assert r.status_code == 200, r.text
    assert "error" not in r.text
    assert service.sampled[-1].greedy and service.sampled[-1].temperature == 0.0
    r = post_raw(client, path, body, "temperature", repr(SAMPLING_EPS))
    assert r.status_code == 200 and service.sampled[-1].temperature == SAMPLING_EPS  # from the epsilon on: sampled


@pytest.mark.parametrize("raw", DENORMALS)
@pytest.mark.parametrize("path, body", GENERATION_ROUTES)
def test_a_denormal_top_p_samples_the_most_likely_token(client, service, path, body, raw):
    r = post_raw(client, path, {**body, "temperature": 1.0}, "top_p", raw)
    assert r.status_code == 200, r.text
    assert not service.sampled[-1].greedy and 0 < service.sampled[-1].top_p < 1e-300
    if path != "/v1/generate":  # OpenAI's penalties: only 0 is served; a denormal is not 0
        for field in ("presence_penalty", "frequency_penalty"):
            r = post_raw(client, path, body, field, raw)
            assert r.status_code == 400 and r.json()["error"]["param"] == field


@pytest.mark.parametrize("path, body", GENERATION_ROUTES)
def test_integer_sampling_fields_at_their_bounds(client, service, path, body):
    assert client.post(path, json={**body, "temperature": 1.0, "seed": SEED_MAX, "top_k": 10**30}).status_code == 200
    for field, value in (("seed", SEED_MAX + 1), ("seed", -1), ("top_k", -1)):
        r = client.post(path, json={**body, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)


# ---------------------------------------------------------------------- startup and overload
@pytest.mark.parametrize("path, body", GENERATION_ROUTES)
def test_before_the_pools_are_ready_a_generation_gets_503_then_runs(client, service, path, body):
    calls, pools_up = [], []

    async def ready():  # the Router's check: every pool answers info()
        calls.append(1)
        return (
            (True, {"pools": {"verifier": {}}})
            if pools_up
            else (False, {"pools": {"verifier": {"error": "TimeoutError"}}})
        )

    state.install(ready=ready)
    r = client.post(path, json=body)
    assert_error(r, 503, "service_unavailable", retry_after=True)
    assert "Retry-After" in documented(client, path, "post", 503)["headers"]
    assert service.submitted == 0  # nothing was queued behind a pool that is still loading
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json()["ready"] is False and int(r.headers["retry-after"]) == 3
    pools_up.append(True)
    assert client.post(path, json=body).status_code == 200
    checks = len(calls)
    assert client.post(path, json=body).status_code == 200 and len(calls) == checks  # ready is kept


def test_a_readiness_check_that_hangs_answers_503_within_the_wait(client):
    async def loading():  # a pool replica that does not exist yet: the call waits
        await asyncio.sleep(30)

    state.install(ready=loading)
    r = client.post("/v1/generate", json={"prompt": "hi"})
    assert_error(r, 503, "service_unavailable", retry_after=True)
    documented(client, "/v1/generate", "post", 503)


def test_client_server_routes_wait_for_readiness_too(client):
    async def not_ready():
        return False, {"pools": {"verifier": {"error": "TimeoutError"}}}

    state.install(ready=not_ready, cs=object())  # any installed sessions object: readiness comes first
    assert_error(client.get("/v1/cs"), 503, "service_unavailable", retry_after=True)
    documented(client, "/v1/cs", "get", 503)


def test_without_a_frontend_yet_routes_answer_503(client):
    state.install(frontend=None)
    for method, path, kw in (
        ("get", "/v1/models", {}),
        ("get", "/v1/stats", {}),
        ("post", "/v1/generate", {"json": {"prompt": "hi"}}),
    ):
        r = client.request(method.upper(), path, **kw)
        assert_error(r, 503, "service_unavailable", retry_after=True)
        documented(client, path, method, 503)


@pytest.mark.parametrize("path, body", GENERATION_ROUTES)
def test_a_full_queue_answers_429_with_retry_after(client, service, path, body):
    service.full = True
    r = client.post(path, json=body)
    assert_error(r, 429, "rate_limit_error", retry_after=True)
    assert "Retry-After" in documented(client, path, "post", 429)["headers"]


@pytest.mark.parametrize("path, body", GENERATION_ROUTES)
def test_a_failed_round_is_a_documented_500(client, service, path, body):
    service.fail = True
    r = client.post(path, json=body)
    assert_error(r, 500, "server_error", retry_after=False)
    documented(client, path, "post", 500)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, body", GENERATION_ROUTES)
def test_after_a_failed_round_pools_that_do_not_answer_get_503_not_500s(client, service, path, body, stream):
    pools_up = [True]

    async def ready():
        return (True, {}) if pools_up[0] else (False, {"pools": {"verifier": {"error": "ActorDiedError"}}})

    state.install(ready=ready)
    assert client.post(path, json=body).status_code == 200
    service.fail, pools_up[0] = True, False  # the verifier pool is gone: the round fails for good
    r = client.post(path, json={**body, "stream": stream})
    if stream:  # the status went out with the first byte: the error is an event
        assert r.status_code == 200 and '"type": "server_error"' in r.text
    else:
        assert_error(r, 500, "server_error", retry_after=False)
    submitted = service.submitted
    for _ in range(3):  # no more 500s: told to come back, nothing queued behind dead pools
        r = client.post(path, json=body)
        assert_error(r, 503, "service_unavailable", retry_after=True)
        assert "do not answer" in r.json()["error"]["message"]
    assert service.submitted == submitted
    service.fail, pools_up[0] = False, True
    assert client.post(path, json=body).status_code == 200


def test_a_failed_round_with_pools_that_answer_keeps_admitting(client, service):
    checks = []

    async def ready():
        checks.append(1)
        return True, {}

    state.install(ready=ready)
    service.fail = True
    assert client.post("/v1/generate", json={"prompt": "hi"}).status_code == 500
    service.fail = False
    n = len(checks)
    assert client.post("/v1/generate", json={"prompt": "hi"}).status_code == 200
    assert len(checks) == n + 1  # one check after the failure, then admitted as before


def test_unknown_model_is_a_documented_404(client):
    r = client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert_error(r, 404, "not_found_error", retry_after=False)
    assert r.json()["error"]["param"] == "model"
    documented(client, "/v1/completions", "post", 404)


# ---------------------------------------------------------------------- a client that goes away
class EndlessService(FakeRoundService):
    """One event, then nothing until the stream is closed; records aborts and open streams."""

    def __init__(self, tokens: list[int]):
        super().__init__(tokens)
        self.aborted = self.open_streams = 0

    async def stream(self, tracked):
        self.open_streams += 1
        try:
            yield TokenEvent(self.tokens[:2])
            await asyncio.Event().wait()
        finally:
            self.open_streams -= 1

    def abort(self, tracked):
        self.aborted += 1


async def stream_then_vanish(app, path: str, body: dict, spec_version: str) -> None:
    """Runs one streaming request on the ASGI app directly; the client goes away while the app
    sends the first event (the send never completes, or fails as a closed socket does)."""
    sending = asyncio.Event()
    requested = False

    async def receive():
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await sending.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            sending.set()
            if spec_version >= "2.4":
                raise OSError("connection reset by peer")
            await asyncio.Event().wait()

    scope = http_scope(
        path, [(b"content-type", b"application/json")], asgi={"version": "3.0", "spec_version": spec_version}
    )
    try:
        await app(scope, receive, send)
    except ClientDisconnect:  # how Starlette ends a response whose send failed
        pass


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])  # disconnect seen by receive / by a failed send
@pytest.mark.parametrize("path, body", GENERATION_ROUTES)
def test_a_client_gone_mid_send_aborts_the_session_before_the_response_ends(
    monkeypatch, tokenizer, path, body, spec_version
):
    """The session is aborted (its caches freed) and its stream closed by the time the response is
    over, not whenever the garbage collector finds the abandoned generators (if ever: a chat's
    first event is sent before the session's stream is opened)."""
    service = EndlessService(tokenizer.encode(" and they lived happily"))
    monkeypatch.setattr(state, "_STATE", {})
    install_frontend(service, tokenizer, max_model_len=256)
    asyncio.run(stream_then_vanish(create_app(ready_wait_s=0.5), path, {**body, "stream": True}, spec_version))
    assert service.submitted == 1 and service.aborted == 1 and service.open_streams == 0


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_n_choices_each_sample_with_their_own_seed_and_count_the_prompt_once(client, service, path, body):
    one = client.post(path, json={**body, "max_tokens": 8, "seed": 5}).json()
    service.sampled.clear()
    three = client.post(path, json={**body, "max_tokens": 8, "seed": 5, "n": 3}).json()
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert [s.seed for s in service.sampled] == [5, 6, 7]
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert three["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    seen = {}
    with client.stream("POST", path, json={**body, "max_tokens": 8, "n": 2, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    seen[c["index"]] = seen.get(c["index"], 0) + 1
    assert sorted(seen) == [0, 1] and seen[0] == seen[1]


# ---------------------------------------------------------------------- log-probabilities
def sse_chunks(client: TestClient, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_logprobs_in_the_openai_shapes_streamed_and_not(client, service, tokenizer):
    n = len(service.tokens)
    chat = {"messages": [{"role": "user", "content": "Tell a story"}], "max_tokens": 4, "logprobs": True}
    body = client.post("/v1/chat/completions", json={**chat, "top_logprobs": 2}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == n and all(c["logprob"] == -0.5 and len(c["top_logprobs"]) == 2 for c in content)
    assert "".join(c["token"] for c in content) == body["choices"][0]["message"]["content"]
    assert bytes(content[0]["bytes"]).decode() == content[0]["token"]
    chunks = sse_chunks(client, "/v1/chat/completions", chat)
    streamed = [c for ch in chunks if ch["choices"][0]["logprobs"] for c in ch["choices"][0]["logprobs"]["content"]]
    assert [c["token"] for c in streamed] == [c["token"] for c in content] and streamed[0]["top_logprobs"] == []
    assert (
        client.post("/v1/chat/completions", json={**chat, "logprobs": False}).json()["choices"][0]["logprobs"] is None
    )

    comp = {"prompt": "Once upon a time", "max_tokens": 4, "logprobs": 1}
    lp = client.post("/v1/completions", json=comp).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == n and lp["token_logprobs"] == [-0.5] * n
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    assert all(max(top.values()) == -0.5 for top in lp["top_logprobs"])
    chunks = sse_chunks(client, "/v1/completions", comp)
    assert [t for ch in chunks if ch["choices"][0]["logprobs"] for t in ch["choices"][0]["logprobs"]["tokens"]] == (
        lp["tokens"]
    )
    native = client.post("/v1/generate", json={"prompt": "x", "max_tokens": 4, "logprobs": 0}).json()
    assert [x["token_id"] for x in native["logprobs"]] == native["token_ids"]


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_echo_scores_the_prompt_given_as_text_or_token_ids(client, service, tokenizer, max_tokens):
    ids = tokenizer.encode("Once upon a time")
    for prompt in ("Once upon a time", ids, [ids]):
        body = {"prompt": prompt, "max_tokens": max_tokens, "echo": True, "logprobs": 1}
        r = client.post("/v1/completions", json=body).json()
        choice, lp = r["choices"][0], r["choices"][0]["logprobs"]
        generated = 0 if max_tokens == 0 else len(service.tokens)
        assert len(lp["tokens"]) == len(ids) + generated and r["usage"]["completion_tokens"] == generated
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == [-0.5] * (len(ids) - 1 + generated)
        assert choice["text"].startswith("Once upon a time") and "".join(lp["tokens"]) == choice["text"]
        assert choice["finish_reason"] == "length"
        chunks = sse_chunks(client, "/v1/completions", body)
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == choice["text"]
        assert [
            v for ch in chunks if ch["choices"][0]["logprobs"] for v in ch["choices"][0]["logprobs"]["token_logprobs"]
        ] == lp["token_logprobs"]


def test_a_backend_without_logprobs_answers_400_naming_the_field(client, served):
    served.unsupported = Unsupported(logprobs="log-probabilities need backend: torch")
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "logprobs": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = client.post("/v1/completions", json={"prompt": "x", "logprobs": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_each_of_n_choices_carries_its_own_logprobs_streamed_and_not(client, service, tokenizer):
    n = len(service.tokens)
    chat = {"messages": [{"role": "user", "content": "Tell a story"}], "max_tokens": 4, "logprobs": True, "n": 2}
    body = client.post("/v1/chat/completions", json=chat).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for c in body["choices"]:
        content = c["logprobs"]["content"]
        assert len(content) == n and "".join(x["token"] for x in content) == c["message"]["content"]
    per_choice = {0: [], 1: []}
    for ch in sse_chunks(client, "/v1/chat/completions", chat):
        for c in ch["choices"]:
            per_choice[c["index"]] += [x["token"] for x in (c["logprobs"] or {}).get("content", [])]
    assert per_choice[0] == per_choice[1] == [x["token"] for x in content]

    ids = tokenizer.encode("Once upon a time")
    scored = {"prompt": "Once upon a time", "max_tokens": 0, "echo": True, "logprobs": 1, "n": 2}
    r = client.post("/v1/completions", json=scored).json()
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    first, second = (c["logprobs"] for c in r["choices"])
    assert first == second and len(first["tokens"]) == len(ids) and first["token_logprobs"][0] is None
