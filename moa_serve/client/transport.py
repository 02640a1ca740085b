"""The device's HTTP link to the server's ``/v1/cs`` API: one keep-alive ``httpx.Client``, bytes
on the wire counted per call (HTTP/1.1 request and status lines, headers and bodies; TCP/IP
overhead excluded), bounded retries.

Every call has a deadline (``deadline.CallDeadline``: a multiple of the round trips measured on
this link, or ``--timeout``) that bounds all its attempts together: a failure that comes fast (a
refused or reset connection, a lost response, a 5xx) is retried while at least half the deadline
is left; a call that times out has spent it. So a blackholed link is noticed within one deadline.

Retrying is safe by protocol: a verify round is idempotent on the server (a retry after a lost
response is answered again, nothing is committed twice) and a create carries the session id the
client chose. A link that stays down raises ``Unreachable``; an answer the server refuses raises
``ServerError`` (``ResyncError`` for a 409 resync)."""

from __future__ import annotations

import json
import time

import httpx
import torch

from moa_serve.app.auth import API_KEY_ENV  # noqa: F401 - the key ``moa client`` sends when --api-key is not given
from moa_serve.client.deadline import CallDeadline
from moa_serve.client_server import wire

# headers the protocol does not need (HTTP/1.1 connections persist without "connection: keep-alive")
DEFAULT_TRIM = ("accept", "accept-encoding", "user-agent", "connection")


class ServerError(RuntimeError):
    """A refusal (4xx) or failure (5xx) with the API's error body."""

    def __init__(self, status: int, body: dict):
        err = body.get("error", {}) if isinstance(body, dict) else {}
        super().__init__(f"HTTP {status}: {err.get('message', body)}")
        self.status = status
        self.kind = err.get("type")
        self.param = err.get("param")
        self.body = err


class ResyncError(ServerError):
    """409: the server holds another length of the session (or none: expected_length 0)."""

    @property
    def expected_length(self) -> int:
        return int(self.body.get("expected_length", 0))


class Unreachable(ConnectionError):
    """The server could not be reached (connection refused or reset, timeouts) within the call's deadline."""


def _request_bytes(req: httpx.Request, body: bytes) -> int:
    line = len(req.method) + 1 + len(req.url.raw_path) + len(" HTTP/1.1\r\n")
    return line + sum(len(k) + len(v) + 4 for k, v in req.headers.raw) + 2 + len(body)


def _response_bytes(resp: httpx.Response) -> int:
    line = len(f"HTTP/1.1 {resp.status_code} {resp.reason_phrase}\r\n")
    return line + sum(len(k) + len(v) + 4 for k, v in resp.headers.raw) + 2 + len(resp.content)


