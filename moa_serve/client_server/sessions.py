"""Client-server mode, server side: the table of sessions whose drafter runs on the client.

Each session is a remote session of the RoundService (same verifier pool, same round batching as
every other user); the client drives it one round at a time:

* ``create`` — prompt tokens in; the first round prefills them and answers the target's first
  token plus the features of the prompt positions (round 0).
* ``verify`` — round ``r`` at committed length ``n`` with the client's drafts: answers how many
  were accepted, the accepted drafts + the target's correction or bonus token, and the features of
  the newly committed positions. Idempotent: a retry of the round just answered (same ``r`` and
  ``n``: its response was lost) gets the same answer again, a retry of a round still running
  awaits it; nothing is committed twice.
* anything else (an unknown, expired or restarted-away session, another length) is a ``Resync``
  (HTTP 409) with the length the server expects: the client sends its committed ids again
  through ``create``.

Sessions idle longer than ``ttl_s`` are dropped (their caches freed). Before that, a session
between rounds gives its round seat back when others wait for one (``reclaim``: the longest idle
first): its client's next call is a resync, and nothing it committed is lost."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Awaitable, Callable

import torch

from moa_serve.client_server.fingerprint import drafter_fingerprint, tokenizer_fingerprint
from moa_serve.drafter.checkpoint import load_draft_vocab
from moa_serve.drafter.spec import DrafterSpec
from moa_serve.engine.events import QueueFullError, Tracked
from moa_serve.engine.round_service import RoundService
from moa_serve.engine.session import Session
from moa_serve.sampling import SamplingParams

log = logging.getLogger(__name__)

MAX_DRAFTS = 64  # per verify call: K, or an offline tail verified on reconnection
MAX_ALTERNATIVES = 24  # tree drafts: alternatives per verify call, all depths together


class CSError(Exception):
    """A request the server refuses: HTTP ``status``, ``param`` names the field, ``extra`` is
    added to the error body (a resync's expected length and round)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error", **extra
    ):
        super().__init__(message)
        self.status, self.param, self.kind, self.extra = status, param, kind, extra

    def __reduce__(self):
        """Pickled as a plain CSError with every field: it crosses a Ray call when a Router replica
        holds the session and the Gateway answers the route (a subclass's own arguments differ)."""
        return CSError, (self.status, str(self), self.param, self.kind), {"extra": self.extra}


class Resync(CSError):
    def __init__(self, message: str, expected_length: int, expected_round: int):
        super().__init__(
            409,
            message,
            "committed_length" if expected_length else "session_id",
            "resync",
            expected_length=expected_length,
            expected_round=expected_round,
        )


@dataclass
class ServerIdentity:
    """What the handshake shows a client (``GET /v1/cs``)."""

    model: str
    target: str  # fingerprints (moa_serve.client_server.fingerprint)
    tokenizer: str
    drafter: str | None  # None: the server computes no features
    drafter_kind: str | None
    vocab_size: int
    draft_vocab_size: int | None
    max_model_len: int
    stop_token_ids: list[int]
    max_drafts: int = MAX_DRAFTS
    max_alternatives: int = MAX_ALTERNATIVES  # tree drafts, greedy sessions only
    session_ttl_s: float = 300.0
    feature_codecs: tuple[str, ...] = ("float16", "int8")
    # "latest": the drafter reads only the freshest verified feature (MoA with
    # cross_attention_latest_only), so a round sends only the last committed position's feature
    # and the client stands zeros in for the older ones, which its drafter never reads
    feature_positions: str = "all"

    @property
    def features(self) -> bool:
        return self.drafter is not None and self.drafter_kind in ("moa", "eagle")

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def build(
        cls,
        *,
        model: str,
        target_fingerprint: str,
        tokenizer,
        drafter: str | None,
        vocab_size: int,
        max_model_len: int,
        stop_token_ids,
    ) -> "ServerIdentity":
        """From what the Router holds (the tokenizer, the drafter's name) and the target's
        fingerprint (computed where the weights are: the verifier)."""
        spec = DrafterSpec.parse(drafter)
        vocab = load_draft_vocab(drafter) if drafter else None
        return cls(
            model=model,
            target=target_fingerprint,
            tokenizer=tokenizer_fingerprint(tokenizer),
            drafter=drafter_fingerprint(drafter) if drafter else None,
            drafter_kind=spec.kind,
            vocab_size=vocab_size,
            draft_vocab_size=len(vocab) if vocab is not None else None,
            max_model_len=max_model_len,
            stop_token_ids=sorted(stop_token_ids),
            feature_positions="latest" if spec.latest_feature_only else "all",
        )


