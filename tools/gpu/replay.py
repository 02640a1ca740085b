"""A proposer with controlled acceptance: it replays the target's own greedy continuation
(computed beforehand by plain decoding of the same prompts) and corrupts each draft token with
probability ``p`` (seeded), so the mean accepted length of a K-token draft is
tau = (1 - a^(K+1)) / (1 - a) with a = 1 - p. It costs nothing to draft, which isolates what
speculation costs and gains on the verifier side."""

from __future__ import annotations

import random

from moa_serve.protocol import DraftRequest, DraftResult


def tau_for(accept: float, k: int) -> float:
    """Expected tokens per round (accepted drafts + the target's own) for per-token acceptance ``accept``."""
    return sum(accept**i for i in range(k + 1))


def corruption_for(tau: float, k: int) -> float | None:
    """The corruption probability p that gives mean accepted length ``tau`` with K = ``k`` drafts
    (None when tau is out of reach: tau >= K + 1)."""
    if tau >= k + 1 or tau < 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if tau_for(mid, k) < tau:
            lo = mid
        else:
            hi = mid
    return 1.0 - (lo + hi) / 2


class ReplayProposer:
    """Drafts ``reference[i][n:n + K]`` for a session whose committed tokens are prompt ``i`` plus
    ``n`` generated ones, each token replaced by another with probability ``corruption``."""

    needs_features = False

    def __init__(
        self, prompts: list[list[int]], references: list[list[int]], corruption: float, vocab_size: int, seed: int = 0
    ):
        self.table = {tuple(p): (len(p), r) for p, r in zip(prompts, references)}
        self.lengths = sorted({len(p) for p in prompts})
        self.corruption = corruption
        self.vocab = vocab_size
        self.rng = random.Random(seed)
        self.copies: dict[str, list[int]] = {}  # each session's committed tokens, from the requests' deltas
        self.which: dict[str, tuple[int, list[int]]] = {}

    def _reference(self, session_id: str, committed: list[int]):
        found = self.which.get(session_id)
        if found is None:
            for n in self.lengths:
                found = self.table.get(tuple(committed[:n]))
                if found is not None:
                    self.which[session_id] = found
                    break
        return found

    def propose(self, requests: list[DraftRequest]) -> list[DraftResult]:
        out = []
        for r in requests:
            committed = self.copies.get(r.session_id, [])[: r.base] + list(r.tokens)
            self.copies[r.session_id] = committed
            found = self._reference(r.session_id, committed)
            drafts = []
            if found is not None:
                plen, ref = found
                done = len(committed) - plen
                drafts = list(ref[done : done + r.num_drafts])
            drafts += [0] * (r.num_drafts - len(drafts))
            drafts = [
                t if self.rng.random() >= self.corruption else (t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                for t in drafts
            ]
            out.append(DraftResult(r.session_id, drafts))
        return out

    def release(self, session_id: str) -> None:
        self.copies.pop(session_id, None)
        self.which.pop(session_id, None)
