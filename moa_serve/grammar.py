"""Structured output: a grammar that a session's generated tokens must follow (a JSON schema, any
JSON object, a regular expression, one of fixed strings), compiled and matched by xgrammar.

``GrammarSpec`` is what travels with a session (plain, picklable, hashable); ``check`` turns it into
a grammar without a tokenizer, so the HTTP edge refuses what cannot compile before a session
exists. The verifier holds a ``Grammars`` per target (xgrammar's compiler over the target's
vocabulary, compiled grammars cached) and a ``GrammarState`` per constrained session: the matcher
advanced over the session's committed tokens, which gives the token mask of each position a verify
call scores, and which drafts the grammar allows. Its state follows the committed tokens it is
given (``sync`` rolls back what differs), so a replica that gets the session afresh rebuilds it
from the Router's tokens.

JSON is generated compactly (no free whitespace between tokens, as vLLM's
``disable_any_whitespace``): a small model cannot then loop on whitespace until ``max_tokens``."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

KINDS = ("json_object", "json_schema", "regex", "choice")
COMPILED_CACHE = 64  # compiled grammars a verifier keeps (least recently used dropped)


@dataclass(frozen=True)
class GrammarSpec:
    """``kind``: one of ``KINDS``; ``source``: the JSON schema as JSON text (json_schema), the regular
    expression (regex), the choices as a JSON list of strings (choice), empty for json_object."""

    kind: str
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict) -> GrammarSpec:
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def choice(cls, options: list[str]) -> GrammarSpec:
        return cls("choice", json.dumps(list(options)))


def _xgrammar():
    import xgrammar

    return xgrammar


def check(spec: GrammarSpec):
    """The spec as an xgrammar ``Grammar`` (no tokenizer needed). Raises ``ValueError`` saying why
    when it does not compile (a schema feature the engine lacks, a malformed regex)."""
    xgr = _xgrammar()
    if spec.kind not in KINDS:
        raise ValueError(f"unknown grammar kind {spec.kind!r}; one of {', '.join(KINDS)}")
    try:
        if spec.kind == "json_object":  # an object, as OpenAI's json_object (not any JSON value)
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec.source, any_whitespace=False, strict_mode=True)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.source)
        options = json.loads(spec.source)
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError("choice needs at least one non-empty string")
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(o) for o in options))
    except (RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"the grammar engine cannot compile this {spec.kind}: {first}") from None


class Grammars:
    """xgrammar's compiler over one target's vocabulary (``vocab_size``: the LM head's rows, which
    may exceed the tokenizer's) and the grammars compiled for it. ``stop_token_ids``: what the
    grammar allows once complete (the target's end-of-sequence tokens)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids):
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self._compiled: OrderedDict[GrammarSpec, object] = OrderedDict()
        self._lock = threading.Lock()

    def compiled(self, spec: GrammarSpec):
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
        out = self._compiler.compile_grammar(check(spec))
        with self._lock:
            self._compiled[spec] = out
            while len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
        return out

    def state(self, spec: GrammarSpec) -> GrammarState:
        return GrammarState(spec, self.compiled(spec), self.stop_token_ids, self.vocab_size)

    def bitmask(self, rows: int) -> torch.Tensor:
        """[rows, ceil(V / 32)] int32, every token allowed."""
        return _xgrammar().allocate_token_bitmask(rows, self.vocab_size)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Sets the logits [n, V] of the tokens ``bitmask`` forbids to -inf, in place (any layout and
        device: the bits are unpacked by torch, not by a kernel that wants contiguous rows)."""
        bits = bitmask.to(logits.device)
        shifts = torch.arange(32, device=logits.device, dtype=bits.dtype)
        allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(bits.shape[0], -1)[:, : logits.shape[-1]]
        logits.masked_fill_(allowed == 0, float("-inf"))


class GrammarViolation(ValueError):
    """A committed token the grammar does not allow (the session's tokens were not generated under it)."""


class GrammarState:
    """The grammar's matcher over one session's generated tokens. Once the grammar is complete only
    its stop tokens are allowed (a session that ignores them keeps getting them)."""

    def __init__(self, spec: GrammarSpec, compiled, stop_token_ids: list[int], vocab_size: int):
        self.spec = spec
        self._matcher = _xgrammar().GrammarMatcher(compiled)
        self._stops = stop_token_ids
        self._words = (vocab_size + 31) // 32
        self.consumed: list[int] = []  # the tokens the state stands after
        self._in_matcher = 0  # consumed[:_in_matcher] went through the matcher; the rest are stops past its end

    def _accept(self, token: int) -> bool:
        if self._in_matcher == len(self.consumed) and self._matcher.accept_token(token):
            self._in_matcher += 1
        elif not (self._matcher.is_terminated() and token in self._stops):
            return False
        self.consumed.append(token)
        return True

    def _rollback(self, n: int) -> None:
        if n <= 0:
            return
        past_end = len(self.consumed) - self._in_matcher
        in_matcher = max(0, n - past_end)
        if in_matcher:
            self._matcher.rollback(in_matcher)
            self._in_matcher -= in_matcher
        del self.consumed[len(self.consumed) - n :]

    def sync(self, tokens: list[int]) -> None:
        """Moves the state to stand after ``tokens`` (the session's generated tokens): what differs
        from the tokens it stands after is rolled back, the rest accepted."""
        same = 0
        limit = min(len(tokens), len(self.consumed))
        while same < limit and tokens[same] == self.consumed[same]:
            same += 1
        self._rollback(len(self.consumed) - same)
        for i in range(same, len(tokens)):
            if not self._accept(tokens[i]):
                raise GrammarViolation(f"generated token {i} ({tokens[i]}) is not allowed by the {self.spec.kind}")

    def allowed_prefix(self, drafts: list[int]) -> int:
        """How many of ``drafts`` (in order, from the current state) the grammar allows: a draft it
        forbids ends the draft there. The state is left as it was."""
        n = 0
        while n < len(drafts) and self._accept(drafts[n]):
            n += 1
        self._rollback(n)
        return n

    def fill(self, bitmask: torch.Tensor, row: int, drafts: list[int] = ()) -> None:
        """The masks of the positions after the current state and after each of ``drafts`` (all
        allowed) into ``bitmask`` rows ``row`` ... ``row + len(drafts)``. The state is left as it was."""
        done = 0
        for i in range(len(drafts) + 1):
            if self._matcher.is_terminated():
                bitmask[row + i] = 0
                for t in self._stops:
                    bitmask[row + i, t // 32] |= _bit(t % 32)
            else:
                self._matcher.fill_next_token_bitmask(bitmask, row + i)
            if i < len(drafts):
                if not self._accept(drafts[i]):
                    raise GrammarViolation(f"draft {i} ({drafts[i]}) is not allowed by the {self.spec.kind}")
                done += 1
        self._rollback(done)


def _bit(i: int) -> int:
    """Bit ``i`` of an int32 word (bit 31 is the sign bit)."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i
