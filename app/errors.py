"""The API's one error shape, ``{"error": {"message", "type", "param", "code"}}``, shared by the
routes of ``app/http.py`` and client-server mode's ``app/client_server.py``: the ``responses=`` entries that
put every error status in the OpenAPI schema, ``ApiError`` (answered by the app's handler), and
the field a validation error names."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from moa_serve.app import state
from moa_serve.app.schemas import ErrorResponse

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


def errors(*codes: int) -> dict:
    """The ``responses=`` entries of a route's error statuses: the error body, Retry-After on 429/503."""
    return {
        code: {
            "model": ErrorResponse,
            "description": WHY[code],
            **({"headers": RETRY_AFTER} if code in (429, 503) else {}),
        }
        for code in codes
    }


class ApiError(Exception):
    """Answered as ``error(status, message, param, kind, headers)`` by the app's handler."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.param, self.kind, self.headers = status, param, kind, headers


def retry_after() -> dict:
    return {"Retry-After": str(state.get("retry_after_s", 1))}


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, None, "service_unavailable", retry_after())


def error(
    status: int,
    message: str,
    param: str | None = None,
    kind: str = "invalid_request_error",
    headers: dict | None = None,
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}},
        status_code=status,
        headers=headers,
    )


def loc_param(loc) -> str:
    """A validation error's location as the field it names (``messages.0.content``; ``body``: the whole body)."""
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
    return loc_param(loc)
