"""How many tokens to draft per round on the device: the K that maximizes expected committed
tokens per second of a round, from the measured round trip, the measured drafting time per
token and the measured per-token acceptance rate.

A round with K drafts commits E(K) = (1 - a^(K+1)) / (1 - a) tokens on average when each draft is
accepted with probability a (given the ones before were), and costs round_trip + K * draft_s. A
long round trip (a slow link) makes drafting nearly free and K grows; a drafter that is rarely
right makes drafts wasted work and K shrinks."""

from __future__ import annotations

from moa_serve.engine.draft_length import Acceptance, expected_tokens


def best_k(alpha: float, draft_s: float, round_trip_s: float, k_max: int, k_min: int = 1) -> int:
    """The K in [k_min, k_max] with the most expected tokens per second of a round."""
    return max(
        range(k_min, k_max + 1), key=lambda k: (expected_tokens(alpha, k) / max(1e-9, round_trip_s + k * draft_s), -k)
    )


class KController:
    """Running estimates (exponentially decayed, so they follow a changing link or text) and the
    K they call for. Before any measurement: ``k_start``."""

    def __init__(self, k_max: int, k_start: int | None = None, decay: float = 0.9, adaptive: bool = True):
        if k_max < 1:
            raise ValueError("k_max must be >= 1")
        self.k_max = k_max
        self.k_start = min(k_max, k_start or 4)
        self.decay = decay
        self.adaptive = adaptive
        self.acceptance = Acceptance(decay)
        self.draft_s: float | None = None  # per drafted token
        self.round_trip_s: float | None = None

    @property
    def alpha(self) -> float:
        return self.acceptance.alpha

    def observe(self, drafted: int, accepted: int, draft_s: float, round_trip_s: float) -> None:
        """One round: ``accepted`` of ``drafted`` drafts, drafting took ``draft_s`` (all of them),
        the verify call ``round_trip_s``."""
        d = self.decay
        self.round_trip_s = (
            round_trip_s if self.round_trip_s is None else d * self.round_trip_s + (1 - d) * round_trip_s
        )
        if drafted <= 0:
            return
        self.acceptance.observe(drafted, accepted)
        per = draft_s / drafted
        self.draft_s = per if self.draft_s is None else d * self.draft_s + (1 - d) * per

    def k(self) -> int:
        if not self.adaptive:
            return self.k_max
        if self.draft_s is None or self.round_trip_s is None:
            return self.k_start
        return best_k(self.alpha, self.draft_s, self.round_trip_s, self.k_max)

    def snapshot(self) -> dict:
        return {
            "alpha": round(self.alpha, 4),
            "k": self.k(),
            "draft_ms_per_token": round(1e3 * self.draft_s, 3) if self.draft_s is not None else None,
            "round_trip_ms": round(1e3 * self.round_trip_s, 3) if self.round_trip_s is not None else None,
        }
