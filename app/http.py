"""FastAPI routes: /v1/generate, OpenAI-compatible /v1/completions and /v1/chat/completions
(streaming as server-sent events), /v1/models, /healthz, /readyz, /v1/stats, and client-server
mode's /v1/cs (``app/cs.py``). The routes read
the ``Frontend``, the readiness check and Retry-After from ``moa_serve.app.state``.

Every status a route can answer is in its OpenAPI schema (``responses=``), with one error body,
``ErrorResponse``: bad input is a 400 naming the field (never FastAPI's 422, which is removed from
the schema), a full queue a 429 and a server that is not ready yet a 503, both with
``Retry-After``."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moa_serve.app import state
from moa_serve.app.frontend import Frontend, Generation, InputError
from moa_serve.app.schemas import (ChatCompletionRequest, CompletionRequest, ErrorResponse, GenerateRequest,
                                   GenerateResponse, ReadyStatus, SpeculativeStats, Usage)
from moa_serve.engine.service import QueueFullError

log = logging.getLogger(__name__)

# how long a generation request waits for the first readiness check of this replica before it is
# answered 503 (the check asks every pool for its info, 5 s per pool at most)
READY_WAIT_S = 5.0

WHY = {
    400: "bad input: the body does not parse or a field is invalid; error.param names the field",
    404: "not found (an unknown model, session or route)",
    405: "method not allowed on this path",
    409: "client-server mode: the client must resync (expected_length, expected_round) or the round conflicts",
    429: "the request queue is full; retry after Retry-After seconds",
    500: "the generation failed on the server (every verify retry failed)",
    503: "the server is starting (its pools are not ready yet) or not serving; retry after Retry-After seconds",
}
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
SSE = {"text/event-stream": {"schema": {  # one event (OpenAPI 3.1: the schema of a stream's item)
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk; the last event is [DONE]"}}}}}


def errors(*codes: int) -> dict:
    """The ``responses=`` entries of a route's error statuses: the error body, Retry-After on 429/503."""
    return {code: {"model": ErrorResponse, "description": WHY[code], **({"headers": RETRY_AFTER} if code in (429, 503)
                                                                        else {})} for code in codes}


