"""One draft/verify/commit round over many sessions, framework-free.

The in-process engine calls these with a local proposer/verifier; the Ray Serve router calls
the same functions around remote calls. Nothing here knows about Ray or HTTP.

Requests carry token *deltas*: each session remembers how many of its committed tokens the
verifier replica and the drafter replica hold (``verifier_base`` / ``drafter_base``) and sends
only the rest. Whatever goes wrong (a failed call, a replica that answers ``resync``) sets that
base back to 0, and the next request carries the whole list: correctness never depends on a
replica's state, only speed does. Results are always matched to sessions by id."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from moa_serve.engine.session import Session
from moa_serve.protocol import DraftRequest, DraftResult, TokenLogprobs, VerifyRequest, VerifyResult

log = logging.getLogger(__name__)


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
            steps, room = step_budget(s, len(s.tokens), decode_steps)
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


def step_budget(s: Session, length: int, decode_steps: int) -> tuple[int, int]:
    """(forwards, room) for a session whose committed length will be ``length``: room is how many
    more tokens its output and context can take, forwards at most ``decode_steps`` and at least 1."""
    room = s.room - (length - len(s.tokens))
    return max(1, min(decode_steps, room)), room


def lookahead_requests(
    sessions: list[Session], bases: dict[str, int], decode_steps: int
) -> tuple[list[VerifyRequest], dict[str, int]]:
    """A draft-free verify call sent before the previous one returned: each session continues from
    ``bases[id]``, the committed length that call is predicted to leave (the replica holds those
    tokens: it returned them), no tokens sent, no features. Sessions with no room left are not in
    it. Returns the requests and the tokens each asks for (the next prediction)."""
    reqs, asked = [], {}
    for s in sessions:
        steps, room = step_budget(s, bases[s.id], decode_steps)
        if room <= 0:
            continue
        asked[s.id] = steps
        reqs.append(
            VerifyRequest(
                s.id,
                [],
                [],
                None,
                s.sampling,
                False,
                base=bases[s.id],
                decode_steps=steps,
                max_tokens=room if steps > 1 else 0,
                stop_token_ids=tuple(sorted(s.stop_token_ids)),
                grammar=s.grammar,
                grammar_start=s.grammar_start,
                logprobs=s.logprobs,
            )
        )
    return reqs, asked


def verify_failed(sessions: list[Session]) -> None:
    """A verify call that failed (or timed out): the next attempt may reach another replica."""
    for s in sessions:
        s.verifier_base = 0


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
