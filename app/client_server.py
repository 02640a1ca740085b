"""HTTP routes of client-server mode (``/v1/cs``), over ``moa_serve.client_server.sessions.ClientSessions``
(installed by the ingress as ``state["cs"]``):

* ``GET /v1/cs`` — the handshake: fingerprints of target / tokenizer / drafter, vocabulary sizes,
  stop tokens, limits;
* ``POST /v1/cs/sessions`` — a session; answers round 0 (first token + prompt features);
* ``POST /v1/cs/sessions/{id}/verify`` — one round of drafts;
* ``DELETE /v1/cs/sessions/{id}``.

Requests are JSON, or a binary frame (``application/octet-stream``: JSON header + tensors, e.g. the
drafter's distribution when sampling). Answers are frames: a JSON header (round, tokens, accepted
count, ...) and the features as float16 or int8 tensors. Errors are the API's usual JSON
``{"error": {"message", "type", "param", "code"}}``; a resync (409) adds ``expected_length`` and
``expected_round``; 429 and 503 carry ``Retry-After``. Every status is in the OpenAPI schema.

The schema describes the frames (``FRAME_LAYOUT``: the byte layout; the JSON header's schema; the
400 of a malformed frame) and links the calls of a session: the handshake's fingerprints to
``create``'s body, and ``create``'s ``Session-Id`` header to ``verify`` and ``DELETE``, so that a
stateful fuzzer opens sessions and uses them. No JSON Schema can say which bytes form a frame (a
length prefix that must match what follows), so "schema-valid" bytes may still be a malformed
frame; and whether a well-formed create or verify is accepted depends on the server's state (its
models' fingerprints, its vocabulary, the session's round), which the schema cannot carry either.
A malformed or refused body is a documented 400 naming what is wrong."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

from moa_serve.app import access, state
from moa_serve.app.client_server_schemas import SESSION_ID, CreateSession, VerifyRound
from moa_serve.app.errors import error_param, errors, retry_after
from moa_serve.app.frontend import InputError
from moa_serve.app.readiness import Readiness, running_frontend
from moa_serve.client_server import wire
from moa_serve.client_server.sessions import ClientSessions, CSError, Reply

REQUEST_TENSORS = {"draft_probs"}
SESSION_HEADER = "Session-Id"  # create's answer: the session's id, for the calls that use it (OpenAPI links)


async def _read(request: Request, model: type[BaseModel]):
    """(validated header, tensors) of a JSON or framed body; CSError 400 naming the field."""
    body = await request.body()
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        if ctype == wire.MEDIA_TYPE:
            header, tensors = wire.unpack(body)
        else:
            header, tensors = json.loads(body or b"null"), {}
    except wire.WireError as exc:
        raise CSError(400, f"malformed frame: {exc}", exc.param) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CSError(400, f"malformed JSON: {exc}", "body") from None
    if not isinstance(header, dict):
        raise CSError(400, "the body must be a JSON object", "body")
    for name in tensors:
        if name not in REQUEST_TENSORS:
            raise CSError(400, f"{name}: unknown tensor (expected one of {sorted(REQUEST_TENSORS)})", name)
    try:
        return model.model_validate(header), tensors
    except ValidationError as exc:
        first = exc.errors()[0]
        param = error_param(exc.errors())
        msg = "unknown field" if first.get("type") == "extra_forbidden" else first.get("msg", "invalid value")
        raise CSError(400, f"{param}: {msg}", param) from None


def _frame(reply: Reply, codec: str, headers: dict | None = None, **extra) -> Response:
    header = {
        **extra,
        "round": reply.round,
        "committed_length": reply.committed_length,
        "tokens": reply.tokens,
        "accepted": reply.accepted,
        "finish_reason": reply.finish_reason,
        "feature_start": reply.feature_start if reply.features is not None else None,
    }
    header = {k: v for k, v in header.items() if v is not None}  # absent = null
    return Response(
        wire.pack(header, wire.encode_features(reply.features, codec)), media_type=wire.MEDIA_TYPE, headers=headers
    )


def _sessions() -> ClientSessions:
    cs = state.get("cs")
    if cs is None:
        reason = state.get("cs_unavailable") or "client-server mode is not enabled on this server"
        raise CSError(404, reason, None, "not_found_error")
    return cs


FRAME_LAYOUT = (
    "A frame (`application/octet-stream`) is `header_length | header | tensor bytes`: `header_length` is a "
    f"uint32, little-endian, at most {wire.MAX_HEADER}; `header` is that many bytes of UTF-8 JSON, one object, "
    f"whose `tensors` lists each tensor as `[name, dtype, shape]` (dtype one of {', '.join(sorted(wire.DTYPES))}) "
    "in the order their bytes follow; then each tensor's bytes, row-major, little-endian, and nothing after the "
    "last (moa_serve.client_server.wire)."
)
REQUEST_TENSORS_DOC = {
    "CreateSession": "A create carries no tensors.",
    "VerifyRound": "A verify may carry `draft_probs` [len(draft_ids), vocabulary or draft vocabulary] (the "
    "drafter's distribution; needed when the session samples): finite and non-negative.",
}
ANSWER_HEADER = (
    "The header's other fields: `round`, `committed_length`, `tokens`, `accepted`, `finish_reason`, "
    "`feature_start` (absent = null); its tensors: `features` [n, hidden size] (float16, or int8 with "
    "`feature_scales`, one float32 per row)."
)
MALFORMED = (
    "bad input, as JSON `ErrorResponse`: a field is invalid (error.param names it, dotted for nested ones); "
    "a malformed frame (error.message starts with `malformed frame`; error.param is `body`, `tensors.N` or "
    "the tensor's name); the client's fingerprints are not the server's (type `fingerprint_mismatch`); "
    "token ids outside the vocabulary"
)


def _frame_response(description: str, headers: dict | None = None, links: dict | None = None) -> dict:
    """A 200 that answers a frame."""
    response = {
        "description": f"{description}. {FRAME_LAYOUT} {ANSWER_HEADER}",
        "content": {wire.MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
    }
    if headers:
        response["headers"] = headers
    if links:
        response["links"] = links
    return response


def _body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` of a route that reads its body itself (JSON or a binary frame)."""
    name = model.__name__
    frame = (
        f"{FRAME_LAYOUT} The header's other fields are the message, as the JSON body (`{name}`). "
        f"{REQUEST_TENSORS_DOC[name]}"
    )
    return {
        "requestBody": {
            "required": True,
            "description": f"JSON (`{name}`) or a frame. {frame}",
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}},
                wire.MEDIA_TYPE: {"schema": {"type": "string", "format": "binary", "description": frame}},
            },
        }
    }


