"""The router's scheduling core, framework-free and async.

Sessions are pinned to a *session group* at admission; each group runs its own round loop
(draft -> verify -> commit for all of its sessions in one call per pool) so that, with two or
more groups, one group drafts while another verifies and neither pool idles. Groups are
hashable keys chosen by the caller: each Router replica passes keys of its own (e.g.
``f"{replica_id}/{i}"``) so that the pools' affinity routing spreads every router's groups over
every pool replica. The pools are async callables: Ray Serve handles in the cluster, local
objects in tests.

Reliability: the committed tokens held here are the source of truth; a replica only ever holds
a cache of them (see ``rounds``: requests carry deltas, any doubt resends everything). A failed
or slow draft call degrades that round to target-only decoding; a failed or slow verify call is
retried a bounded number of times (the retry resends whole token lists, so another or a
restarted replica re-prefills), then errors only the sessions of that round. A failed release is
kept and retried before the group's next round. Nothing committed is ever lost or duplicated.

Speculation never loses at scale: a round's verify width is bounded by
``speculation_token_budget`` (see ``rounds.speculation_cap``), so K shrinks as the batch grows
and turns off when verification stops being nearly free; each session's adaptive K still applies
below that cap. Within it, a drafter pool's drafts are governed round by round (``governor``);
prompt-lookup drafts session by session and token by token (``draft_gate``: a draft is verified
when its measured chance of acceptance outweighs the measured price of one more verify row).

Client-server mode: a *remote* session (``submit(..., remote=True)``) drafts on the user's
device. It joins a round only when its client has proposed drafts (``verify_remote``): the
drafter pool is never asked for it, but its drafts go into the same verify call as everyone
else's, and the round's tokens answer the client instead of a stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Hashable, Sequence

import torch

from moa_serve.drafter.lookup import LookupTable
from moa_serve.drafter.proposer import DraftRequest, DraftResult
from moa_serve.engine import rounds
from moa_serve.engine.draft_gate import DraftGate
from moa_serve.engine.governor import SpeculationGovernor
from moa_serve.engine.session import Session
from moa_serve.verifier.api import VerifyRequest, VerifyResult

log = logging.getLogger(__name__)

DraftFn = Callable[[Hashable, list[DraftRequest]], Awaitable[list[DraftResult]]]
VerifyFn = Callable[[Hashable, list[VerifyRequest]], Awaitable[list[VerifyResult]]]
ReleaseFn = Callable[[Hashable, list[str]], Awaitable[None]]


class QueueFullError(RuntimeError):
    pass


async def _within(seconds: float, aw):
    """``aw`` with a time limit. ``asyncio.timeout``, not ``wait_for``: on Python 3.11 ``wait_for``
    swallows a cancellation that arrives as the inner call completes, and a group loop that
    misses ``stop()``'s cancellation runs forever."""
    async with asyncio.timeout(seconds):
        return await aw


@dataclass
class TokenEvent:
    tokens: list[int]
    finish_reason: str | None = None


@dataclass
class RemoteRound:
    """The drafts a remote client proposed for its session's next round, and where the round's
    event goes."""
    drafts: DraftResult
    done: asyncio.Future


@dataclass
class _Tracked:
    session: Session
    group: Hashable | None = None  # None while queued
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    remote: bool = False  # drafts come from the client (client-server mode), one round per proposal
    pending: RemoteRound | None = None  # a remote session's proposal waiting for its round

    @property
    def ready(self) -> bool:
        """Whether the session takes part in the next round (a remote one only with a proposal)."""
        return not self.remote or self.pending is not None

    def emit(self, ev: TokenEvent) -> None:
        """A round's outcome: to the stream, or to the remote client's pending proposal."""
        if not self.remote:
            self.events.put_nowait(ev)
        elif self.pending is not None:
            if not self.pending.done.done():
                self.pending.done.set_result(ev)
            self.pending = None


def last_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[-1]


def error_reason(exc: BaseException) -> str:
    """A session's finish reason for a failure: ``error: <type>: <last line of the message>``."""
    return f"error: {type(exc).__name__}: {last_line(exc)}"


async def stream_events(tracked: _Tracked, abort: Callable[[_Tracked], None]):
    """A session's TokenEvents until it finishes; a consumer that stops early aborts it."""
    try:
        while True:
            ev: TokenEvent = await tracked.events.get()
            yield ev
            if ev.finish_reason is not None:
                return
    finally:
        if not tracked.session.finished:
            abort(tracked)


