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


def test_rounds_that_prefill_a_prompt_do_not_count_against_plain_decoding():
    """The first round of every request prefills its prompt without drafts (no features yet):
    timing it as a plain-decoding round made plain decoding look 4x slower than it is."""
    import asyncio

    from moa_serve.drafter.proposer import DraftResult
    from moa_serve.engine.service import RoundService
    from moa_serve.engine.session import Session
    from moa_serve.verifier.api import VerifyResult

    async def verify(group, reqs):
        out = []
        for r in reqs:
            prefill = r.base == 0
            await asyncio.sleep(0.05 if prefill else 0.002)
            out.append(VerifyResult(r.session_id, [7], 0, 0, None, num_computed=len(r.tokens) + len(r.drafts)))
        return out

    async def draft(group, reqs):
        await asyncio.sleep(0.001)
        return [DraftResult(r.session_id, [1] * r.num_drafts) for r in reqs]

    async def release(group, ids):
        pass

    async def main():
        svc = RoundService(verify, draft, release, speculation_governor=True)
        for i in range(3):
            t = svc.submit(Session(f"s{i}", list(range(40)), 4, num_speculative_tokens=2))
            async for _ in svc.stream(t):
                pass
        snap = svc.governor_snapshot()["0"]["1"]
        await svc.stop()
        return snap

    snap = asyncio.run(main())
    assert snap["off_ms_per_token"] < 10  # decode rounds take ~2 ms; the 50 ms prefills are not counted


def test_a_mode_that_keeps_losing_is_probed_less_and_less_often():
    gov = SpeculationGovernor(probe_every=10, max_probe_every=80)
    modes = drive(gov, 1, on_ms=100, off_ms=60, rounds=400)
    probes = [i for i, m in enumerate(modes) if m][1:]  # round 0 measures speculation first
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[0] <= 20 and gaps[-1] == 80  # 10, 20, 40, 80, 80, ...
    assert len(probes) <= 10  # instead of ~40 at a fixed interval of 10
    # speculation becomes the faster mode: the next probe finds it and it takes over
    later = drive(gov, 1, on_ms=30, off_ms=60, rounds=200)
    assert sum(later[-50:]) >= 45