def _responses(frame: dict, *codes: int) -> dict:
    """A frame route's responses: ``frame`` (200), the error statuses, its 400 saying what a body can get wrong."""
    out = {200: frame, **errors(*codes)}
    out[400] = {**out[400], "description": MALFORMED}
    return out


def _frame_route(api: FastAPI, path: str, operation_id: str, body: type[BaseModel], frame: dict, codes: tuple):
    """A POST that reads its body itself (JSON or a frame) and answers a frame (``frame``, its 200) or
    one of the error statuses ``codes``."""
    return api.post(
        path,
        operation_id=operation_id,
        openapi_extra=_body(body),
        response_class=Response,
        responses=_responses(frame, *codes),
    )


SESSION_ID_PARAM = {"session_id": f"$response.header.{SESSION_HEADER}"}
IDENTITY_LINKS = {
    "CreateSession": {
        "operationId": "cs_create_session",
        "description": "a session opened with the server's own fingerprints (the handshake's target, tokenizer, "
        "drafter)",
        "requestBody": {
            "fingerprints": {part: f"$response.body#/{part}" for part in ("target", "tokenizer", "drafter")}
        },
    }
}
SESSION_LINKS = {
    "VerifyRound": {
        "operationId": "cs_verify_round",
        "parameters": SESSION_ID_PARAM,
        "description": "a round of the session just created",
    },
    "CloseSession": {
        "operationId": "cs_close_session",
        "parameters": SESSION_ID_PARAM,
        "description": "closes the session just created",
    },
}


