"""Who may call the HTTP API and how much, decided before a route runs: ``AccessMiddleware``, a
pure ASGI middleware in front of every route of ``app/http.py`` and ``app/client_server.py``.

In order, for each HTTP request:

1. with API keys set (``app/auth.py``), every path but the open ones (``/healthz``, ``/readyz``
   and the OpenAPI pages) needs ``Authorization: Bearer <key>``: a missing or wrong key gets 401
   with the API's error body, before the body is read — nothing is parsed, tokenized or queued;
2. a POST over ``http_limits.max_concurrent_requests_per_key`` in flight for its key gets 429
   with Retry-After (the queue's own 429 stays);
3. the body is counted as it arrives: over the cap (``app/limits.py``'s ``BodyCaps``) it gets
   413 at once, from its Content-Length or as soon as the bytes received pass the cap, so the
   Gateway never holds more than the cap; within it, the route reads it as usual;
4. the body must arrive within ``http_limits.body_timeout_s`` of the headers (and a second more
   per ``MIN_BODY_BYTES_PER_S`` of its Content-Length; 408 and close otherwise); a body whose next
   bytes do not come within ``SLOW_BODY_GRACE_S`` makes the request a slow one of its client
   address, and one slow request over ``max_slow_requests_per_client`` gets 429 and close at once:
   announced bodies that never come hold a Gateway request briefly, and few of them.

Responses pass through untouched, except that a chunk of a streamed body the client does not take
within ``http_limits.stalled_stream_timeout_s`` ends the response (its generation is aborted).
The Gateway installs its ``Access`` in ``moa_serve.app.state`` (``access``); an app without one
(tests, the one-process client-server server) is open, with the default limits of the installed
frontend's context and vocabulary. ``document`` puts 401, 408, 413 and the 429 in the OpenAPI
schema, and the bearer scheme while keys are set."""

from __future__ import annotations

import asyncio
import copy
import logging

from fastapi import FastAPI

from moa_serve.app import state
from moa_serve.app.auth import KeyRing, bearer
from moa_serve.app.errors import RETRY_AFTER, ApiError, error, retry_after
from moa_serve.app.limits import (
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_VOCAB,
    MIN_BODY_BYTES_PER_S,
    SLOW_BODY_GRACE_S,
    BodyCaps,
    HttpLimitsConfig,
    KeyConcurrency,
    LimitError,
    SlowClients,
    capped_max_tokens,
)

log = logging.getLogger("ray.serve")

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
SECURITY_SCHEME = "apiKey"
OPEN_WARNING = (
    "http_auth: no API keys are set: every /v1 route is open to anyone who reaches this port "
    "(set $MOA_API_KEYS, $MOA_API_KEYS_FILE or http_auth; docs/security.md)"
)

WHY_401 = (
    "the server has API keys and the request carries none or a wrong one: send `Authorization: Bearer <key>` "
    "(error.type `authentication_error`)"
)
WHY_413 = (
    "the request body is larger than the server's cap (http_limits.max_body_bytes; verify frames: max_frame_bytes)"
)
WHY_429 = (
    "the request queue is full, the request would wait longer than http_limits.max_queue_wait_s for its first "
    "round, this API key has http_limits.max_concurrent_requests_per_key requests in flight, or this client has "
    "http_limits.max_slow_requests_per_client bodies still arriving; retry after Retry-After seconds"
)
WHY_408 = "the request body did not arrive within http_limits.body_timeout_s of the headers; the connection is closed"


class Access:
    """The keys and limits of one Gateway replica."""

    def __init__(
        self,
        keys: KeyRing | None = None,
        limits: HttpLimitsConfig | None = None,
        *,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        vocab_size: int = DEFAULT_VOCAB,
    ):
        self.keys = keys if keys is not None else KeyRing()
        self.limits = limits or HttpLimitsConfig()
        self.caps = BodyCaps(self.limits, max_model_len, vocab_size)
        self.concurrency = KeyConcurrency(self.limits.max_concurrent_requests_per_key)
        self.slow_clients = SlowClients(self.limits.max_slow_requests_per_client)

    @classmethod
    def for_gateway(cls, cfg, max_model_len: int, vocab_size: int) -> "Access":
        """The Gateway's access from its ``AppConfig`` (keys from the config, the key file and the
        environment); warns once when the API is open. Raises ValueError for a key file that
        cannot be read or holds no key."""
        keys = KeyRing.from_config(cfg.http_auth)
        access = cls(keys, cfg.http_limits, max_model_len=max_model_len, vocab_size=vocab_size)
        if not keys.enabled:
            log.warning(OPEN_WARNING)
        return access


