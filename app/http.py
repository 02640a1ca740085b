"""FastAPI routes: /v1/generate, OpenAI-compatible /v1/completions and /v1/chat/completions
(streaming as server-sent events), /v1/models, /healthz, /readyz, /v1/stats, and client-server
mode's /v1/cs (``app/client_server.py``, installed on the same app). The routes read the ``Frontend``, the
readiness check and Retry-After from ``moa_serve.app.state``; the error shape is ``app/errors.py``'s,
admission (``Readiness``) ``app/readiness.py``'s.

Every status a route can answer is in its OpenAPI schema (``responses=``), with one error body,
``ErrorResponse``: bad input is a 400 naming the field (never FastAPI's 422, which is removed from
the schema), a full queue a 429 and a server that is not ready yet a 503, both with
``Retry-After``."""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from contextlib import aclosing
from dataclasses import dataclass

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moa_serve.app import access, client_server, state
from moa_serve.app.errors import RETRY_AFTER, ApiError, error, error_param, errors, loc_param, retry_after
from moa_serve.app.frontend import Generation, InputError
from moa_serve.app.logprobs import TokenTexts, chat_content, completion_logprobs, completion_text_length, native
from moa_serve.app.readiness import READY_WAIT_S, Readiness, running_frontend
from moa_serve.app.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    GenerateResponse,
    ReadyStatus,
    SpeculativeStats,
    Usage,
)
from moa_serve.engine.events import QueueFullError

SSE = {
    "text/event-stream": {
        "schema": {  # one event (OpenAPI 3.1: the schema of a stream's item)
            "type": "object",
            "required": ["data"],
            "properties": {"data": {"type": "string", "description": "a JSON chunk; the last event is [DONE]"}},
        }
    }
}


def _without_422(api: FastAPI) -> None:
    """FastAPI documents a 422 on every route with a body; this API answers bad input with a 400
    (``errors(400)``), so the 422 and its HTTPValidationError schema are taken out."""
    build = api.openapi

    def openapi() -> dict:
        if api.openapi_schema is not None:
            return api.openapi_schema
        schema = build()
        _bound_token_ids(schema)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        return schema

    api.openapi = openapi


def _bound_token_ids(schema: dict) -> None:
    """A prompt's token ids are below the served vocabulary's size: the schema says so once the
    frontend is installed (the bound is the tokenizer's, not known to the models)."""
    fe = state.get("frontend")
    if fe is None:
        return

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "integer":
                node["maximum"] = len(fe.tokenizer) - 1
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(
        schema.get("components", {}).get("schemas", {}).get("CompletionRequest", {}).get("properties", {}).get("prompt")
    )


def _install_error_handlers(api: FastAPI) -> None:
    """Every error in the one error shape: validation errors as 400 naming the field, Starlette's
    own (404, 405) and ``ApiError``."""

    @api.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        param = error_param(exc.errors())
        if first.get("type") == "json_invalid":
            return error(400, f"malformed JSON: {first.get('msg')}", "body")
        msg = first.get("msg", "invalid value")
        if first.get("type") == "extra_forbidden":
            msg = "unknown field"
        if param != loc_param(first.get("loc", ())):  # no member of a union took the value: say why for each
            msg = "; or ".join(
                dict.fromkeys(
                    e.get("msg", "invalid value")
                    for e in exc.errors()
                    if f"{loc_param(e.get('loc', ()))}.".startswith(f"{param}.")
                )
            )
        return error(400, f"{param}: {msg}", param)

    @api.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail), None, "http_error", exc.headers)  # 405 keeps its Allow

    @api.exception_handler(ApiError)
    async def _refused(_request: Request, exc: ApiError):
        return error(exc.status, str(exc), exc.param, exc.kind, exc.headers)


