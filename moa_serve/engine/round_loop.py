"""One round of a session group: draft -> verify -> commit -> publish, for all of its sessions in
one call per pool. The one round loop of the project: the cluster's Router, the in-process engine
(``moa generate`` / ``moa bench``) and client-server sessions all run their rounds here.

``RoundLoop.run`` reads top to bottom: the round's draft caps, the drafts (prompt lookup here, the
drafter pool, a remote client's device), the verify call (and its follow-up for sessions the
replica could not place), the commit and the stream. What it calls lives elsewhere: the pools'
transport with its time limits and retries in ``pool_calls``, pipelined draft-free calls in
``lookahead``, which sessions ask for features in ``feature_policy``, the governor and the draft
gate. The pure pieces it builds and applies (requests as token deltas, commit, resync) are at the
bottom of this module.

Speculation never loses at scale: a round's verify width is bounded by the token budget
(``speculation_cap``), so K shrinks as the batch grows and turns off when verification stops
being nearly free; each session's adaptive K still applies below that cap. Within it, a drafter
pool's drafts are governed round by round (``governor``); prompt-lookup drafts session by session
and token by token (``draft_gate``), whether or not the governor lets the pool draft (a hybrid
drafter's lookup drafts need no features and keep multi-step decoding)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable, Hashable

from moa_serve.drafter.lookup import LookupTable
from moa_serve.engine.draft_gate import DraftGate
from moa_serve.engine.events import TokenEvent, Tracked
from moa_serve.engine.feature_policy import FeaturePolicy
from moa_serve.engine.governor import SpeculationGovernor
from moa_serve.engine.lookahead import Ahead, Lookahead
from moa_serve.engine.options import RoundContext
from moa_serve.engine.pool_calls import PoolCalls
from moa_serve.engine.round_stats import RoundProfile
from moa_serve.engine.session import Session
from moa_serve.protocol import DraftRequest, DraftResult, TokenLogprobs, VerifyRequest, VerifyResult

log = logging.getLogger(__name__)


class RoundLoop:
    def __init__(
        self,
        context: RoundContext,
        calls: PoolCalls,
        features: FeaturePolicy,
        lookup: LookupTable | None,
        queued: Callable[[], bool],
    ):
        options, groups = context.options, context.groups
        self.options, self.calls, self.features, self.lookup = options, calls, features, lookup
        self.stats, self.observer, self.queued = context.stats, context.observer, queued
        self.lookahead = Lookahead(calls, self.stats, options.lookahead, options.decode_steps)
        drafter_pool = calls.draft_fn is not None
        self.governors = (
            {g: SpeculationGovernor() for g in groups} if options.speculation_governor and drafter_pool else {}
        )
        self.gates = (
            {g: DraftGate(row_tile=options.verify_row_tile) for g in groups}
            if options.speculation_governor and lookup is not None
            else {}
        )
        # groups whose verify call in flight decodes several steps and was not cut short yet
        self._multi_step_in_flight: set[Hashable] = set()

    # ------------------------------------------------------------------ one round
    async def run(self, g: Hashable, batch: list[Tracked], active: list[Tracked]) -> None:
        """One round of group ``g`` over ``batch`` (its sessions ready for a round; ``active``: all
        of the group's sessions)."""
        ahead = self.lookahead.take(g)
        if ahead is not None:
            await self._ahead_round(g, batch, active, ahead)
            return
        t0 = time.perf_counter()
        by_id = {t.session.id: t.session for t in batch}
        sessions = list(by_id.values())
        lookup_cap = speculation_cap(self.options.speculation_token_budget, len(sessions))
        cap = self.cap(g, len(sessions), lookup_cap)
        profile = RoundProfile(g, len(batch), speculation_cap=cap)
        remote = {t.session.id: t.pending.drafts for t in batch if t.remote and t.pending.drafts.drafts}
        matches: dict[str, int] = {}  # lookup-drafted sessions -> length of the n-gram they continue
        local = [t.session for t in batch if not t.remote]
        drafts = await self._drafts(
            g, by_id, local, cap, lookup_cap, profile, self._decode_steps(batch, set(), False), matches
        )
        pooled = set(drafts) - set(matches)  # drafted by the drafter pool
        drafts.update(remote)  # drafted on the clients' devices
        trim_alternatives(drafts, len(sessions), self.options.speculation_token_budget)
        want = self._features_wanted(g, batch, cap, lookup_cap)
        steps = self._decode_steps(batch, pooled, want)
        t1 = time.perf_counter()
        if self.lookahead.possible(batch, self._drafting(cap, lookup_cap), drafts, want, self.queued()):
            call = asyncio.ensure_future(self._verify(g, by_id, sessions, drafts, profile, want, steps))
            await asyncio.sleep(0)  # this round's call goes out first
            bases = {s.id: len(s.tokens) + s.step_budget(len(s.tokens), steps)[0] for s in sessions}
            self.lookahead.send(g, sessions, bases)
            try:
                results = await call
            except BaseException:
                self.lookahead.drop(g, active)
                raise
        else:
            if steps > 1:
                self._multi_step_in_flight.add(g)
            try:
                results = await self._verify(g, by_id, sessions, drafts, profile, want, steps)
            finally:
                self._multi_step_in_flight.discard(g)
        t2 = time.perf_counter()
        self._note_reprefills(by_id, results, drafts, profile)
        self._observe_gate(g, results, drafts, matches, t2 - t1, profile)
        self._publish(batch, commit(by_id, results, drafts), profile)
        t3 = time.perf_counter()
        profile.draft_s, profile.verify_s, profile.commit_s = t1 - t0, t2 - t1, t3 - t2
        profile.round_s = t3 - t0
        self._record(profile)
        # rounds that prefilled a prompt say nothing about decoding speed in either mode
        # (nor rounds with remote drafts: the governor weighs this server's drafting, not a device's);
        # a round speculated when the pool drafted in it (lookup drafts are in both modes' rounds)
        governor = self.governors.get(g)
        if governor is not None and profile.prefilled_sessions == 0 and profile.resyncs == 0 and not remote:
            governor.observe(profile.sessions, bool(pooled), profile.round_s, profile.tokens, profile.draft_s)

    def cap(self, g: Hashable, n: int, budget_cap: int | None) -> int | None:
        """Most drafter-pool drafts per session in a round of ``n`` sessions: the token budget's
        cap (``budget_cap``, ``speculation_cap``), 0 while the group's governor has
        speculation off (asking it counts a round; a round the budget leaves no drafts is not
        asked)."""
        governor = self.governors.get(g)
        if budget_cap != 0 and governor is not None and not governor.speculate(n, budget_cap):
            return 0
        return budget_cap

    def _drafting(self, cap: int | None, lookup_cap: int | None) -> bool:
        """Whether a round with these caps could draft (a drafter pool or prompt lookup)."""
        return (cap != 0 and self.calls.draft_fn is not None) or (lookup_cap != 0 and self.lookup is not None)

    async def _ahead_round(self, g: Hashable, batch: list[Tracked], active: list[Tracked], ahead: Ahead) -> None:
        """Takes the results of the call sent ahead. If the round may look ahead again (its sessions
        are the call's, still decoding), the next call goes out before this one's results are
        awaited. A session's result is used only if it holds exactly what the call assumed."""
        t0 = time.perf_counter()
        live = [t for t in batch if t.session.id in ahead.bases and not t.session.finished]
        profile = RoundProfile(g, len(live), speculation_cap=0)
        lookup_cap = speculation_cap(self.options.speculation_token_budget, len(batch))
        cap = self.cap(g, len(batch), lookup_cap)
        if (
            len(live) == len(batch)
            and all(t.session.id in ahead.asked for t in live)
            and self.lookahead.possible(
                batch,
                self._drafting(cap, lookup_cap),
                {},
                self._features_wanted(g, batch, cap, lookup_cap),
                self.queued(),
            )
        ):
            self.lookahead.send(
                g,
                [t.session for t in live],
                {t.session.id: ahead.bases[t.session.id] + ahead.asked[t.session.id] for t in live},
            )
        got = await self.lookahead.results(g, live, ahead, active)
        if got is None:
            return
        by_id, results = got
        t1 = time.perf_counter()
        used = [t for t in live if t.session.id in by_id]
        self._publish(used, commit(by_id, results, {}), profile)
        if not used:  # every session of the call ended meanwhile: not a round
            return
        t2 = time.perf_counter()
        profile.verify_s, profile.commit_s = t1 - t0, t2 - t1
        profile.round_s = t2 - t0
        self._record(profile)

    def admitted(self, g: Hashable) -> None:
        """A session joined group ``g``: its prompt waits for the group's next verify call, so a
        multi-step call in flight is asked (once) to end its steps early."""
        if g in self._multi_step_in_flight:
            self._multi_step_in_flight.discard(g)
            self.calls.cut(g)

    def _record(self, profile: RoundProfile) -> None:
        """A finished round into the stats and the observer."""
        self.stats.add(profile)
        self.observer.round_done(profile.group, profile.sessions, profile.draft_s, profile.verify_s, profile.round_s)
        self.observer.round_profile(profile)

    def forget(self, g: Hashable, session_id: str) -> None:
        """Drops what the loop keeps of a finished session (its lookup index, its draft-gate record)."""
        if self.lookup is not None:
            self.lookup.release(session_id)
        if g in self.gates:
            self.gates[g].release(session_id)

    # ------------------------------------------------------------------ drafts
    async def _drafts(
        self,
        g,
        by_id: dict[str, Session],
        sessions: list[Session],
        cap: int | None,
        lookup_cap: int | None,
        profile: RoundProfile,
        steps: int,
        matches: dict[str, int],
    ) -> dict[str, DraftResult]:
        """Prompt-lookup drafts (up to ``lookup_cap`` each), then the drafter pool's (up to ``cap``)
        for the sessions lookup left."""
        local = self._lookup_drafts(g, sessions, lookup_cap, steps, matches)
        if self.calls.draft_fn is None or cap == 0:
            return local
        reqs = draft_requests(
            [s for s in sessions if s.id not in local], cap, current_features=self.features.drafts_need_current_features
        )
        if not reqs:
            return local
        got = await self.calls.draft(g, reqs)
        if got is None:
            drafts_failed(by_id, reqs)
            return local
        got = [r for r in got if r.session_id in by_id]
        self.stats.drafter_resyncs += sum(r.needs_features_from is not None for r in got)
        n_resync = sum(r.resync for r in got)
        self.stats.resyncs += n_resync
        profile.resyncs += n_resync
        return {**drafts_delivered(by_id, reqs, got), **local}

    def _lookup_drafts(
        self, g: Hashable, sessions: list[Session], cap: int | None, steps: int, matches: dict[str, int]
    ) -> dict[str, DraftResult]:
        """Prompt-lookup drafts (one-hot: no probabilities) for the sessions whose last tokens
        occurred before, as many of each as the group's draft gate finds worth verifying in a
        round of this size (``matches`` gets the n-gram length each continues)."""
        if self.lookup is None or cap == 0:
            return {}
        gate = self.gates.get(g)
        bar = gate.bar(len(sessions), steps) if gate is not None else None
        offered, keep = {}, {s.id for s in sessions}
        for s in sessions:
            k = s.speculation_length(cap, needs_features=False)
            if k > 0:
                offered[s.id] = self.lookup.draft_match(s.id, s.tokens, k, keep)
        if gate is not None and offered:
            kept = gate.keep_round([(sid, m, len(d)) for sid, (d, m) in offered.items()], len(sessions), bar)
            offered = {sid: (d[: kept[sid]], m) for sid, (d, m) in offered.items()}
        out = {}
        for sid, (drafts, match) in offered.items():
            if drafts:
                out[sid] = DraftResult(sid, drafts)
                matches[sid] = match
        return out

    def _observe_gate(
        self,
        g: Hashable,
        results: dict[str, VerifyResult],
        drafts: dict[str, DraftResult],
        matches: dict[str, int],
        verify_s: float,
        profile: RoundProfile,
    ) -> None:
        """Teaches the group's draft gate what the verify call cost (forwards, rows) and how the
        lookup drafts fared."""
        gate = self.gates.get(g)
        if gate is None or not results:
            return
        for sid, match in matches.items():
            r = results.get(sid)
            if r is not None and r.tokens:
                gate.observe_drafts(sid, match, len(drafts[sid].drafts), r.num_accepted)
        # a follow-up call would blur the timing; a prompt's rows cost less than verify rows (no
        # logits but the last), and counting them priced a row at a third of its cost at 4 users
        if profile.resyncs == 0 and profile.prefilled_sessions == 0:
            forwards = max(max(1, len(r.tokens) - r.num_accepted) for r in results.values())
            gate.observe_call(forwards, sum(r.num_computed for r in results.values()), verify_s)

    # ------------------------------------------------------------------ verify
    async def _verify(
        self,
        g: Hashable,
        by_id: dict[str, Session],
        sessions: list[Session],
        drafts: dict[str, DraftResult],
        profile: RoundProfile,
        want: bool | set[str],
        steps: int,
    ) -> dict[str, VerifyResult]:
        """The round's verify call; sessions the replica could not place (``resync``) go once more,
        whole, in a follow-up call of the same round."""

        def call(ss: list[Session]):
            return self.calls.verify(g, ss, lambda: verify_requests(ss, drafts, want, steps))

        results = by_session(by_id, await call(sessions))
        again = resynced(by_id, results)
        if again:
            self.stats.resyncs += len(again)
            profile.resyncs += len(again)
            results.update(by_session({s.id: s for s in again}, await call(again)))
        return results

    # ------------------------------------------------------------------ the verify call's shape
    def _decode_steps(self, batch: list[Tracked], pooled: set[str], want: bool | set[str]) -> int:
        """Multi-step decoding for small batches with nobody waiting. Sessions with drafts that
        need no features (prompt lookup) take part too: after their drafts are verified they go
        on decoding in the same call (``verify_requests``); a drafter pool's drafts
        (``pooled``: the sessions it drafted) with features to keep up keep the whole round to
        single steps."""
        o = self.options
        feature_drafts = bool(pooled) and (want is True or (isinstance(want, set) and not want.isdisjoint(pooled)))
        if (
            o.decode_steps == 1
            or feature_drafts
            or self.queued()
            or len(batch) > o.multi_step_max_sessions
            or any(t.remote or t.session.prefilling or t.session.verifier_base == 0 for t in batch)
        ):
            return 1
        return o.decode_steps

    def _features_wanted(
        self, g: Hashable, batch: list[Tracked], cap: int | None, budget_cap: int | None
    ) -> bool | set[str]:
        """Whether (or for which sessions) this round's verify asks for drafter features; the next
        round is taken to hold this round's sessions (``budget_cap``: the token budget's cap)."""
        n = len(batch)
        governor = self.governors.get(g)

        def next_round_drafts() -> bool:
            return budget_cap != 0 and (governor is None or governor.next_speculates(n, budget_cap))

        remote = {t.session.id for t in batch if t.remote}
        return self.features.wanted(remote, cap, next_round_drafts)

    # ------------------------------------------------------------------ after the call
    def _note_reprefills(
        self,
        by_id: dict[str, Session],
        results: dict[str, VerifyResult],
        drafts: dict[str, DraftResult],
        profile: RoundProfile,
    ) -> None:
        for sid, r in results.items():
            d = drafts.get(sid)
            # multi-step decoding computes one more position per extra token of the target's own
            extra_steps = max(0, len(r.tokens) - 1 - r.num_accepted)
            if r.num_computed - extra_steps > 1 + (len(d.drafts) if d else 0):  # a prompt, a chunk or a re-prefill
                profile.prefilled_sessions += 1
                if by_id[sid].rounds > 0 and r.tokens:
                    self.stats.reprefills += 1

    def _publish(self, batch: list[Tracked], committed: list[Committed], profile: RoundProfile) -> None:
        """Streams each session's new tokens (matched by id) and counts the round's work."""
        tracked = {t.session.id: t for t in batch}
        for c in committed:
            t = tracked[c.session.id]
            if c.feature_gap and not t.session.finished:
                # features the verifier computed never reached us (a timed-out call that ran there):
                # the drafter can only get them back from a full re-prefill, so the session is
                # released on both pools before the group's next round and resent whole
                self.stats.resyncs += 1
                t.session.forget_replicas()
                self.calls.release_later(t.group, t.session.id, before_next_round=True)
            if c.prefill:
                profile.prefill_sessions += 1
                continue
            if t.session.finish_reason == "abort":
                continue
            if c.drafted:
                profile.drafted_sessions += 1
                self.observer.accepted(len(c.new_tokens))
            profile.tokens += len(c.new_tokens)
            t.emit(TokenEvent(c.new_tokens, t.session.finish_reason, c.logprobs, c.prompt_logprobs))
            if t.session.finished:
                self.stats.completed += 1


# ====================================================================== the round's pure pieces
# Requests carry token *deltas*: each session remembers how many of its committed tokens the
# verifier replica and the drafter replica hold (``verifier_base`` / ``drafter_base``) and sends
# only the rest. Whatever goes wrong (a failed call, a replica that answers ``resync``) sets that
# base back to 0, and the next request carries the whole list: correctness never depends on a
# replica's state, only speed does. Results are always matched to sessions by id.


def speculation_cap(budget: int, num_sessions: int) -> int | None:
    """The most drafts any session of a round may verify so that the round's verify forward stays
    within ``budget`` tokens (each session feeds its drafts + 1): with few sessions verification is
    nearly free and the cap is loose; as the batch grows it shrinks, down to 0 (plain decoding)
    once even one draft each would exceed the budget. ``budget == 0``: no cap."""
    if budget <= 0 or num_sessions <= 0:
        return None
    return max(0, budget // num_sessions - 1)


# ---------------------------------------------------------------------- draft
def draft_requests(
    sessions: list[Session], cap: int | None = None, current_features: bool = False
) -> list[DraftRequest]:
    """Requests for the sessions worth drafting for this round (features known, not prefilling,
    room left, ``cap`` > 0), each with the tokens and features the drafter has not seen yet.
    ``current_features``: skip sessions whose features lag their verified tokens (features were
    skipped while speculation was off; this round's verify catches them up)."""
    out = []
    for s in sessions:
        k = s.speculation_length(cap)
        if k == 0 or (current_features and s.drafter_needs_features and s.features_lag > 0):
            continue
        start, feats = s.unsent_features()
        out.append(DraftRequest(s.id, s.tokens[s.drafter_base :], k, start, feats, s.sampling, base=s.drafter_base))
    return out


def drafts_delivered(
    sessions: dict[str, Session], requests: list[DraftRequest], results: list[DraftResult]
) -> dict[str, DraftResult]:
    """Records what the drafter replica now holds of each session asked; returns the usable
    drafts by session id. A session missing from the results counts as a failed call."""
    got = {r.session_id: r for r in results}
    usable = {}
    for q in requests:
        s, r = sessions[q.session_id], got.get(q.session_id)
        if r is None:
            drafts_failed(sessions, [q])
            continue
        if r.resync:  # the replica lacks the base we assumed: the whole list next round
            s.drafter_base = 0
        else:
            s.drafter_base = len(s.tokens)
        if r.needs_features_from is not None:
            s.features_sent = min(r.needs_features_from, s.num_features)  # resend next round
        elif not r.resync:
            s.features_sent = q.feature_start + (len(q.features) if q.features is not None else 0)
        if not r.resync and r.needs_features_from is None and r.drafts:
            usable[q.session_id] = r
    return usable


def drafts_failed(sessions: dict[str, Session], requests: list[DraftRequest]) -> None:
    """A draft call that failed (or timed out): its replica may be gone, and a replacement holds
    nothing of these sessions, tokens or features."""
    for q in requests:
        s = sessions[q.session_id]
        s.drafter_base = 0
        s.features_sent = 0


def trim_alternatives(drafts: dict[str, DraftResult], sessions: int, budget: int) -> int:
    """Keeps a round's tree drafts within its verify budget: ``sessions`` each feed their drafts + 1
    tokens, and alternatives are dropped, deepest first, while the round would exceed ``budget``
    tokens (0: no budget). The chains are never cut (``speculation_cap`` sized them). Returns how
    many alternatives were dropped."""
    alts = sum(len(a) for d in drafts.values() for a in d.alternatives)
    if budget <= 0 or not alts:
        return 0
    over = sessions + sum(len(d.drafts) for d in drafts.values()) + alts - budget
    dropped = 0
    for depth in range(max(len(d.alternatives) for d in drafts.values()) - 1, -1, -1):
        for d in drafts.values():
            if over <= 0:
                return dropped
            if depth < len(d.alternatives) and d.alternatives[depth]:
                cut = min(over, len(d.alternatives[depth]))
                d.alternatives[depth] = d.alternatives[depth][: len(d.alternatives[depth]) - cut]
                over -= cut
                dropped += cut
    return dropped


# ---------------------------------------------------------------------- verify
def verify_requests(
    sessions: list[Session],
    drafts: dict[str, DraftResult],
    want_features: bool | set[str] = True,
    decode_steps: int = 1,
) -> list[VerifyRequest]:
    """``want_features``: for every session, or the ids of those that want them. Features are asked
    from the first position the session lacks (``features_from``), so positions skipped while not
    speculating are caught up. ``decode_steps`` > 1: sessions without drafts, or with drafts but
    no features to keep up, take part in that many forwards of the call, one token of the
    target's own per forward after their accepted drafts (never more tokens than their output and
    context can still take; stopping at a stop token)."""
    out = []
    for s in sessions:
        d = drafts.get(s.id)
        want = want_features if isinstance(want_features, bool) else s.id in want_features
        steps, room = 1, 0
        if decode_steps > 1 and (d is None or not want):
            steps, room = s.step_budget(len(s.tokens), decode_steps)
        out.append(
            VerifyRequest(
                s.id,
                s.tokens[s.verifier_base :],
                list(d.drafts) if d else [],
                d.probs if d is not None else None,
                s.sampling,
                want,
                base=s.verifier_base,
                features_from=s.num_features if want else None,
                decode_steps=steps,
                max_tokens=room if steps > 1 else 0,
                stop_token_ids=tuple(sorted(s.stop_token_ids)),
                alternatives=list(d.alternatives) if d else [],
                grammar=s.grammar,
                grammar_start=s.grammar_start,
                logprobs=s.logprobs,
                score_from=s.score_from,
            )
        )
    return out


def by_session(sessions: dict[str, Session], results: list[VerifyResult]) -> dict[str, VerifyResult]:
    """Results keyed by session id (a pool may answer in any order); strangers are dropped."""
    out = {}
    for r in results:
        if r.session_id in sessions:
            out[r.session_id] = r
        else:
            log.warning("verify answered for unknown session %s", r.session_id)
    return out


def resynced(sessions: dict[str, Session], results: dict[str, VerifyResult]) -> list[Session]:
    """Sessions whose verifier replica lacked the base we assumed (nothing was computed): their
    base drops to 0 and they go once more, whole, in the same round."""
    out = []
    for sid, r in results.items():
        if r.resync:
            s = sessions[sid]
            s.verifier_base = 0
            out.append(s)
    return out


# ---------------------------------------------------------------------- commit
@dataclass
class Committed:
    session: Session
    new_tokens: list[int]
    drafted: int = 0  # drafts this session verified this round
    prefill: bool = False  # a chunk of the prompt was prefilled; nothing committed
    feature_gap: bool = False  # features arrived past a hole (see Session.add_features)
    logprobs: list[TokenLogprobs] | None = None  # of new_tokens, when the session asks
    prompt_logprobs: list[TokenLogprobs] | None = None  # with a scored prompt's first tokens


def commit(
    sessions: dict[str, Session], results: dict[str, VerifyResult] | list[VerifyResult], drafted: dict[str, DraftResult]
) -> list[Committed]:
    """Applies verify results (matched by session id): features are kept, tokens appended up to a
    stop condition, and the verifier base advanced to what its replica now holds. A session still
    being prefilled commits nothing and does not count as a round; a session without a usable
    result (none, or resync twice) commits nothing and resyncs next round."""
    if isinstance(results, list):
        results = by_session(sessions, results)
    out = []
    for sid, s in sessions.items():
        r = results.get(sid)
        if r is None or r.resync:
            s.verifier_base = 0
            continue
        gap = not s.add_features(r.feature_start, r.features)
        scoring = s.score_from is not None
        if scoring:
            s.add_scores(r.scores_start, r.scores)
        if not r.tokens:  # chunked prefill: the replica holds what it got, nothing to commit yet
            if r.prefill_remaining <= 0:
                log.warning("session %s: verify returned no tokens and nothing left to prefill", sid)
            s.prefilling = True
            s.verifier_base = len(s.tokens)
            out.append(Committed(s, [], 0, prefill=True, feature_gap=gap))
            continue
        s.prefilling = False
        d = drafted.get(sid)
        n_drafts = len(d.drafts) if d else 0
        held = len(s.token_logprobs)
        kept = s.commit(r.tokens, n_drafts, r.num_accepted, r.logprobs)
        # the replica holds the tokens it got + those it returned; ours are a prefix of that
        s.verifier_base = len(s.tokens)
        out.append(
            Committed(
                s,
                kept,
                n_drafts,
                feature_gap=gap,
                logprobs=s.token_logprobs[held:] if s.logprobs is not None else None,
                prompt_logprobs=list(s.prompt_logprobs) if scoring and kept else None,
            )
        )
    return out
