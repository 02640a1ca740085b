"""The draft gate: which prompt-lookup drafts are worth a verify row (moa_serve/engine/draft_gate.py)."""

import asyncio

import pytest

from moa_serve.drafter.lookup import LookupTable
from moa_serve.engine.draft_gate import AcceptanceStats, DraftGate, VerifyCost
from moa_serve.engine.feature_policy import RecomputedFeatures
from moa_serve.engine.session import Session
from tests.support.service_stubs import (
    FakeDrafter,
    FakeVerifier,
    ScriptedGovernor,
    collect,
    make_service,
    reference,
)


def test_verify_cost_recovers_fixed_per_forward_and_per_row_seconds():
    cost = VerifyCost()
    assert cost.coefficients() is None
    for i in range(60):
        forwards, rows = 1 + i % 4, 1 + (7 * i) % 23
        rows = max(rows, forwards)
        cost.observe(forwards, rows, 0.010 + 0.012 * forwards + 0.005 * rows)
    fixed, per_forward, per_row = cost.coefficients()
    assert fixed == pytest.approx(0.010, abs=2e-4)
    assert per_forward == pytest.approx(0.012, abs=2e-4)
    assert per_row == pytest.approx(0.005, abs=5e-5)
    # a call of 4 sessions x 1 step: (10 + 12 + 4 x 5) ms for 4 tokens
    assert cost.token_seconds(4, 1) == pytest.approx(0.042 / 4, rel=1e-2)


def test_verify_cost_waits_for_enough_calls_and_never_goes_negative():
    cost = VerifyCost(min_calls=8)
    for _ in range(7):
        cost.observe(1, 4, 0.05)
    assert cost.coefficients() is None and cost.row_seconds() is None and cost.token_seconds(4, 1) is None
    cost.observe(1, 4, 0.05)  # no variation at all: the ridge keeps it solvable
    assert all(c >= 0 for c in cost.coefficients())
    for rows in range(1, 40):  # more rows, faster calls (noise): the slope is clamped at 0
        cost.observe(1, rows, 0.05 - 0.0001 * rows)
    assert cost.row_seconds() == 0.0


def test_acceptance_per_match_length_and_per_session():
    acc = AcceptanceStats(prior=0.5)
    assert acc.alpha("a", 3) == 0.5
    for _ in range(20):
        acc.observe("a", 4, drafted=3, accepted=3)  # long matches: always right
        acc.observe("b", 2, drafted=3, accepted=0)  # short matches: always wrong
    assert acc.shared(4) > 0.9 and acc.shared(2) < 0.1
    assert acc.alpha("a", 4) > 0.95 and acc.alpha("b", 2) < 0.05
    # a new session starts from the shared estimate of its match length
    assert acc.alpha("new", 4) == acc.shared(4) and acc.alpha("new", 2) == acc.shared(2)
    # a session's own record moves its estimate away from the shared one, and is forgotten on release
    for _ in range(10):
        acc.observe("c", 4, drafted=2, accepted=0)
    assert acc.alpha("c", 4) < 0.4 < 0.8 < acc.alpha("new", 4)
    acc.release("c")
    assert acc.alpha("c", 4) == acc.alpha("new", 4)


def _gate_with_costs(per_row=0.005, fixed=0.015, per_forward=0.010) -> DraftGate:
    gate = DraftGate(probe_every=4)
    for i in range(60):
        forwards, rows = 1 + i % 4, 4 + i % 19
        gate.observe_call(forwards, rows, fixed + per_forward * forwards + per_row * rows)
    return gate


def test_the_bar_rises_with_the_batch_and_drafts_are_kept_while_they_pay():
    gate = _gate_with_costs()
    b1, b4, b16 = gate.bar(1, 1), gate.bar(4, 1), gate.bar(16, 1)
    assert b1 < b4 < b16 < 1
    assert b1 == pytest.approx(0.005 / 0.030, rel=1e-2)  # one row vs a whole one-session step
    for _ in range(30):
        gate.observe_drafts("good", 4, drafted=3, accepted=3)
        gate.observe_drafts("poor", 2, drafted=3, accepted=1)
    alpha_good, alpha_poor = gate.acceptance.alpha("good", 4), gate.acceptance.alpha("poor", 2)
    assert alpha_good > 0.9 and 0.4 < alpha_poor < 0.6
    # the k-th draft is kept while alpha**k clears the bar
    for bar in (b1, b4, b16):
        expect = lambda a: next((k for k in range(5) if a ** (k + 1) < bar), 5)  # noqa: E731
        assert gate.keep("good", 4, 5, bar) == expect(alpha_good)
        assert gate.keep("poor", 2, 5, bar) == expect(alpha_poor)
    assert gate.keep("poor", 2, 5, b1) > gate.keep("poor", 2, 5, b16)
    assert gate.keep("good", 4, 2, None) == 2  # no cost estimate yet: everything offered
    assert gate.keep("good", 4, 0, b1) == 0


