"""Proposers that draft from reference continuations (the target's own greedy output) with random
corruptions: partial acceptance, full acceptance and rollback at every depth, with a known answer."""

from __future__ import annotations

import random

from moa_serve.protocol import DraftResult


class ReferenceOracle:
    """Each session's committed tokens are rebuilt from the requests' deltas; its truth is the
    continuation of the reference whose prompt they start with. A subclass corrupts it
    (``drafts``)."""

    needs_features = False

    def __init__(self, refs: dict[tuple, list[int]], error_rate: float, seed: int = 0):
        self.refs, self.error_rate, self.rng = refs, error_rate, random.Random(seed)
        self.copies: dict[str, list[int]] = {}

    def propose(self, requests):
        out = []
        for r in requests:
            committed = self.copies[r.session_id] = self.copies.get(r.session_id, [])[: r.base] + list(r.tokens)
            for p, ref in self.refs.items():
                if tuple(committed[: len(p)]) == p:
                    done = len(committed) - len(p)
                    result = self.drafts(r, list(ref[done : done + r.num_drafts]))
                    if result is not None:
                        out.append(result)
                    break
        return out

    def drafts(self, r, truth: list[int]) -> DraftResult | None:
        raise NotImplementedError

    def release(self, session_id):
        self.copies.pop(session_id, None)


class NoisyOracle(ReferenceOracle):
    """Proposes the reference continuation (padded with token 0 past its end) with random
    corruptions."""

    def __init__(self, prompts, refs, error_rate, seed=0):
        super().__init__({tuple(p): r for p, r in zip(prompts, refs)}, error_rate, seed)
        self.accepted_max = 0

    def drafts(self, r, truth):
        drafts = truth + [0] * (r.num_drafts - len(truth))
        drafts = [t if self.rng.random() > self.error_rate else (t + 1) % 512 for t in drafts]
        return DraftResult(r.session_id, drafts)


class TreeOracle(ReferenceOracle):
    """Drafts the reference continuation with corruptions; a corrupted draft carries the right
    token as a tree alternative, so alternatives are accepted too."""

    def drafts(self, r, truth):
        drafts, alts = [], []
        for t in truth:
            bad = self.rng.random() < self.error_rate
            drafts.append((t + 1) % 512 if bad else t)
            alts.append([t] if bad else [])
        return DraftResult(r.session_id, drafts, alternatives=alts) if drafts else None
