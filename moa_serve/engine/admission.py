"""How long a newcomer would wait for a seat, from what the service measures now: admission by
expected wait (``http_limits.max_queue_wait_s``).

A seat frees when a running session ends. ``RoundClock`` measures the time between a session's
consecutive rounds (at the load of the moment: it follows a burst within a round) and the tokens a
round commits. ``expected_wait_s`` plays the seats forward: each running session ends after the
rounds its remaining ``max_tokens`` need, each request queued ahead then takes the first seat to
free and holds it for the rounds its own ``max_tokens`` need; the newcomer's wait is when the next
seat frees after those. A session may end sooner (a stop token), so the estimate errs towards
refusing: a seat that frees early is taken by the next request at once, and the requests it admits
wait no longer than the estimate said."""

from __future__ import annotations

import heapq
import math
import time
from typing import Callable, Iterable

SMOOTHING = 0.2  # weight of the newest interval in the moving average of the time per round


class RoundClock:
    """Moving averages of the seconds between a session's consecutive rounds and of the tokens a
    round commits per session, over all sessions."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.round_s: float | None = None
        self.tokens_per_round: float = 1.0
        self._last: dict[str, float] = {}
        self._first: set[str] = set()  # sessions whose first round has not committed yet

    def started(self, key: str) -> None:
        self._last[key] = self.clock()
        self._first.add(key)

    def committed(self, key: str, tokens: int) -> None:
        """A round of session ``key`` committed ``tokens`` tokens. Its first (the prefill of its
        prompt, after its wait for the Router) is not a round's time: the clock starts there."""
        now = self.clock()
        last = self._last.get(key)
        self._last[key] = now
        if last is None or key in self._first:
            self._first.discard(key)
            return
        interval = now - last
        self.round_s = interval if self.round_s is None else (1 - SMOOTHING) * self.round_s + SMOOTHING * interval
        if tokens > 0:
            self.tokens_per_round = (1 - SMOOTHING) * self.tokens_per_round + SMOOTHING * tokens

    def ended(self, key: str) -> None:
        self._last.pop(key, None)
        self._first.discard(key)

    def rounds_for(self, tokens: int) -> int:
        return max(1, math.ceil(tokens / max(1.0, self.tokens_per_round)))


def expected_wait_s(clock: RoundClock, remaining: Iterable[int], ahead: Iterable[int], free_seats: int) -> float | None:
    """Seconds until a newcomer gets a seat: ``remaining``, the tokens each running session may
    still generate; ``ahead``, the ``max_tokens`` of each request queued before it; ``free_seats``,
    the seats nobody holds. 0 when a seat is free for it; None before a round was timed."""
    ahead = list(ahead)
    if free_seats > len(ahead):
        return 0.0
    if clock.round_s is None:
        return None
    seats = [0.0] * max(0, free_seats) + [clock.rounds_for(n) * clock.round_s for n in remaining]
    if not seats:
        return None
    heapq.heapify(seats)
    for max_tokens in ahead:
        heapq.heappush(seats, heapq.heappop(seats) + clock.rounds_for(max_tokens) * clock.round_s)
    return seats[0]


def retry_after_s(expected_wait_s: float) -> int:
    """Retry-After for a request refused by its expected wait: that wait, whole seconds, at least 1."""
    return max(1, math.ceil(expected_wait_s))
