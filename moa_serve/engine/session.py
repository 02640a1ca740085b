"""A generation session: the committed tokens (the source of truth), the features the drafter
needs, stop conditions and speculative statistics."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from moa_serve.engine.sampling import GREEDY, SamplingParams


@dataclass
class Session:
    id: str
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = GREEDY
    num_speculative_tokens: int = 4
    stop_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 2048
    drafter_needs_features: bool = True  # MoA drafts only once the prompt's features exist
    adaptive_speculation: bool = False  # ask for about as many drafts as recent rounds accepted
    tokens: list[int] = field(default_factory=list)
    feature_chunks: list[torch.Tensor] = field(default_factory=list)
    num_features: int = 0  # features held for positions [0, num_features)
    features_sent: int = 0  # the drafter has features of positions [0, features_sent)
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    finish_reason: str | None = None
    accept_ema: float = -1.0  # moving average of drafts accepted per round (-1: none yet)

    def __post_init__(self):
        if not self.prompt:
            raise ValueError("prompt is empty")
        if len(self.prompt) >= self.max_model_len:
            raise ValueError(f"prompt has {len(self.prompt)} tokens; the context holds {self.max_model_len} "
                             "(prompt + at least one new token)")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        self.tokens = list(self.prompt)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify round, the target's own token included."""
        return len(self.generated) / self.rounds if self.rounds else 0.0

    def speculation_length(self) -> int:
        """Drafts worth asking for this round: none before the prompt is verified (no
        features yet); never more than the output or the context can still take."""
        if self.drafter_needs_features and self.num_features == 0:
            return 0
        room = min(self.max_new_tokens - len(self.generated), self.max_model_len - len(self.tokens)) - 1
        k = self.num_speculative_tokens
        if self.adaptive_speculation and self.accept_ema >= 0:
            # drafts beyond what the drafter usually gets accepted cost drafter steps and
            # verifier width for nothing; one more than the recent average keeps probing
            k = min(k, max(1, math.ceil(self.accept_ema + 1)))
        return max(0, min(k, room))

    # -- features ------------------------------------------------------------------
    def add_features(self, start: int, feats: torch.Tensor | None) -> None:
        if feats is None or len(feats) == 0:
            return
        if start != self.num_features:
            # a re-prefill recomputed positions we already hold: keep the prefix before them
            self._truncate_features(start)
        self.feature_chunks.append(feats)
        self.num_features = start + len(feats)

    def _truncate_features(self, n: int) -> None:
        allf = torch.cat(self.feature_chunks)[:n] if self.feature_chunks else None
        self.feature_chunks = [allf] if allf is not None and len(allf) else []
        self.num_features = n
        self.features_sent = min(self.features_sent, n)

    def unsent_features(self) -> tuple[int, torch.Tensor | None]:
        if self.features_sent >= self.num_features:
            return self.features_sent, None
        allf = torch.cat(self.feature_chunks)
        self.feature_chunks = [allf]
        return self.features_sent, allf[self.features_sent:]

    # -- commit --------------------------------------------------------------------
    def commit(self, new_tokens: list[int], drafted: int, accepted: int) -> list[int]:
        """Appends the round's tokens up to a stop condition; returns those kept."""
        if self.finished:  # aborted while the round was in flight
            return []
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        if drafted:
            self.accept_ema = accepted if self.accept_ema < 0 else 0.7 * self.accept_ema + 0.3 * accepted
        kept = []
        for tok in new_tokens:
            kept.append(tok)
            self.tokens.append(tok)
            if tok in self.stop_token_ids:
                self.finish_reason = "stop"
            elif len(self.generated) >= self.max_new_tokens or len(self.tokens) >= self.max_model_len:
                self.finish_reason = "length"
            if self.finished:
                break
        return kept

    def stats(self) -> dict:
        return {"rounds": self.rounds, "drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
                "mean_accepted_length": round(self.mean_accepted_length, 4)}
