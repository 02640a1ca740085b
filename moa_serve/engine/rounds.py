"""One draft/verify/commit round over many sessions, framework-free.

The in-process engine calls these with a local proposer/verifier; the Ray Serve router calls
the same functions around remote calls. Nothing here knows about Ray or HTTP."""

from __future__ import annotations

from dataclasses import dataclass

from moa_serve.drafter.proposer import DraftRequest, DraftResult
from moa_serve.engine.session import Session
from moa_serve.verifier.api import VerifyRequest, VerifyResult


def draft_requests(sessions: list[Session]) -> list[DraftRequest]:
    """Requests for the sessions worth drafting for this round (features known, room left)."""
    out = []
    for s in sessions:
        k = s.speculation_length()
        if k == 0:
            continue
        start, feats = s.unsent_features()
        out.append(DraftRequest(s.id, list(s.tokens), k, start, feats, s.sampling))
    return out


def note_drafts_delivered(sessions: dict[str, Session], results: list[DraftResult]) -> dict[str, DraftResult]:
    """Records which features the drafter now holds; returns usable drafts by session."""
    usable = {}
    for r in results:
        s = sessions[r.session_id]
        if r.needs_features_from is not None:
            s.features_sent = min(r.needs_features_from, s.num_features)  # resend next round
            continue
        s.features_sent = s.num_features
        usable[r.session_id] = r
    return usable


def verify_requests(sessions: list[Session], drafts: dict[str, DraftResult],
                    want_features: bool = True) -> list[VerifyRequest]:
    out = []
    for s in sessions:
        d = drafts.get(s.id)
        out.append(VerifyRequest(s.id, list(s.tokens), list(d.drafts) if d else [],
                                 d.probs if d is not None else None, s.sampling, want_features))
    return out


@dataclass
class Committed:
    session: Session
    new_tokens: list[int]


def commit(sessions: dict[str, Session], results: list[VerifyResult],
           drafted: dict[str, DraftResult]) -> list[Committed]:
    out = []
    for r in results:
        s = sessions[r.session_id]
        d = drafted.get(r.session_id)
        s.add_features(r.feature_start, r.features)
        kept = s.commit(r.tokens, len(d.drafts) if d else 0, r.num_accepted)
        out.append(Committed(s, kept))
    return out
