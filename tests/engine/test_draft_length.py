"""DraftLength: a verifier step's draft length from the measured cost of a row, of a draft step
and the drafter's acceptance."""

import random

import pytest

from moa_serve.engine.draft_length import DraftLength, expected_tokens


def teach(length: DraftLength, fixed: float, per_row: float, draft_step: float, alpha: float, k: int) -> None:
    """Steps of 1 to 4 requests, drafting k or not (as the governor's probes alternate), whose
    seconds follow fixed + per_row x rows exactly, and whose drafts are accepted one by one with
    probability alpha."""
    rng = random.Random(0)
    for i in range(200):
        n = 1 + i % 4
        rows = n * (1 + k) if i % 3 else n
        length.observe_step(rows, fixed + per_row * rows)
        if i % 3:
            length.observe_call(k, draft_step * k)
            for _ in range(n):
                accepted = 0
                while accepted < k and rng.random() < alpha:
                    accepted += 1
                length.observe_drafts(k, accepted)


def test_the_longest_length_until_both_costs_are_measured():
    length = DraftLength(4)
    assert length.choose(1) == 4
    length.observe_step(1, 0.04)
    length.observe_step(5, 0.06)
    assert length.choose(1) == 4  # the verify fit needs more steps, the draft call is unknown
    with pytest.raises(ValueError):
        DraftLength(0)


def test_a_costly_row_and_a_weak_drafter_draft_one_a_cheap_row_and_a_good_drafter_draft_all():
    cpu = DraftLength(4)  # a row costs a sixth of a one-row step, one draft in three is accepted
    teach(cpu, fixed=0.032, per_row=0.006, draft_step=0.002, alpha=0.33, k=4)
    assert 0.25 < cpu.alpha < 0.42
    assert cpu.choose(1) == 1
    gpu = DraftLength(4)  # a row is nearly free, four drafts in five are accepted
    teach(gpu, fixed=0.007, per_row=0.00002, draft_step=0.0005, alpha=0.8, k=4)
    assert gpu.choose(1) == 4
    # the same drafter where a row costs more: the longest length pays at one request, not at 16
    mid = DraftLength(4)
    teach(mid, fixed=0.007, per_row=0.0008, draft_step=0.0005, alpha=0.8, k=4)
    assert mid.choose(1) == 4 and mid.choose(16) < 4


def test_the_rate_is_the_models():
    length = DraftLength(3)
    teach(length, fixed=0.03, per_row=0.005, draft_step=0.002, alpha=0.5, k=3)
    fixed, per_forward, per_row = length.cost.coefficients()
    assert fixed + per_forward == pytest.approx(0.03, rel=0.05) and per_row == pytest.approx(0.005, rel=0.05)
    for n, k in ((1, 1), (2, 3)):
        seconds = fixed + per_forward + per_row * n * (1 + k) + length.draft_step_s * k
        assert length.tokens_per_second(n, k) == pytest.approx(n * expected_tokens(length.alpha, k) / seconds)
    assert expected_tokens(0.0, 3) == 1.0 and expected_tokens(1.0, 3) == 4.0
    assert set(length.snapshot()) == {"alpha", "draft_step_ms", "verify_cost"}