def test_drafts_fill_the_last_row_tile_and_open_another_only_when_they_pay_for_it():
    def gate_with(alphas: dict[str, float]) -> DraftGate:
        gate = DraftGate(row_tile=4)
        for sid, a in alphas.items():  # per-session records only: match lengths left at the prior
            rec = gate.acceptance.record(sid)
            rec.accepted, rec.trials = a * 1e6, 1e6
        return gate

    alphas = {"a": 0.9, "b": 0.6, "c": 0.5}
    offers = [(sid, 3, 4) for sid in alphas]
    # 3 sessions leave one row of their tile free: it goes to the likeliest draft (a's first);
    # the next tile takes a's 2nd-4th and b's 1st (chances .81 + .73 + .66 + .6 >= 4 x .45), and
    # c's one draft (.5) alone cannot pay for a third
    assert gate_with(alphas).keep_round(offers, 3, bar=0.45) == {"a": 4, "b": 1, "c": 0}
    # where keep() leaves only a's .9 and .81, the free row takes the first, the second cannot pay a tile
    assert gate_with(alphas).keep_round(offers, 3, bar=0.8) == {"a": 1, "b": 0, "c": 0}
    # 4 sessions fill their tile: the same two drafts would open a second one, and do not pay for it
    assert gate_with(alphas).keep_round([*offers, ("d", 3, 4)], 4, bar=0.8) == {"a": 0, "b": 0, "c": 0, "d": 0}
    # a drafted session's k-th draft always follows its k-1 first ones, and row_tile 1 is keep()
    kept = gate_with({"a": 0.95, "b": 0.7}).keep_round([("a", 3, 4), ("b", 3, 4)], 2, bar=0.2)
    assert kept == {"a": 4, "b": 2}
    plain = gate_with(alphas)
    plain.row_tile = 1
    assert plain.keep_round(offers, 3, bar=0.45) == {sid: plain.keep(sid, 3, 4, 0.45) for sid in alphas}
    gate = gate_with(alphas)
    gate.keep_round(offers, 3, bar=0.45)
    assert gate.stats["tile_trimmed"] == 1 and gate.stats["kept"] == 5
    with pytest.raises(ValueError):
        DraftGate(row_tile=0)


def test_a_declining_session_probes_one_draft_every_probe_every_offers():
    gate = _gate_with_costs()
    for _ in range(30):
        gate.observe_drafts("s", 2, drafted=3, accepted=0)
    bar = gate.bar(4, 1)
    kept = [gate.keep("s", 2, 3, bar) for _ in range(12)]
    assert kept == [0, 0, 0, 1] * 3  # probe_every=4
    gate.observe_drafts("s", 2, drafted=1, accepted=1)  # a probe's outcome resets the count
    assert [gate.keep("s", 2, 3, bar) for _ in range(4)] == [0, 0, 0, 1]


class _FixedBarGate(DraftGate):
    """A gate whose price of a row is fixed (the service's measurements of a fake verifier's time
    would make the test depend on this machine's timing)."""

    def __init__(self, bar: float):
        super().__init__(probe_every=8)
        self._bar = bar

    def bar(self, sessions, steps):
        return self._bar


def _two_lookup_sessions(max_tokens: int, new_gate=None):
    """Two sessions whose prompts repeat themselves (lookup drafts) run to ``max_tokens`` through a
    service with prompt lookup and its draft gates (``new_gate()``: each group's, instead of the
    measuring one). Returns the fake verifier, the service, the sessions and their outputs."""

    async def main():
        verifier = FakeVerifier()
        svc, _ = make_service(verifier, None, lookup=LookupTable(min_n=1, max_n=3), speculation_governor=True)
        if new_gate is not None:
            for g in svc.groups:
                svc.rounds.gates[g] = new_gate()
        ss = [
            Session(
                f"s{i}",
                [(i * 11 + j) % 97 for j in range(4)] * 2,
                max_tokens,
                num_speculative_tokens=3,
                max_model_len=256,
                drafter_needs_features=False,
            )
            for i in range(2)
        ]
        outs = await asyncio.gather(*(collect(svc, svc.submit(s)) for s in ss))
        await svc.stop()
        return verifier, svc, ss, outs

    return asyncio.run(main())