class Transport:
    """``timeout_s``: a fixed deadline per call, retries included (None: ``deadline``, or one that
    follows the measured round trips). ``api_key``: sent on every call as ``Authorization: Bearer``
    (a server with API keys answers 401 without it, raised as ``ServerError``)."""

    def __init__(
        self,
        server: str | None = None,
        *,
        http: httpx.Client | None = None,
        timeout_s: float | None = None,
        connect_timeout_s: float = 3.0,
        attempts: int = 3,
        backoff_s: float = 0.2,
        deadline: CallDeadline | None = None,
        api_key: str | None = None,
    ):
        self.deadline = deadline or CallDeadline(fixed_s=timeout_s)
        if http is None:
            if not server:
                raise ValueError("a server URL (or an httpx client) is needed")
            # (each request carries its own timeout: the call's deadline)
            http = httpx.Client(
                base_url=server.rstrip("/"),
                timeout=httpx.Timeout(self.deadline.cap_s, connect=connect_timeout_s),
                limits=httpx.Limits(max_keepalive_connections=1, keepalive_expiry=300),
            )
        for h in DEFAULT_TRIM:
            http.headers.pop(h, None)
        if api_key:
            http.headers["authorization"] = f"Bearer {api_key}"
        self.http = http
        self.attempts = attempts
        self.connect_timeout_s = connect_timeout_s
        self.backoff_s = backoff_s
        self.calls = 0  # HTTP requests sent (retries included)
        self.retries = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.last_round_trip_s = 0.0

    def close(self) -> None:
        self.http.close()

    # ------------------------------------------------------------------ calls
    def info(self) -> dict:
        return self._json(self._send("GET", "/v1/cs"))

    def create(self, body: dict, attempts: int | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
        return self._frame(self._send("POST", "/v1/cs/sessions", body, None, attempts, prefill=True))

    def verify(
        self, session_id: str, body: dict, tensors: dict[str, torch.Tensor] | None = None, attempts: int | None = None
    ) -> tuple[dict, dict[str, torch.Tensor]]:
        return self._frame(self._send("POST", f"/v1/cs/sessions/{session_id}/verify", body, tensors, attempts))

    def delete(self, session_id: str) -> bool:
        resp = self._send("DELETE", f"/v1/cs/sessions/{session_id}", attempts=1)
        return resp.status_code == 200

    # ------------------------------------------------------------------ plumbing
    def _send(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        tensors: dict | None = None,
        attempts: int | None = None,
        prefill: bool = False,
    ) -> httpx.Response:
        """Attempts the call until it is answered (< 500, not 429) or its deadline rules out
        another attempt. A prefill's round trip is the server's work, not the link's: not measured."""
        content, ctype = _encode(body, tensors)
        deadline_s = self.deadline.prefill_seconds() if prefill else self.deadline.seconds()
        end = time.perf_counter() + deadline_s
        last: Exception | None = None
        for attempt in range(attempts or self.attempts):
            if attempt:
                if not self._may_retry(end, deadline_s, attempt):
                    break
                self.retries += 1
                time.sleep(self._backoff(attempt))
            try:
                resp = self._attempt(method, path, content, ctype, end - time.perf_counter(), measure=not prefill)
            except httpx.TransportError as exc:  # refused, reset, dropped response, timeout
                last = exc
                continue
            if resp.status_code >= 500 or resp.status_code == 429:
                last = ServerError(resp.status_code, _body(resp))
                continue
            return resp
        if isinstance(last, ServerError):
            raise last
        raise Unreachable(
            f"{method} {path}: {type(last).__name__}: {last} (deadline {deadline_s:.2f} s: {self.deadline.describe()})"
        ) from last

    def _backoff(self, attempt: int) -> float:
        return self.backoff_s * 2 ** (attempt - 1)

    def _may_retry(self, end: float, deadline_s: float, attempt: int) -> bool:
        """Another attempt only with half the call's deadline still left after the backoff: a
        timed-out attempt has spent it, a fast failure (refused, reset, lost response) has not."""
        return end - time.perf_counter() - self._backoff(attempt) >= deadline_s / 2

    def _attempt(
        self, method: str, path: str, content: bytes, ctype: str | None, timeout_s: float, measure: bool
    ) -> httpx.Response:
        # (connect, read, write, pool) as a tuple: a client of httpx or of its successor httpx2 (which
        # Starlette's TestClient uses) takes it
        timeout = (min(self.connect_timeout_s, timeout_s), timeout_s, timeout_s, timeout_s)
        req = self.http.build_request(
            method, path, content=content or None, headers={"content-type": ctype} if ctype else None, timeout=timeout
        )
        self.calls += 1
        self.bytes_up += _request_bytes(req, content)
        t0 = time.perf_counter()
        resp = self.http.send(req)
        resp.read()
        self.last_round_trip_s = time.perf_counter() - t0
        self.bytes_down += _response_bytes(resp)
        if measure:
            self.deadline.observe(self.last_round_trip_s)
        return resp

    @staticmethod
    def _raise_for(resp: httpx.Response) -> None:
        if resp.status_code < 400:
            return
        body = _body(resp)
        if resp.status_code == 409 and body.get("error", {}).get("type") == "resync":
            raise ResyncError(resp.status_code, body)
        raise ServerError(resp.status_code, body)

    def _json(self, resp: httpx.Response) -> dict:
        self._raise_for(resp)
        return resp.json()

    def _frame(self, resp: httpx.Response) -> tuple[dict, dict[str, torch.Tensor]]:
        self._raise_for(resp)
        return wire.unpack(resp.content)


def _encode(body: dict | None, tensors: dict | None) -> tuple[bytes, str | None]:
    if tensors:
        return wire.pack(body or {}, tensors), wire.MEDIA_TYPE
    if body is not None:
        return json.dumps(body, separators=(",", ":")).encode(), "application/json"
    return b"", None


def _body(resp: httpx.Response) -> dict:
    try:
        body = resp.json()
    except ValueError:
        return {"error": {"message": resp.text[:200]}}
    return body if isinstance(body, dict) else {"error": {"message": str(body)}}
