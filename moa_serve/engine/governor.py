"""Speculation only where it measurably pays.

Whether drafting K tokens and verifying K+1 beats verifying one token depends on the drafter's
acceptance, the batch size and the hardware (on a 2-core AVX2 CPU, verifying 5 tokens of one
session costs 1.6x one token; of 16 sessions, 2.8x). Rather than guess, the governor measures:
per batch-size bucket it keeps moving averages of round seconds and of committed tokens with
speculation on and with it off (their ratio is the cost per token: an average of per-round
ratios would overstate a weak drafter's cost, whose rounds mostly commit one token and now and
then several), keeps the mode in force until a probe finds the other faster or its own estimate
falls behind the other's by more than ``margin``, and every ``probe_every`` rounds tries the other
mode for ``probe_rounds`` rounds in a row, so that the estimate follows the load and the drafter.
A probe spans several rounds because one round says little: with τ ≈ 1.3 most speculative rounds
accept nothing and a few accept several, so single-round probes lost four times in five even
where speculation paid 1.1x on average. A mode whose probes keep losing
clearly is probed less and less often (the interval doubles, up to ``max_probe_every``), so a
drafter that never pays costs almost nothing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Bucket:
    # moving averages per round of seconds and committed tokens, speculating (on) and not (off)
    on_s: float | None = None
    on_tokens: float | None = None
    off_s: float | None = None
    off_tokens: float | None = None
    rounds: int = 0
    current: bool | None = None  # the mode in force, once both are measured
    interval: int = 0  # rounds between probes of the other mode (0: not set yet)
    since: int = 0  # rounds since the last probe
    probing: bool = False  # rounds run ``probe_on``'s mode until ``probe_left`` more are observed
    probe_on: bool = False
    probe_left: int = 0
    probe_s: float = 0.0
    probe_tokens: int = 0
    probe_n: int = 0

    @property
    def on(self) -> float | None:
        """Seconds per committed token, speculating."""
        return None if self.on_s is None else self.on_s / self.on_tokens

    @property
    def off(self) -> float | None:
        return None if self.off_s is None else self.off_s / self.off_tokens


class SpeculationGovernor:
    def __init__(self, probe_every: int = 12, alpha: float = 0.1, max_probe_every: int = 192,
                 margin: float = 1.1, probe_rounds: int = 8):
        if probe_every < 2:
            raise ValueError("probe_every must be >= 2")
        if probe_rounds < 1:
            raise ValueError("probe_rounds must be >= 1")
        self.probe_every = probe_every
        self.max_probe_every = max(probe_every, max_probe_every)
        self.alpha = alpha
        # a probe that finds its mode slower by more than this backs off; the mode in force is left
        # between probes only when it is slower than the other by more than this
        self.margin = margin
        self.probe_rounds = probe_rounds
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(sessions: int) -> int:
        """Batch sizes 1, 2, 3-4, 5-8, ... share an estimate (the next power of two)."""
        return 1 << max(0, sessions - 1).bit_length()

    def _probe_due(self, b: _Bucket, ahead: int = 0) -> bool:
        return b.since + ahead >= (b.interval or self.probe_every)

    def _start_probe(self, b: _Bucket, on: bool) -> bool:
        b.probing, b.probe_on, b.probe_left = True, on, self.probe_rounds
        b.probe_s, b.probe_tokens, b.probe_n = 0.0, 0, 0
        return on

    def speculate(self, sessions: int) -> bool:
        """Whether the next round of ``sessions`` sessions should draft."""
        b = self._buckets.setdefault(self.bucket(sessions), _Bucket())
        b.rounds += 1
        if b.probing:
            return b.probe_on
        if b.on is None or b.off is None:  # measure both modes first, speculation first
            return self._start_probe(b, on=b.on is None)
        b.current, fell_behind = self._in_force(b)
        if fell_behind:  # the other mode took over: probe this one back soon
            b.interval, b.since = self.probe_every, 0
        b.since += 1
        if self._probe_due(b):
            b.since = 0
            return self._start_probe(b, on=not b.current)
        return b.current

    def next_speculates(self, sessions: int) -> bool:
        """What :meth:`speculate` will answer for the next round of this size (without counting a
        round): the caller fetches drafter features only when a round soon drafts."""
        b = self._buckets.get(self.bucket(sessions))
        if b is None or b.on is None or b.off is None:
            return True
        if b.probing:
            return b.probe_on
        current, fell_behind = self._in_force(b)
        return (not current) if not fell_behind and self._probe_due(b, ahead=1) else current

    def _in_force(self, b: _Bucket) -> tuple[bool, bool]:
        """(the mode for the next round outside probes, whether that changed because the mode in
        force fell behind the other's estimate by more than ``margin``)."""
        current = b.current if b.current is not None else b.on <= b.off
        mine, other = (b.on, b.off) if current else (b.off, b.on)
        return (not current, True) if mine > self.margin * other else (current, False)

    def observe(self, sessions: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A finished round: its wall time and the tokens it committed. A probe's rounds are
        summed and, once all are in, replace the estimate of their mode; a probe that confirms
        the other mode is clearly faster doubles the interval to the next probe (up to
        ``max_probe_every``): a mode that keeps losing is tried less and less often; one that
        comes close or wins brings the interval back to ``probe_every``."""
        if tokens <= 0 or seconds <= 0:
            return
        b = self._buckets.setdefault(self.bucket(sessions), _Bucket())
        if b.probing and speculated == b.probe_on:
            b.probe_s, b.probe_tokens, b.probe_n = b.probe_s + seconds, b.probe_tokens + tokens, b.probe_n + 1
            b.probe_left -= 1
            if b.probe_left > 0:
                return
            b.probing = False
            self._set(b, speculated, b.probe_s / b.probe_n, b.probe_tokens / b.probe_n)
            new, other = (b.on, b.off) if speculated else (b.off, b.on)
            if other is not None:
                if b.current is not None and new < other:
                    b.current = speculated  # the probe found its mode faster: it takes over
                interval = b.interval or self.probe_every
                b.interval = min(2 * interval, self.max_probe_every) if new > self.margin * other else self.probe_every
            return
        old_s, old_tokens = (b.on_s, b.on_tokens) if speculated else (b.off_s, b.off_tokens)
        if old_s is None:
            self._set(b, speculated, seconds, tokens)
        else:
            a = self.alpha
            self._set(b, speculated, (1 - a) * old_s + a * seconds, (1 - a) * old_tokens + a * tokens)

    @staticmethod
    def _set(b: _Bucket, speculated: bool, seconds: float, tokens: float) -> None:
        if speculated:
            b.on_s, b.on_tokens = seconds, tokens
        else:
            b.off_s, b.off_tokens = seconds, tokens

    def snapshot(self) -> dict:
        """ms per token by batch bucket and mode (for /v1/stats)."""
        ms = lambda v: None if v is None else round(v * 1e3, 2)  # noqa: E731
        return {str(k): {"on_ms_per_token": ms(b.on), "off_ms_per_token": ms(b.off), "rounds": b.rounds}
                for k, b in sorted(self._buckets.items())}
