"""The speculation governor keeps the faster mode per batch size and keeps probing the other."""

import pytest

from moa_serve.engine.governor import SpeculationGovernor


def drive(gov: SpeculationGovernor, sessions: int, on_ms: float, off_ms: float, rounds: int) -> list[bool]:
    modes = []
    for _ in range(rounds):
        on = gov.speculate(sessions)
        modes.append(on)
        gov.observe(sessions, on, (on_ms if on else off_ms) / 1e3 * 10, 10)
    return modes


def test_prefers_speculation_where_it_pays_and_plain_decoding_where_it_does_not():
    gov = SpeculationGovernor(probe_every=10)
    small = drive(gov, 1, on_ms=40, off_ms=60, rounds=100)
    large = drive(gov, 16, on_ms=90, off_ms=60, rounds=100)
    assert sum(small[2:]) >= 0.85 * 98  # mostly on, with a probe of the other mode now and then
    assert sum(large[2:]) <= 0.15 * 98
    assert 0 < sum(not m for m in small[2:]) and 0 < sum(large[2:])  # it keeps probing both ways


def test_follows_a_change_in_which_mode_is_faster():
    gov = SpeculationGovernor(probe_every=5)
    drive(gov, 4, on_ms=40, off_ms=60, rounds=50)
    later = drive(gov, 4, on_ms=80, off_ms=60, rounds=60)
    assert sum(later[-20:]) <= 4


def test_batch_sizes_share_power_of_two_buckets():
    assert [SpeculationGovernor.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 4, 4, 8, 8, 16, 64]
    with pytest.raises(ValueError):
        SpeculationGovernor(probe_every=1)