# ---------------------------------------------------------------------- a generation's steps
async def start_generation(
    readiness: Readiness, body, prompt, messages, max_tokens, logprobs=None, score_prompt=False
) -> Generation:
    """Admits the request and starts its generation on the running frontend (400 / 429 / 503 as
    ApiError); ``logprobs`` / ``score_prompt``: as ``Frontend.start_choices``."""
    return (await start_generations(readiness, body, prompt, messages, max_tokens, 1, logprobs, score_prompt))[0]


async def start_generations(
    readiness: Readiness, body, prompt, messages, max_tokens, n: int, logprobs=None, score_prompt=False
) -> list[Generation]:
    """Admits the request and starts its ``n`` choices on the running frontend (400 / 429 / 503 as
    ApiError); ``logprobs`` / ``score_prompt``: as ``Frontend.start_choices`` (each choice its own)."""
    max_tokens = access.max_tokens_of(body, max_tokens)  # http_limits.max_tokens
    fe = running_frontend()
    await readiness.admit()
    try:
        gens = await fe.start_choices(
            n,
            prompt=prompt,
            messages=messages,
            max_tokens=max_tokens,
            sampling=body.sampling(),
            stops=body.stop_strings(),
            ignore_eos=body.ignore_eos,
            num_speculative_tokens=body.num_speculative_tokens,
            grammar=body.grammar() if hasattr(body, "grammar") else None,
            logprobs=logprobs,
            score_prompt=score_prompt,
        )
        for gen in gens:
            gen.on_error = readiness.recheck  # pools that stopped answering: 503s, not a 500 per request
        return gens
    except InputError as exc:
        raise ApiError(400, str(exc), exc.param) from None
    except QueueFullError as exc:
        later = retry_after() if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
        raise ApiError(429, f"server busy: {exc}; retry later", None, "rate_limit_error", later) from None


def usage(gen: Generation | list[Generation], output: bool = True) -> dict:
    """The prompt counted once, the completion tokens of every choice (``output`` False: none, the
    prompt was only scored)."""
    gens = gen if isinstance(gen, list) else [gen]
    prompt = gens[0].prompt_tokens
    n = sum(len(g.token_ids) for g in gens) if output else 0
    return Usage(prompt_tokens=prompt, completion_tokens=n, total_tokens=prompt + n).model_dump()


def choices_stats(gens: list[Generation]) -> dict:
    """The speculative statistics of a request's choices together."""
    if len(gens) == 1:
        return gens[0].stats()
    each = [g.stats() for g in gens]
    rounds = sum(e["rounds"] for e in each)
    tokens = sum(len(g.token_ids) for g in gens)
    return {
        "rounds": rounds,
        "drafted_tokens": sum(e["drafted_tokens"] for e in each),
        "accepted_tokens": sum(e["accepted_tokens"] for e in each),
        "mean_accepted_length": round(tokens / rounds, 4) if rounds else 0.0,
    }


