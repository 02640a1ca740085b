"""Which prompt-lookup drafts are worth verifying, session by session and token by token.

A draft token costs one more row in the round's verify forward whether or not it is accepted,
and gains a token only if it and every draft before it are accepted. So the k-th draft of a
session pays when

    P(its first k drafts are accepted) x (seconds a token costs without drafts) > (seconds of one more row).

Both sides are measured while serving:

- ``VerifyCost`` fits each verify call's seconds as ``fixed + per_forward x forwards + per_row x
  rows`` (exponentially weighted least squares over the recent calls), which gives the price of
  a row and, for the round about to run (n sessions, m decode steps), of a token:
  ``seconds(m, n*m) / (n*m)``.
- ``AcceptanceStats`` estimates the chance that a draft token is accepted given the ones before
  it were: per n-gram match length over all sessions (a longer match is a better bet), refined by
  the session's own recent record. Under that (geometric) model the first k are all accepted with
  probability ``alpha**k``.

The bar therefore rises with the batch: where a row is nearly free (a GPU at small batches, or one
session on a CPU) almost any lookup draft is verified; on a small CPU, where each row costs
noticeably, one session drafts on modest evidence, four sessions need better, and past that only
long copies get through.
Rounds therefore no longer switch speculation on or off as a whole: each session drafts as far as
its own evidence carries. A session that has not drafted for ``probe_every`` of its rounds drafts
one token anyway (when lookup has one), so that an estimate that turned pessimistic can recover.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class VerifyCost:
    """``seconds ~ fixed + per_forward * forwards + per_row * rows`` for a verify call, by
    exponentially weighted least squares (``decay`` per call, a small ridge keeps it solvable
    while the calls have not varied yet). NumPy, not torch: the Router updates it every round,
    and torch's per-op dispatch would cost several times this per round."""

    def __init__(self, decay: float = 0.98, min_calls: int = 8, ridge: float = 1e-3):
        self.decay, self.min_calls, self.ridge = decay, min_calls, ridge
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self.calls = 0
        self._coef: tuple[float, float, float] | None = None

    def observe(self, forwards: int, rows: int, seconds: float) -> None:
        if forwards < 1 or rows < 1 or seconds <= 0:
            return
        x = np.array([1.0, float(forwards), float(rows)])
        self._xtx = self._xtx * self.decay + np.outer(x, x)
        self._xty = self._xty * self.decay + x * seconds
        self.calls += 1
        self._coef = None

    def coefficients(self) -> tuple[float, float, float] | None:
        """(fixed, per_forward, per_row) seconds, each >= 0; None until ``min_calls`` calls."""
        if self.calls < self.min_calls:
            return None
        if self._coef is None:
            # ridge on the slopes only, scaled to the data so it is negligible once rows vary
            reg = np.diag([0.0, 1.0, 1.0]) * self.ridge * self._xtx[0, 0]
            beta = np.linalg.solve(self._xtx + reg, self._xty)
            self._coef = tuple(max(0.0, float(b)) for b in beta)
        return self._coef

    def row_seconds(self) -> float | None:
        c = self.coefficients()
        return None if c is None else c[2]

    def token_seconds(self, sessions: int, steps: int) -> float | None:
        """Seconds per token of a call of ``sessions`` sessions x ``steps`` decode steps, no drafts."""
        c = self.coefficients()
        if c is None or sessions < 1 or steps < 1:
            return None
        fixed, per_forward, per_row = c
        tokens = sessions * steps
        return (fixed + per_forward * steps + per_row * tokens) / tokens

    def snapshot(self) -> dict:
        c = self.coefficients()
        if c is None:
            return {"calls": self.calls}
        return {
            "calls": self.calls,
            "fixed_ms": round(c[0] * 1e3, 3),
            "per_forward_ms": round(c[1] * 1e3, 3),
            "per_row_ms": round(c[2] * 1e3, 3),
        }


@dataclass
class _Record:
    accepted: float = 0.0  # exponentially weighted draft tokens accepted
    trials: float = 0.0  # ... and draft tokens judged (the accepted ones + the first rejected)
    since_draft: int = 0  # offers of drafts the session declined since it last drafted


