"""The round service's options, in one typed object. Its defaults are the served ones:
``RouterConfig`` (deployments/config.py) starts its fields from them and builds one with
``round_options()``; the in-process engine sets what differs for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

from moa_serve.engine.round_stats import Observer, ServiceStats


@dataclass(frozen=True)
class CallLimits:
    """Time limits and retry bounds of the pool calls."""

    verify_retries: int = 5
    retry_backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    verify_timeout_s: float = 120.0
    draft_timeout_s: float = 5.0
    release_timeout_s: float = 5.0
    release_attempts: int = 5

    def backoff(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.retry_backoff_s * 2**attempt)


@dataclass(frozen=True)
class RoundOptions(CallLimits):
    """Admission, speculation and round shape; the pool calls' limits are ``CallLimits``'s fields."""

    # admission: each group verifies at most this many sessions per round; this many more wait
    # (beyond that: QueueFullError, HTTP 429)
    max_sessions_per_round: int = 16
    max_queued: int = 64
    num_groups: int = 1  # session groups when the caller names none (each runs its own round loop)
    # verify tokens per round that bound every session's K (round_loop.speculation_cap); 0 = no bound
    speculation_token_budget: int = 32
    # a drafter pool's drafts only in rounds where they measurably pay (governor.py); lookup drafts
    # only where each one does (draft_gate.py)
    speculation_governor: bool = True
    # multi-step decoding: a round without feature drafts, of at most ``multi_step_max_sessions``
    # decoding sessions and nobody queued, asks for up to ``decode_steps`` tokens per session in
    # one verify call (the call's transport and the round's overhead paid once)
    decode_steps: int = 4
    multi_step_max_sessions: int = 4
    # pipelined verify calls for draft-free rounds (lookahead.py)
    lookahead: bool = False
    # rows the verifier's matmuls multiply together (draft_gate.DraftGate.keep_round); 1: none
    verify_row_tile: int = 1

    def __post_init__(self):
        if self.decode_steps < 1:
            raise ValueError("decode_steps must be >= 1")
        if self.verify_row_tile < 1:
            raise ValueError("verify_row_tile must be >= 1")


@dataclass
class RoundContext:
    """What the parts of one round service share: its options, its session groups, the stats they
    add to and the observer they report to."""

    options: RoundOptions
    groups: list[Hashable]
    stats: ServiceStats
    observer: Observer
