"""How long the device waits for one server call before it calls the server unreachable.

The deadline follows the link the device measured: ``multiple`` x the 99th percentile of the
round trips of the last ``window`` answered calls, within [``floor_s``, ``cap_s``]. A blackholed
link answers nothing, so this is how fast the device notices it and keeps writing offline; a link
that merely got slower raises its own p99 and so its deadline. Before any round trip is measured,
and for a call that waits for a prefill on the server (a create carries the whole prompt),
``first_s`` is the least it waits. ``fixed_s`` (``--timeout``) replaces the rule with a fixed
deadline."""

from __future__ import annotations

import math
from collections import deque

MULTIPLE = 4.0
FLOOR_S = 2.0  # the deadline is never shorter: a verify round's own work, a loaded server's queue
CAP_S = 30.0
FIRST_S = 15.0  # before any measurement, and for a prefill (a long prompt on a CPU server)
WINDOW = 32  # recent round trips the p99 is taken over


def percentile(values, q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ``values`` (not empty)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class CallDeadline:
    def __init__(
        self,
        *,
        multiple: float = MULTIPLE,
        floor_s: float = FLOOR_S,
        cap_s: float = CAP_S,
        first_s: float = FIRST_S,
        window: int = WINDOW,
        fixed_s: float | None = None,
    ):
        if not 0 < floor_s <= cap_s or multiple <= 0 or first_s <= 0 or window < 1:
            raise ValueError("a deadline needs 0 < floor_s <= cap_s, multiple > 0, first_s > 0 and window >= 1")
        if fixed_s is not None and fixed_s <= 0:
            raise ValueError(f"a fixed deadline must be > 0 seconds, got {fixed_s}")
        self.multiple, self.floor_s, self.cap_s = multiple, floor_s, cap_s
        self.first_s, self.fixed_s = first_s, fixed_s
        self.round_trips: deque[float] = deque(maxlen=window)

    def observe(self, round_trip_s: float) -> None:
        """One answered call's round trip (request sent to response read)."""
        self.round_trips.append(round_trip_s)

    @property
    def p99_s(self) -> float | None:
        return percentile(self.round_trips, 99) if self.round_trips else None

    def seconds(self) -> float:
        """The deadline of an ordinary call (a verify round, the handshake, a delete)."""
        if self.fixed_s is not None:
            return self.fixed_s
        p99 = self.p99_s
        if p99 is None:
            return self.first_s
        return min(self.cap_s, max(self.floor_s, self.multiple * p99))

    def prefill_seconds(self) -> float:
        """The deadline of a call the server answers after a prefill (a create)."""
        if self.fixed_s is not None:
            return self.fixed_s
        return max(self.first_s, self.seconds())

    def describe(self) -> str:
        if self.fixed_s is not None:
            return f"fixed {self.fixed_s:g} s"
        p99 = self.p99_s
        seen = f"p99 {1e3 * p99:.0f} ms of {len(self.round_trips)} calls" if p99 is not None else "no calls measured"
        return f"{self.seconds():.2f} s ({seen})"