@pytest.mark.parametrize("bar", [0.6, 0.0])
def test_the_service_stops_verifying_lookup_drafts_that_keep_failing(bar):
    """The fake target's text does not repeat its context, so lookup drafts are nearly always
    wrong: with a bar above their acceptance the gate cuts them down to its probes; with a bar of 0
    (rows free) every one is verified. The text is the target's either way."""

    verifier, svc, ss, outs = _two_lookup_sessions(60, lambda: _FixedBarGate(bar))
    assert [o[0] for o in outs] == [reference(s.prompt, 60) for s in ss] and not verifier.errors
    gate = svc.rounds.gates[svc.groups[0]]
    drafted = sum(1 for _, reqs in verifier.calls for q in reqs if q.drafts)
    if bar == 0.0:
        assert gate.stats["kept"] == gate.stats["offered"] > 0 and gate.stats["probes"] == 0
    else:
        offers = gate.stats["offered"]
        assert gate.stats["probes"] > 0 and gate.stats["kept"] < offers / 4
        assert drafted <= 2 * 3 + gate.stats["probes"]  # the first rounds at the prior, then probes only
    assert "acceptance_by_match" in svc.draft_gate_snapshot()[str(svc.groups[0])]


def test_the_gate_prices_rows_from_calls_without_a_prompt_in_them():
    """A call that prefills a prompt has rows that need no logits (all but the last): it would
    price a verify row below its cost. The gate's fit sees every call but those (the calls that
    carried a whole prompt)."""
    verifier, svc, ss, outs = _two_lookup_sessions(24)
    assert [o[0] for o in outs] == [reference(s.prompt, 24) for s in ss] and not verifier.errors
    prompt_calls = sum(1 for _, reqs in verifier.calls if any(q.base == 0 and len(q.tokens) > 1 for q in reqs))
    assert prompt_calls >= 1
    assert svc.rounds.gates[svc.groups[0]].cost.calls == len(verifier.calls) - prompt_calls


@pytest.mark.parametrize("pool_on", [False, True])
def test_a_hybrid_drafts_by_lookup_whatever_the_governor_decides_for_its_pool(pool_on):
    """``hybrid``: prompt lookup in front of a drafter pool. The governor rules the pool's drafts
    only: with the pool off, lookup drafts are still verified, in multi-step calls that ask for no
    drafter features, the pool is never called and the governor sees plain rounds; with it on, the
    pool drafts where lookup has nothing and those rounds are single steps with features."""

    async def main():
        verifier, drafter = FakeVerifier(), FakeDrafter()
        svc, _ = make_service(
            verifier,
            drafter,
            lookup=LookupTable(min_n=1, max_n=3),
            speculation_governor=True,
            features=RecomputedFeatures(),
            decode_steps=4,
        )
        governor = ScriptedGovernor(on_rounds=range(1, 1000) if pool_on else ())
        for g in svc.groups:
            svc.rounds.gates[g] = _FixedBarGate(0.0)  # every lookup draft is verified
            svc.rounds.governors[g] = governor
        # pool off: every token recurs in the prompt (a lookup draft each round); on: few recur
        prompt = list(range(97)) if not pool_on else list(range(0, 60, 5))
        s = Session("s0", prompt, 40, num_speculative_tokens=3, max_model_len=256)
        toks, _ = await collect(svc, svc.submit(s))
        await svc.stop()
        return verifier, drafter, governor, s, toks

    verifier, drafter, governor, s, toks = asyncio.run(main())
    assert toks == reference(s.prompt, 40) and not verifier.errors and not drafter.errors
    requests = [q for _, reqs in verifier.calls for q in reqs]
    if not pool_on:
        assert not drafter.calls and not any(governor.observed)
        lookup = [q for q in requests if q.drafts]
        assert lookup and all(q.decode_steps > 1 and not q.want_features for q in lookup)
    else:
        assert drafter.calls and any(governor.observed)
        pooled = {len(q.tokens) + q.base for _, reqs in drafter.calls for q in reqs}  # lengths the pool drafted at
        drafted_by_pool = [q for q in requests if q.drafts and q.base + len(q.tokens) in pooled]
        assert drafted_by_pool and all(q.decode_steps == 1 and q.want_features for q in drafted_by_pool)