@dataclass
class RoundProfile:
    """What one round did and where its wall time went (router-side view: ``verify_s`` and
    ``draft_s`` include the calls' transport and (de)serialisation)."""
    group: Hashable
    sessions: int
    drafted_sessions: int = 0  # sessions that verified drafts this round
    speculation_cap: int | None = None  # the round-wide K limit (None: no limit)
    prefill_sessions: int = 0  # sessions that only prefilled a prompt chunk
    prefilled_sessions: int = 0  # sessions whose forward included prompt (or re-prefill) tokens
    resyncs: int = 0  # sessions a replica asked to resend whole (verifier or drafter)
    tokens: int = 0  # tokens committed
    release_s: float = 0.0  # retrying pending releases before the round
    draft_s: float = 0.0
    verify_s: float = 0.0  # resync follow-up and retries included
    commit_s: float = 0.0  # committing, stop conditions, events
    round_s: float = 0.0


@dataclass
class ServiceStats:
    rounds: int = 0
    sessions_in_rounds: int = 0
    max_sessions_in_round: int = 0
    multi_session_rounds: int = 0
    draft_fallbacks: int = 0
    drafter_resyncs: int = 0  # a drafter replica lacked a session's features and got them again
    verify_retries: int = 0
    reprefills: int = 0  # a verifier replica rebuilt a session's KV cache from its committed tokens
    completed: int = 0
    aborted: int = 0
    resyncs: int = 0  # a replica lacked a session's token base: resent whole (verifier: same round)
    prefill_rounds: int = 0  # session-rounds that only prefilled a prompt chunk (no token, no round)
    release_failures: int = 0  # release calls that failed (their sessions are retried later)
    releases_dropped: int = 0  # sessions given up after bounded release attempts (pools evict LRU)
    lookahead_calls: int = 0  # verify calls sent before the previous one returned (lookahead)
    lookahead_discarded: int = 0  # their session results not used (finished, aborted, mispredicted)
    lookahead_failures: int = 0  # lookahead calls that failed (their sessions resync)
    # cumulative seconds of the rounds' parts
    release_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0
    round_s: float = 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["mean_sessions_per_round"] = round(self.sessions_in_rounds / self.rounds, 3) if self.rounds else 0.0
        for part in ("release", "draft", "verify", "commit", "round"):
            d[f"{part}_s"] = round(d[f"{part}_s"], 6)
            d[f"mean_{part}_ms"] = round(1e3 * getattr(self, f"{part}_s") / self.rounds, 3) if self.rounds else 0.0
        return d

    def add(self, p: RoundProfile) -> None:
        self.rounds += 1
        self.sessions_in_rounds += p.sessions
        self.max_sessions_in_round = max(self.max_sessions_in_round, p.sessions)
        self.multi_session_rounds += p.sessions > 1
        self.prefill_rounds += p.prefill_sessions
        for part in ("release", "draft", "verify", "commit", "round"):
            setattr(self, f"{part}_s", getattr(self, f"{part}_s") + getattr(p, f"{part}_s"))


@dataclass
class _Ahead:
    """A verify call sent before the previous one came back: it continues each of its sessions
    from ``bases`` (the committed length the previous call was predicted to leave) and asks for
    ``asked`` tokens each."""
    task: asyncio.Future
    bases: dict[str, int]
    asked: dict[str, int]


class Observer:
    """Hooks for metrics; the Ray layer plugs Prometheus metrics in. ``round_done`` keeps its
    original signature; ``round_profile`` carries the full per-round picture (a no-op unless
    overridden)."""

    def round_done(self, group: Hashable, sessions: int, draft_s: float, verify_s: float, round_s: float) -> None: ...
    def round_profile(self, profile: RoundProfile) -> None: ...
    def accepted(self, length: int) -> None: ...
    def queue_depth(self, depth: int) -> None: ...
    def fallback(self, reason: str) -> None: ...


