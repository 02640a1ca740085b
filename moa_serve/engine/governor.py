"""Speculation only where it measurably pays.

Whether drafting K tokens and verifying K+1 beats verifying one token depends on the drafter's
acceptance, the batch size and the hardware (on a 2-core AVX2 CPU, verifying 5 tokens of one
session costs 1.6x one token; of 16 sessions, 2.8x). Rather than guess, the governor measures:
per batch-size bucket it keeps a moving average of round seconds per committed token with
speculation on and with it off, runs each round in the faster mode, and every ``probe_every``
rounds tries the other mode so that the estimate follows the load and the drafter."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Bucket:
    on: float | None = None  # EMA of seconds per committed token, speculating
    off: float | None = None  # the same, plain decoding
    rounds: int = 0


class SpeculationGovernor:
    def __init__(self, probe_every: int = 12, alpha: float = 0.25):
        if probe_every < 2:
            raise ValueError("probe_every must be >= 2")
        self.probe_every = probe_every
        self.alpha = alpha
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(sessions: int) -> int:
        """Batch sizes 1, 2, 3-4, 5-8, ... share an estimate (the next power of two)."""
        return 1 << max(0, sessions - 1).bit_length()

    def speculate(self, sessions: int) -> bool:
        """Whether the next round of ``sessions`` sessions should draft."""
        b = self._buckets.setdefault(self.bucket(sessions), _Bucket())
        b.rounds += 1
        if b.on is None or b.off is None:  # measure both modes first
            return b.on is None
        better_on = b.on <= b.off
        if b.rounds % self.probe_every == 0:
            return not better_on
        return better_on

    def next_speculates(self, sessions: int) -> bool:
        """What :meth:`speculate` will answer for the next round of this size (without counting a
        round): the caller fetches drafter features only when a round soon drafts."""
        b = self._buckets.get(self.bucket(sessions))
        if b is None or b.on is None or b.off is None:
            return True
        better_on = b.on <= b.off
        return (not better_on) if (b.rounds + 1) % self.probe_every == 0 else better_on

    def observe(self, sessions: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A finished round: its wall time and the tokens it committed."""
        if tokens <= 0 or seconds <= 0:
            return
        b = self._buckets.setdefault(self.bucket(sessions), _Bucket())
        per_token = seconds / tokens
        old = b.on if speculated else b.off
        new = per_token if old is None else (1 - self.alpha) * old + self.alpha * per_token
        if speculated:
            b.on = new
        else:
            b.off = new

    def snapshot(self) -> dict:
        """ms per token by batch bucket and mode (for /v1/stats)."""
        ms = lambda v: None if v is None else round(v * 1e3, 2)  # noqa: E731
        return {str(k): {"on_ms_per_token": ms(b.on), "off_ms_per_token": ms(b.off), "rounds": b.rounds}
                for k, b in sorted(self._buckets.items())}
