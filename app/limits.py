"""How much one request may ask for, checked before any work is done: the request body's size
(413, counted while it arrives, by ``app/access.py``), the time its body may take (408), the
requests one client address may have with a body still arriving, new tokens (``max_tokens``),
stop strings (their number and length, in the request schemas), the requests one API key may
have in flight (429 with Retry-After), how long an admitted request may expect to wait for its
first round (``max_queue_wait_s``, ``moa_serve/engine/admission.py``) and how long a stream may
wait for its client to read (``stalled_stream_timeout_s``). ``HttpLimitsConfig`` is the
``http_limits`` block of the serve config; docs/security.md says where each limit is enforced."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

MIN_BODY_BYTES = 1 << 20  # the default body cap is never below this
BODY_BYTES_PER_TOKEN = 64  # default body cap per token of the context: JSON-escaped text of a full prompt
FRAME_DRAFTS = 64  # the most drafts of one client-server verify (moa_serve.client_server.sessions.MAX_DRAFTS)
FRAME_BYTES_PER_PROB = 4  # draft_probs in float32, the widest dtype a frame may carry
DEFAULT_MAX_MODEL_LEN = 2048  # an app without a Gateway (tests, the one-process client-server server)
DEFAULT_VOCAB = 1 << 18
# a body whose next bytes do not come within this makes its request a slow one (counted per client
# address); a client that sends its JSON with its headers, or streams a large body, is never counted.
# Behind Serve's Python proxy the body reaches the Gateway by one more call to the proxy, which a
# burst of requests on a busy machine delays (docs/benchmarks.md#resilience)
SLOW_BODY_GRACE_S = 1.0
# a large body gets one more second of body_timeout_s per this many bytes of its Content-Length: a
# device's verify frame of drafter distributions (megabytes) over a slow link is not cut short
MIN_BODY_BYTES_PER_S = 64 * 1024

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
# the ``stop`` field of a generation request: one string or a list, both bounded
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None


class HttpLimitsConfig(BaseModel):
    """What one request may ask for, refused before any work is done (docs/security.md). Stop
    strings are bounded by the API itself: at most 16, of at most 256 characters each."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int | None = Field(
        None,
        ge=1024,
        description="the largest request body; a larger one gets 413 before it is parsed (at once "
        "when its Content-Length says so, else as soon as the bytes received pass it: the Gateway never holds more). "
        "Default: 64 bytes per token of max_model_len, at least 1 MiB",
    )
    max_frame_bytes: int | None = Field(
        None,
        ge=1024,
        description="the largest body of a client-server verify (POST /v1/cs/sessions/{id}/verify), "
        "whose frame may carry the drafter's distribution for up to 64 drafts. Default: max_body_bytes + 64 x the "
        "vocabulary x 4 bytes",
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="the most new tokens a request may ask for (max_tokens, max_completion_tokens, a "
        "client-server session's max_tokens): more is a 400 naming the field; a request that names none gets at most "
        "this. Default: no cap beyond the API's 32768 (a generation also ends at the context, max_model_len)",
    )
    max_concurrent_requests_per_key: int | None = Field(
        None,
        ge=1,
        description="POST requests one API key may have in flight on one Gateway replica (streams count "
        "until they end); one more gets 429 with Retry-After. Applies when API keys are set; default: no limit",
    )
    body_timeout_s: float = Field(
        10.0,
        gt=0,
        description="seconds a request's body may take to arrive after its headers (one more per 64 KiB of "
        "its Content-Length); a body still incomplete then gets 408 and its connection is closed, so a client "
        "that sends slowly, or announces a body and never sends it, holds a Gateway request for no longer",
    )
    max_slow_requests_per_client: int = Field(
        32,
        ge=1,
        description="requests from one client address whose body stopped coming for a second before "
        "it was whole, at once on one Gateway replica; one more gets 429 with Retry-After and its connection "
        "is closed. A client that sends its body with its headers, or streams it, is never counted. Behind "
        "Serve's HAProxy every client has HAProxy's address: the bound then holds for slow requests of all "
        "clients together",
    )
    max_queue_wait_s: float | None = Field(
        4.0,
        gt=0,
        description="a generation that would wait longer than this for a seat in the rounds, estimated from the "
        "measured time per token at full seats and the tokens the running sessions and the requests queued ahead "
        "of it may still generate, gets 429 at once instead of waiting, its Retry-After the time until the first "
        "seat may free, at most this (docs/benchmarks.md#resilience); null: only the queue's length bounds the wait",
    )
    stalled_stream_timeout_s: float = Field(
        30.0,
        gt=0,
        description="seconds a streamed response may wait for its client to take the next chunk (a client "
        "that stopped reading: its TCP window full); the stream is then ended and its session aborted, its slot "
        "freed. Other users' rounds never wait for a client",
    )


class _CountPerKey:
    """How many of something each key holds; ``acquire`` answers False at ``limit`` (None: no limit)."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self._held: dict = {}

    def acquire(self, key) -> bool:
        n = self._held.get(key, 0)
        if self.limit is not None and n >= self.limit:
            return False
        self._held[key] = n + 1
        return True

    def release(self, key) -> None:
        n = self._held.get(key, 0) - 1
        if n > 0:
            self._held[key] = n
        else:
            self._held.pop(key, None)

    def held(self, key) -> int:
        return self._held.get(key, 0)


class SlowClients(_CountPerKey):
    """Requests per client address whose body is still arriving after ``SLOW_BODY_GRACE_S``.
    ``acquire`` answers False at the limit."""

    def slow(self, client: str) -> int:
        return self.held(client)


class BodyCaps:
    """The body caps of one Gateway: ``json`` for every route, ``frame`` for a client-server verify."""

    def __init__(self, limits: HttpLimitsConfig, max_model_len: int, vocab_size: int):
        self.json = limits.max_body_bytes or max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)
        self.frame = limits.max_frame_bytes or self.json + FRAME_DRAFTS * vocab_size * FRAME_BYTES_PER_PROB

    def field(self, frame: bool) -> str:
        return "http_limits.max_frame_bytes" if frame else "http_limits.max_body_bytes"


def max_tokens_param(body) -> str:
    """The field that named a request's new tokens (chat: ``max_completion_tokens`` when given)."""
    return "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"


class LimitError(ValueError):
    """A request beyond a limit; ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def capped_max_tokens(limits: HttpLimitsConfig | None, body, max_tokens: int) -> int:
    """``max_tokens`` of ``body`` under ``limits.max_tokens``: a request that asked for more is refused
    (``LimitError``); one that asked for nothing gets the cap when its default is above it."""
    cap = limits.max_tokens if limits is not None else None
    if cap is None or max_tokens <= cap:
        return max_tokens
    param = max_tokens_param(body)
    asked = param in body.model_fields_set
    if asked:
        raise LimitError(
            f"{param}: {max_tokens} new tokens asked; this server allows at most {cap} (http_limits.max_tokens)", param
        )
    return cap


class KeyConcurrency(_CountPerKey):
    """Requests in flight per API key (its digest). ``acquire`` answers False at the limit."""

    def in_flight(self, key: bytes) -> int:
        return self.held(key)