def _document_bodies(api: FastAPI, models: list[type[BaseModel]]) -> None:
    """Adds the JSON schemas of the bodies the routes read themselves to the OpenAPI components."""
    build = api.openapi

    def openapi() -> dict:
        if api.openapi_schema is not None:
            return api.openapi_schema
        schema = build()
        _, defs = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, definition in defs["$defs"].items():
            components.setdefault(name, definition)
        return schema

    api.openapi = openapi


def install(api: FastAPI, readiness: Readiness) -> None:
    _document_bodies(api, [CreateSession, VerifyRound])

    @api.exception_handler(CSError)
    async def _refused(_request: Request, exc: CSError):
        body = {"message": str(exc), "type": exc.kind, "param": exc.param, "code": exc.status, **exc.extra}
        return JSONResponse(
            {"error": body}, status_code=exc.status, headers=retry_after() if exc.status in (429, 503) else None
        )

    @api.get(
        "/v1/cs",
        operation_id="cs_identity",
        responses={
            200: {
                "description": "the handshake: fingerprints, vocabulary sizes, stop tokens, limits",
                "links": IDENTITY_LINKS,
            },
            **errors(404, 503),
        },
    )
    async def cs_identity():
        cs = _sessions()
        await readiness.admit()
        return (await cs.identity()).as_dict()

    @_frame_route(
        api,
        "/v1/cs/sessions",
        "cs_create_session",
        CreateSession,
        _frame_response(
            "round 0 of a new session: its first token and the prompt's features; the frame's header adds `session_id`",
            headers={
                SESSION_HEADER: {
                    "description": "the session's id (as the frame header's `session_id`): the path of its "
                    "verify and DELETE calls",
                    "required": True,
                    "schema": {"type": "string", "pattern": SESSION_ID},
                }
            },
            links=SESSION_LINKS,
        ),
        (400, 404, 409, 429, 503),
    )
    async def cs_create(request: Request):
        cs = _sessions()
        await readiness.admit()
        body, _ = await _read(request, CreateSession)
        body.max_tokens = access.max_tokens_of(body, body.max_tokens)  # http_limits.max_tokens
        ids = body.token_ids
        if ids is None:
            try:
                ids, _field = await running_frontend().tokenize(body.prompt, body.messages)
            except InputError as exc:
                raise CSError(400, str(exc), exc.param) from None
        sid, reply = await cs.create(
            ids,
            fingerprints=body.fingerprints.model_dump(),
            max_tokens=body.max_tokens,
            sampling=body.sampling(),
            ignore_eos=body.ignore_eos,
            want_features=body.want_features,
            feature_codec=body.feature_codec,
            features_from=body.features_from,
            session_id=body.session_id,
        )
        return _frame(reply, body.feature_codec, headers={SESSION_HEADER: sid}, session_id=sid)

    @_frame_route(
        api,
        "/v1/cs/sessions/{session_id}/verify",
        "cs_verify_round",
        VerifyRound,
        _frame_response(
            "the round's answer: accepted drafts, the target's token, the features of the newly committed positions"
        ),
        (400, 404, 409, 503),
    )
    async def cs_verify(session_id: str, request: Request):
        cs = _sessions()
        body, tensors = await _read(request, VerifyRound)
        reply = await cs.verify(
            session_id,
            body.round,
            body.committed_length,
            body.draft_ids,
            tensors.get("draft_probs"),
            body.features_from,
            body.alternatives,
        )
        return _frame(reply, cs.feature_codec(session_id))

    @api.delete("/v1/cs/sessions/{session_id}", operation_id="cs_close_session", responses=errors(404))
    async def cs_close(session_id: str):
        if not _sessions().close(session_id):
            raise CSError(404, f"unknown session {session_id}", "session_id", "not_found_error")
        return {"id": session_id, "deleted": True}
