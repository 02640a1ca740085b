"""What crosses a Ray call between the Router, the pools and the client: plain dataclasses that
pickle unchanged. A drafter and a verifier meet only here, never by importing each other.

Token lists travel as deltas against what the receiving replica already holds of a session
(``replica_copy[:base] + tokens``); a replica that holds fewer than ``base`` tokens answers
``resync`` and the sender resends the whole list (``base=0``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moa_serve.grammar import GrammarSpec
from moa_serve.sampling import GREEDY, SamplingParams


@dataclass
class TokenLogprobs:
    """The target's log-probability of one token at its position (its distribution before any
    temperature or top-p) and the ``top`` most likely tokens there, most likely first, as
    ``(token id, log-probability)``."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class DraftRequest:
    """One session's share of a draft call. Like ``VerifyRequest``, tokens travel as deltas: the
    session's committed tokens are ``replica_copy[:base] + tokens`` (``base=0``: the whole list)."""

    session_id: str
    tokens: list[int]  # committed tokens from position ``base`` on
    num_drafts: int
    feature_start: int = 0
    # [n, H] for positions feature_start ... A drafter that reads only the latest verified feature
    # (MoA with cross_attention_latest_only) takes them past a gap: the positions skipped are
    # never read, so a verifier may send just the newest one
    features: torch.Tensor | None = None
    sampling: SamplingParams = GREEDY
    base: int = 0


@dataclass
class DraftResult:
    session_id: str
    drafts: list[int]
    # [K, V'] over the checkpoint's draft vocabulary (or [K, V] without one) when sampling
    probs: torch.Tensor | None = None
    # tree drafts (greedy, a proposer with ``branching``): per draft, the drafter's runners-up at
    # that depth, verified beside it (``VerifyRequest.alternatives``)
    alternatives: list[list[int]] = field(default_factory=list)
    needs_features_from: int | None = None  # features missing: resend from this position
    # the replica does not hold ``base`` committed tokens: resend with base=0 (nothing changed;
    # needs_features_from then says how many features it holds: 0 for a session it lacks)
    resync: bool = False


@dataclass
class VerifyRequest:
    """One session's share of a verify call. Token lists travel as deltas: the session's committed
    tokens are ``replica_copy[:base] + tokens``, where ``replica_copy`` is what the replica already
    holds of the session (its previous committed tokens plus the tokens it returned last round).
    ``base=0`` sends the whole committed list (a new session, or a resync)."""

    session_id: str
    tokens: list[int]  # committed tokens from position ``base`` on
    drafts: list[int] = field(default_factory=list)
    # drafter distributions when sampling: [K, V] over the target vocabulary, or [K, V'] over the
    # drafter checkpoint's draft vocabulary (the verifier loads that vocabulary); None: the drafts
    # are treated as one-hot (q = 1 at each draft). That is what greedy acceptance assumes, and for
    # sampling it is exact for deterministic drafts (prompt lookup) and still lossless for any
    # draft (accept x with probability p(x), else draw from p without x), at lower acceptance
    draft_probs: torch.Tensor | None = None
    sampling: SamplingParams = GREEDY
    want_features: bool = True
    base: int = 0
    # tree drafts (greedy only; ignored when sampling): alternatives[i] are tokens verified beside
    # drafts[i], each as a leaf (the drafter's runners-up at that depth). When drafts[i] is rejected
    # and the target's token is one of them, it is accepted and the target's token after it added
    alternatives: list[list[int]] = field(default_factory=list)
    # the sender holds features only up to this position (it skipped them while not speculating):
    # features start here instead of at the first newly cached position, recomputed from the
    # K/V cache (MoA's per-layer K/V features; ignored for features the cache cannot give back)
    features_from: int | None = None
    # multi-step decoding: the forwards this session takes part in (the first, which verifies its
    # drafts, included): after its accepted drafts and correction, one token of the target's own
    # per further forward, stopping after a stop token or at ``max_tokens``; with drafts only when
    # no features are wanted. Accepted drafts thus add to the tokens of the call, not replace them.
    decode_steps: int = 1
    max_tokens: int = 0  # most tokens this call may return (room left in output and context); 0: no limit
    stop_token_ids: tuple[int, ...] = ()
    # structured output: the grammar the tokens from committed position ``grammar_start`` on (the
    # generated ones) follow; the target's logits are masked by it at every position scored, and a
    # draft it forbids ends the drafts there
    grammar: GrammarSpec | None = None
    grammar_start: int = 0
    # log-probabilities of the returned tokens, each with this many most likely alternatives (0: the
    # token's alone), from the logits that chose or accepted them; None: none computed
    logprobs: int | None = None
    # prompt scoring: the log-probabilities of the committed tokens from this position on (position 0
    # has none), from the prefill's logits: the replica feeds them from ``score_from - 1`` even where
    # it holds their K/V. None: none computed
    score_from: int | None = None


@dataclass
class VerifyResult:
    session_id: str
    # accepted drafts followed by one token of the target's own; with tree drafts the last
    # accepted one may be an alternative (then tokens[num_accepted - 1] is not that draft)
    tokens: list[int]
    num_accepted: int
    feature_start: int  # position of features[0]
    features: torch.Tensor | None  # [n, F] MoA features of positions newly in the target cache
    num_computed: int = 0  # tokens the target forward processed for this session (prefill included)
    # the replica does not hold ``base`` committed tokens of this session (new replica, evicted
    # session): nothing was computed; resend with base=0
    resync: bool = False
    # chunked prefill: the prompt is not fully in the cache yet; ``tokens`` is empty (nothing is
    # committed this round) and this many committed tokens still wait to be prefilled
    prefill_remaining: int = 0
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked
    scores_start: int = 0  # position of scores[0]
    scores: list[TokenLogprobs] | None = None  # prompt scoring: committed tokens fed this call


@dataclass
class PoolReply:
    """What a pool call returns: the backend's results plus who did the work and how long it took."""

    results: Any
    replica: str
    compute_s: float  # on the replica's worker thread
    queued_s: float  # waiting for the worker thread (behind other groups' calls)


@dataclass
class Update:
    """What one step of a step-wise verifier (the vLLM backend) did for a request, streamed to the
    Router: its new tokens, the finish reason when it ended
    (``stop`` / ``length`` / ``abort`` / ``error: ...``), and its drafts verified and accepted so
    far (cumulative)."""

    tokens: list[int]
    finish_reason: str | None = None
    drafted: int = 0
    accepted: int = 0
    replica: str | None = None  # set by the serving layer: which verifier replica ran it
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the session asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # the prompt's tokens from position 1 on, once
