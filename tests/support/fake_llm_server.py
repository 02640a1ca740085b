"""TEST SCAFFOLDING ONLY — a fake LLM server speaking our /v1/generate and the OpenAI routes.

It emits canned tokens with a fixed delay, so that the locustfile and the runner can be
tested without a model. Never use it for any reported number.

    python tests/support/fake_llm_server.py --port 8123 [--fail-every N] [--token-delay 0.005]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "fake/model"
WORDS = ["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit"]


def _usage(n: int) -> dict:
    return {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}


def _spec(n: int, accepted_length: float) -> dict:
    rounds = max(1, round(n / accepted_length))
    return {
        "rounds": rounds,
        "drafted_tokens": rounds * 4,
        "accepted_tokens": n - rounds,
        "mean_accepted_length": n / rounds,
    }


def _error():
    return JSONResponse(
        {"error": {"message": "injected failure", "type": "server_error", "param": None}}, status_code=500
    )


def _unknown_model(model) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": f"unknown model {model}", "type": "invalid_request_error", "param": "model"}},
        status_code=404,
    )


async def _tokens(n: int, token_delay: float):
    for i in range(n):
        await asyncio.sleep(token_delay)
        yield i, WORDS[i % len(WORDS)] + " "


def _openai_reply(n: int, chat: bool, accepted_length: float) -> dict:
    obj = "chat.completion" if chat else "text_completion"
    choice = {"index": 0, "finish_reason": "length"}
    choice |= {"message": {"role": "assistant", "content": "x " * n}} if chat else {"text": "x " * n}
    return {
        "id": "c-1",
        "object": obj,
        "created": int(time.time()),
        "model": MODEL,
        "choices": [choice],
        "usage": _usage(n),
        "speculative": _spec(n, accepted_length),
    }


async def _openai_sse(n: int, chat: bool, include_usage: bool, token_delay: float, accepted_length: float):
    obj = "chat.completion" if chat else "text_completion"
    async for _, w in _tokens(n, token_delay):
        choice = {"index": 0, "finish_reason": None}
        choice |= {"delta": {"content": w}} if chat else {"text": w}
        chunk = {"id": "c-1", "object": obj + ".chunk", "model": MODEL, "choices": [choice]}
        yield f"data: {json.dumps(chunk)}\n\n"
    last = {"index": 0, "finish_reason": "length"}
    last |= {"delta": {}} if chat else {"text": ""}
    yield f"data: {json.dumps({'id': 'c-1', 'object': obj + '.chunk', 'model': MODEL, 'choices': [last]})}\n\n"
    if include_usage:
        u = {
            "id": "c-1",
            "object": obj + ".chunk",
            "model": MODEL,
            "choices": [],
            "usage": _usage(n),
            "speculative": _spec(n, accepted_length),
        }
        yield f"data: {json.dumps(u)}\n\n"
    yield "data: [DONE]\n\n"


def make_app(fail_every: int = 0, token_delay: float = 0.005, accepted_length: float = 2.5) -> FastAPI:
    app = FastAPI()
    counter = itertools.count(1)
    stats_calls = itertools.count(1)

    def should_fail() -> bool:
        return fail_every > 0 and next(counter) % fail_every == 0

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        return {"status": "ready"}

    @app.get("/v1/stats")
    async def stats():  # the fields the soak samples, shaped as ours (counters are not meaningful)
        served = next(stats_calls)
        return {
            "queue_depth": 0,
            "active_sessions": 0,
            "verifier_engine": {
                "replica": "fake",
                "sessions": 0,
                "retained_slots": min(served, 8),
                "free_slots": 16 - min(served, 8),
            },
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]}

    @app.post("/v1/generate")
    async def generate(req: Request):
        body = await req.json()
        if should_fail():
            return _error()
        n = int(body.get("max_tokens", 128))
        if not body.get("stream"):
            await asyncio.sleep(token_delay * n)
            return {
                "id": "gen-1",
                "text": "x " * n,
                "token_ids": list(range(n)),
                "finish_reason": "length",
                "usage": _usage(n),
                "speculative": _spec(n, accepted_length),
            }

        async def sse():
            async for i, w in _tokens(n, token_delay):
                yield f"data: {json.dumps({'text': w, 'token_ids': [i]})}\n\n"
            final = {
                "text": "",
                "finish_reason": "length",
                "usage": _usage(n),
                "speculative": _spec(n, accepted_length),
            }
            yield f"data: {json.dumps(final)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    async def openai(req: Request, chat: bool):
        body = await req.json()
        if should_fail():
            return _error()
        if body.get("model") != MODEL:
            return _unknown_model(body.get("model"))
        n = int(body.get("max_tokens", 16))
        if not body.get("stream"):
            await asyncio.sleep(token_delay * n)
            return _openai_reply(n, chat, accepted_length)
        include_usage = (body.get("stream_options") or {}).get("include_usage")
        sse = _openai_sse(n, chat, include_usage, token_delay, accepted_length)
        return StreamingResponse(sse, media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        return await openai(req, chat=True)

    @app.post("/v1/completions")
    async def completions(req: Request):
        return await openai(req, chat=False)

    return app


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--fail-every", type=int, default=0)
    p.add_argument("--token-delay", type=float, default=0.005)
    a = p.parse_args()
    uvicorn.run(make_app(a.fail_every, a.token_delay), host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
