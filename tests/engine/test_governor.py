"""The speculation governor keeps the faster mode per batch size and keeps probing the other."""

import pytest

from moa_serve.engine.governor import SpeculationGovernor


def drive(gov: SpeculationGovernor, sessions: int, on_ms: float, off_ms: float, rounds: int) -> list[bool]:
    """Rounds committing one token per session in either mode, ``on_ms``/``off_ms`` per token."""
    modes = []
    for _ in range(rounds):
        on = gov.speculate(sessions)
        modes.append(on)
        gov.observe(sessions, on, (on_ms if on else off_ms) / 1e3 * sessions, sessions)
    return modes


def test_prefers_speculation_where_it_pays_and_plain_decoding_where_it_does_not():
    gov = SpeculationGovernor(probe_every=10)
    small = drive(gov, 1, on_ms=40, off_ms=60, rounds=300)
    large = drive(gov, 16, on_ms=90, off_ms=60, rounds=300)
    assert sum(small[100:]) >= 0.9 * 200  # mostly on, with a probe of the other mode now and then
    assert sum(large[100:]) <= 0.1 * 200
    assert 0 < sum(not m for m in small[100:]) and 0 < sum(large[100:])  # it keeps probing both ways


def _drive_random(gov, rounds, on_s, on_tokens, off_s, seed=0):
    """Rounds whose committed tokens vary: speculating, ``on_tokens`` is a list of (probability,
    tokens); plain decoding commits one token."""
    import random

    rng = random.Random(seed)
    modes = []
    for _ in range(rounds):
        on = gov.speculate(1)
        modes.append(on)
        if on:
            x, tokens = rng.random(), on_tokens[-1][1]
            for prob, n in on_tokens:
                if x < prob:
                    tokens = n
                    break
                x -= prob
            gov.observe(1, True, on_s, tokens)
        else:
            gov.observe(1, False, off_s, 1)
    return modes


def test_a_weak_drafter_that_pays_on_average_is_kept_though_most_rounds_lose():
    """τ ≈ 1.6 from rounds that mostly accept nothing: 80 % of speculative rounds are slower than a
    plain one, yet speculation costs 6.25 ms per token against 8. Probes of one round lost four
    times in five and backed off (the vLLM backend drafted in 19 of 403 steps where drafting every
    step was 1.1x faster); probes of several rounds, and seconds / tokens as a ratio of averages,
    see the mean."""
    gov = SpeculationGovernor(probe_every=12)
    modes = _drive_random(gov, 600, on_s=0.010, on_tokens=[(0.8, 1), (0.2, 4)], off_s=0.008)
    assert sum(modes[100:]) >= 0.75 * 500
    snap = gov.snapshot()["1"]
    assert snap["on_ms_per_token"] < snap["off_ms_per_token"]


def test_a_weak_drafter_that_does_not_pay_is_declined_though_some_rounds_win():
    gov = SpeculationGovernor(probe_every=12)
    modes = _drive_random(gov, 600, on_s=0.010, on_tokens=[(0.9, 1), (0.1, 2)], off_s=0.008)
    assert sum(modes[100:]) <= 0.2 * 500  # 9.1 ms per token against 8: plain decoding


def test_follows_a_change_in_which_mode_is_faster():
    gov = SpeculationGovernor(probe_every=5, probe_rounds=4)
    drive(gov, 4, on_ms=40, off_ms=60, rounds=50)
    later = drive(gov, 4, on_ms=80, off_ms=60, rounds=60)
    assert sum(later[-20:]) <= 4  # at most one probe of speculation


def test_batch_sizes_share_power_of_two_buckets():
    assert [SpeculationGovernor.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 4, 4, 8, 8, 16, 64]
    with pytest.raises(ValueError):
        SpeculationGovernor(probe_every=1)


def test_rounds_that_prefill_a_prompt_do_not_count_against_plain_decoding():
    """The first round of every request prefills its prompt without drafts (no features yet):
    timing it as a plain-decoding round made plain decoding look 4x slower than it is."""
    import asyncio

    from moa_serve.engine.options import RoundOptions
    from moa_serve.engine.pool_calls import Pools
    from moa_serve.engine.round_service import RoundService
    from moa_serve.engine.session import Session
    from moa_serve.protocol import DraftResult, VerifyResult

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
        svc = RoundService(Pools(verify, draft, release), RoundOptions(speculation_governor=True))
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
    gov = SpeculationGovernor(probe_every=10, max_probe_every=80, probe_rounds=4, short_probe_rounds=4)
    modes = drive(gov, 1, on_ms=100, off_ms=60, rounds=600)
    assert modes[:8] == [True] * 4 + [False] * 4  # each mode measured first, speculation first
    starts = [i for i in range(8, len(modes)) if modes[i] and not modes[i - 1]]  # probes of speculation
    assert all(modes[i : i + 4] == [True] * 4 and not modes[i + 4] for i in starts)  # 4 rounds each
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    # the interval between probe starts: 10, 20, 40, 80, 80 ... rounds, plus the 4 rounds of a probe, minus
    # the one that starts it
    assert gaps == sorted(gaps) and gaps[0] <= 20 + 3 and gaps[-1] == 80 + 3
    assert len(starts) <= 12  # instead of ~45 at a fixed interval of 10
    # speculation becomes the faster mode: the next probe finds it and it takes over
    later = drive(gov, 1, on_ms=30, off_ms=60, rounds=200)
    assert sum(later[-50:]) >= 45


