"""Speculation only where it measurably pays.

Whether drafting K tokens and verifying K+1 beats verifying one token depends on the drafter's
acceptance, the batch size and the hardware (on a 2-core AVX2 CPU, verifying 5 tokens of one
session costs 1.6x one token; of 16 sessions, 2.8x). Rather than guess, the governor measures:
per batch-size bucket it keeps a moving average of round seconds per committed token with
speculation on and with it off, runs each round in the faster mode, and every ``probe_every``
rounds tries the other mode so that the estimate follows the load and the drafter; a mode whose
probes keep losing clearly is probed less and less often (the interval doubles, up to
``max_probe_every``), so a drafter that never pays costs almost nothing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Bucket:
    on: float | None = None  # EMA of seconds per committed token, speculating
    off: float | None = None  # the same, plain decoding
    rounds: int = 0
    interval: int = 0  # rounds between probes of the other mode (0: not set yet)
    since: int = 0  # rounds since the last probe
    probing: bool = False  # the round in flight runs the other mode


class SpeculationGovernor:
    def __init__(self, probe_every: int = 12, alpha: float = 0.25, max_probe_every: int = 192,
                 margin: float = 1.1):
        if probe_every < 2:
            raise ValueError("probe_every must be >= 2")
        self.probe_every = probe_every
        self.max_probe_every = max(probe_every, max_probe_every)
        self.alpha = alpha
        self.margin = margin  # a probe that finds its mode slower by more than this backs off
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(sessions: int) -> int:
        """Batch sizes 1, 2, 3-4, 5-8, ... share an estimate (the next power of two)."""
        return 1 << max(0, sessions - 1).bit_length()

    def _probe_due(self, b: _Bucket, ahead: int = 0) -> bool:
        return b.since + ahead >= (b.interval or self.probe_every)

    def speculate(self, sessions: int) -> bool:
        """Whether the next round of ``sessions`` sessions should draft."""
        b = self._buckets.setdefault(self.bucket(sessions), _Bucket())
        b.rounds += 1
        if b.on is None or b.off is None:  # measure both modes first
            return b.on is None
        better_on = b.on <= b.off
        b.since += 1
        b.probing = self._probe_due(b)
        if b.probing:
            b.since = 0
            return not better_on
        return better_on

    def next_speculates(self, sessions: int) -> bool:
        """What :meth:`speculate` will answer for the next round of this size (without counting a
        round): the caller fetches drafter features only when a round soon drafts."""
        b = self._buckets.get(self.bucket(sessions))
        if b is None or b.on is None or b.off is None:
            return True
        better_on = b.on <= b.off
        return (not better_on) if self._probe_due(b, ahead=1) else better_on

    def observe(self, sessions: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A finished round: its wall time and the tokens it committed. A probe that confirms the
        other mode is clearly slower doubles the interval to the next probe (up to
        ``max_probe_every``): a mode that keeps losing is tried less and less often; one that
        comes close or wins brings the interval back to ``probe_every``."""
        if tokens <= 0 or seconds <= 0:
            return
        b = self._buckets.setdefault(self.bucket(sessions), _Bucket())
        per_token = seconds / tokens
        old = b.on if speculated else b.off
        # a probe's mode was last measured long ago: its fresh measurement replaces the estimate
        fresh = old is None or b.probing
        new = per_token if fresh else (1 - self.alpha) * old + self.alpha * per_token
        if speculated:
            b.on = new
        else:
            b.off = new
        if b.probing:
            b.probing = False
            other = b.off if speculated else b.on
            interval = b.interval or self.probe_every
            if other is not None and new > self.margin * other:
                b.interval = min(2 * interval, self.max_probe_every)
            else:
                b.interval = self.probe_every

    def snapshot(self) -> dict:
        """ms per token by batch bucket and mode (for /v1/stats)."""
        ms = lambda v: None if v is None else round(v * 1e3, 2)  # noqa: E731
        return {str(k): {"on_ms_per_token": ms(b.on), "off_ms_per_token": ms(b.off), "rounds": b.rounds}
                for k, b in sorted(self._buckets.items())}
