"""Structured output on SmolLM2-135M-Instruct, in one process (the round service with local pools):

1. ``--replies N`` chat replies over a few JSON schemas, with the MoA drafter and without one
   (``drafter: null``): every reply must parse and validate against its schema, and the two runs
   must give the same tokens.
2. the grammar's cost: tokens per second of the target alone, the same prompts with a schema and
   without one (``ignore_eos``, so both decode ``--tokens`` each), alternated A/B/A/B at each number
   of users.

    python -m tools.bench.structured_output --out benchmarks/structured-output/results.json

Prints a markdown table; ``--out`` keeps the raw numbers."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jsonschema

from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.grammar import GrammarSpec

TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"
DRAFTER = str(Path(__file__).resolve().parents[2] / "drafter" / "checkpoints" / "smollm2-135m-instruct-moa")
TEXT = {"type": "string", "maxLength": 40}
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": TEXT, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "city": TEXT},
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
    "product": {
        "type": "object",
        "properties": {
            "name": TEXT,
            "price": {"type": "number", "minimum": 0},
            "tags": {"type": "array", "items": TEXT, "maxItems": 3},
        },
        "required": ["name", "price", "tags"],
        "additionalProperties": False,
    },
    "weather": {
        "type": "object",
        "properties": {
            "city": TEXT,
            "celsius": {"type": "integer", "minimum": -60, "maximum": 60},
            "sky": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
        },
        "required": ["city", "celsius", "sky"],
        "additionalProperties": False,
    },
    "answer": {
        "type": "object",
        "properties": {"answer": TEXT, "confident": {"type": "boolean"}},
        "required": ["answer", "confident"],
        "additionalProperties": False,
    },
    "todo": {
        "type": "object",
        "properties": {
            "title": TEXT,
            "steps": {"type": "array", "items": TEXT, "minItems": 1, "maxItems": 3},
        },
        "required": ["title", "steps"],
        "additionalProperties": False,
    },
}
ASKS = {
    "person": ["a famous scientist", "a chef from Italy", "a young pilot", "a retired teacher", "a painter"],
    "product": ["a coffee mug", "running shoes", "a laptop", "a desk lamp", "a backpack"],
    "weather": ["Paris", "Tokyo", "Cairo", "Oslo", "Lima"],
    "answer": ["the capital of France", "2 + 2", "the largest ocean", "who wrote Hamlet", "the boiling point of water"],
    "todo": ["baking bread", "planting a tree", "learning to swim", "moving house", "writing a letter"],
}


def requests(n: int) -> list[tuple[str, str]]:
    """``n`` (schema name, user message) pairs, cycling over the schemas."""
    pairs = [
        (name, ask) for i in range(len(next(iter(ASKS.values())))) for name, asks in ASKS.items() for ask in [asks[i]]
    ]
    out = []
    while len(out) < n:
        name, ask = pairs[len(out) % len(pairs)]
        suffix = "" if len(out) < len(pairs) else f" (version {len(out) // len(pairs) + 1})"
        out.append((name, f"Give me JSON about {ask}{suffix}."))
    return out


def replies(engine: SpeculativeEngine, asks: list[tuple[str, str]], max_tokens: int, batch: int) -> list:
    outs = []
    for i in range(0, len(asks), batch):
        part = asks[i : i + batch]
        for name in dict.fromkeys(n for n, _ in part):  # one grammar per generate call
            prompts = [prompt(engine, ask) for n, ask in part if n == name]
            grammar = GrammarSpec.json_schema(SCHEMAS[name])
            for o in engine.generate(prompts, max_tokens, grammar=grammar):
                outs.append((name, o))
    return outs


def prompt(engine: SpeculativeEngine, ask: str) -> list[int]:
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": ask}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def validity(outs) -> dict:
    ok, bad = 0, []
    for name, o in outs:
        try:
            jsonschema.validate(json.loads(o.text), SCHEMAS[name])
            ok += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            bad.append({"schema": name, "text": o.text, "error": str(exc)[:200]})
    return {"valid": ok, "of": len(outs), "invalid": bad}


class GrammarClock:
    """Seconds the verifier spends on the grammar (matcher sync, draft walk, masks, applying them)
    and in ``verify`` as a whole: a share of the same calls, which load from other jobs inflates
    on both sides alike."""

    def __init__(self, verifier):
        self.grammar_s = self.verify_s = 0.0
        for name in ("_constrain", "_grammar_mask"):
            setattr(verifier, name, self._timed(getattr(verifier, name), "grammar_s"))
        verifier.grammars.apply = self._timed(verifier.grammars.apply, "grammar_s")
        verifier.verify = self._timed(verifier.verify, "verify_s")
        self.verifier = verifier

    def stop(self) -> None:
        for name in ("_constrain", "_grammar_mask", "verify"):
            delattr(self.verifier, name)
        del self.verifier.grammars.apply

    def _timed(self, fn, slot: str):
        def run(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                setattr(self, slot, getattr(self, slot) + time.perf_counter() - t0)

        return run


def cost(engine: SpeculativeEngine, users: int, tokens: int, passes: int) -> dict:
    """tok/s with a schema (A) and without (B), alternated A/B/A/B; and the share of the A runs'
    verify time spent on the grammar."""
    prompts = [prompt(engine, ask) for _, ask in requests(users)]
    grammar = GrammarSpec.json_schema(SCHEMAS["person"])
    engine.generate(prompts[:1], 4, grammar=grammar)  # compile and warm up
    runs = {"grammar": [], "free": []}
    share = []
    for _ in range(passes):
        for label, g in (("grammar", grammar), ("free", None)):
            clock = GrammarClock(engine.verifier)
            t0 = time.perf_counter()
            outs = engine.generate(prompts, tokens, ignore_eos=True, grammar=g)
            runs[label].append(sum(o.num_tokens for o in outs) / (time.perf_counter() - t0))
            clock.stop()
            if g is not None:
                share.append(clock.grammar_s / clock.verify_s)
    mean = {k: sum(v) / len(v) for k, v in runs.items()}
    return {
        "users": users,
        "runs": runs,
        "mean": mean,
        "ratio": mean["grammar"] / mean["free"],
        "grammar_share_of_verify": share,
    }


def reply_check(spec: SpeculativeEngine, plain: SpeculativeEngine, args) -> dict:
    asks = requests(args.replies)
    t0 = time.perf_counter()
    with_drafts = replies(spec, asks, args.max_tokens, args.batch)
    without = replies(plain, asks, args.max_tokens, args.batch)
    return {
        "drafter": validity(with_drafts),
        "none": validity(without),
        "identical": sum(a.token_ids == b.token_ids for (_, a), (_, b) in zip(with_drafts, without)),
        "mean_accepted_length": sum(o.mean_accepted_length for _, o in with_drafts) / len(with_drafts),
        "mean_tokens": sum(o.num_tokens for _, o in without) / len(without),
        "seconds": time.perf_counter() - t0,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replies", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--users", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cost-only", action="store_true", help="skip the replies")
    args = ap.parse_args(argv)
    spec = SpeculativeEngine.load(TARGET, DRAFTER, "float32", max_sessions=16)
    plain = SpeculativeEngine(spec.verifier, None, spec.tokenizer, spec.stop_ids, max_batch=16)
    result = {"target": TARGET, "dtype": "float32", "matmul_precision": "highest"}
    if not args.cost_only:
        result["replies"] = reply_check(spec, plain, args)
        r = result["replies"]
        print(
            f"replies: {r['drafter']['valid']}/{r['drafter']['of']} valid with the drafter, {r['none']['valid']}/"
            f"{r['none']['of']} without; {r['identical']} identical; tau {r['mean_accepted_length']:.2f}"
        )
    result["cost"] = [cost(plain, u, args.tokens, args.passes) for u in args.users]
    print("| users | tok/s with a schema (each pass) | tok/s free text (each pass) | ratio | grammar share of verify |")
    print("| ---: | --- | --- | ---: | --- |")
    for c in result["cost"]:
        g = " / ".join(f"{x:.1f}" for x in c["runs"]["grammar"])
        f = " / ".join(f"{x:.1f}" for x in c["runs"]["free"])
        sh = " / ".join(f"{100 * x:.2f} %" for x in c["grammar_share_of_verify"])
        print(f"| {c['users']} | {g} | {f} | {c['ratio']:.3f} | {sh} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