class AllOf:
    """A request's choices, closed together when its response ends."""

    def __init__(self, gens: list[Generation]):
        self.gens = gens

    def close(self) -> None:
        for gen in self.gens:
            gen.close()


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose generator is closed when the response ends, also when the client
    went away: Starlette cancels the response and leaves the generator to the garbage collector,
    which can run its ``finally`` (the abort that frees the session) seconds later, after the
    session generated every token for nobody."""

    def __init__(self, events):
        super().__init__(events, media_type="text/event-stream")

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):  # the response's scope may be cancelled already
                await self.body_iterator.aclose()


async def guarded(gen: Generation | AllOf, events):
    """A stream's events, an error event if the round failed for this request, then [DONE].
    Every generator below the response is closed by the one above it (``aclosing``), so closing
    the response's closes them all at once, down to the session's stream; a stream that ends
    early (a client gone) aborts its session, also one whose stream was not opened yet."""
    try:
        async with aclosing(events):
            async for item in events:
                yield item
    except RuntimeError as exc:  # the round failed for this request
        yield sse({"error": {"message": str(exc), "type": "server_error"}})
    finally:
        gen.close()
    yield "data: [DONE]\n\n"


async def finish_or_500(gen: Generation) -> JSONResponse | None:
    try:
        await gen.run()
    except RuntimeError as exc:
        return error(500, str(exc), None, "server_error")
    return None


# ---------------------------------------------------------------------- ops
def _ops_routes(api: FastAPI, readiness: Readiness) -> None:
    @api.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @api.get(
        "/readyz",
        response_model=ReadyStatus,
        responses={
            503: {
                "model": ReadyStatus,
                "description": "not ready: a pool does not answer yet (its error in pools)",
                "headers": RETRY_AFTER,
            }
        },
    )
    async def readyz(request: Request):
        ok, detail = await readiness.check()
        return JSONResponse(
            {"ready": ok, **detail}, status_code=200 if ok else 503, headers=None if ok else retry_after()
        )

    @api.get("/v1/stats", responses=errors(503))
    async def stats(request: Request):
        fe = running_frontend()
        extra = state.get("stats")  # the ingress's own view (work per pool replica, call timings)
        extra = extra() if extra else {}
        if inspect.isawaitable(extra):
            extra = await extra
        return {
            **fe.service.stats.as_dict(),
            "queue_depth": fe.service.queue_depth,
            "active_sessions": fe.service.active_sessions,
            "speculative": fe.speculation.enabled,
            **extra,
        }

    @api.get("/v1/models", responses=errors(503))
    async def models(request: Request):
        fe = running_frontend()
        return {
            "object": "list",
            "data": [
                {
                    "id": fe.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "moa-serve",
                    "max_model_len": fe.max_model_len,
                    "weights": fe.weights,
                }
            ],
        }


# ---------------------------------------------------------------------- native API
GENERATION_ERRORS = errors(400, 429, 500, 503)


def _native_routes(api: FastAPI, readiness: Readiness) -> None:
    @api.post(
        "/v1/generate",
        response_model=GenerateResponse,
        responses={
            200: {
                "description": "the generation: one JSON body, or with stream: true server-sent events",
                "content": SSE,
            },
            **GENERATION_ERRORS,
        },
    )
    async def generate(body: GenerateRequest, request: Request):
        gen = await start_generation(readiness, body, body.prompt, body.messages, body.max_tokens, body.logprobs)
        wanted = body.logprobs is not None
        if body.stream:

            async def events():
                async with aclosing(gen.deltas()) as deltas:
                    async for d in deltas:
                        extra = {"logprobs": native(d.token_ids, d.logprobs or [])} if wanted else {}
                        yield sse({"text": d.text, "token_ids": d.token_ids, **extra})
                yield sse(
                    {
                        "text": "",
                        "token_ids": [],
                        "finish_reason": gen.finish_reason,
                        "usage": usage(gen),
                        "speculative": gen.stats(),
                    }
                )

            return EventStream(guarded(gen, events()))
        failed = await finish_or_500(gen)
        if failed:
            return failed
        return GenerateResponse(
            id=gen.id,
            text=gen.text,
            token_ids=gen.token_ids,
            finish_reason=gen.finish_reason,
            usage=Usage(**usage(gen)),
            speculative=SpeculativeStats(**gen.stats()),
            logprobs=native(gen.token_ids, gen.logprobs) if wanted else None,
        )


# ---------------------------------------------------------------------- OpenAI-compatible
def check_openai_model(body) -> None:
    """404 naming ``model`` when the request asks for a model this server does not serve."""
    fe = running_frontend()
    if body.model is not None and body.model != fe.model_name:
        raise ApiError(
            404, f"model {body.model!r} is not served here (serving {fe.model_name!r})", "model", "not_found_error"
        )


@dataclass(frozen=True)
class Shape:
    """What an OpenAI choice holds beside the text: ``logprobs`` (alternatives per token; None:
    none asked), ``echo`` (completions: the prompt's text before the completion) and ``output``
    (False for ``max_tokens: 0``: the prompt is scored, the token generated with it is dropped).
    Every choice of a request has the same shape."""

    chat: bool
    logprobs: int | None = None
    echo: str | None = None
    output: bool = True


class ChoiceLogprobs:
    """One choice's ``logprobs``, chunk by chunk (completions' text offsets carried on)."""

    def __init__(self, shape: Shape, gen: Generation, texts: TokenTexts):
        self.shape, self.gen, self.texts = shape, gen, texts
        self.offset = 0

    def prompt(self) -> dict:
        """Completions with echo: the prompt's tokens, the first without a log-probability."""
        ids = self.gen.session.prompt
        out = completion_logprobs(self.texts, [], ids, [None, *(self.gen.prompt_logprobs or [])])
        self.offset = completion_text_length(out)
        return out

    def tokens(self, ids: list[int], lps: list, before: list[int]) -> dict:
        if self.shape.chat:
            return {"content": chat_content(self.texts, before, ids, lps)}
        out = completion_logprobs(self.texts, before, ids, lps, self.offset)
        self.offset += completion_text_length(out)
        return out

    def context(self, new: int) -> list[int]:
        """The tokens just before the last ``new`` generated ones (a few suffice for their texts)."""
        done = len(self.gen.token_ids) - new
        return self.gen.session.prompt[-4:] + self.gen.token_ids[max(0, done - 4) : done]