class ApiError(Exception):
    """Answered as ``error(status, message, param, kind, headers)`` by the app's handler."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.headers = status, param, kind, headers


def retry_after() -> dict:
    return {"Retry-After": str(state.get("retry_after_s", 1))}


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, None, "service_unavailable", retry_after())


def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
          headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


def _param(loc) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) if parts else "body"


def error_param(errors: list[dict]) -> str:
    """The field a validation error names: the first error's location, cut where the other errors
    about the same field part from it (a value matching no member of a union, ``str | list[str]``,
    gets one error per member: ``prompt.str``, ``prompt.list[str]``, ... name ``prompt``)."""
    loc = [p for p in errors[0].get("loc", ()) if p != "body"]
    for other in errors[1:]:
        o = [p for p in other.get("loc", ()) if p != "body"]
        if o[:1] == loc[:1]:
            n = 0
            while n < min(len(loc), len(o)) and loc[n] == o[n]:
                n += 1
            loc = loc[:n]
    return _param(loc)


def running_frontend() -> Frontend:
    """The installed ``Frontend``; 503 while the ingress has not installed one yet."""
    fe = state.get("frontend")
    if fe is None:
        raise unavailable("the server is starting: no frontend yet")
    return fe


class Readiness:
    """Admits generation requests once the ingress's readiness check (``state["ready"]``, the
    check behind ``/readyz``) has passed: before that, a request would wait on a pool that is still
    loading, so it gets 503 with Retry-After instead. Concurrent requests share one check; the
    first success is kept (later pool failures are the round service's to retry)."""

    def __init__(self, wait_s: float):
        self.wait_s = wait_s
        self.ready = False
        self._pending: asyncio.Future | None = None

    async def check(self) -> tuple[bool, dict]:
        """Runs (or joins) the readiness check: (ready, detail)."""
        check = state.get("ready")
        if check is None:  # an ingress without pools (tests, the one-process client-server server)
            return True, {}
        loop = asyncio.get_running_loop()
        if self._pending is None or self._pending.done() or self._pending.get_loop() is not loop:
            self._pending = asyncio.ensure_future(check())
        ok, detail = await asyncio.shield(self._pending)
        self.ready = self.ready or ok
        return ok, detail

    async def admit(self) -> None:
        """Returns when the server is ready; raises ApiError 503 otherwise."""
        if self.ready or state.get("ready") is None:
            return
        try:
            ok, _detail = await asyncio.wait_for(self.check(), self.wait_s)
        except TimeoutError:
            ok = False
        except Exception:  # noqa: BLE001 - a check that fails says "not ready", like /readyz
            log.warning("readiness check failed", exc_info=True)
            ok = False
        if not ok:
            raise unavailable("the server is starting: its pools are not ready yet (see /readyz)")


def _without_422(api: FastAPI) -> None:
    """FastAPI documents a 422 on every route with a body; this API answers bad input with a 400
    (``errors(400)``), so the 422 and its HTTPValidationError schema are taken out."""
    build = api.openapi

    def openapi() -> dict:
        if api.openapi_schema is not None:
            return api.openapi_schema
        schema = build()
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        return schema

    api.openapi = openapi


def create_app(ready_wait_s: float = READY_WAIT_S) -> FastAPI:
    api = FastAPI(title="MoA-Serve", version="0.1.0",
                  description="Lossless Mixture-of-Attentions speculative decoding on Ray Serve")
    _without_422(api)
    readiness = Readiness(ready_wait_s)

    @api.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        param = error_param(exc.errors())
        if first.get("type") == "json_invalid":
            return error(400, f"malformed JSON: {first.get('msg')}", "body")
        msg = first.get("msg", "invalid value")
        if first.get("type") == "extra_forbidden":
            msg = "unknown field"
        if param != _param(first.get("loc", ())):  # no member of a union took the value: say why for each
            msg = "; or ".join(dict.fromkeys(e.get("msg", "invalid value") for e in exc.errors()
                                             if f"{_param(e.get('loc', ()))}.".startswith(f"{param}.")))
        return error(400, f"{param}: {msg}", param)

    @api.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail), None, "http_error", exc.headers)  # 405 keeps its Allow

    @api.exception_handler(ApiError)
    async def _refused(_request: Request, exc: ApiError):
        return error(exc.status, str(exc), exc.param, exc.kind, exc.headers)

    from moa_serve.app import cs  # client-server mode: /v1/cs (its own module, same error shape)

    cs.install(api, readiness)

    def frontend(request: Request) -> Frontend:
        return running_frontend()

    async def start(request: Request, body, prompt, messages, max_tokens) -> Generation:
        fe = frontend(request)
        await readiness.admit()
        try:
            return await fe.start(prompt=prompt, messages=messages, max_tokens=max_tokens, sampling=body.sampling(),
                                  stops=body.stop_strings(), ignore_eos=body.ignore_eos,
                                  num_speculative_tokens=body.num_speculative_tokens)
        except InputError as exc:
            raise ApiError(400, str(exc), exc.param) from None
        except QueueFullError as exc:
            raise ApiError(429, f"server busy: {exc}; retry later", None, "rate_limit_error", retry_after()) from None

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

    @api.get("/readyz", response_model=ReadyStatus, responses={
        503: {"model": ReadyStatus, "description": "not ready: a pool does not answer yet (its error in pools)",
              "headers": RETRY_AFTER}})
    async def readyz(request: Request):
        ok, detail = await readiness.check()
        return JSONResponse({"ready": ok, **detail}, status_code=200 if ok else 503,
                            headers=None if ok else retry_after())

    @api.get("/v1/stats", responses=errors(503))
    async def stats(request: Request):
        fe = frontend(request)
        extra = state.get("stats")  # the ingress's own view (work per pool replica, call timings)
        extra = extra() if extra else {}
        if inspect.isawaitable(extra):
            extra = await extra
        return {**fe.service.stats.as_dict(), "queue_depth": fe.service.queue_depth,
                "active_sessions": fe.service.active_sessions, "speculative": fe.speculative, **extra}

    @api.get("/v1/models", responses=errors(503))
    async def models(request: Request):
        fe = frontend(request)
        return {"object": "list", "data": [{"id": fe.model_name, "object": "model", "created": 0,
                                            "owned_by": "moa-serve", "max_model_len": fe.max_model_len}]}

    # ------------------------------------------------------------------ native API
    generation_errors = errors(400, 429, 500, 503)

    @api.post("/v1/generate", response_model=GenerateResponse, responses={
        200: {"description": "the generation: one JSON body, or with stream: true server-sent events", "content": SSE},
        **generation_errors})
    async def generate(body: GenerateRequest, request: Request):
        gen = await start(request, body, body.prompt, body.messages, body.max_tokens)
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
    def openai_model(request: Request, body) -> None:
        fe = frontend(request)
        if body.model is not None and body.model != fe.model_name:
            raise ApiError(404, f"model {body.model!r} is not served here (serving {fe.model_name!r})", "model",
                           "not_found_error")

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

    openai_responses = {
        200: {"description": "the completion: one JSON body, or with stream: true server-sent events", "content": SSE},
        **errors(404), **generation_errors}

    @api.post("/v1/completions", responses=openai_responses)
    async def completions(body: CompletionRequest, request: Request):
        openai_model(request, body)
        gen = await start(request, body, body.prompt_text(), None, body.max_tokens or 16)
        return await openai_response(request, body, gen, chat=False)

    @api.post("/v1/chat/completions", responses=openai_responses)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        openai_model(request, body)
        gen = await start(request, body, None, body.messages, body.max_completion_tokens or body.max_tokens or 256)
        return await openai_response(request, body, gen, chat=True)

    return api