def test_once_tau_is_known_a_batch_size_where_drafting_does_not_pay_costs_short_rare_probes():
    """τ is the drafter's (one estimate for every batch size); a bucket's round time varies
    little. At 1 session speculation pays (τ 1.6 from rounds of 1 or 4 tokens); at 16 it costs 3x
    a plain round per round, so it loses at any τ below 3. There, after the first probe, probes
    last ``short_probe_rounds`` rounds and their interval grows to ``max_probe_every``: ~1 % of
    the rounds speculate instead of the 8-round probes every <= 192 rounds (> 4 %) of before."""
    gov = SpeculationGovernor(probe_every=12, probe_rounds=8, short_probe_rounds=2, max_probe_every=768)
    small, drafted = [], 0
    for _ in range(400):
        on = gov.speculate(1)
        small.append(on)
        drafted += on
        gov.observe(1, on, 0.010 if on else 0.008, (4 if drafted % 5 == 0 else 1) if on else 1)
    assert sum(small[100:]) >= 0.75 * 300 and abs(gov.tau - 1.6) < 0.5
    large = drive(gov, 16, on_ms=3 * 60 / 1.6, off_ms=60, rounds=3000)
    starts = [i for i in range(1, len(large)) if large[i] and not large[i - 1]]
    assert all(large[i : i + 3] == [True, True, False] for i in starts[1:])  # short probes
    assert sum(large[500:]) <= 0.015 * 2500
    assert sum(large[-1000:]) <= 6  # at most 3 probes of 2 rounds once the interval is 768


def test_a_larger_batch_inherits_plain_decoding_from_a_smaller_one_that_found_speculation_slower():
    """At 4 sessions speculation lost clearly (plain decoding in force, probes backed off): the
    first rounds at 16 sessions run plain, with that probe interval, instead of measuring
    speculation first; a probe still comes, and a speculation that wins there takes over."""
    gov = SpeculationGovernor(probe_every=12, max_probe_every=768)
    drive(gov, 4, on_ms=100, off_ms=60, rounds=400)
    interval = gov._buckets[4].interval
    assert gov._buckets[4].current is False and interval > 12
    assert not gov.next_speculates(16)
    large = drive(gov, 16, on_ms=100, off_ms=60, rounds=interval - 2)
    assert not any(large)
    later = drive(gov, 16, on_ms=30, off_ms=60, rounds=interval + 200)  # speculation now wins at 16
    assert sum(later[-50:]) >= 45
    # a batch size above one where speculation pays still measures speculation first
    gov2 = SpeculationGovernor(probe_every=12)
    drive(gov2, 1, on_ms=40, off_ms=60, rounds=100)
    assert drive(gov2, 2, on_ms=40, off_ms=60, rounds=1) == [True]


def test_a_clear_loss_is_probed_briefly_before_tau_is_settled():
    """A drafter three times slower per token than plain decoding (the MoA pool at one user on a
    CPU): once both modes are measured, every later probe is short although τ rests on only the
    first probe's rounds — no error of a young τ turns a 3x verdict — so learning costs the
    first probe and a few two-round ones, not four long probes."""
    gov = SpeculationGovernor(probe_every=12, probe_rounds=8, short_probe_rounds=2)
    modes = drive(gov, 1, on_ms=30, off_ms=10, rounds=600)
    assert modes[:16] == [True] * 8 + [False] * 8  # each mode measured first
    starts = [i for i in range(16, len(modes)) if modes[i] and not modes[i - 1]]
    assert starts and all(modes[i : i + 3] == [True, True, False] for i in starts)
    # a loss by more than clear_ratio backs off fourfold: probes 12, 48, 192 rounds apart, then 768
    assert sum(modes) <= 8 + 2 * 3  # the first probe, then three short ones within 600 rounds
    # a close race still gets long probes until τ is settled
    close = SpeculationGovernor(probe_every=12, probe_rounds=8, short_probe_rounds=2)
    near = drive(close, 1, on_ms=11, off_ms=10, rounds=200)
    later = [i for i in range(16, len(near)) if near[i] and not near[i - 1]]
    assert later and near[later[0] : later[0] + 8] == [True] * 8


