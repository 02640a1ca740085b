"""How many tokens to draft per request in a verifier step: the length with the most expected
committed tokens per second, from what the step, the draft call and acceptance are measured to
cost and give.

A step of ``n`` requests that each verify ``k`` drafts commits ``n * E(alpha, k)`` tokens, where
``E(alpha, k) = (1 - alpha**(k+1)) / (1 - alpha)`` when each draft is accepted with probability
``alpha`` given the ones before it were, and costs

    verify(rows = n * (1 + k)) + draft(k).

``verify`` is ``VerifyCost``'s fit of a step's seconds by its rows (the draft gate's: every step
with or without drafts teaches it); ``draft(k)`` is ``k`` times the draft call's seconds per draft
step (the call's fixed part counted per step: an estimate that leans towards shorter drafts,
which cost less to be wrong about). Where a row is nearly free (a GPU at small batches) the
longest length wins whenever the drafter is often right; where each row costs a good share of a
step (a small CPU) one or two drafts, or, at a large batch, the shortest. Whether drafting pays
at all is the speculation governor's question; this answers how far, once it does.
"""

from __future__ import annotations

from moa_serve.engine.draft_gate import VerifyCost


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round of ``k`` drafts commits on average (the target's own token included) when
    each draft is accepted with probability ``alpha`` given the ones before it were."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class Acceptance:
    """``alpha``, the chance that a draft is accepted given the ones before it were, from decayed
    counts of judged drafts (the accepted ones and the first rejected); a prior of 0.5."""

    def __init__(self, decay: float):
        self.decay = decay
        self._accepts, self._rejects = 1.0, 1.0

    @property
    def alpha(self) -> float:
        return self._accepts / (self._accepts + self._rejects)

    def observe(self, drafted: int, accepted: int) -> None:
        """``accepted`` of ``drafted`` drafts of one round (nothing when none was drafted)."""
        if drafted <= 0:
            return
        d = self.decay
        self._accepts = d * self._accepts + accepted
        self._rejects = d * self._rejects + (1.0 if accepted < drafted else 0.0)


class DraftLength:
    """Running estimates (exponentially decayed) and the draft length they call for; ``k_max``
    until both costs are measured."""

    def __init__(self, k_max: int, cost: VerifyCost | None = None, decay: float = 0.98):
        if k_max < 1:
            raise ValueError("k_max must be >= 1")
        self.k_max = k_max
        self.decay = decay
        self.cost = cost or VerifyCost()
        self.acceptance = Acceptance(decay)
        self.draft_step_s: float | None = None  # a draft call's seconds per draft step

    @property
    def alpha(self) -> float:
        return self.acceptance.alpha

    def observe_step(self, rows: int, seconds: float) -> None:
        """A verifier step's seconds (without its draft call) and the rows it verified: one per
        request plus its drafts."""
        self.cost.observe(1, rows, seconds)

    def observe_drafts(self, drafted: int, accepted: int) -> None:
        """One request's verified drafts: ``accepted`` of ``drafted`` (each judged draft is a
        trial: the accepted ones and the first rejected)."""
        self.acceptance.observe(drafted, accepted)

    def observe_call(self, steps: int, seconds: float) -> None:
        """A draft call of ``steps`` draft steps (the longest request's drafts) took ``seconds``."""
        if steps <= 0 or seconds <= 0:
            return
        per = seconds / steps
        d = self.decay
        self.draft_step_s = per if self.draft_step_s is None else d * self.draft_step_s + (1 - d) * per

    def tokens_per_second(self, requests: int, k: int) -> float | None:
        """Expected committed tokens per second of a step of ``requests`` requests drafting ``k``
        each (None: a cost not measured yet)."""
        c = self.cost.coefficients()
        if c is None or self.draft_step_s is None or requests < 1:
            return None
        fixed, per_forward, per_row = c
        seconds = fixed + per_forward + per_row * requests * (1 + k) + self.draft_step_s * k
        return requests * expected_tokens(self.alpha, k) / max(seconds, 1e-9)

    def choose(self, requests: int) -> int:
        """The draft length in 1..``k_max`` with the most expected tokens per second for a step of
        ``requests`` requests (the shorter on a tie)."""
        rates = [(self.tokens_per_second(requests, k), -k) for k in range(1, self.k_max + 1)]
        if rates[0][0] is None:
            return self.k_max
        return -max(rates)[1]

    def snapshot(self) -> dict:
        return {
            "alpha": round(self.alpha, 4),
            "draft_step_ms": None if self.draft_step_s is None else round(1e3 * self.draft_step_s, 3),
            "verify_cost": self.cost.snapshot(),
        }
