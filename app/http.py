"""FastAPI routes: /v1/generate, OpenAI-compatible /v1/completions and /v1/chat/completions
(streaming as server-sent events), /v1/models, /healthz, /readyz, /v1/stats, and client-server
mode's /v1/cs (``app/cs.py``). The routes read
the ``Frontend``, the readiness check and Retry-After from ``moa_serve.app.state``."""

from __future__ import annotations

import inspect

import json
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moa_serve.app import state
from moa_serve.app.frontend import Frontend, Generation, InputError
from moa_serve.app.schemas import (ChatCompletionRequest, CompletionRequest, GenerateRequest, GenerateResponse,
                                   SpeculativeStats, Usage)
from moa_serve.engine.service import QueueFullError


def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
          headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


def _param(loc) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) if parts else "body"


def create_app() -> FastAPI:
    api = FastAPI(title="MoA-Serve", version="0.1.0",
                  description="Lossless Mixture-of-Attentions speculative decoding on Ray Serve")

    @api.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        param = _param(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            return error(400, f"malformed JSON: {first.get('msg')}", "body")
        msg = first.get("msg", "invalid value")
        if first.get("type") == "extra_forbidden":
            msg = "unknown field"
        return error(400, f"{param}: {msg}", param)

    @api.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail), None, "http_error")

    from moa_serve.app import cs  # client-server mode: /v1/cs (its own module, same error shape)

    cs.install(api)

    def frontend(request: Request) -> Frontend:
        return state.get("frontend")

    async def start(request: Request, body, prompt, messages, max_tokens) -> Generation | JSONResponse:
        fe = frontend(request)
        try:
            return await fe.start(prompt=prompt, messages=messages, max_tokens=max_tokens, sampling=body.sampling(),
                            stops=body.stop_strings(), ignore_eos=body.ignore_eos,
                            num_speculative_tokens=body.num_speculative_tokens)
        except InputError as exc:
            return error(400, str(exc), exc.param)
        except QueueFullError as exc:
            retry = str(state.get("retry_after_s", 1))
            return error(429, f"server busy: {exc}; retry later", None, "rate_limit_error", {"Retry-After": retry})

    def usage(gen: Generation) -> dict:
        n = len(gen.token_ids)
        return Usage(prompt_tokens=gen.prompt_tokens, completion_tokens=n, total_tokens=gen.prompt_tokens + n).model_dump()

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def guarded(gen: Generation, events):
        try:
            async for item in events:
                yield item
        except RuntimeError as exc:  # the round failed for this request
            yield sse({"error": {"message": str(exc), "type": "server_error"}})
        yield "data: [DONE]\n\n"

    async def finish_or_500(gen: Generation) -> JSONResponse | None:
        try:
            await gen.run()
        except RuntimeError as exc:
            return error(500, str(exc), None, "server_error")
        return None

    # ------------------------------------------------------------------ ops
    @api.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @api.get("/readyz")
    async def readyz(request: Request):
        check = state.get("ready")
        ok, detail = (await check()) if check else (True, {})
        return JSONResponse({"ready": ok, **detail}, status_code=200 if ok else 503)

    @api.get("/v1/stats")
    async def stats(request: Request):
        fe = frontend(request)
        extra = state.get("stats")  # the ingress's own view (work per pool replica, call timings)
        extra = extra() if extra else {}
        if inspect.isawaitable(extra):
            extra = await extra
        return {**fe.service.stats.as_dict(), "queue_depth": fe.service.queue_depth,
                "active_sessions": fe.service.active_sessions, "speculative": fe.speculative, **extra}

    @api.get("/v1/models")
    async def models(request: Request):
        fe = frontend(request)
        return {"object": "list", "data": [{"id": fe.model_name, "object": "model", "created": 0,
                                            "owned_by": "moa-serve", "max_model_len": fe.max_model_len}]}

    # ------------------------------------------------------------------ native API
    @api.post("/v1/generate", response_model=GenerateResponse)
    async def generate(body: GenerateRequest, request: Request):
        gen = await start(request, body, body.prompt, body.messages, body.max_tokens)
        if isinstance(gen, JSONResponse):
            return gen
        if body.stream:
            async def events():
                async for d in gen.deltas():
                    yield sse({"text": d.text, "token_ids": d.token_ids})
                yield sse({"text": "", "token_ids": [], "finish_reason": gen.finish_reason, "usage": usage(gen),
                           "speculative": gen.stats()})
            return StreamingResponse(guarded(gen, events()), media_type="text/event-stream")
        failed = await finish_or_500(gen)
        if failed:
            return failed
        return GenerateResponse(id=gen.id, text=gen.text, token_ids=gen.token_ids, finish_reason=gen.finish_reason,
                                usage=Usage(**usage(gen)), speculative=SpeculativeStats(**gen.stats()))

    # ------------------------------------------------------------------ OpenAI-compatible
    def openai_model(request: Request, body) -> JSONResponse | None:
        fe = frontend(request)
        if body.model is not None and body.model != fe.model_name:
            return error(404, f"model {body.model!r} is not served here (serving {fe.model_name!r})", "model",
                         "not_found_error")
        return None

    async def openai_response(request: Request, body, gen: Generation, chat: bool):
        fe = frontend(request)
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        rid = ("chatcmpl-" if chat else "cmpl-") + gen.id
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(text, finish, role=False):
                if chat:
                    delta = ({"role": "assistant", "content": text} if role else {"content": text}) if text or role else {}
                    choice = {"index": 0, "delta": delta, "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
                return {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                        "model": fe.model_name, "choices": [choice]}

            async def events():
                if chat:
                    yield sse(chunk("", None, role=True))
                async for d in gen.deltas():
                    if d.text or d.finish_reason:
                        yield sse(chunk(d.text, d.finish_reason))
                if include_usage:
                    yield sse({"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                               "model": fe.model_name, "choices": [], "usage": usage(gen),
                               "speculative": gen.stats()})
            return StreamingResponse(guarded(gen, events()), media_type="text/event-stream")
        failed = await finish_or_500(gen)
        if failed:
            return failed
        finish = "length" if gen.finish_reason == "length" else "stop"
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": gen.text}, "finish_reason": finish,
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": gen.text, "finish_reason": finish, "logprobs": None}
        return {"id": rid, "object": obj, "created": created, "model": fe.model_name, "choices": [choice],
                "usage": usage(gen), "speculative": gen.stats()}

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        bad = openai_model(request, body)
        if bad:
            return bad
        gen = await start(request, body, body.prompt_text(), None, body.max_tokens or 16)
        if isinstance(gen, JSONResponse):
            return gen
        return await openai_response(request, body, gen, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        bad = openai_model(request, body)
        if bad:
            return bad
        gen = await start(request, body, None, body.messages, body.max_completion_tokens or body.max_tokens or 256)
        if isinstance(gen, JSONResponse):
            return gen
        return await openai_response(request, body, gen, chat=True)

    return api