def joined(parts: list[dict]) -> dict:
    """Completions' ``logprobs`` of consecutive token runs as one."""
    return {k: [v for p in parts for v in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def _openai_stream(
    body, gens: list[Generation], shape: Shape, rid: str, obj: str, created: int, model_name: str
) -> EventStream:
    """The choices' deltas as they come, each chunk naming its choice (``index``) and carrying its
    own ``logprobs`` when asked."""
    chat = shape.chat
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    texts = TokenTexts(running_frontend().tokenizer)
    lps = [ChoiceLogprobs(shape, gen, texts) for gen in gens]

    def chunk(index, text, finish, role=False, logprobs=None):
        if chat:
            delta = ({"role": "assistant", "content": text} if role else {"content": text}) if text or role else {}
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
        return {
            "id": rid,
            "object": obj + ".chunk" if chat else obj,
            "created": created,
            "model": model_name,
            "choices": [choice],
        }

    async def events():
        if chat:
            for i in range(len(gens)):
                yield sse(chunk(i, "", None, role=True))
        echoed = [shape.echo is None] * len(gens)
        async with aclosing(merged_deltas(gens)) as deltas:
            async for i, d in deltas:
                if not echoed[i]:  # a scored prompt's values come with the first tokens
                    echoed[i] = True
                    lp = lps[i].prompt() if shape.logprobs is not None else None
                    yield sse(chunk(i, shape.echo, None, logprobs=lp))
                if not shape.output:
                    if d.finish_reason:
                        yield sse(chunk(i, "", "length"))
                    continue
                lp = None
                if shape.logprobs is not None and d.token_ids:
                    lp = lps[i].tokens(d.token_ids, d.logprobs or [], lps[i].context(len(d.token_ids)))
                if d.text or d.finish_reason or lp:
                    yield sse(chunk(i, d.text, d.finish_reason, logprobs=lp))
        if include_usage:
            yield sse(
                {
                    "id": rid,
                    "object": obj + ".chunk" if chat else obj,
                    "created": created,
                    "model": model_name,
                    "choices": [],
                    "usage": usage(gens, shape.output),
                    "speculative": choices_stats(gens),
                }
            )

    return EventStream(guarded(AllOf(gens), events()))


async def merged_deltas(gens: list[Generation]):
    """(choice index, delta) of every choice, in the order they arrive; an error of one choice ends
    them all (raised after the others are closed)."""
    if len(gens) == 1:
        async with aclosing(gens[0].deltas()) as deltas:
            async for d in deltas:
                yield 0, d
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: Generation):
        try:
            async with aclosing(gen.deltas()) as deltas:
                async for d in deltas:
                    await queue.put((i, d, None))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((i, None, exc))
        await queue.put((i, None, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, d, exc = await queue.get()
            if exc is not None:
                raise exc
            if d is None:
                left -= 1
                continue
            yield i, d
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def choice_logprobs(shape: Shape, gen: Generation, texts: TokenTexts) -> dict | None:
    """The ``logprobs`` of a whole choice (None when not asked)."""
    if shape.logprobs is None:
        return None
    lps = ChoiceLogprobs(shape, gen, texts)
    parts = [lps.prompt()] if shape.echo is not None else []
    ids, values = (gen.token_ids, gen.logprobs) if shape.output else ([], [])
    parts.append(lps.tokens(ids, values, gen.session.prompt))
    return parts[-1] if shape.chat else joined(parts)


async def openai_response(body, gens: list[Generation], shape: Shape):
    """The completion (``shape.chat``: the chat completion) of a request's choices, as one body or a
    stream of chunks."""
    fe = running_frontend()
    created = int(time.time())
    chat = shape.chat
    obj = "chat.completion" if chat else "text_completion"
    rid = ("chatcmpl-" if chat else "cmpl-") + gens[0].id
    if body.stream:
        return _openai_stream(body, gens, shape, rid, obj, created, fe.model_name)
    for failed in await asyncio.gather(*(finish_or_500(g) for g in gens)):
        if failed:
            return failed
    texts = TokenTexts(fe.tokenizer)
    choices = []
    for i, gen in enumerate(gens):
        finish = "length" if gen.finish_reason == "length" or not shape.output else "stop"
        logprobs = choice_logprobs(shape, gen, texts)
        text = (shape.echo or "") + (gen.text if shape.output else "")
        if chat:
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish,
                    "logprobs": logprobs,
                }
            )
        else:
            choices.append({"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs})
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": fe.model_name,
        "choices": choices,
        "usage": usage(gens, shape.output),
        "speculative": choices_stats(gens),
    }


def _completion_shape(body: CompletionRequest, prompt) -> Shape:
    """The shape of a completion (``max_tokens: 0``: no output; with echo, the prompt scored)."""
    echo = None
    if body.echo:
        echo = prompt if isinstance(prompt, str) else running_frontend().tokenizer.decode(prompt)
    return Shape(chat=False, logprobs=body.logprobs, echo=echo, output=body.max_tokens != 0)


def _openai_routes(api: FastAPI, readiness: Readiness) -> None:
    openai_responses = {
        200: {"description": "the completion: one JSON body, or with stream: true server-sent events", "content": SSE},
        **errors(404),
        **GENERATION_ERRORS,
    }

    @api.post("/v1/completions", responses=openai_responses)
    async def completions(body: CompletionRequest, request: Request):
        check_openai_model(body)
        prompt = body.prompt_input()
        shape = _completion_shape(body, prompt)
        max_tokens = 16 if body.max_tokens is None else max(1, body.max_tokens)
        score = body.echo and body.logprobs is not None
        gens = await start_generations(readiness, body, prompt, None, max_tokens, body.n, body.logprobs, score)
        return await openai_response(body, gens, shape)

    @api.post("/v1/chat/completions", responses=openai_responses)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_openai_model(body)
        logprobs = body.logprobs_wanted()
        max_tokens = body.max_completion_tokens or body.max_tokens or 256
        gens = await start_generations(readiness, body, None, body.messages, max_tokens, body.n, logprobs)
        return await openai_response(body, gens, Shape(chat=True, logprobs=logprobs))


def create_app(ready_wait_s: float = READY_WAIT_S) -> FastAPI:
    api = FastAPI(
        title="MoA-Serve",
        version="0.1.0",
        description="Lossless Mixture-of-Attentions speculative decoding on Ray Serve",
    )
    _without_422(api)
    readiness = Readiness(ready_wait_s)
    _install_error_handlers(api)
    client_server.install(api, readiness)  # client-server mode: /v1/cs (its own module, same error shape)
    _ops_routes(api, readiness)
    _native_routes(api, readiness)
    _openai_routes(api, readiness)
    access.install(api)  # API keys and request limits, before any route (app/access.py)
    return api
