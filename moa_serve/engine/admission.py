"""How long a newcomer would wait for a seat, from what the service measures now: admission by
expected wait (``http_limits.max_queue_wait_s``).

A seat frees when a running session ends. ``RoundClock`` measures the seconds a session waits
per committed token, and the same per running session. ``expected_wait_s`` plays the seats
forward at the pace of full seats: each running session ends after the tokens its remaining
``max_tokens`` allow, each request queued ahead then takes the first seat to free and holds it for
the tokens its own ``max_tokens`` allow; the newcomer's wait is when the next
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
    """Moving averages of the seconds one session waits per committed token (between its
    consecutive rounds, over the tokens a round commits to it) and of the same per running session:
    a round's time grows with the sessions it verifies, so a wait at the seats' full count is
    predicted from the larger of the two, the time per token measured and that measured per
    session times the sessions the seats will hold (a burst on an idle server is not estimated at
    the idle server's pace)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.token_s: float | None = None
        self.token_s_per_session: float | None = None
        self._last: dict[str, float] = {}
        self._first: set[str] = set()  # sessions whose first round has not committed yet

    def started(self, key: str) -> None:
        self._last[key] = self.clock()
        self._first.add(key)

    def committed(self, key: str, tokens: int, running: int) -> None:
        """A round of session ``key`` committed ``tokens`` tokens while ``running`` sessions held
        seats. Its first (the prefill of its prompt, after its wait for the Router) is not timed:
        the clock starts there."""
        now = self.clock()
        last = self._last.get(key)
        self._last[key] = now
        if last is None or key in self._first:
            self._first.discard(key)
            return
        if tokens < 1:
            return
        per_token = (now - last) / tokens
        self.token_s = _average(self.token_s, per_token)
        self.token_s_per_session = _average(self.token_s_per_session, per_token / max(1, running))

    def ended(self, key: str) -> None:
        self._last.pop(key, None)
        self._first.discard(key)

    def seconds_per_token(self, sessions: int) -> float | None:
        """Seconds per token of one session while ``sessions`` hold seats (None before a round was timed)."""
        if self.token_s is None or self.token_s_per_session is None:
            return None
        return max(self.token_s, self.token_s_per_session * sessions)


def _average(mean: float | None, sample: float) -> float:
    return sample if mean is None else (1 - SMOOTHING) * mean + SMOOTHING * sample


def expected_wait_s(clock: RoundClock, remaining: Iterable[int], ahead: Iterable[int], free_seats: int) -> float | None:
    """Seconds until a newcomer gets a seat: ``remaining``, the tokens each running session may
    still generate; ``ahead``, the ``max_tokens`` of each request queued before it; ``free_seats``,
    the seats nobody holds. 0 when a seat is free for it; None before a round was timed."""
    ahead = list(ahead)
    if free_seats > len(ahead):
        return 0.0
    remaining = list(remaining)
    per_token = clock.seconds_per_token(len(remaining) + free_seats)  # every seat taken until it gets one
    if per_token is None:
        return None
    seats = [0.0] * max(0, free_seats) + [max(1, n) * per_token for n in remaining]
    if not seats:
        return None
    heapq.heapify(seats)
    for max_tokens in ahead:
        heapq.heappush(seats, heapq.heappop(seats) + max(1, max_tokens) * per_token)
    return seats[0]


def next_seat_s(clock: RoundClock, remaining: Iterable[int]) -> float | None:
    """Seconds until the first running session may end and free its seat (at the pace of the seats
    taken): when a refused request may find room (its Retry-After)."""
    remaining = list(remaining)
    per_token = clock.seconds_per_token(len(remaining))
    if per_token is None or not remaining:
        return None
    return max(1, min(remaining)) * per_token


def retry_after_s(seconds: float) -> int:
    """Retry-After of ``seconds``: whole seconds, at least 1."""
    return max(1, math.ceil(seconds))
