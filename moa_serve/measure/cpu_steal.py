"""The share of the machine's CPU time the hypervisor gave to other machines ("steal"): a small
cloud VM's speed drifts with it, by tens of per cent within minutes, so benchmarks record it
beside every measurement and can count their seconds net of it."""

from __future__ import annotations

from pathlib import Path


def cpu_ticks() -> tuple[int, int] | None:
    """(all, steal) clock ticks of every CPU since boot, from /proc/stat (None where it is not
    readable)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    # user nice system idle iowait irq softirq steal (guest time is counted in user already)
    return sum(fields[:8]), fields[7] if len(fields) > 7 else 0


def steal_percent(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Steal as a percentage of every tick between two readings (None: unknown, or no tick)."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    return round(100.0 * (after[1] - before[1]) / (after[0] - before[0]), 1)
