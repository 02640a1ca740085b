"""Speculation only where it measurably pays.

Whether drafting K tokens and verifying K+1 beats verifying one token depends on the drafter's
acceptance, the batch size and the hardware (on a small CPU, verifying 5 tokens of one session
costs well under five times one token, of 16 sessions closer to it). Rather than guess, the
governor measures.
The cost per token of a mode is the ratio of its averaged round seconds to its averaged committed
tokens (an average of per-round ratios would overstate a weak drafter's cost, whose rounds mostly
commit one token and now and then several). The two halves are measured where they are known
best:

* round seconds and sessions per round, per batch-size bucket and mode: they depend on the batch
  and vary little from round to round;
* tokens per session of a speculative round (τ), once for all buckets: it is the drafter's
  acceptance on this traffic, whatever the batch, and it is noisy (with τ ≈ 1.3 most speculative
  rounds accept nothing and a few accept several), so it is averaged over every speculative
  round of every bucket. Plain rounds commit one token per session.

The mode in force stays until a probe finds the other faster or its own estimate falls behind the
other's by more than ``margin``; every ``probe_every`` rounds the other mode is tried for a few
rounds in a row, so that the estimate follows the load and the drafter: ``probe_rounds`` while τ
is not yet known, then ``short_probe_rounds`` (a probe then only refreshes the bucket's round
time). A mode whose probes keep losing is probed less and less often (the interval doubles, or
grows fourfold when the loss is by more than ``clear_ratio``, up to ``max_probe_every``), so a
drafter that never pays at a batch size costs almost nothing there; a larger batch size seen for
the first time starts from that verdict (``_new_bucket``).

A probe is priced before it runs. Once τ rests on ``4 * probe_rounds`` speculative rounds and
the draft call's seconds are known (from any bucket), speculation's best case in a bucket is a
round that costs one plain step (a verify call of one forward costs at least a plain round's
time per step) plus the draft call, and commits τ tokens per session, at most the round's cap
+ 1. Where that is slower than plain decoding by more than ``margin``, the probe is skipped and
counts as lost (the interval doubles; it is priced again when next due), so a drafter that
cannot pay at a batch size costs neither probe rounds nor the features a probe would have made
the verifier catch up on. Such a bucket measures plain decoding first, to have its price. A τ of
a few rounds (a warm-up's) is not trusted to price: a low one would price out every probe, and
τ is learnt only from the rounds that probes run. For the same reason a probe due at the longest
interval (``max_probe_every``) runs whatever its price: τ follows the traffic, at the cost of
``short_probe_rounds`` rounds per ``max_probe_every``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Bucket:
    # moving averages per round of seconds and sessions (speculating: on) or committed tokens (not: off)
    on_s: float | None = None
    on_sessions: float | None = None
    off_s: float | None = None
    off_tokens: float | None = None
    rounds: int = 0
    current: bool | None = None  # the mode in force, once both are measured (or inherited off)
    interval: int = 0  # rounds between probes of the other mode (0: not set yet)
    since: int = 0  # rounds since the last probe
    probing: bool = False  # rounds run ``probe_on``'s mode until ``probe_left`` more are observed
    probe_on: bool = False
    probe_left: int = 0
    probe_s: float = 0.0
    probe_count: int = 0  # sessions (speculating) or tokens (not) summed over the probe's rounds
    probe_n: int = 0
    skipped: int = 0  # probes of speculation priced out

    @property
    def off(self) -> float | None:
        return None if self.off_s is None else self.off_s / self.off_tokens


class SpeculationGovernor:
    def __init__(
        self,
        probe_every: int = 12,
        alpha: float = 0.1,
        max_probe_every: int = 768,
        margin: float = 1.1,
        probe_rounds: int = 8,
        short_probe_rounds: int = 2,
        tau_alpha: float = 0.05,
        clear_ratio: float = 2.0,
    ):
        if probe_every < 2:
            raise ValueError("probe_every must be >= 2")
        if not 1 <= short_probe_rounds <= probe_rounds:
            raise ValueError("need 1 <= short_probe_rounds <= probe_rounds")
        self.probe_every = probe_every
        self.max_probe_every = max(probe_every, max_probe_every)
        self.alpha = alpha
        # a probe that finds its mode slower by more than this backs off; the mode in force is left
        # between probes only when it is slower than the other by more than this
        self.margin = margin
        self.probe_rounds = probe_rounds
        self.short_probe_rounds = short_probe_rounds
        self.clear_ratio = clear_ratio
        self._buckets: dict[int, _Bucket] = {}
        # τ: moving averages of committed tokens and sessions per speculative round, all buckets
        self.tau_alpha = tau_alpha
        self._tau_tokens = self._tau_sessions = None
        self._tau_rounds = 0
        # moving average of a speculative round's draft seconds (the drafter pool's call), all buckets
        self._draft_s: float | None = None

    @property
    def tau(self) -> float | None:
        """Committed tokens per session of a speculative round (all batch sizes)."""
        return None if not self._tau_sessions else self._tau_tokens / self._tau_sessions

    def _probe_length(self, b: _Bucket) -> int:
        """``probe_rounds`` until τ rests on that many speculative rounds four times over (then a
        probe only refreshes a bucket's round time, which varies little), or once the bucket's
        modes differ by more than ``clear_ratio``: no error of a young τ turns such a verdict,
        and every long probe of a losing drafter costs what ``probe_rounds`` of its rounds lose."""
        on, off = self._on(b), b.off
        clear = on is not None and off is not None and max(on, off) > self.clear_ratio * min(on, off)
        return self.short_probe_rounds if clear or self._tau_rounds >= 4 * self.probe_rounds else self.probe_rounds

    @staticmethod
    def bucket(sessions: int) -> int:
        """Batch sizes 1, 2, 3-4, 5-8, ... share an estimate (the next power of two)."""
        return 1 << max(0, sessions - 1).bit_length()

    def _probe_due(self, b: _Bucket, ahead: int = 0) -> bool:
        return b.since + ahead >= (b.interval or self.probe_every)

    def _start_probe(self, b: _Bucket, on: bool) -> bool:
        b.probing, b.probe_on, b.probe_left = True, on, self._probe_length(b)
        b.probe_s, b.probe_count, b.probe_n = 0.0, 0, 0
        return on

    def speculate(self, sessions: int, cap: int | None = None) -> bool:
        """Whether the next round of ``sessions`` sessions should draft (``cap``: the most drafts
        a session may verify in it, None: no limit)."""
        b = self._bucket(sessions)
        b.rounds += 1
        if b.probing:
            return b.probe_on
        if self._on(b) is None or b.off is None:
            if b.current is False and b.off is not None:  # plain decoding inherited: speculation when due
                b.since += 1
                if self._probe_due(b):
                    b.since = 0
                    return self._probe_speculation(b, sessions, cap)
                return False
            if b.off is None and b.current is None and self._priced():
                return self._start_probe(b, on=False)  # plain decoding first: a probe needs its price
            if self._on(b) is None and b.current is None and b.off is not None:
                return self._probe_speculation(b, sessions, cap)
            # measure both modes first, speculation first unless plain decoding was inherited
            return self._start_probe(b, on=self._on(b) is None and b.current is None)
        b.current, fell_behind = self._in_force(b)
        if fell_behind:  # the other mode took over: probe this one back soon
            b.interval, b.since = self.probe_every, 0
        b.since += 1
        if self._probe_due(b):
            b.since = 0
            return self._probe_speculation(b, sessions, cap) if not b.current else self._start_probe(b, on=False)
        return b.current

    def _probe_speculation(self, b: _Bucket, sessions: int, cap: int | None) -> bool:
        """Starts a probe of speculation unless it is priced out (and not yet at the longest
        interval); a skipped probe counts as lost."""
        if self._probe_runs(b, sessions, cap):
            return self._start_probe(b, on=True)
        b.skipped += 1
        b.current = False
        b.interval = min(2 * (b.interval or self.probe_every), self.max_probe_every)
        return False

    def _probe_runs(self, b: _Bucket, sessions: int, cap: int | None) -> bool:
        """Whether a due probe of speculation runs: at the longest interval always, else unless
        priced out."""
        return b.interval >= self.max_probe_every or not self._priced_out(b, sessions, cap)

    def _priced(self) -> bool:
        """Whether probes can be priced: τ rests on enough speculative rounds (as for short
        probes) and the draft call's seconds are known."""
        return self._tau_rounds >= 4 * self.probe_rounds and self._draft_s is not None

    def _priced_out(self, b: _Bucket, sessions: int, cap: int | None) -> bool:
        """Whether speculation's best case in this bucket is slower than plain decoding by more
        than ``margin``: one plain step of the round (``off`` seconds per token x sessions) plus
        the draft call, for τ tokens per session (at most ``cap`` + 1)."""
        off = b.off
        if not self._priced() or off is None:
            return False
        per_session = self.tau if cap is None else min(self.tau, cap + 1)
        best = (off * sessions + self._draft_s) / (sessions * per_session)
        return best > self.margin * off

    def next_speculates(self, sessions: int, cap: int | None = None) -> bool:
        """What :meth:`speculate` will answer for the next round of this size (without counting a
        round): the caller fetches drafter features only when a round soon drafts."""
        b = self._buckets.get(self.bucket(sessions)) or self._new_bucket(self.bucket(sessions))
        if b.probing:
            return b.probe_on
        if self._on(b) is None or b.off is None:
            if b.current is False and b.off is not None:
                return self._probe_due(b, ahead=1) and self._probe_runs(b, sessions, cap)
            if b.off is None and b.current is None and self._priced():
                return False
            if self._on(b) is None and b.current is None and b.off is not None:
                return self._probe_runs(b, sessions, cap)
            return self._on(b) is None and b.current is None
        current, fell_behind = self._in_force(b)
        if not fell_behind and self._probe_due(b, ahead=1):
            return not current and self._probe_runs(b, sessions, cap)
        return current

    def _in_force(self, b: _Bucket) -> tuple[bool, bool]:
        """(the mode for the next round outside probes, whether that changed because the mode in
        force fell behind the other's estimate by more than ``margin``)."""
        current = b.current if b.current is not None else self._on(b) <= b.off
        mine, other = (self._on(b), b.off) if current else (b.off, self._on(b))
        return (not current, True) if mine > self.margin * other else (current, False)

    def observe(self, sessions: int, speculated: bool, seconds: float, tokens: int, draft_s: float = 0.0) -> None:
        """A finished round: its wall time, the tokens it committed and, speculating, the seconds
        of its draft call (``draft_s``, which prices later probes). A probe's rounds are
        summed and, once all are in, replace the estimate of their mode; a probe that confirms
        the other mode is faster by more than ``margin`` doubles the interval to the next probe
        (by more than ``clear_ratio``: quadruples it; up to ``max_probe_every``): a mode that
        keeps losing is tried less and less often; one that comes close or wins brings the
        interval back to ``probe_every``."""
        if tokens <= 0 or seconds <= 0 or sessions <= 0:
            return
        if speculated:
            self._observe_tau(sessions, tokens)
            if draft_s > 0:
                self._draft_s = (
                    draft_s if self._draft_s is None else (1 - self.alpha) * self._draft_s + self.alpha * draft_s
                )
        b = self._bucket(sessions)
        count = sessions if speculated else tokens  # what the bucket averages besides seconds
        if b.probing and speculated == b.probe_on:
            b.probe_s, b.probe_count, b.probe_n = b.probe_s + seconds, b.probe_count + count, b.probe_n + 1
            b.probe_left -= 1
            if b.probe_left > 0:
                return
            b.probing = False
            self._set(b, speculated, b.probe_s / b.probe_n, b.probe_count / b.probe_n)
            new, other = (self._on(b), b.off) if speculated else (b.off, self._on(b))
            if other is not None:
                if b.current is not None and new < other:
                    b.current = speculated  # the probe found its mode faster: it takes over
                interval = b.interval or self.probe_every
                if new > self.margin * other:  # lost: back off, faster from a clear verdict
                    grow = 4 if new > self.clear_ratio * other else 2
                    b.interval = min(grow * interval, self.max_probe_every)
                else:
                    b.interval = self.probe_every
            return
        old_s, old_count = (b.on_s, b.on_sessions) if speculated else (b.off_s, b.off_tokens)
        if old_s is None:
            self._set(b, speculated, seconds, count)
        else:
            a = self.alpha
            self._set(b, speculated, (1 - a) * old_s + a * seconds, (1 - a) * old_count + a * count)

    def _observe_tau(self, sessions: int, tokens: int) -> None:
        self._tau_rounds += 1
        if self._tau_sessions is None:
            self._tau_tokens, self._tau_sessions = float(tokens), float(sessions)
        else:  # the plain mean of the rounds so far until it holds 1 / tau_alpha of them
            a = max(self.tau_alpha, 1 / self._tau_rounds)
            self._tau_tokens = (1 - a) * self._tau_tokens + a * tokens
            self._tau_sessions = (1 - a) * self._tau_sessions + a * sessions

    def _on(self, b: _Bucket) -> float | None:
        """Seconds per committed token in this bucket, speculating."""
        tau = self.tau
        return None if b.on_s is None or not tau else b.on_s / (b.on_sessions * tau)

    def _bucket(self, sessions: int) -> _Bucket:
        key = self.bucket(sessions)
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = self._new_bucket(key)
        return b

    def _new_bucket(self, key: int) -> _Bucket:
        """A batch size seen for the first time. Where a smaller batch size already found
        speculation clearly slower (plain decoding in force, its probes backed off), this one
        starts with plain decoding and that probe interval: verifying K extra tokens per session
        costs relatively more as the batch grows (the step turns compute-bound) while τ does not
        change, so speculation loses there too — a probe still checks, when due."""
        smaller = [k for k in self._buckets if k < key]
        if smaller:
            prior = self._buckets[max(smaller)]
            if prior.current is False and prior.interval > self.probe_every:
                return _Bucket(current=False, interval=prior.interval)
        return _Bucket()

    @staticmethod
    def _set(b: _Bucket, speculated: bool, seconds: float, count: float) -> None:
        if speculated:
            b.on_s, b.on_sessions = seconds, count
        else:
            b.off_s, b.off_tokens = seconds, count

    def snapshot(self) -> dict:
        """ms per token by batch bucket and mode (for /v1/stats), τ under "tau", a speculative
        round's draft call under "draft_ms"."""
        ms = lambda v: None if v is None else round(v * 1e3, 2)  # noqa: E731
        out = {}
        for k, b in sorted(self._buckets.items()):
            out[str(k)] = {
                "on_ms_per_token": ms(self._on(b)),
                "off_ms_per_token": ms(b.off),
                "rounds": b.rounds,
                "probes_priced_out": b.skipped,
            }
        out["tau"] = None if self.tau is None else round(self.tau, 3)
        out["draft_ms"] = ms(self._draft_s)
        return out