def drive_priced(
    gov: SpeculationGovernor,
    sessions: int,
    cap: int,
    off_ms: float,
    on_round_ms: float,
    on_tokens: float,
    draft_ms: float,
    rounds: int,
) -> list[bool]:
    """Rounds of ``sessions`` sessions under a draft cap: plain ones commit a token per session at
    ``off_ms`` per token; speculative ones take ``on_round_ms`` (``draft_ms`` of it the draft
    call) and commit ``on_tokens`` per session."""
    modes = []
    for _ in range(rounds):
        on = gov.speculate(sessions, cap)
        modes.append(on)
        if on:
            gov.observe(sessions, True, on_round_ms / 1e3, round(on_tokens * sessions), draft_ms / 1e3)
        else:
            gov.observe(sessions, False, off_ms / 1e3 * sessions, sessions)
    return modes


def test_a_probe_that_cannot_pay_is_priced_out_and_priced_again_when_due():
    """τ 1.5 and a 30 ms draft call, learnt at two sessions where speculation pays. At 8 sessions
    with a cap of one draft, a plain round costs 4 ms per token; speculation's best case, one
    plain step (32 ms) + the draft call for 1.5 tokens per session, is 62 / 12 = 5.2 ms, slower
    by more than the margin. The bucket measures plain decoding, then never speculates: no probe
    rounds, and none of the features a probe would have asked the verifier for. With a 2 ms
    draft call (34 / 12 = 2.8 ms) the next due probe runs."""
    gov = SpeculationGovernor(probe_every=12, max_probe_every=768)
    small = drive_priced(gov, 2, cap=7, off_ms=20, on_round_ms=40, on_tokens=1.5, draft_ms=30, rounds=200)
    assert sum(small[100:]) >= 90 and gov.tau == pytest.approx(1.5) and gov.snapshot()["draft_ms"] == 30.0
    for _ in range(300):
        assert not gov.next_speculates(8, 1)
        assert not drive_priced(gov, 8, cap=1, off_ms=4, on_round_ms=60, on_tokens=2, draft_ms=30, rounds=1)[0]
    snap = gov.snapshot()["8"]
    assert snap["on_ms_per_token"] is None and snap["off_ms_per_token"] == 4.0
    assert snap["probes_priced_out"] == 4  # when first due, then after 24, 48, 96 rounds: priced again when due
    drive_priced(gov, 2, cap=7, off_ms=20, on_round_ms=12, on_tokens=1.5, draft_ms=2, rounds=100)
    later = drive_priced(gov, 8, cap=1, off_ms=4, on_round_ms=20, on_tokens=2, draft_ms=2, rounds=200)
    assert any(later)


def test_a_young_tau_prices_nothing_and_the_longest_interval_probes_anyway():
    """A warm-up's few speculative rounds that accepted nothing (τ 1) must not price speculation
    out where it pays: until τ rests on 4 x probe_rounds rounds, probes run and measure. And a
    bucket priced out for good still probes once its interval is the longest, so that τ follows
    a drafter that now accepts more."""
    gov = SpeculationGovernor(probe_every=12, max_probe_every=96)
    drive_priced(gov, 2, cap=7, off_ms=20, on_round_ms=45, on_tokens=1.0, draft_ms=10, rounds=8)  # a warm-up
    assert gov.tau == pytest.approx(1.0)
    one = drive_priced(gov, 1, cap=7, off_ms=30, on_round_ms=40, on_tokens=2.0, draft_ms=10, rounds=300)
    assert sum(one[100:]) >= 180  # speculation found faster (two tokens per round) and kept
    gov = SpeculationGovernor(probe_every=12, max_probe_every=96)
    drive_priced(gov, 2, cap=7, off_ms=20, on_round_ms=40, on_tokens=1.5, draft_ms=30, rounds=200)
    modes = drive_priced(gov, 8, cap=1, off_ms=4, on_round_ms=100, on_tokens=2, draft_ms=30, rounds=600)
    assert gov.snapshot()["8"]["probes_priced_out"] == 3  # when first due, after 24 and 48 rounds
    assert 0 < sum(modes) <= 6 * 2  # then short probes at the longest interval (96 rounds) only


def test_without_a_draft_time_probes_are_not_priced():
    """Callers that do not report the draft call (a device's drafts) keep the measured probes."""
    gov = SpeculationGovernor(probe_every=12)
    drive(gov, 1, on_ms=40, off_ms=60, rounds=50)
    assert drive(gov, 8, on_ms=100, off_ms=60, rounds=1) == [True]  # speculation measured first, as before
