"""HTTP routes of client-server mode (``/v1/cs``), over ``moa_serve.cs.sessions.ClientSessions``
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
``expected_round``; 429 and 503 carry ``Retry-After``. Every status is in the OpenAPI schema."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

from moa_serve.app import state
from moa_serve.app.cs_schemas import CreateSession, VerifyRound
from moa_serve.app.frontend import InputError
from moa_serve.app.errors import error_param, errors, retry_after
from moa_serve.app.readiness import Readiness, running_frontend
from moa_serve.cs import wire
from moa_serve.cs.sessions import ClientSessions, CSError, Reply

REQUEST_TENSORS = {"draft_probs"}


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


def _frame(reply: Reply, codec: str, **extra) -> Response:
    header = {**extra, "round": reply.round, "committed_length": reply.committed_length, "tokens": reply.tokens,
              "accepted": reply.accepted, "finish_reason": reply.finish_reason,
              "feature_start": reply.feature_start if reply.features is not None else None}
    header = {k: v for k, v in header.items() if v is not None}  # absent = null
    return Response(wire.pack(header, wire.encode_features(reply.features, codec)), media_type=wire.MEDIA_TYPE)


def _sessions() -> ClientSessions:
    cs = state.get("cs")
    if cs is None:
        reason = state.get("cs_unavailable") or "client-server mode is not enabled on this server"
        raise CSError(404, reason, None, "not_found_error")
    return cs


FRAME = {200: {"description": "a frame: JSON header + feature tensors (moa_serve.cs.wire)",
                "content": {wire.MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}}


def _body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` of a route that reads its body itself (JSON or a binary frame)."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}},
        wire.MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}}


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
        return JSONResponse({"error": body}, status_code=exc.status,
                            headers=retry_after() if exc.status in (429, 503) else None)

    @api.get("/v1/cs", responses=errors(404, 503))
    async def cs_identity():
        cs = _sessions()
        await readiness.admit()
        return (await cs.identity()).as_dict()

    @api.post("/v1/cs/sessions", responses={**FRAME, **errors(400, 404, 409, 429, 503)},
              openapi_extra=_body(CreateSession))
    async def cs_create(request: Request):
        cs = _sessions()
        await readiness.admit()
        body, _ = await _read(request, CreateSession)
        ids = body.token_ids
        if ids is None:
            try:
                ids, _field = await running_frontend().tokenize(body.prompt, body.messages)
            except InputError as exc:
                raise CSError(400, str(exc), exc.param) from None
        sid, reply = await cs.create(ids, fingerprints=body.fingerprints.model_dump(), max_tokens=body.max_tokens,
                                     sampling=body.sampling(), ignore_eos=body.ignore_eos,
                                     want_features=body.want_features, feature_codec=body.feature_codec,
                                     features_from=body.features_from, session_id=body.session_id)
        return _frame(reply, body.feature_codec, session_id=sid)

    @api.post("/v1/cs/sessions/{session_id}/verify", responses={**FRAME, **errors(400, 404, 409, 503)},
              openapi_extra=_body(VerifyRound))
    async def cs_verify(session_id: str, request: Request):
        cs = _sessions()
        body, tensors = await _read(request, VerifyRound)
        reply = await cs.verify(session_id, body.round, body.committed_length, body.draft_ids,
                                tensors.get("draft_probs"), body.features_from, body.alternatives)
        return _frame(reply, cs.feature_codec(session_id))

    @api.delete("/v1/cs/sessions/{session_id}", responses=errors(404))
    async def cs_close(session_id: str):
        if not _sessions().close(session_id):
            raise CSError(404, f"unknown session {session_id}", "session_id", "not_found_error")
        return {"id": session_id, "deleted": True}