@dataclass
class Reply:
    """One round's answer."""

    round: int
    committed_length: int  # the session's committed tokens after the round
    tokens: list[int]  # accepted drafts, then the target's own token (cut at a stop)
    accepted: int
    feature_start: int
    features: torch.Tensor | None  # [n, H] of positions [feature_start, ...), float32
    finish_reason: str | None


@dataclass
class _Entry:
    tracked: Tracked
    want_features: bool
    feature_codec: str
    latest_only: bool  # send only the last committed position's feature (ServerIdentity.feature_positions)
    features_sent: int = 0  # the client holds the features of positions [0, features_sent)
    round: int = 0  # the last round answered
    last: Reply | None = None
    last_key: tuple[int, int] | None = None  # (round, committed length) of ``last``
    inflight: asyncio.Task | None = None
    inflight_key: tuple[int, int] | None = None
    touched: float = 0.0  # when the client was last heard of (the ClientSessions' clock)


class ClientSessions:
    def __init__(
        self,
        service: RoundService,
        identity: ServerIdentity | Callable[[], Awaitable[ServerIdentity]],
        *,
        ttl_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.service = service
        self._identity = identity
        self.ttl_s = ttl_s
        self.clock = clock
        self.entries: dict[str, _Entry] = {}
        self.stats = {
            "created": 0,
            "rounds": 0,
            "replays": 0,
            "resyncs": 0,
            "expired": 0,
            "closed": 0,
            "reclaimed": 0,
            "drafted": 0,
            "accepted": 0,
        }
        self._sweeper: asyncio.Task | None = None
        service.reclaim = self.reclaim  # seats of idle client-server sessions, for sessions waiting for one

    async def identity(self) -> ServerIdentity:
        if not isinstance(self._identity, ServerIdentity):
            got = self._identity()
            self._identity = await got if inspect.isawaitable(got) else got
            self._identity.session_ttl_s = self.ttl_s
        return self._identity

    # ------------------------------------------------------------------ create
    async def create(
        self,
        tokens: list[int],
        *,
        fingerprints: dict,
        max_tokens: int,
        sampling: SamplingParams,
        ignore_eos: bool = False,
        want_features: bool = True,
        feature_codec: str = "float16",
        features_from: int = 0,
        session_id: str | None = None,
    ) -> tuple[str, Reply]:
        """A new session over ``tokens`` (a prompt, or everything a client committed before a
        resync); answers round 0: the target's next token and the features from ``features_from``
        on. A retry with the same ``session_id`` gets the same answer."""
        self._sweep()
        ident = await self.identity()
        if session_id is not None and session_id in self.entries:
            e = self.entries[session_id]
            if e.round == 0:  # a retried create
                return session_id, await self._answer(e, (0, len(tokens)))
            raise CSError(409, f"session {session_id} exists and is past its first round", "session_id")
        if want_features and not ident.features:
            raise CSError(
                400,
                "this server computes no drafter features (it serves no MoA or EAGLE-style drafter); "
                "set want_features to false (drafters that need no features only)",
                "want_features",
            )
        self._check_fingerprints(ident, fingerprints, want_features)
        self._check_ids(ident, tokens, "token_ids")
        sid = session_id or uuid.uuid4().hex
        try:
            session = Session(
                sid,
                list(tokens),
                max_tokens,
                sampling,
                0,
                frozenset() if ignore_eos else frozenset(ident.stop_token_ids),
                ident.max_model_len,
            )
        except ValueError as exc:
            raise CSError(400, str(exc), "token_ids") from None
        try:
            tracked = self.service.submit(session, remote=True)
        except QueueFullError as exc:
            raise CSError(429, f"server busy: {exc}; retry later", None, "rate_limit_error") from None
        e = self.entries[sid] = _Entry(
            tracked,
            want_features,
            feature_codec,
            ident.feature_positions == "latest",
            min(features_from, len(tokens)),
            touched=self.clock(),
        )
        self.stats["created"] += 1
        self._ensure_sweeper()
        return sid, await self._start_round(e, (0, len(tokens)), [], None)

    def _check_fingerprints(self, ident: ServerIdentity, fp: dict, want_features: bool) -> None:
        for part in ("target", "tokenizer") + (("drafter",) if want_features else ()):
            theirs, ours = fp.get(part), getattr(ident, part)
            if theirs != ours:
                raise CSError(
                    400,
                    f"fingerprints.{part}: the client's {part} ({theirs}) is not the server's ({ours}); "
                    f"the device must use the server's {part}",
                    f"fingerprints.{part}",
                    "fingerprint_mismatch",
                )

    @staticmethod
    def _check_ids(ident: ServerIdentity, ids: list[int], param: str) -> None:
        for i, t in enumerate(ids):
            if not 0 <= t < ident.vocab_size:
                raise CSError(
                    400, f"{param}.{i}: token id {t} is outside the vocabulary [0, {ident.vocab_size})", f"{param}.{i}"
                )

    # ------------------------------------------------------------------ verify
    async def verify(
        self,
        session_id: str,
        round: int,
        committed_length: int,
        drafts: list[int],
        probs: torch.Tensor | None = None,
        features_from: int | None = None,
        alternatives: list[list[int]] | None = None,
    ) -> Reply:
        self._sweep()
        e = self.entries.get(session_id)
        if e is None:
            self.stats["resyncs"] += 1
            raise Resync(
                f"unknown session {session_id} (expired, closed, reclaimed for waiting requests or lost "
                "by a server restart): "
                "create it again with your committed token ids",
                0,
                0,
            )
        e.touched = self.clock()
        key = (round, committed_length)
        if e.inflight is not None or key == e.last_key:
            if key in (e.inflight_key, e.last_key):
                return await self._answer(e, key)
            raise CSError(409, f"round {e.inflight_key[0]} of this session is still running", "round", "conflict")
        s = e.tracked.session
        if round != e.round + 1 or committed_length != len(s.tokens):
            self.stats["resyncs"] += 1
            raise Resync(
                f"expected round {e.round + 1} at committed length {len(s.tokens)}, got round {round} at "
                f"{committed_length}: create the session again with your committed token ids",
                len(s.tokens),
                e.round + 1,
            )
        if s.finished:
            raise CSError(
                409,
                f"the session has finished ({s.finish_reason})",
                "session_id",
                "finished",
                finish_reason=s.finish_reason,
            )
        ident = await self.identity()
        if len(drafts) > ident.max_drafts:
            raise CSError(400, f"draft_ids: at most {ident.max_drafts} drafts per round", "draft_ids")
        self._check_ids(ident, drafts, "draft_ids")
        alternatives = self._check_alternatives(ident, s, drafts, alternatives or [])
        probs = self._check_probs(ident, s, drafts, probs)
        if features_from is not None:  # the client lost some: they come again from there
            e.features_sent = min(e.features_sent, features_from)
        return await self._start_round(e, key, drafts, probs, alternatives)

    @classmethod
    def _check_alternatives(
        cls, ident: ServerIdentity, s: Session, drafts: list[int], alternatives: list[list[int]]
    ) -> list[list[int]]:
        if not alternatives:
            return []
        if not s.sampling.greedy:
            raise CSError(
                400,
                "alternatives: tree drafts are verified greedily; this session samples (send a chain of draft_ids)",
                "alternatives",
            )
        if len(alternatives) > len(drafts):
            raise CSError(
                400,
                f"alternatives: {len(alternatives)} depths for {len(drafts)} draft_ids "
                "(alternatives[i] are verified beside draft_ids[i])",
                "alternatives",
            )
        if sum(len(a) for a in alternatives) > ident.max_alternatives:
            raise CSError(400, f"alternatives: at most {ident.max_alternatives} per round", "alternatives")
        for i, row in enumerate(alternatives):
            cls._check_ids(ident, row, f"alternatives.{i}")
        return [list(row) for row in alternatives]

    @staticmethod
    def _check_probs(ident: ServerIdentity, s: Session, drafts: list[int], probs) -> torch.Tensor | None:
        if s.sampling.greedy or not drafts:
            return None  # greedy acceptance needs no distribution
        if probs is None:
            raise CSError(
                400,
                "draft_probs: sampling with drafts needs the drafter's distribution [len(draft_ids), vocabulary]",
                "draft_probs",
            )
        cols = {ident.vocab_size} | ({ident.draft_vocab_size} if ident.draft_vocab_size else set())
        if probs.dim() != 2 or probs.shape[0] != len(drafts) or probs.shape[1] not in cols:
            raise CSError(
                400,
                f"draft_probs: shape {list(probs.shape)}, expected [{len(drafts)}, one of {sorted(cols)}]",
                "draft_probs",
            )
        probs = probs.float()
        if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
            raise CSError(400, "draft_probs: probabilities must be finite and non-negative", "draft_probs")
        return probs

    # ------------------------------------------------------------------ rounds
    async def _start_round(
        self, e: _Entry, key: tuple[int, int], drafts: list[int], probs, alternatives: list[list[int]] | None = None
    ) -> Reply:
        e.inflight_key = key
        e.inflight = asyncio.ensure_future(self._round(e, key, drafts, probs, alternatives or []))
        return await self._answer(e, key)

    async def _answer(self, e: _Entry, key: tuple[int, int]) -> Reply:
        """The answer of round ``key``: the one running (awaited without cancelling it when the
        caller goes away: its answer is kept for the retry) or the one kept."""
        if e.inflight is not None and e.inflight_key == key:
            return await asyncio.shield(e.inflight)
        if e.last_key == key:
            self.stats["replays"] += 1
            return e.last
        raise CSError(409, "that round is neither running nor the last one answered", "round", "conflict")

    async def _round(
        self, e: _Entry, key: tuple[int, int], drafts: list[int], probs, alternatives: list[list[int]]
    ) -> Reply:
        s = e.tracked.session
        accepted_before = s.accepted
        try:
            ev = await self.service.verify_remote(e.tracked, drafts, probs, alternatives)
            if ev.finish_reason is not None and ev.finish_reason.startswith("error"):
                self.entries.pop(s.id, None)  # the client's retry resyncs
                raise CSError(503, f"verification failed: {ev.finish_reason}", None, "server_error")
            if ev.finish_reason == "abort":
                raise CSError(409, "the session was closed while its round ran", "session_id", "finished")
            # features the client lacks (recomputed ones it holds, after a re-prefill, are as good)
            start = min(e.features_sent, s.num_features)
            if e.latest_only:  # the drafter reads only the freshest: the older ones are never sent
                start = max(start, s.num_features - 1)
            feats = s.features.since(start) if e.want_features else None
            e.features_sent = s.num_features
            reply = Reply(
                key[0], len(s.tokens), list(ev.tokens), s.accepted - accepted_before, start, feats, ev.finish_reason
            )
            e.round, e.last, e.last_key = key[0], reply, key
            self.stats["rounds"] += 1
            self.stats["drafted"] += len(drafts)
            self.stats["accepted"] += reply.accepted
            return reply
        finally:
            e.inflight, e.inflight_key = None, None
            e.touched = self.clock()

    def feature_codec(self, session_id: str) -> str:
        e = self.entries.get(session_id)
        return e.feature_codec if e is not None else "float16"

    # ------------------------------------------------------------------ end of sessions
    def close(self, session_id: str) -> bool:
        e = self.entries.pop(session_id, None)
        if e is None:
            return False
        self.service.abort(e.tracked)
        self.stats["closed"] += 1
        return True

    def reclaim(self, n: int) -> int:
        """Gives back up to ``n`` round seats for sessions that wait for one (``RoundService``
        asks when none is free): the sessions without a round running, the longest idle first,
        are dropped as if expired. A client between rounds that comes back gets a resync and
        creates its session again with its committed tokens; one that went away no longer holds
        a seat until its TTL. Returns how many were dropped."""
        idle = sorted(
            (e for e in self.entries.values() if e.inflight is None and not e.tracked.session.finished),
            key=lambda e: e.touched,
        )[:n]
        for e in idle:
            del self.entries[e.tracked.session.id]
            self.service.abort(e.tracked)
            self.stats["reclaimed"] += 1
        return len(idle)

    def _sweep(self) -> None:
        """Drops sessions idle for longer than the TTL (never one with a round running)."""
        cutoff = self.clock() - self.ttl_s
        for sid in [sid for sid, e in self.entries.items() if e.inflight is None and e.touched < cutoff]:
            self.service.abort(self.entries.pop(sid).tracked)
            self.stats["expired"] += 1

    def _ensure_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        while self.entries:
            await asyncio.sleep(max(0.05, min(30.0, self.ttl_s / 4)))
            self._sweep()

    def snapshot(self) -> dict:
        return {**self.stats, "sessions": len(self.entries)}
