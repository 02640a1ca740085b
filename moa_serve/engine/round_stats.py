"""What the round service counts: one ``RoundProfile`` per round, ``ServiceStats`` over all of
them (``GET /v1/stats``), and the ``Observer`` hooks the Ray layer plugs Prometheus metrics into."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable


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
    steps_cut: int = 0  # multi-step verify calls asked to end early for a newcomer's prefill
    # cumulative seconds of the rounds' parts
    draft_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0
    round_s: float = 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["mean_sessions_per_round"] = round(self.sessions_in_rounds / self.rounds, 3) if self.rounds else 0.0
        for part in ("draft", "verify", "commit", "round"):
            d[f"{part}_s"] = round(d[f"{part}_s"], 6)
            d[f"mean_{part}_ms"] = round(1e3 * getattr(self, f"{part}_s") / self.rounds, 3) if self.rounds else 0.0
        return d

    def add(self, p: RoundProfile) -> None:
        self.rounds += 1
        self.sessions_in_rounds += p.sessions
        self.max_sessions_in_round = max(self.max_sessions_in_round, p.sessions)
        self.multi_session_rounds += p.sessions > 1
        self.prefill_rounds += p.prefill_sessions
        for part in ("draft", "verify", "commit", "round"):
            setattr(self, f"{part}_s", getattr(self, f"{part}_s") + getattr(p, f"{part}_s"))


class Observer:
    """Hooks for metrics (no-ops here; the Ray layer plugs Prometheus metrics in): ``round_done``
    gives a round's timing, ``round_profile`` its full picture."""

    def round_done(self, group: Hashable, sessions: int, draft_s: float, verify_s: float, round_s: float) -> None: ...
    def round_profile(self, profile: RoundProfile) -> None: ...
    def accepted(self, length: int) -> None: ...
    def queue_depth(self, depth: int) -> None: ...
    def fallback(self, reason: str) -> None: ...
