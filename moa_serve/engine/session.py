"""A generation session: the committed tokens (the source of truth), what each pool replica
already holds of them (so requests carry only deltas), the features the drafter needs, stop
conditions and speculative statistics."""

from __future__ import annotations

import bisect
import logging
import math
from dataclasses import dataclass, field

import torch

from moa_serve.grammar import GrammarSpec
from moa_serve.protocol import TokenLogprobs
from moa_serve.sampling import GREEDY, SamplingParams

log = logging.getLogger(__name__)


class FeatureStore:
    """The verifier's features of positions ``[0, end)``, kept as the chunks they arrived in.

    A round appends one small chunk and the drafter usually needs only the chunks it has not
    seen, so appending is O(chunk) and sending is O(unsent): the whole history is concatenated
    only when a drafter replica asks for everything again (a new or restarted replica)."""

    def __init__(self):
        self._starts: list[int] = []
        self._chunks: list[torch.Tensor] = []
        self.end = 0

    def __len__(self) -> int:
        return self.end

    def add(self, start: int, feats: torch.Tensor) -> bool:
        """Stores features of positions ``[start, start + len(feats))``. A start before ``end``
        means the verifier recomputed positions (a re-prefill): the newer values replace ours. A
        start past ``end`` would leave a hole the drafter cannot draft over: refused (False)."""
        if start > self.end:
            return False
        if start < self.end:
            self.truncate(start)
        if feats.untyped_storage().nbytes() > feats.nbytes:
            feats = feats.clone()  # a view into a whole batch's features would keep the batch alive
        self._starts.append(start)
        self._chunks.append(feats)
        self.end = start + len(feats)
        return True

    def truncate(self, n: int) -> None:
        """Keeps positions ``[0, n)``."""
        if n >= self.end:
            return
        i = bisect.bisect_right(self._starts, n) - 1  # the chunk holding position n, if any
        if i < 0:
            self._starts, self._chunks, self.end = [], [], 0
            return
        del self._starts[i + 1 :], self._chunks[i + 1 :]
        self._chunks[i] = self._chunks[i][: n - self._starts[i]]
        if len(self._chunks[i]) == 0:
            del self._starts[i], self._chunks[i]
        self.end = n

    def since(self, pos: int) -> torch.Tensor | None:
        """Features of positions ``[pos, end)`` in one tensor (None when there are none)."""
        if pos >= self.end:
            return None
        i = max(0, bisect.bisect_right(self._starts, pos) - 1)
        parts = [self._chunks[i][pos - self._starts[i] :]] + self._chunks[i + 1 :]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


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
    features: FeatureStore = field(default_factory=FeatureStore)
    features_sent: int = 0  # the drafter has features of positions [0, features_sent)
    # committed tokens each pool's replica holds (a prefix of ``tokens``): requests carry only the
    # rest; 0 = send everything (new session, failed call, replica that lost the session)
    verifier_base: int = 0
    drafter_base: int = 0
    prefilling: bool = False  # the verifier is still prefilling the prompt in chunks: no drafts
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    finish_reason: str | None = None
    accept_ema: float = -1.0  # moving average of drafts accepted per round (-1: none yet)
    grammar: GrammarSpec | None = None  # structured output: what the generated tokens follow
    grammar_start: int = -1  # where the generated tokens begin (-1: after the prompt)
    # the target's log-probability of each generated token with this many alternatives (None: off)
    logprobs: int | None = None
    score_prompt: bool = False  # the prompt's tokens' log-probabilities too, from its prefill
    token_logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per generated token
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt positions 1, 2, ...

    def __post_init__(self):
        if not self.prompt:
            raise ValueError("prompt is empty")
        if len(self.prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(self.prompt)} tokens; the context holds {self.max_model_len} "
                "(prompt + at least one new token)"
            )
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        self.tokens = list(self.prompt)
        if self.grammar_start < 0:
            self.grammar_start = len(self.prompt)

    def continuation(self, session_id: str) -> "Session":
        """A fresh session that goes on where this one stands: its committed tokens are the
        prompt, and it may generate what this one still may, with the same sampling (seeded
        generators depend only on the absolute position), stops and speculation settings."""
        return Session(
            session_id,
            list(self.tokens),
            self.max_new_tokens - self.num_generated,
            self.sampling,
            self.num_speculative_tokens,
            self.stop_token_ids,
            self.max_model_len,
            drafter_needs_features=self.drafter_needs_features,
            adaptive_speculation=self.adaptive_speculation,
            grammar=self.grammar,
            grammar_start=self.grammar_start,
            logprobs=self.logprobs,
            # the prompt's scores come with the first tokens: once those arrived they were delivered
            score_prompt=self.score_prompt and not self.generated,
        )

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def num_generated(self) -> int:
        """len(generated), without copying the tokens."""
        return len(self.tokens) - len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def step_budget(self, length: int, decode_steps: int) -> tuple[int, int]:
        """(forwards, room) for this session once its committed length is ``length``: room is how
        many more tokens its output and context can take then, forwards at most ``decode_steps`` and
        at least 1."""
        room = self.room - (length - len(self.tokens))
        return max(1, min(decode_steps, room)), room

    @property
    def room(self) -> int:
        """Tokens this session may still generate: what its max_new_tokens and the context allow."""
        return max(0, min(self.max_new_tokens - self.num_generated, self.max_model_len - len(self.tokens)))

    @property
    def num_features(self) -> int:
        return self.features.end

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify round, the target's own token included."""
        return self.num_generated / self.rounds if self.rounds else 0.0

    @property
    def features_lag(self) -> int:
        """Verified positions whose features we do not hold (all but the last token, which the
        target has not cached yet)."""
        return max(0, len(self.tokens) - 1 - self.num_features)

    def speculation_length(self, cap: int | None = None, needs_features: bool = True) -> int:
        """Drafts worth asking for this round: none while the prompt is being prefilled or, for a
        drafter that reads features (``needs_features``; not prompt lookup), before it is verified
        (no features yet); never more than the output or the context can still take, nor more
        than ``cap`` (the round-wide limit that keeps verification cheap)."""
        if self.prefilling or (needs_features and self.drafter_needs_features and self.num_features == 0):
            return 0
        room = self.room - 1
        k = self.num_speculative_tokens
        if self.adaptive_speculation and self.accept_ema >= 0:
            # drafts beyond what the drafter usually gets accepted cost drafter steps and
            # verifier width for nothing; one more than the recent average keeps probing
            k = min(k, max(1, math.ceil(self.accept_ema + 1)))
        if cap is not None:
            k = min(k, cap)
        return max(0, min(k, room))

    # -- features ------------------------------------------------------------------
    def add_features(self, start: int, feats: torch.Tensor | None) -> bool:
        """Keeps the verifier's features of a round. False when they start past the ones we hold:
        the verifier computed positions whose features never reached us (a call that timed out
        here but ran there); they are dropped, and only a re-prefill can fill the hole."""
        if feats is None or len(feats) == 0:
            return True
        if not self.features.add(start, feats):
            log.warning(
                "session %s: features from %d arrived but we hold only %d; dropped", self.id, start, self.num_features
            )
            return False
        # recomputed positions (a re-prefill) go to the drafter again
        self.features_sent = min(self.features_sent, start)
        return True

    def forget_replicas(self) -> None:
        """Both pools' replicas are to start this session afresh (base 0, every feature)."""
        self.verifier_base = self.drafter_base = self.features_sent = 0

    def unsent_features(self) -> tuple[int, torch.Tensor | None]:
        """(position of the first feature the drafter lacks, those features or None)."""
        return self.features_sent, self.features.since(self.features_sent)

    # -- log-probabilities -----------------------------------------------------------
    @property
    def score_from(self) -> int | None:
        """The first prompt position whose log-probability the verifier is still to compute (None:
        none wanted, or all of them arrived with the first tokens)."""
        if not self.score_prompt or self.generated:
            return None
        return 1 + len(self.prompt_logprobs)

    def add_scores(self, start: int, scores: list[TokenLogprobs] | None) -> None:
        """Keeps the verifier's prompt scores of positions ``[start, start + len(scores))`` (a
        re-prefill may send some again); scores past a gap are dropped (they are asked again)."""
        if not scores or start > 1 + len(self.prompt_logprobs):
            return
        held = self.prompt_logprobs[: start - 1]
        self.prompt_logprobs = (held + list(scores))[: len(self.prompt) - 1]

    # -- commit --------------------------------------------------------------------
    def commit(
        self, new_tokens: list[int], drafted: int, accepted: int, logprobs: list[TokenLogprobs] | None = None
    ) -> list[int]:
        """Appends the round's tokens up to a stop condition (``logprobs``: theirs, kept alike);
        returns those kept."""
        if self.finished:  # aborted while the round was in flight
            return []
        if logprobs is not None:
            self.token_logprobs.extend(logprobs[: self._room(new_tokens)])
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
            elif self.num_generated >= self.max_new_tokens or len(self.tokens) >= self.max_model_len:
                self.finish_reason = "length"
            if self.finished:
                break
        return kept

    def _room(self, new_tokens: list[int]) -> int:
        """How many of ``new_tokens`` a commit keeps (up to and including the first that ends it)."""
        room = self.room
        for i, tok in enumerate(new_tokens[:room]):
            if tok in self.stop_token_ids:
                return i + 1
        return min(room, len(new_tokens))

    def stats(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
        }
