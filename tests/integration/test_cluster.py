"""The Ray Serve application end to end: real Ray on 127.0.0.1, real HTTP, the official
openai client, failure injection (killed replicas, disconnects, a full queue)."""

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from moa_serve.deployments.app import build_app  # noqa: E402
from moa_serve.engine.in_process import SpeculativeEngine  # noqa: E402
from tests.support.chat_model import with_chat_template  # noqa: E402
from tests.support.ray_harness import READY_TIMEOUT_S, kill_replica  # noqa: E402
from tools.prompts import STORY_PROMPTS  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def target(tmp_path_factory, stories_path):
    """stories260k with a chat template, so the chat routes have something to apply."""
    return with_chat_template(stories_path, tmp_path_factory.mktemp("stories-chat"))


def app_args(target, drafter, **router):
    pool = {"ray_actor_options": {"num_cpus": 0.25}, "torch_threads": 1, "max_sessions": 16}
    return {
        "target": str(target),
        "drafter": str(drafter) if drafter else None,
        "dtype": "float32",
        "num_speculative_tokens": 3,
        "model_name": "stories",
        "router": {"ray_actor_options": {"num_cpus": 0}, **router},
        "verifier_pool": pool,
        "drafter_pool": pool,
    }


def serve_locally(apps, poll_s: float, ready_timeout_s: float = READY_TIMEOUT_S):
    """Ray (2 CPUs) and Serve on a free loopback port, running ``apps`` ((application, name,
    route_prefix) each); waits for ``/readyz`` at the root, yields the base URL, then shuts down."""
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    for app, name, prefix in apps:
        serve.run(app, name=name, route_prefix=prefix)
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=base, timeout=120) as c:
        deadline = time.time() + ready_timeout_s
        while c.get("/readyz").status_code != 200:
            assert time.time() < deadline, "cluster never became ready"
            time.sleep(poll_s)
    yield base
    # no serve.shutdown(): it drains each replica, and a Router's lane call (a stream the Gateway
    # keeps open) holds it for the whole graceful-shutdown timeout (~20 s per module); the
    # processes go with the Ray instance
    ray.shutdown()


@pytest.fixture(scope="module")
def cluster(target, stories_drafter):
    # every round drafts (no governor): these tests are about speculative rounds and their failures
    yield from serve_locally(
        [
            (
                build_app(
                    app_args(
                        target, stories_drafter, max_sessions_per_round=8, session_groups=2, speculation_governor=False
                    )
                ),
                "moa",
                "/",
            ),
            # the Router inside the Gateway (router.in_gateway), as local-cpu.yaml runs it
            (
                build_app(
                    app_args(
                        target, None, max_sessions_per_round=1, session_groups=1, max_queued_requests=1, in_gateway=True
                    )
                ),
                "tight",
                "/tight",
            ),
        ],
        poll_s=0.5,
    )


@pytest.fixture(scope="module")
def engine(target, stories_drafter):
    return SpeculativeEngine.load(str(target), str(stories_drafter), "float32", max_sessions=8)


PROMPTS = STORY_PROMPTS[:6]


def test_health_ready_models(cluster):
    with httpx.Client(base_url=cluster) as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        ready = c.get("/readyz").json()
        assert ready["ready"] and {"verifier", "drafter"} <= set(ready["pools"])
        assert c.get("/v1/models").json()["data"][0]["id"] == "stories"
        assert "/v1/generate" in c.get("/openapi.json").json()["paths"]


def test_greedy_http_identical_to_engine_and_rounds_are_shared(cluster, engine):
    refs = [r.token_ids for r in engine.generate([engine.tokenizer.encode(p) for p in PROMPTS], 32)]

    async def run_all():
        async with httpx.AsyncClient(base_url=cluster, timeout=120) as c:
            rs = await asyncio.gather(*(c.post("/v1/generate", json={"prompt": p, "max_tokens": 32}) for p in PROMPTS))
            return [r.json() for r in rs], (await c.get("/v1/stats")).json()

    outs, stats = asyncio.run(run_all())
    assert [o["token_ids"] for o in outs] == refs
    for o in outs:
        assert o["usage"]["completion_tokens"] == len(o["token_ids"])
        assert o["speculative"]["rounds"] >= 1 and o["speculative"]["mean_accepted_length"] >= 1.0
    assert stats["multi_session_rounds"] > 0 and stats["max_sessions_in_round"] > 1


