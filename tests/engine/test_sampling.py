"""Speculative sampling follows the target's (warped) distribution exactly: checked against
exact probabilities with a bound derived from the sample size, with a negative control."""

import argparse
import math

import pytest
import torch
from pydantic import ValidationError

from moa_serve.cli_args import CLIError, sampling_params
from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.model.kv_cache import PackedBatch
from moa_serve.sampling import SAMPLING_EPS, SEED_MAX, TEMPERATURE_MAX, SamplingParams, sample, warp_probs
from moa_serve.verifier.acceptance import accept_sampling


def tv_bound(p: torch.Tensor, n: int, sigmas: float = 4.0) -> float:
    """An upper bound (about `sigmas` standard deviations) on the total-variation distance
    between an empirical distribution of n samples and its true distribution p."""
    return 0.5 * sigmas * float(torch.sqrt(p * (1 - p) / n).sum()) + 0.5 * len(p) / n


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def test_rejection_sampling_first_token_follows_target():
    gen = torch.Generator().manual_seed(0)
    vocab, k, n = 8, 3, 20000
    p = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(k, vocab, generator=gen) * 2, -1)
    counts = torch.zeros(vocab)
    accepted_all = 0
    for _ in range(n):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
        n_acc, nxt = accept_sampling(p, q, drafts, gen)
        first = drafts[0] if n_acc > 0 else nxt
        counts[first] += 1
        accepted_all += n_acc == k
    freq = counts / n
    assert tv(freq, p[0]) < tv_bound(p[0], n)
    # negative control: keeping every draft would follow q, which the bound tells apart
    assert tv(q[0], p[0]) > 3 * tv_bound(p[0], n)
    assert 0 < accepted_all < n


def test_top_k_top_p_warping():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    pk = warp_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (pk[0, 2:] == 0).all() and abs(float(pk.sum()) - 1) < 1e-6
    full = torch.softmax(logits, -1)[0]
    pp = warp_probs(logits, SamplingParams(temperature=1.0, top_p=float(full[0] + 1e-3)))
    assert (pp[0, 2:] == 0).all() and pp[0, 1] > 0  # smallest prefix reaching top_p
    pp1 = warp_probs(logits, SamplingParams(temperature=1.0, top_p=float(full[0] * 0.5)))
    assert pp1[0, 0] == 1.0


def exact_two_token_distribution(engine, prompt, params):
    """P(t1, t2 | prompt) from the target alone, by enumeration (vocabulary of 16)."""
    model = engine.verifier.model
    vocab = model.arch.vocab_size
    cache = model.new_cache(1, 64)
    slot = cache.allocate()

    def probs(tokens):
        h = model.forward_packed(torch.tensor(tokens), PackedBatch(cache, [slot], [0], [len(tokens)]))
        return warp_probs(model.lm_head(h[-1:]), params)[0]

    with torch.no_grad():
        p1 = probs(prompt)
        joint = torch.zeros(vocab, vocab)
        for a in range(vocab):
            joint[a] = p1[a] * probs(prompt + [a])
    return joint.flatten()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
    ],
)
def test_engine_sampling_matches_target_distribution(tiny_model, params):
    from moa_serve.drafter.checkpoint import init_drafter

    drafter = init_drafter(str(tiny_model), tiny_model / f"drafter-{params.top_k}", seed=3)
    spec = SpeculativeEngine.load(str(tiny_model), str(drafter), "float32", max_sessions=16)
    prompt = [1, 5, 9]
    exact = exact_two_token_distribution(spec, prompt, params)
    n = 1500
    counts = torch.zeros(16 * 16)
    sessions = [
        spec.new_session(prompt, 3, params.model_copy(update={"seed": i}), 3, ignore_eos=True) for i in range(n)
    ]
    taus = []
    for res in spec.generate_sessions(sessions):
        counts[res.token_ids[0] * 16 + res.token_ids[1]] += 1
        taus.append(res.mean_accepted_length)
    assert tv(counts / n, exact) < tv_bound(exact, n)
    assert max(taus) > 1.0  # drafts were accepted, so the rejection path was exercised both ways


def test_seeded_sampling_is_reproducible(stories_path, stories_drafter):
    spec = SpeculativeEngine.load(str(stories_path), str(stories_drafter), "float32", max_sessions=2)
    prompt = spec.tokenizer.encode("Once upon a time")
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
    a = spec.generate([prompt], 20, params)[0].token_ids
    b = spec.generate([prompt], 20, params)[0].token_ids
    c = spec.generate([prompt], 20, params.model_copy(update={"seed": 99}))[0].token_ids
    assert a == b and a != c


# ---------------------------------------------------------------------- values the sampler cannot run
NON_FINITE = (math.nan, math.inf, -math.inf)
DENORMALS = (2.225073858507e-311, 5e-324)


@pytest.mark.parametrize("value", NON_FINITE + (1.7976931348623157e308, -5e-324, -1.0))
@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_a_float_parameter_the_sampler_cannot_run_is_refused_naming_it(field, value):
    with pytest.raises(ValidationError) as err:
        SamplingParams(**{field: value})
    assert err.value.errors()[0]["loc"] == (field,)
    args = argparse.Namespace(temperature=0.0, top_p=1.0, top_k=0, seed=None)
    setattr(args, field, value)
    with pytest.raises(CLIError, match=f"--{field.replace('_', '-')}"):
        sampling_params(args)  # the CLIs refuse what the HTTP routes refuse


@pytest.mark.parametrize("temperature", DENORMALS + (1e-30, 1e-38, SAMPLING_EPS / 2))
def test_a_temperature_below_the_epsilon_is_greedy(temperature):
    params = SamplingParams(temperature=temperature, top_p=0.5, seed=3)
    assert params.greedy and params.temperature == 0.0
    at_eps = SamplingParams(temperature=SAMPLING_EPS)
    assert not at_eps.greedy and at_eps.temperature == SAMPLING_EPS


def test_integer_parameters_at_their_bounds():
    assert SamplingParams(seed=SEED_MAX, top_k=10**30).seed == SEED_MAX
    for field, value in (("seed", SEED_MAX + 1), ("seed", -1), ("top_k", -1)):
        with pytest.raises(ValidationError) as err:
            SamplingParams(**{field: value})
        assert err.value.errors()[0]["loc"] == (field,)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=SAMPLING_EPS),
        SamplingParams(temperature=TEMPERATURE_MAX),
        SamplingParams(temperature=1.0, top_p=DENORMALS[0]),
        SamplingParams(temperature=1.0, top_p=DENORMALS[1]),
        SamplingParams(temperature=SAMPLING_EPS, top_p=DENORMALS[1], top_k=1),
        SamplingParams(temperature=TEMPERATURE_MAX, top_k=10**30),
    ],
    ids=["eps", "max", "top_p-denormal", "top_p-min", "all-edges", "top_k-huge"],
)
def test_every_accepted_parameter_warps_to_a_distribution_the_sampler_draws_from(params):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen) * 30
    probs = warp_probs(logits, params)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert torch.allclose(probs.sum(-1), torch.ones(4))
    for row in probs:
        sample(row, gen)
    if params.top_p < 1e-300:  # a top_p that float32 rounds to 0: the most likely token alone
        assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and bool((probs.max(-1).values == 1).all())