class AcceptanceStats:
    """Per-token acceptance of lookup drafts: ``alpha`` = P(a draft is accepted | the drafts before
    it were). Estimated per n-gram match length over all sessions, shrunk towards it for each
    session by its own recent outcomes (``weight`` pseudo-trials of the shared estimate)."""

    def __init__(
        self, prior: float = 0.5, weight: float = 3.0, session_decay: float = 0.8, global_decay: float = 0.995
    ):
        self.prior, self.weight = prior, weight
        self.session_decay, self.global_decay = session_decay, global_decay
        self._by_match: dict[int, _Record] = {}
        self._sessions: dict[str, _Record] = {}

    def shared(self, match: int) -> float:
        r = self._by_match.get(match)
        # two pseudo-trials at the prior: a match length seen only a few times stays near it
        return self.prior if r is None else (r.accepted + 2 * self.prior) / (r.trials + 2)

    def alpha(self, session_id: str, match: int) -> float:
        shared = self.shared(match)
        r = self._sessions.get(session_id)
        if r is None:
            return shared
        return (r.accepted + self.weight * shared) / (r.trials + self.weight)

    def observe(self, session_id: str, match: int, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        trials = accepted + (accepted < drafted)  # the first rejected draft was judged too
        for rec, decay in (
            (self._by_match.setdefault(match, _Record()), self.global_decay),
            (self._sessions.setdefault(session_id, _Record()), self.session_decay),
        ):
            rec.accepted = decay * rec.accepted + accepted
            rec.trials = decay * rec.trials + trials

    def record(self, session_id: str) -> _Record:
        return self._sessions.setdefault(session_id, _Record())

    def release(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def snapshot(self) -> dict:
        return {
            str(n): {"alpha": round(self.shared(n), 3), "judged": round(r.trials, 1)}
            for n, r in sorted(self._by_match.items())
        }


class DraftGate:
    """How many of a session's lookup drafts to verify this round (see the module docstring)."""

    def __init__(
        self,
        probe_every: int = 16,
        cost: VerifyCost | None = None,
        acceptance: AcceptanceStats | None = None,
        row_tile: int = 1,
    ):
        if row_tile < 1:
            raise ValueError("row_tile must be >= 1")
        self.probe_every = probe_every
        self.cost = cost or VerifyCost()
        self.acceptance = acceptance or AcceptanceStats()
        self.row_tile = row_tile
        self.stats = {"offered": 0, "kept": 0, "probes": 0, "tile_trimmed": 0}

    def bar(self, sessions: int, steps: int) -> float | None:
        """The chance of acceptance a draft token needs at this batch: row cost / token cost
        (None: no cost estimate yet, every draft is verified)."""
        row, token = self.cost.row_seconds(), self.cost.token_seconds(sessions, steps)
        if row is None or token is None or token <= 0:
            return None
        return row / token

    def keep(self, session_id: str, match: int, offered: int, bar: float | None) -> int:
        """The number of leading drafts (of ``offered``, from a lookup match of ``match`` tokens)
        worth verifying: the largest k with alpha**k >= bar; at least one on a probe round."""
        if offered <= 0:
            return 0
        self.stats["offered"] += offered
        if bar is None:
            k = offered
        else:
            alpha, k, p = self.acceptance.alpha(session_id, match), 0, 1.0
            while k < offered and p * alpha >= bar:
                p *= alpha
                k += 1
        rec = self.acceptance.record(session_id)
        if k == 0:
            rec.since_draft += 1
            if rec.since_draft >= self.probe_every:
                k = 1
                self.stats["probes"] += 1
        if k > 0:
            rec.since_draft = 0
        self.stats["kept"] += k
        return k

    def keep_round(self, offers: list[tuple[str, int, int]], sessions: int, bar: float | None) -> dict[str, int]:
        """``keep`` for every session of a round (``offers``: session id, match length, drafts
        offered), then, where the verifier multiplies ``row_tile`` rows at a time (a CPU's packed
        matmul kernels: a forward of 5 to 8 rows costs what one of 8 does), the drafts that fit
        the last tile the round's ``sessions`` rows leave part-empty are kept, the likeliest
        first, and each further tile only where its drafts' chances of acceptance sum to at least
        ``row_tile`` x ``bar`` (the tokens it is expected to add pay for its rows)."""
        kept = {sid: self.keep(sid, match, offered, bar) for sid, match, offered in offers}
        if self.row_tile <= 1:
            return kept
        matches = {sid: match for sid, match, _ in offers}
        # every kept draft with the chance that it and the ones before it are accepted, likeliest first
        candidates = sorted(
            (
                (-(self.acceptance.alpha(sid, matches[sid]) ** j), j, sid)
                for sid, k in kept.items()
                for j in range(1, k + 1)
            )
        )
        take = min(len(candidates), -sessions % self.row_tile)  # the rows the last tile holds anyway
        while take < len(candidates):
            tile = candidates[take : take + self.row_tile]
            if bar is not None and -sum(c[0] for c in tile) < self.row_tile * bar:
                break
            take += len(tile)
        out = dict.fromkeys(kept, 0)
        for _, _, sid in candidates[:take]:
            out[sid] += 1
        trimmed = len(candidates) - take
        self.stats["kept"] -= trimmed
        self.stats["tile_trimmed"] += trimmed
        return out

    def observe_call(self, forwards: int, rows: int, seconds: float) -> None:
        self.cost.observe(forwards, rows, seconds)

    def observe_drafts(self, session_id: str, match: int, drafted: int, accepted: int) -> None:
        self.acceptance.observe(session_id, match, drafted, accepted)

    def release(self, session_id: str) -> None:
        self.acceptance.release(session_id)

    def snapshot(self) -> dict:
        return {**self.stats, "verify_cost": self.cost.snapshot(), "acceptance_by_match": self.acceptance.snapshot()}