def test_a_router_inside_the_gateway_streams_the_engines_greedy_text(cluster, engine):
    apps = serve.status().applications
    assert "Router" in apps["moa"].deployments and "Router" not in apps["tight"].deployments
    prompt = PROMPTS[2]
    ref = engine.generate([engine.tokenizer.encode(prompt)], 24)[0].token_ids
    with httpx.Client(base_url=cluster + "/tight", timeout=120) as c:
        full = c.post("/v1/generate", json={"prompt": prompt, "max_tokens": 24}).json()
        tokens = []
        with c.stream("POST", "/v1/generate", json={"prompt": prompt, "max_tokens": 24, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    tokens += json.loads(line[6:])["token_ids"]
        stats = c.get("/v1/stats").json()
    assert full["token_ids"] == ref and tokens == ref
    assert stats["completed"] >= 2 and stats["tokens"] >= 48 and stats["gateway"]["completed"] >= 2


def test_streaming_generate_concatenates_to_the_full_text(cluster):
    body = {"prompt": "The little dog", "max_tokens": 24}
    with httpx.Client(base_url=cluster, timeout=120) as c:
        full = c.post("/v1/generate", json=body).json()
        text, tokens, final = "", [], None
        with c.stream("POST", "/v1/generate", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                text += ev["text"]
                tokens += ev["token_ids"]
                final = ev if ev.get("finish_reason") else final
    assert text == full["text"] and tokens == full["token_ids"]
    assert final["usage"]["completion_tokens"] == 24 and "mean_accepted_length" in final["speculative"]


def test_openai_client_both_routes(cluster):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster + "/v1", api_key="unused")
    comp = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=16, temperature=0)
    assert comp.choices[0].text and comp.usage.completion_tokens == 16
    streamed = "".join(
        ch.choices[0].text
        for ch in client.completions.create(
            model="stories", prompt="Once upon a time", max_tokens=16, temperature=0, stream=True
        )
        if ch.choices
    )
    assert streamed == comp.choices[0].text
    chat = client.chat.completions.create(
        model="stories", messages=[{"role": "user", "content": "Tell a story"}], max_tokens=12, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    pieces, usage = [], None
    for ch in client.chat.completions.create(
        model="stories",
        messages=[{"role": "user", "content": "Tell a story"}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if ch.choices and ch.choices[0].delta.content:
            pieces.append(ch.choices[0].delta.content)
        usage = ch.usage or usage
    assert "".join(pieces) == chat.choices[0].message.content and usage.completion_tokens == 12
    assert [m.id for m in client.models.list().data] == ["stories"]


def test_openai_client_parses_a_pydantic_model_identically_with_and_without_speculation(cluster):
    """``response_format`` from a pydantic model through the official client's ``parse``: the reply
    validates, and the speculative server (drafter, every round drafting) gives the text of the one
    without a drafter."""
    openai = pytest.importorskip("openai")
    from typing import Literal

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=6)
        legs: int
        mood: Literal["glad", "sad"]

    messages = [{"role": "user", "content": "Tell me about a dog"}]
    replies = []
    for base in (cluster, cluster + "/tight"):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
        done = client.chat.completions.parse(
            model="stories", messages=messages, response_format=Pet, max_tokens=64, temperature=0
        )
        assert isinstance(done.choices[0].message.parsed, Pet), done.choices[0].message.content
        replies.append(done.choices[0].message.content)
    assert replies[0] == replies[1]
    picked = httpx.post(
        cluster + "/v1/completions",
        json={"prompt": "The dog was", "max_tokens": 8, "structured_outputs": {"choice": ["happy", "sad"]}},
        timeout=120,
    ).json()
    assert picked["choices"][0]["text"] in ("happy", "sad")


def test_n_choices_share_one_prompt_each_with_its_own_seed(cluster):
    """n > 1 through the official client: n choices indexed 0..n-1, the prompt counted once; seeded
    choices are reproducible, one per seed stream (choice i samples with seed + i, so choice 1 of
    seed s is choice 0 of seed s + 1); greedy choices are all the same; a stream's chunks name
    their choice."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster + "/v1", api_key="unused")
    prompt = "Lily went to the park and she saw a big red ball. She wanted to play with it, so she"
    ask = dict(model="stories", prompt=prompt, max_tokens=12, temperature=1.0)
    three = client.completions.create(n=3, seed=5, **ask)
    assert [c.index for c in three.choices] == [0, 1, 2]
    single = client.completions.create(n=1, seed=5, **ask)
    assert single.usage.prompt_tokens == three.usage.prompt_tokens
    assert single.usage.completion_tokens <= 12 < three.usage.completion_tokens <= 36
    assert client.completions.create(n=1, seed=6, **ask).choices[0].text == three.choices[1].text
    assert single.choices[0].text == three.choices[0].text
    greedy = client.completions.create(n=2, **{**ask, "temperature": 0})
    assert greedy.choices[0].text == greedy.choices[1].text
    texts = {}
    for ch in client.chat.completions.create(
        model="stories", messages=[{"role": "user", "content": "Tell a story"}], max_tokens=8, n=2, seed=5, stream=True
    ):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert sorted(texts) == [0, 1]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/generate", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/generate", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/generate", {"prompt": "x", "top_p": 1.5}, "top_p"),
        ("/v1/generate", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/generate", {"prompt": "x", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ("/v1/generate", {"prompt": "x", "colour": "red"}, "colour"),
        ("/v1/generate", {"max_tokens": 3}, "body"),
        ("/v1/generate", {"prompt": "Once upon a time " * 200}, "prompt"),
        ("/v1/completions", {"model": "stories", "prompt": "x", "n": 17}, "n"),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}},
            },
            "response_format",
        ),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "([a-"}}, "structured_outputs"),
        ("/v1/chat/completions", {"model": "stories", "messages": []}, "messages"),
        (
            "/v1/chat/completions",
            {"model": "stories", "messages": [{"role": "wizard", "content": "x"}]},
            "messages.0.role",
        ),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(cluster, path, body, param):
    r = httpx.post(cluster + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_malformed_json_and_unknown_model(cluster):
    r = httpx.post(cluster + "/v1/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = httpx.post(cluster + "/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_full_queue_answers_429_with_retry_after(cluster):
    async def burst():
        async with httpx.AsyncClient(base_url=cluster + "/tight", timeout=120) as c:
            return await asyncio.gather(
                *(
                    c.post("/v1/generate", json={"prompt": "Once", "max_tokens": 150, "ignore_eos": True})
                    for _ in range(6)
                )
            )

    rs = asyncio.run(burst())
    codes = [r.status_code for r in rs]
    assert 429 in codes and 200 in codes
    busy = next(r for r in rs if r.status_code == 429)
    assert int(busy.headers["retry-after"]) >= 1 and busy.json()["error"]["type"] == "rate_limit_error"
    assert all(len(r.json()["token_ids"]) == 150 for r in rs if r.status_code == 200)  # nothing lost


def router_stats(c: httpx.Client, deadline: float) -> dict:
    """``GET /v1/stats`` with the Router's counters in it (the Gateway falls back to its own when the
    Router does not answer within its stats timeout: those are not comparable)."""
    while True:
        s = c.get("/v1/stats").json()
        if "router_error" not in s:
            return s
        assert time.time() < deadline, json.dumps(s)
        time.sleep(0.2)


def test_client_disconnect_frees_the_session(cluster):
    with httpx.Client(base_url=cluster, timeout=120) as c:
        before = router_stats(c, time.time() + 60)
        with c.stream(
            "POST", "/v1/generate", json={"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
        ) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 4:
                    break
        # the Gateway, where the disconnect lands, aborts the session and frees its seat; the Router's
        # session ends too (the Gateway's cancel call to it is sent in the background and is not
        # asserted here: when it does not arrive, the Router runs the session to its end)
        deadline = time.time() + 60
        while True:
            s = router_stats(c, deadline)
            gateway = s["gateway"]["aborted"] > before["gateway"]["aborted"]
            if gateway and s["active_sessions"] == 0:
                break
            assert time.time() < deadline, f"aborted at the Gateway: {gateway}; {json.dumps(s)}"
            time.sleep(0.2)


@pytest.mark.parametrize("deployment", ["DrafterPool", "VerifierPool"])
def test_killed_replica_mid_generation_keeps_greedy_text(cluster, engine, deployment):
    prompt = "Lily went to the park and"
    ref = engine.generate([engine.tokenizer.encode(prompt)], 300, ignore_eos=True)[0].token_ids
    result = {}

    def call():
        result["r"] = httpx.post(
            cluster + "/v1/generate", json={"prompt": prompt, "max_tokens": 300, "ignore_eos": True}, timeout=300
        )

    before = httpx.get(cluster + "/v1/stats").json()  # counters are per cluster: compare deltas
    rounds_before = before["rounds"]
    t = threading.Thread(target=call)
    t.start()
    # kill once the generation is under way (a few rounds in, far from its ~75 rounds): a fixed
    # sleep raced a faster engine and could kill after the last token
    deadline = time.monotonic() + 60
    while httpx.get(cluster + "/v1/stats").json()["rounds"] < rounds_before + 6 and time.monotonic() < deadline:
        time.sleep(0.02)
    mid_generation = t.is_alive()
    kill_replica(deployment)
    t.join(300)
    assert mid_generation, "the generation ended before the replica was killed"
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["token_ids"] == ref
    stats = httpx.get(cluster + "/v1/stats").json()
    grew = lambda *keys: sum(stats[k] - before[k] for k in keys)  # noqa: E731
    if deployment == "DrafterPool":  # the round fell back to the target, or the new replica was resynced
        assert grew("draft_fallbacks", "drafter_resyncs") > 0, stats
    else:  # the replacement replica rebuilt the session from the committed tokens
        assert grew("reprefills", "verify_retries", "resyncs") > 0, stats