class RoundService:
    def __init__(self, verify: VerifyFn, draft: DraftFn | None, release: ReleaseFn, *,
                 groups: Sequence[Hashable] | None = None, num_groups: int = 1,
                 max_sessions_per_round: int = 16, max_queued: int = 64,
                 verify_retries: int = 5, retry_backoff_s: float = 0.5, max_backoff_s: float = 8.0,
                 verify_timeout_s: float = 120.0, draft_timeout_s: float = 5.0,
                 release_timeout_s: float = 5.0, release_attempts: int = 5,
                 speculation_token_budget: int = 32, speculation_governor: bool = True,
                 observer: Observer | None = None, want_features: bool | None = None,
                 recompute_features: bool = False, decode_steps: int = 1, multi_step_max_sessions: int = 4,
                 lookup: LookupTable | None = None, lookahead: bool = False, remote_features: bool = False):
        self._verify, self._draft, self._release = verify, draft, release
        # prompt lookup over the sessions' own tokens, here: a session it drafts for skips the
        # drafter call this round (``hybrid:``); with no drafter pool it is the only drafter
        self.lookup = lookup
        # ask the verifier for drafter features (default: when there is a drafter pool; remote
        # clients' drafters need them too)
        self.want_features = draft is not None if want_features is None else want_features
        # ... or for remote sessions alone: a server that drafts its own sessions without features
        # (prompt lookup, none) still serves the devices of its client drafter
        self.remote_features = remote_features
        # the verifier can recompute skipped features from its cache (MoA's per-layer K/V): rounds
        # that will not draft soon skip them, so speculation turned off costs what plain decoding does
        self.recompute_features = recompute_features
        # multi-step decoding: a round without drafts, of at most ``multi_step_max_sessions``
        # decoding sessions and nobody queued, asks for up to ``decode_steps`` tokens per session
        # in one verify call (the call's transport and the round's overhead paid once)
        if decode_steps < 1:
            raise ValueError("decode_steps must be >= 1")
        self.decode_steps, self.multi_step_max_sessions = decode_steps, multi_step_max_sessions
        # lookahead (verify-call pipelining): a draft-free round sends the next round's call before
        # its own returns, predicting what each session will then hold, so the verifier is never
        # idle while the Router commits and streams; a session the prediction misses (a stop token)
        # costs a discarded row
        self.lookahead = lookahead
        self._ahead: dict[Hashable, _Ahead] = {}
        self.groups = list(groups) if groups is not None else list(range(num_groups))
        if not self.groups or len(set(self.groups)) != len(self.groups):
            raise ValueError(f"session groups must be a non-empty list of distinct keys: {self.groups!r}")
        # per group: a drafter pool's drafts only in the rounds where they measurably pay
        # (governor.py); prompt-lookup drafts only where each one measurably pays (draft_gate.py)
        self._governors = ({g: SpeculationGovernor() for g in self.groups}
                           if speculation_governor and draft is not None else {})
        self._gates = {g: DraftGate() for g in self.groups} if speculation_governor and lookup is not None else {}
        self.max_sessions_per_round = max_sessions_per_round
        self.max_queued = max_queued
        self.verify_retries = verify_retries
        self.retry_backoff_s = retry_backoff_s
        self.max_backoff_s = max_backoff_s
        self.verify_timeout_s = verify_timeout_s
        self.draft_timeout_s = draft_timeout_s
        self.release_timeout_s = release_timeout_s
        self.release_attempts = release_attempts
        self.speculation_token_budget = speculation_token_budget
        self.observer = observer or Observer()
        self.stats = ServiceStats()
        self._waiting: list[_Tracked] = []
        self._active: dict[Hashable, list[_Tracked]] = {g: [] for g in self.groups}
        self._pending_release: dict[Hashable, dict[str, int]] = {g: {} for g in self.groups}  # id -> attempts
        self._release_backoff: dict[Hashable, tuple[int, float]] = {}  # group -> (failures in a row, retry at)
        self._wake: dict[Hashable, asyncio.Event] = {}
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    def governor_snapshot(self) -> dict:
        """Measured ms per committed token with speculation on/off, per group and batch bucket."""
        return {str(g): gov.snapshot() for g, gov in self._governors.items()}

    def draft_gate_snapshot(self) -> dict:
        """Per group: lookup drafts offered / kept, the fitted verify cost, acceptance by match length."""
        return {str(g): gate.snapshot() for g, gate in self._gates.items()}

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    # ------------------------------------------------------------------ public API
    def start(self) -> None:
        if self._tasks:
            return
        self._stopping = False
        for g in self.groups:
            self._wake[g] = asyncio.Event()
            self._tasks.append(asyncio.get_running_loop().create_task(self._group_loop(g)))

    async def stop(self) -> None:
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        ahead = [a.task for a in self._ahead.values()]
        self._ahead.clear()
        for t in ahead:
            t.cancel()
        await asyncio.gather(*ahead, return_exceptions=True)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active_sessions(self) -> int:
        return sum(len(a) for a in self._active.values())

    @property
    def pending_releases(self) -> int:
        return sum(len(p) for p in self._pending_release.values())

    def submit(self, session: Session, remote: bool = False) -> _Tracked:
        """Queues a session; raises QueueFullError when the bounded queue is full. A ``remote``
        session's drafter is its client: it has rounds only through ``verify_remote``."""
        self.start()
        if len(self._waiting) >= self.max_queued and self._free_capacity() == 0:
            raise QueueFullError(f"{len(self._waiting)} requests are waiting")
        tracked = _Tracked(session, remote=remote)
        self._waiting.append(tracked)
        self.observer.queue_depth(len(self._waiting))
        self._admit()
        return tracked

    def stream(self, tracked: _Tracked):
        """Yields TokenEvents until the session finishes; aborting the consumer frees it."""
        return stream_events(tracked, self.abort)

    async def verify_remote(self, tracked: _Tracked, drafts: list[int], probs: torch.Tensor | None = None,
                            alternatives: list[list[int]] | None = None) -> TokenEvent:
        """One round of a remote session: the client's drafts (none: the target's next token,
        e.g. the first round, which prefills the prompt) are verified in its group's next verify
        call, beside the other sessions', with their ``alternatives`` (tree drafts, greedy).
        Returns the round's event (tokens committed and the finish reason). Drafts past the room
        left in the output or the context are dropped."""
        if not tracked.remote:
            raise ValueError("verify_remote needs a session submitted with remote=True")
        if tracked.pending is not None:
            raise RuntimeError(f"session {tracked.session.id} already has a round in flight")
        s = tracked.session
        if s.finished:
            return TokenEvent([], s.finish_reason)
        room = max(0, min(s.max_new_tokens - len(s.generated), s.max_model_len - len(s.tokens)) - 1)
        drafts = list(drafts)[:room]
        probs = probs[:len(drafts)] if probs is not None and drafts else None
        alternatives = [list(a) for a in (alternatives or [])[:len(drafts)]]
        done = asyncio.get_running_loop().create_future()
        tracked.pending = RemoteRound(DraftResult(s.id, drafts, probs, alternatives), done)
        if tracked.group is not None:
            self._wake[tracked.group].set()
        return await done

    def abort(self, tracked: _Tracked) -> None:
        s = tracked.session
        if s.finished:
            return
        s.finish_reason = "abort"
        self.stats.aborted += 1
        if tracked in self._waiting:
            self._waiting.remove(tracked)
            if tracked.remote:  # its client awaits the first round: it will not come
                tracked.emit(TokenEvent([], "abort"))
        elif tracked.group is not None:
            # the group loop drops it before its next round and frees its caches
            self._wake[tracked.group].set()

    # ------------------------------------------------------------------ admission
    def _free_capacity(self) -> int:
        return max(0, self.max_sessions_per_round * self.num_groups - self.active_sessions)

    def _admit(self) -> None:
        while self._waiting and self._free_capacity() > 0:
            tracked = self._waiting.pop(0)
            g = min(self.groups, key=lambda k: len(self._active[k]))
            tracked.group = g
            self._active[g].append(tracked)
            if g in self._wake:
                self._wake[g].set()
        self.observer.queue_depth(len(self._waiting))

    # ------------------------------------------------------------------ group loop
    async def _group_loop(self, g: Hashable) -> None:
        while not self._stopping:
            self._drop_finished(g)
            t0 = time.perf_counter()
            await self._flush_releases(g)
            release_s = time.perf_counter() - t0
            batch = [t for t in self._active[g] if t.ready]
            if not batch:
                await self._idle(g)
                continue
            try:
                await self._round(g, batch, release_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a round that cannot complete fails its own sessions, not the loop
                log.exception("round failed for group %s", g)
                self._fail(batch, exc)

    async def _idle(self, g: Hashable) -> None:
        """Sleeps until work arrives; with releases still pending, wakes up to retry them."""
        self._wake[g].clear()
        if not self._pending_release[g]:
            await self._wake[g].wait()
            return
        try:
            await _within(self.retry_backoff_s, self._wake[g].wait())
        except TimeoutError:
            pass

    @staticmethod
    def _fail(batch: list[_Tracked], exc: Exception) -> None:
        """Errors the sessions of a failed round, and only those: sessions admitted while it ran
        were never part of it."""
        reason = error_reason(exc)
        for t in batch:
            if not t.session.finished:
                t.session.finish_reason = "error"
                t.emit(TokenEvent([], reason))

    def _drop_finished(self, g: Hashable) -> None:
        done = [t for t in self._active[g] if t.session.finished]
        if not done:
            return
        self._active[g] = [t for t in self._active[g] if not t.session.finished]
        for t in done:
            if self.lookup is not None:
                self.lookup.release(t.session.id)
            if g in self._gates:
                self._gates[g].release(t.session.id)
            if t.session.finish_reason == "abort":
                t.emit(TokenEvent([], "abort"))
            self._pending_release[g][t.session.id] = 0
        self._admit()

    async def _flush_releases(self, g: Hashable) -> None:
        """Frees the caches of finished sessions. A failed release is kept and retried before the
        group's later rounds, a bounded number of times (the pools also evict idle sessions)."""
        pending = self._pending_release[g]
        fails, retry_at = self._release_backoff.get(g, (0, 0.0))
        if not pending or time.monotonic() < retry_at:  # a failing pool is not hammered every round
            return
        ids = list(pending)
        try:
            await _within(self.release_timeout_s, self._release(g, ids))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.stats.release_failures += 1
            log.warning("release failed for group %s (%s); %d sessions kept for a retry", g, exc, len(ids))
            for sid in ids:
                pending[sid] += 1
                if pending[sid] >= self.release_attempts:
                    del pending[sid]
                    self.stats.releases_dropped += 1
            delay = min(self.max_backoff_s, self.retry_backoff_s * 2 ** fails)
            self._release_backoff[g] = (fails + 1, time.monotonic() + delay)
            return
        self._release_backoff.pop(g, None)
        for sid in ids:
            pending.pop(sid, None)

    # ------------------------------------------------------------------ one round
    def _round_cap(self, g: Hashable, n: int) -> int | None:
        """Most drafts per session in a round of ``n`` sessions: the token budget's cap, 0 while the
        group's governor has speculation off (asking it counts a round)."""
        governor = self._governors.get(g)
        if governor is not None and not governor.speculate(n):
            return 0
        return rounds.speculation_cap(self.speculation_token_budget, n)

    async def _round(self, g: Hashable, batch: list[_Tracked], release_s: float = 0.0) -> None:
        ahead = self._ahead.pop(g, None)
        if ahead is not None:
            await self._ahead_round(g, batch, ahead, release_s)
            return
        t0 = time.perf_counter()
        by_id = {t.session.id: t.session for t in batch}
        sessions = list(by_id.values())
        cap = self._round_cap(g, len(sessions))
        governor = self._governors.get(g)
        profile = RoundProfile(g, len(batch), speculation_cap=cap, release_s=release_s)
        remote = {t.session.id: t.pending.drafts for t in batch if t.remote and t.pending.drafts.drafts}
        matches: dict[str, int] = {}  # lookup-drafted sessions -> length of the n-gram they continue
        local = [t.session for t in batch if not t.remote]
        drafts = await self._draft_round(g, by_id, local, cap, profile, self._decode_steps(batch, {}, False), matches)
        drafts.update(remote)  # drafted on the clients' devices
        rounds.trim_alternatives(drafts, len(sessions), self.speculation_token_budget)
        want = self._features_wanted(g, batch, cap)
        steps = self._decode_steps(batch, drafts, want)
        t1 = time.perf_counter()
        if self._may_look_ahead(batch, cap, drafts, want):
            call = asyncio.ensure_future(self._verify_round(g, by_id, sessions, drafts, profile, want, steps))
            await asyncio.sleep(0)  # this round's call goes out first
            bases = {s.id: len(s.tokens) + rounds.step_budget(s, len(s.tokens), steps)[0] for s in sessions}
            self._send_ahead(g, sessions, bases)
            try:
                results = await call
            except BaseException:
                self._drop_ahead(g)
                raise
        else:
            results = await self._verify_round(g, by_id, sessions, drafts, profile, want, steps)
        t2 = time.perf_counter()
        self._observe_gate(g, results, drafts, matches, t2 - t1, profile)
        self._note_reprefills(by_id, results, drafts, profile)
        self._publish(batch, rounds.commit(by_id, results, drafts), profile)
        t3 = time.perf_counter()
        profile.draft_s, profile.verify_s, profile.commit_s = t1 - t0, t2 - t1, t3 - t2
        profile.round_s = t3 - t0 + release_s
        self.stats.add(profile)
        # rounds that prefilled a prompt say nothing about decoding speed in either mode
        # (nor rounds with remote drafts: the governor weighs this server's drafting, not a device's)
        if governor is not None and profile.prefilled_sessions == 0 and profile.resyncs == 0 and not remote:
            governor.observe(profile.sessions, profile.drafted_sessions > 0, profile.round_s, profile.tokens)
        self.observer.round_done(g, profile.sessions, profile.draft_s, profile.verify_s, profile.round_s)
        self.observer.round_profile(profile)

    # ------------------------------------------------------------------ lookahead
    def _may_look_ahead(self, batch: list[_Tracked], cap: int | None, drafts: dict, want: bool | set[str]) -> bool:
        """A round whose successor can be predicted: no drafts now and none next (no drafter, or a
        cap of 0), no features, no remote client, no prompt still prefilling or unknown to the
        verifier, nobody queued (they would wait one more call)."""
        drafting = cap != 0 and (self._draft is not None or self.lookup is not None)
        return (self.lookahead and not drafting and not drafts and not self._waiting
                and (want is False or (isinstance(want, set) and not want))
                and not any(t.remote or t.session.prefilling or t.session.verifier_base == 0 or t.session.finished
                            for t in batch))

    def _send_ahead(self, g: Hashable, sessions: list[Session], bases: dict[str, int]) -> None:
        reqs, asked = rounds.lookahead_requests(sessions, bases, self.decode_steps)
        if not reqs:
            return
        self.stats.lookahead_calls += 1
        task = asyncio.ensure_future(_within(self.verify_timeout_s, self._verify(g, reqs)))
        self._ahead[g] = _Ahead(task, {r.session_id: r.base for r in reqs}, asked)

    def _drop_ahead(self, g: Hashable) -> None:
        ahead = self._ahead.pop(g, None)
        if ahead is not None:
            ahead.task.cancel()
            # what it did on the replica is unknown: its sessions resend their tokens whole
            for t in self._active[g]:
                if t.session.id in ahead.bases:
                    t.session.verifier_base = 0

    async def _ahead_round(self, g: Hashable, batch: list[_Tracked], ahead: _Ahead, release_s: float) -> None:
        """Takes the results of the call sent ahead. If the round may look ahead again (its sessions
        are the call's, still decoding), the next call goes out before this one's results are
        awaited. A session's result is used only if it holds exactly what the call assumed; the
        others (finished, aborted, a stop token before the end of the previous call) are dropped."""
        t0 = time.perf_counter()
        live = [t for t in batch if t.session.id in ahead.bases and not t.session.finished]
        profile = RoundProfile(g, len(live), speculation_cap=0, release_s=release_s)
        cap = self._round_cap(g, len(batch))
        if (len(live) == len(batch) and all(t.session.id in ahead.asked for t in live)
                and self._may_look_ahead(batch, cap, {}, self._features_wanted(g, batch, cap))):
            self._send_ahead(g, [t.session for t in live],
                             {t.session.id: ahead.bases[t.session.id] + ahead.asked[t.session.id] for t in live})
        try:
            replies = await ahead.task
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.stats.lookahead_failures += 1
            log.warning("lookahead verify call failed (%s: %s); its sessions resync", type(exc).__name__, exc)
            self._drop_ahead(g)
            rounds.verify_failed([t.session for t in live])
            return
        t1 = time.perf_counter()
        by_id = {t.session.id: t.session for t in live if len(t.session.tokens) == ahead.bases[t.session.id]}
        for t in live:
            if t.session.id not in by_id:  # mispredicted: the replica holds tokens this session does not
                t.session.verifier_base = 0
        results = {r.session_id: r for r in replies if r.session_id in by_id}
        self.stats.lookahead_discarded += len(replies) - len(results)
        used = [t for t in live if t.session.id in by_id]
        self._publish(used, rounds.commit(by_id, results, {}), profile)
        if not used:  # every session of the call ended meanwhile: not a round
            return
        t2 = time.perf_counter()
        profile.verify_s, profile.commit_s = t1 - t0, t2 - t1
        profile.round_s = t2 - t0 + release_s
        self.stats.add(profile)
        self.observer.round_done(g, profile.sessions, 0.0, profile.verify_s, profile.round_s)
        self.observer.round_profile(profile)

    def _observe_gate(self, g: Hashable, results: dict[str, VerifyResult], drafts: dict[str, DraftResult],
                      matches: dict[str, int], verify_s: float, profile: RoundProfile) -> None:
        """Teaches the group's draft gate what the verify call cost (forwards, rows) and how the
        lookup drafts fared."""
        gate = self._gates.get(g)
        if gate is None or not results:
            return
        for sid, match in matches.items():
            r = results.get(sid)
            if r is not None and r.tokens:
                gate.observe_drafts(sid, match, len(drafts[sid].drafts), r.num_accepted)
        if profile.resyncs == 0:  # a follow-up call would blur the timing
            forwards = max(max(1, len(r.tokens) - r.num_accepted) for r in results.values())
            gate.observe_call(forwards, sum(r.num_computed for r in results.values()), verify_s)

    def _decode_steps(self, batch: list[_Tracked], drafts: dict[str, DraftResult], want: bool | set[str]) -> int:
        """Multi-step decoding for small batches with nobody waiting. Sessions with drafts that
        need no features (prompt lookup) take part too: after their drafts are verified they go
        on decoding in the same call (``rounds.verify_requests``); drafts that come with features
        to keep up (a drafter pool) keep the whole round to single steps."""
        feature_drafts = bool(drafts) and (want is True or (isinstance(want, set) and not want.isdisjoint(drafts)))
        if (self.decode_steps == 1 or feature_drafts or self._waiting or len(batch) > self.multi_step_max_sessions
                or any(t.remote or t.session.prefilling or t.session.verifier_base == 0 for t in batch)):
            return 1
        return self.decode_steps

    def _features_wanted(self, g: Hashable, batch: list[_Tracked], cap: int | None) -> bool | set[str]:
        """Which sessions' verify asks for drafter features: all of them, unless the verifier can
        recompute skipped ones and neither this round nor (as far as the governor knows) the next
        drafts; remote clients always get theirs (with ``remote_features``, only they do)."""
        remote = {t.session.id for t in batch if t.remote}
        if not self.want_features:
            return remote if self.remote_features else False
        if not self.recompute_features or cap != 0:
            return True
        n = len(batch)
        governor = self._governors.get(g)
        budget_allows = rounds.speculation_cap(self.speculation_token_budget, n) != 0
        if budget_allows and (governor is None or governor.next_speculates(n)):
            return True
        return remote

    async def _draft_round(self, g, by_id: dict[str, Session], sessions: list[Session], cap: int | None,
                           profile: RoundProfile, steps: int = 1,
                           matches: dict[str, int] | None = None) -> dict[str, DraftResult]:
        """Drafts for the sessions worth it; any failure or timeout degrades the round to plain
        target decoding (and the drafter gets everything again next time)."""
        local = self._lookup_drafts(g, sessions, cap, steps, matches if matches is not None else {})
        if self._draft is None:
            return local
        reqs = rounds.draft_requests([s for s in sessions if s.id not in local], cap,
                                     current_features=self.recompute_features)
        if not reqs:
            return local
        try:
            res = await _within(self.draft_timeout_s, self._draft(g, reqs))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.stats.draft_fallbacks += 1
            self.observer.fallback(type(exc).__name__)
            log.warning("drafter unavailable (%s): group %s verifies without drafts", type(exc).__name__, g)
            rounds.drafts_failed(by_id, reqs)
            return local
        res = [r for r in res if r.session_id in by_id]
        self.stats.drafter_resyncs += sum(r.needs_features_from is not None for r in res)
        n_resync = sum(r.resync for r in res)
        self.stats.resyncs += n_resync
        profile.resyncs += n_resync
        return {**rounds.drafts_delivered(by_id, reqs, res), **local}

    def _lookup_drafts(self, g: Hashable, sessions: list[Session], cap: int | None, steps: int,
                       matches: dict[str, int]) -> dict[str, DraftResult]:
        """Prompt-lookup drafts (one-hot: no probabilities) for the sessions whose last tokens
        occurred before, as many of each as the group's draft gate finds worth verifying in a
        round of this size (``matches`` gets the n-gram length each continues)."""
        if self.lookup is None or cap == 0:
            return {}
        gate = self._gates.get(g)
        bar = gate.bar(len(sessions), steps) if gate is not None else None
        out, keep = {}, {s.id for s in sessions}
        for s in sessions:
            k = s.speculation_length(cap)
            if k > 0:
                drafts, match = self.lookup.draft_match(s.id, s.tokens, k, keep)
                if gate is not None:
                    drafts = drafts[:gate.keep(s.id, match, len(drafts), bar)]
                if drafts:
                    out[s.id] = DraftResult(s.id, drafts)
                    matches[s.id] = match
        return out

    async def _verify_round(self, g, by_id: dict[str, Session], sessions: list[Session],
                            drafts: dict[str, DraftResult], profile: RoundProfile,
                            want: bool | set[str] = True, steps: int = 1) -> dict[str, VerifyResult]:
        """One verify call for the round; sessions the replica could not place (``resync``) go
        once more, whole, in a follow-up call of the same round."""
        results = rounds.by_session(by_id, await self._verify_with_retry(g, sessions, drafts, want, steps))
        again = rounds.resynced(by_id, results)
        if again:
            self.stats.resyncs += len(again)
            profile.resyncs += len(again)
            ids = {s.id: s for s in again}
            more = await self._verify_with_retry(g, again, drafts, want, steps)
            results.update(rounds.by_session(ids, more))
        return results

    async def _verify_with_retry(self, g, sessions: list[Session], drafts: dict[str, DraftResult],
                                 want: bool | set[str] = True, steps: int = 1) -> list[VerifyResult]:
        """A verify call with a timeout and bounded retries (exponential backoff). A failed or timed
        out attempt may have reached a replica that is gone: the retry sends whole token lists. A
        ``ValueError`` means the request itself is wrong: retrying cannot help."""
        for attempt in range(self.verify_retries + 1):
            reqs = rounds.verify_requests(sessions, drafts, want, steps)
            try:
                return await _within(self.verify_timeout_s, self._verify(g, reqs))
            except asyncio.CancelledError:
                raise
            except ValueError:
                rounds.verify_failed(sessions)
                raise
            except Exception as exc:
                rounds.verify_failed(sessions)
                if attempt == self.verify_retries:
                    raise
                self.stats.verify_retries += 1
                self.observer.fallback("verify_retry")
                log.warning("verify failed (%s: %s); retrying with whole token lists (attempt %d)",
                            type(exc).__name__, exc, attempt + 1)
                await asyncio.sleep(min(self.max_backoff_s, self.retry_backoff_s * 2 ** attempt))
        raise AssertionError("unreachable")

    def _note_reprefills(self, by_id: dict[str, Session], results: dict[str, VerifyResult],
                         drafts: dict[str, DraftResult], profile: RoundProfile) -> None:
        for sid, r in results.items():
            d = drafts.get(sid)
            # multi-step decoding computes one more position per extra token of the target's own
            extra_steps = max(0, len(r.tokens) - 1 - r.num_accepted)
            if r.num_computed - extra_steps > 1 + (len(d.drafts) if d else 0):  # a prompt, a chunk or a re-prefill
                profile.prefilled_sessions += 1
                if by_id[sid].rounds > 0 and r.tokens:
                    self.stats.reprefills += 1

    def _restart_on_replicas(self, t: _Tracked) -> None:
        """Features the verifier computed never reached us (a timed-out call that ran there): the
        drafter can only get them back from a full re-prefill, so the session is released on both
        pools before the group's next round and resent whole."""
        self.stats.resyncs += 1
        t.session.forget_replicas()
        self._pending_release[t.group].setdefault(t.session.id, 0)

    def _publish(self, batch: list[_Tracked], committed: list[rounds.Committed], profile: RoundProfile) -> None:
        """Streams each session's new tokens (matched by id) and counts the round's work."""
        tracked = {t.session.id: t for t in batch}
        for c in committed:
            t = tracked[c.session.id]
            if c.feature_gap and not t.session.finished:
                self._restart_on_replicas(t)
            if c.prefill:
                profile.prefill_sessions += 1
                continue
            if t.session.finish_reason == "abort":
                continue
            if c.drafted:
                profile.drafted_sessions += 1
                self.observer.accepted(len(c.new_tokens))
            profile.tokens += len(c.new_tokens)
            t.emit(TokenEvent(c.new_tokens, t.session.finish_reason))
            if t.session.finished:
                self.stats.completed += 1
