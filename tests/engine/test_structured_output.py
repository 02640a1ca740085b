"""Structured output: the target's logits are masked by the grammar at every verified position and a
draft the grammar forbids ends the draft there, so the output is exactly grammar-constrained plain
decoding, with or without a drafter; the replies parse and validate against their schemas."""

import json
import re

import jsonschema
import pytest

from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.grammar import GrammarSpec, GrammarViolation, check
from moa_serve.protocol import VerifyRequest
from moa_serve.sampling import SamplingParams
from tests.support.oracles import NoisyOracle

PROMPTS = ["Once upon a time", "The little dog", "Lily went to the park and"]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "happy": {"type": "boolean"},
        "mood": {"enum": ["glad", "sad", "calm"]},
    },
    "required": ["name", "age", "happy", "mood"],
    "additionalProperties": False,
}
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def engines(stories_path):
    """The target alone (``drafter: null``) and its prompts."""
    plain = SpeculativeEngine.load(str(stories_path), None, "float32", max_sessions=8)
    return plain, [plain.tokenizer.encode(p) for p in PROMPTS]


def drafting(plain, prompts, refs, error_rate) -> SpeculativeEngine:
    """The same target with drafts of ``refs`` (a share ``error_rate`` of them wrong)."""
    oracle = NoisyOracle(prompts, refs, error_rate)
    return SpeculativeEngine(plain.verifier, oracle, plain.tokenizer, plain.stop_ids, max_batch=4)


@pytest.fixture(scope="module")
def constrained_reference(engines):
    """Grammar-constrained plain decoding (no drafter) of every prompt."""
    plain, prompts = engines
    return plain.generate(prompts, NEW_TOKENS, grammar=GrammarSpec.json_schema(PERSON))


def test_replies_parse_and_validate_against_the_schema(constrained_reference):
    for out in constrained_reference:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)


@pytest.mark.parametrize("error_rate", [0.0, 0.3])
def test_drafts_give_the_tokens_of_constrained_plain_decoding(engines, constrained_reference, error_rate):
    plain, prompts = engines
    ref = [o.token_ids for o in constrained_reference]
    engine = drafting(plain, prompts, ref, error_rate)  # wrong drafts are mostly tokens the grammar forbids
    outs = engine.generate(prompts, NEW_TOKENS, num_speculative_tokens=4, grammar=GrammarSpec.json_schema(PERSON))
    assert [o.token_ids for o in outs] == ref
    if error_rate == 0.0:
        assert min(o.mean_accepted_length for o in outs) > 3.0


def test_tree_alternatives_are_dropped_for_a_constrained_session(engines, constrained_reference):
    plain, prompts = engines
    grammar, prompt, ref = GrammarSpec.json_schema(PERSON), prompts[0], constrained_reference[0].token_ids
    req = VerifyRequest(
        "tree", prompt + ref[:4], [ref[4], 0], want_features=False, grammar=grammar, grammar_start=len(prompt)
    )
    req.alternatives = [[ref[4] + 1], [ref[5]]]
    out = plain.verifier.verify([req])[0]
    plain.verifier.release("tree")
    assert out.tokens == ref[4:6] and out.num_accepted == 1


CHOICES = ["yes", "no", "maybe so"]
REGEX = r"[A-Z][a-z]{1,6}( [a-z]{1,6}){0,2}\."


@pytest.mark.parametrize(
    "grammar, ok",
    [
        (GrammarSpec("regex", REGEX), lambda t: re.fullmatch(REGEX, t)),
        (GrammarSpec.choice(CHOICES), lambda t: t in CHOICES),
        (GrammarSpec("json_object"), lambda t: isinstance(json.loads(t), dict)),
    ],
)
def test_sampled_speculative_replies_follow_regex_choice_and_json_object(engines, constrained_reference, grammar, ok):
    plain, prompts = engines
    engine = drafting(plain, prompts[:2], [o.token_ids for o in constrained_reference[:2]], 0.3)
    outs = engine.generate(prompts[:2], 40, sampling=SamplingParams(temperature=0.7, seed=7), grammar=grammar)
    for out in outs:
        assert out.text.startswith("{") if grammar.kind == "json_object" else out.finish_reason == "stop"
        assert out.finish_reason == "length" or ok(out.text), (grammar.kind, out.text)


def test_seeded_sampling_under_a_grammar_is_reproducible(engines):
    plain, prompts = engines
    hot = SamplingParams(temperature=0.8, seed=3)
    grammar = GrammarSpec.json_schema(PERSON)
    a = plain.generate(prompts[:1], NEW_TOKENS, sampling=hot, grammar=grammar)
    b = plain.generate(prompts[:1], NEW_TOKENS, sampling=hot, grammar=grammar)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for out in a:
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), PERSON)


def test_a_replica_that_gets_the_session_afresh_rebuilds_the_matcher(engines, constrained_reference):
    """The verifier loses the session halfway (a new replica): the whole committed list comes again
    and its matcher is rebuilt from it; the next token is the one constrained decoding gives."""
    plain, prompts = engines
    verifier = plain.verifier
    grammar = GrammarSpec.json_schema(PERSON)
    prompt, ref = prompts[0], constrained_reference[0].token_ids
    half = prompt + ref[:10]
    verifier.release("fresh")
    out = verifier.verify(
        [VerifyRequest("fresh", half, want_features=False, grammar=grammar, grammar_start=len(prompt))]
    )
    assert out[0].tokens == [ref[10]]
    # the Router's truth differs from the replica's copy (rolled back two tokens): the matcher follows
    out = verifier.verify(
        [VerifyRequest("fresh", half[:-2], want_features=False, grammar=grammar, grammar_start=len(prompt))]
    )
    assert out[0].tokens == [ref[8]]
    verifier.release("fresh")
    with pytest.raises(GrammarViolation):
        verifier.verify(
            [
                VerifyRequest(
                    "bad", prompt + prompt[1:3], want_features=False, grammar=grammar, grammar_start=len(prompt)
                )
            ]
        )
    verifier.release("bad")


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec.json_schema({"type": "frobnicate"}),
        GrammarSpec("regex", "([a-"),
        GrammarSpec("choice", "[]"),
    ],
)
def test_a_grammar_the_engine_cannot_compile_says_why(spec):
    with pytest.raises(ValueError, match="cannot compile"):
        check(spec)


def test_a_constrained_and_a_free_session_share_a_forward(engines, constrained_reference):
    """One verify call holds a session under a schema and one without: each gets the tokens it
    gets alone (the free one's logits rows are not masked)."""
    plain, prompts = engines
    free = plain.generate(prompts[1:2], 8)[0].token_ids
    mixed = plain.generate_sessions(
        [
            plain.new_session(prompts[0], NEW_TOKENS, grammar=GrammarSpec.json_schema(PERSON)),
            plain.new_session(prompts[1], 8),
        ]
    )
    assert [o.token_ids for o in mixed] == [constrained_reference[0].token_ids, free]