_default: tuple[object, Access] | None = None


def current() -> Access:
    """The installed ``Access``; without one, an open one sized from the installed frontend."""
    global _default
    access = state.get("access")
    if access is not None:
        return access
    fe = state.get("frontend")
    if _default is None or _default[0] is not fe:
        if fe is None:
            sized = Access()
        else:
            try:
                vocab = len(fe.tokenizer)
            except TypeError:
                vocab = DEFAULT_VOCAB
            sized = Access(max_model_len=fe.max_model_len, vocab_size=vocab)
        _default = (fe, sized)
    return _default[1]


def max_tokens_of(body, max_tokens: int) -> int:
    """``max_tokens`` under ``http_limits.max_tokens`` (400 naming the field when a request asked for more)."""
    try:
        return capped_max_tokens(current().limits, body, max_tokens)
    except LimitError as exc:
        raise ApiError(400, str(exc), exc.param) from None


def route_path(scope) -> str:
    """The path the app routes on (without the root path a proxy mounted it under)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def is_frame_route(path: str, method: str) -> bool:
    """A client-server verify, whose frame may carry the drafter's distributions."""
    return method == "POST" and path.startswith("/v1/cs/sessions/") and path.endswith("/verify")


def _header(scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers") or ():
        if k.lower() == name:
            return v
    return None


def client_address(scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else ""


class _TooLarge(Exception):
    pass


class _TooSlow(Exception):
    pass


class _TooManySlow(Exception):
    pass


class _Stalled(Exception):
    """The client took no chunk of a streamed response within ``stalled_stream_timeout_s``."""


class AccessMiddleware:
    """See the module docstring."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        access = current()
        path, method = route_path(scope), scope.get("method", "GET")
        key = None
        if path not in OPEN_PATHS and access.keys.enabled:
            presented = bearer(_header(scope, b"authorization"))
            key = access.keys.match(presented)
            if key is None:
                message = (
                    "missing API key: send the header `Authorization: Bearer <key>`"
                    if presented is None
                    else "invalid API key"
                )
                await error(401, message, None, "authentication_error", {"WWW-Authenticate": "Bearer"})(
                    scope, receive, send
                )
                return
        counted = key is not None and method == "POST" and access.concurrency.limit is not None
        if counted and not access.concurrency.acquire(key):
            await error(
                429,
                f"this API key has {access.concurrency.limit} requests in flight "
                "(http_limits.max_concurrent_requests_per_key); retry later",
                None,
                "rate_limit_error",
                retry_after(),
            )(scope, receive, send)
            return
        try:
            frame = is_frame_route(path, method)
            cap = access.caps.frame if frame else access.caps.json
            try:
                receive = await self._bounded_body(scope, receive, method, cap, access)
            except _TooLarge:
                await error(
                    413,
                    f"the request body is larger than {cap} bytes ({access.caps.field(frame)})",
                    "body",
                    "invalid_request_error",
                    {"Connection": "close"},
                )(scope, receive, send)
                return
            except _TooSlow:
                await error(
                    408,
                    f"the request body did not arrive within {access.limits.body_timeout_s:g} s of the headers "
                    "(http_limits.body_timeout_s)",
                    "body",
                    "invalid_request_error",
                    {"Connection": "close"},
                )(scope, receive, send)
                return
            except _TooManySlow:
                await error(
                    429,
                    f"this client has {access.slow_clients.limit} requests whose body is still arriving "
                    "(http_limits.max_slow_requests_per_client); send the body with the headers",
                    "body",
                    "rate_limit_error",
                    {**retry_after(), "Connection": "close"},
                )(scope, receive, send)
                return
            try:
                await self.app(scope, receive, _watched(send, access.limits.stalled_stream_timeout_s))
            except Exception as exc:  # noqa: BLE001 - a task group may wrap it
                if not _stalled(exc):
                    raise
                log.warning(
                    "%s %s: the client took no chunk of its stream for %g s (http_limits.stalled_stream_timeout_s); "
                    "the stream is ended",
                    method,
                    path,
                    access.limits.stalled_stream_timeout_s,
                )
        finally:
            if counted:
                access.concurrency.release(key)

    @staticmethod
    async def _bounded_body(scope, receive, method: str, cap: int, access: Access):
        """The request's ``receive``, its body read here up to ``cap`` bytes and handed on whole;
        raises ``_TooLarge`` as soon as the body is known to be larger, ``_TooSlow`` when it is not
        whole in its time after the headers, ``_TooManySlow`` when its next bytes do not come within
        ``SLOW_BODY_GRACE_S`` and its client has ``max_slow_requests_per_client`` such requests."""
        length = _header(scope, b"content-length")
        announced = 0
        if length is not None:
            try:
                announced = int(length)
                if announced > cap:
                    raise _TooLarge
            except ValueError:
                pass  # not a number: the server refuses it, or the count below holds
        if method not in BODY_METHODS:
            return receive
        loop = asyncio.get_running_loop()
        last_bytes = loop.time()  # when the headers or the latest chunk came
        deadline = last_bytes + access.limits.body_timeout_s + max(0, announced) / MIN_BODY_BYTES_PER_S
        client, slow = client_address(scope), False
        chunks, size = [], 0
        pending: asyncio.Future | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(receive())
                until = deadline if slow else min(deadline, last_bytes + SLOW_BODY_GRACE_S)
                done, _ = await asyncio.wait((pending,), timeout=max(0.0, until - loop.time()))
                if not done:
                    if loop.time() >= deadline:
                        raise _TooSlow
                    if not access.slow_clients.acquire(client):
                        raise _TooManySlow
                    slow = True
                    continue
                message, pending = pending.result(), None
                last_bytes = loop.time()
                if message["type"] != "http.request":  # the client went away: the route sees it as usual
                    return _replay(message, receive)
                body = message.get("body", b"")
                size += len(body)
                if size > cap:
                    raise _TooLarge
                if body:
                    chunks.append(body)
                if not message.get("more_body", False):
                    break
        finally:
            if pending is not None:
                pending.cancel()
            if slow:
                access.slow_clients.release(client)
        return _replay({"type": "http.request", "body": b"".join(chunks), "more_body": False}, receive)


def _stalled(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_stalled(e) for e in exc.exceptions)
    return isinstance(exc, _Stalled)


def _watched(send, timeout_s: float):
    """``send``, raising ``_Stalled`` when a chunk of a streamed body waits longer than ``timeout_s``
    for the client (its TCP window full): the response ends, and with it the generation."""

    async def watched(message):
        if message["type"] == "http.response.body" and message.get("more_body", False):
            try:
                async with asyncio.timeout(timeout_s):  # no task per chunk, unlike wait_for
                    await send(message)
            except TimeoutError:
                raise _Stalled from None
        else:
            await send(message)

    return watched


def _replay(first: dict, receive):
    """A ``receive`` that answers ``first``, then the request's own (a disconnect, while a response streams)."""
    pending = [first]

    async def replay():
        if pending:
            return pending.pop()
        return await receive()

    return replay


# ---------------------------------------------------------------------- the OpenAPI schema
def _error_response(description: str, headers: dict | None = None) -> dict:
    out = {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }
    if headers:
        out["headers"] = headers
    return out


def document(api: FastAPI) -> None:
    """Adds 401 (every operation a key protects), 413 (every operation with a body) and the per-key
    429 (every POST) to the OpenAPI schema; while keys are set, the bearer scheme too."""
    build = api.openapi
    secured: dict = {}
    documented: list = []  # the schema object the statuses were added to (FastAPI builds it once)

    def openapi() -> dict:
        schema = build()
        if not any(s is schema for s in documented):
            for path, operations in schema.get("paths", {}).items():
                if path in OPEN_PATHS:
                    continue
                for method, op in operations.items():
                    responses = op.setdefault("responses", {})
                    responses.setdefault("401", _error_response(WHY_401))
                    if "requestBody" in op:
                        responses.setdefault("413", _error_response(WHY_413))
                        responses.setdefault("408", _error_response(WHY_408))
                    if method == "post":
                        responses["429"] = {
                            **responses.get("429", _error_response(WHY_429, RETRY_AFTER)),
                            "description": WHY_429,
                        }
            documented[:] = [schema]
            secured.clear()
        if not current().keys.enabled:
            return schema
        if "schema" not in secured:
            out = copy.deepcopy(schema)
            out.setdefault("components", {}).setdefault("securitySchemes", {})[SECURITY_SCHEME] = {
                "type": "http",
                "scheme": "bearer",
                "description": "an API key of the server (docs/security.md)",
            }
            for path, operations in out.get("paths", {}).items():
                if path not in OPEN_PATHS:
                    for op in operations.values():
                        op["security"] = [{SECURITY_SCHEME: []}]
            secured["schema"] = out
        return secured["schema"]

    api.openapi = openapi


def install(api: FastAPI) -> None:
    """The middleware in front of every route, and its statuses in the schema."""
    api.add_middleware(AccessMiddleware)
    document(api)
