"""xgrammar against llguidance on SmolLM2-135M-Instruct's vocabulary (49,152 tokens): the time to
build each engine's tokenizer table, to compile one JSON schema, and to fill the token mask at each
position of a reply that fits it (median and worst over the reply's tokens); both engines with their
default whitespace rules.

    python -m tools.bench.grammar_engines

llguidance comes with the ``[vllm]`` extra; xgrammar is a dependency."""

from __future__ import annotations

import json
import statistics
import time

import llguidance
import llguidance.hf
import llguidance.torch
import xgrammar as xgr
from transformers import AutoTokenizer

from moa_serve.model_files import resolve_model_path

VOCAB = 49152
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
REPLY = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"], "address": {"city": "London", "zip": "12345"}}


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def mask_times(fill, accept, ids: list[int]) -> list[float]:
    times = []
    for t in ids:
        _, s = timed(fill)
        times.append(s)
        assert accept(t), t
    return times


def xgrammar_row(tok, ids) -> dict:
    info, table_s = timed(lambda: xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compiled, compile_s = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    matcher, mask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, VOCAB)
    times = mask_times(lambda: matcher.fill_next_token_bitmask(mask, 0), matcher.accept_token, ids)
    return {"engine": "xgrammar", "table_s": table_s, "compile_s": compile_s, "masks_s": times}


def llguidance_row(tok, ids) -> dict:
    lltok, table_s = timed(lambda: llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB))

    def build():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
        return llguidance.LLMatcher(lltok, grammar)

    matcher, compile_s = timed(build)
    assert not matcher.is_error(), matcher.get_error()
    mask = llguidance.torch.allocate_token_bitmask(1, VOCAB)
    times = mask_times(lambda: llguidance.torch.fill_next_token_bitmask(matcher, mask, 0), matcher.consume_token, ids)
    return {"engine": "llguidance", "table_s": table_s, "compile_s": compile_s, "masks_s": times}


def main() -> None:
    path = resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct", weights=False)
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = tok.encode(json.dumps(REPLY))
    print(f"reply of {len(ids)} tokens")
    print("| engine | tokenizer table (ms) | compile the schema (ms) | mask per position, median / worst (µs) |")
    print("| --- | ---: | ---: | ---: |")
    for row in (xgrammar_row(tok, ids), llguidance_row(tok, ids)):
        med, worst = statistics.median(row["masks_s"]) * 1e6, max(row["masks_s"]) * 1e6
        print(
            f"| {row['engine']} | {row['table_s'] * 1e3:.0f} | {row['compile_s'] * 1e3:.1f} | {med:.0f} / {worst:.0f} |"
        )


if __name__ == "__main__":
    main()
