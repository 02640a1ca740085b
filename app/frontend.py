"""Between HTTP and the round service: prompts to tokens (chat templates), a session per
request, token events to text deltas (incremental detokenization, stop strings).

The Router's event loop also drives every session group's rounds, so nothing here may cost
more than a few tokens' worth per event: prompts are tokenized on a worker thread, and each
event decodes only a small window of tokens, never the whole text so far."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from contextlib import aclosing
from dataclasses import dataclass

from jinja2 import TemplateError

from moa_serve.engine.round_service import RoundService
from moa_serve.engine.session import Session
from moa_serve.grammar import GrammarSpec, check
from moa_serve.protocol import TokenLogprobs
from moa_serve.sampling import SEED_MAX, SamplingParams

log = logging.getLogger(__name__)

INLINE_ENCODE_CHARS = 4096  # prompts (or chats) up to this many characters are encoded on the event loop


def _chars(prompt: str | None, messages: list | None) -> int:
    return len(prompt or "") + sum(len(m.content) for m in messages or ())


class InputError(ValueError):
    """A request the server cannot run; ``param`` names the offending field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # of ``token_ids``, when the request asked


class IncrementalDetokenizer:
    """The text of a growing list of token ids, decoding a small window per step (the
    prefix/read-offset scheme of vLLM's ``detokenize_incrementally`` and transformers'
    ``TextStreamer``): the new text is ``decode(ids[prefix:])`` minus ``decode(ids[prefix:read])``.
    The window starts at the tokens of the previous piece, so tokenizers whose decoding depends on
    the token before (SentencePiece's leading space) stay right; text ending in an incomplete UTF-8
    sequence waits for the next tokens. ``finish()`` adds whatever the full decode has beyond what
    was produced, so the final text is exactly ``decode(all ids, skip_special_tokens=True)``."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._pieces: list[str] = []  # the text so far (joined only at the end: no re-copying per step)
        self._prefix = 0  # ids[_prefix:_read] were decoded last time: the context of the next piece
        self._read = 0  # ids[:_read] are in ``text``

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=True)

    def add(self, ids: list[int]) -> str:
        """Takes new token ids; returns the new text (possibly empty)."""
        self.ids.extend(ids)
        if len(self.ids) == self._read:
            return ""
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix, len(self.ids))
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing printable yet (special tokens, a split multi-byte character)
        piece = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self._pieces.append(piece)
        return piece

    def finish(self) -> str:
        """The rest of the text at the end (held incomplete characters, a literal U+FFFD): one full
        decode per request."""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        text = "".join(self._pieces)
        self._prefix = self._read = len(self.ids)
        if not full.startswith(text):  # never seen with byte-level BPE or SentencePiece
            log.warning("incremental detokenization diverged from the full decode")
            return ""
        self._pieces = [full]
        return full[len(text) :]


class Generation:
    """One running request: yields text deltas, then exposes the final statistics."""

    def __init__(self, frontend: "Frontend", session: Session, stops: list[str]):
        self.id = uuid.uuid4().hex
        self.frontend = frontend
        self.session = session
        self.stops = stops
        self.tracked = frontend.service.submit(session)
        self._pieces: list[str] = []  # the text emitted so far
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []  # of ``token_ids``, when the request asked
        self.prompt_logprobs: list[TokenLogprobs] | None = None  # prompt positions 1, 2, ... when scored
        self.finish_reason: str | None = None
        self.on_error = None  # called when the round fails for this generation (before it raises)

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    @property
    def prompt_tokens(self) -> int:
        return len(self.session.prompt)

    def stats(self) -> dict:
        return self.session.stats()

    async def deltas(self):
        """Text deltas as rounds commit tokens. Text that might still begin a stop string (its
        longest length - 1 characters) is held back until the next tokens tell; a stop string ends
        the text before it and frees the session at once."""
        detok = IncrementalDetokenizer(self.frontend.tokenizer)
        hold = max((len(s) for s in self.stops), default=1) - 1
        pending = ""  # decoded, not yet emitted; every stop string found so far is cut already
        async with aclosing(self.frontend.service.stream(self.tracked)) as events:
            async for ev in events:
                finish = ev.finish_reason
                if finish is not None and finish.startswith("error"):
                    if self.on_error is not None:
                        self.on_error()
                    raise RuntimeError(finish)
                self.token_ids.extend(ev.tokens)
                self.logprobs.extend(ev.logprobs or ())
                if ev.prompt_logprobs is not None:
                    self.prompt_logprobs = ev.prompt_logprobs
                pending += detok.add(ev.tokens)
                if finish is not None:
                    pending += detok.finish()
                cut = self._stop_at(pending)
                if cut is not None:
                    pending, finish = pending[:cut], "stop"
                n = len(pending) if finish is not None else max(0, len(pending) - hold)
                piece, pending = pending[:n], pending[n:]
                self._pieces.append(piece)
                if finish is not None:
                    self.finish_reason = finish
                    if cut is not None:
                        self.frontend.service.abort(self.tracked)  # free the caches now
                    yield Delta(piece, ev.tokens, finish, ev.logprobs)
                    return
                if piece or ev.tokens:
                    yield Delta(piece, ev.tokens, logprobs=ev.logprobs)

    def close(self) -> None:
        """Aborts the session unless it finished (a client gone): its caches are freed now."""
        if not self.session.finished:
            self.frontend.service.abort(self.tracked)

    def _stop_at(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    async def run(self) -> "Generation":
        async for _ in self.deltas():
            pass
        return self


@dataclass(frozen=True)
class Speculation:
    """What the served drafter asks of every session: ``enabled`` (a drafter is served; False:
    plain decoding), ``num_speculative_tokens`` (K, unless a request asks for fewer),
    ``adaptive`` (each session adapts its own K) and ``needs_features`` (the drafter reads the
    target's features: MoA, EAGLE-style)."""

    enabled: bool
    num_speculative_tokens: int = 4
    adaptive: bool = False
    needs_features: bool = True


@dataclass(frozen=True)
class Unsupported:
    """What the served backend cannot give, each with why (a request that asks is a 400 naming its
    field); None: it gives it."""

    structured_output: str | None = None
    logprobs: str | None = None  # log-probabilities and prompt scoring


class Frontend:
    def __init__(
        self,
        service: RoundService,
        tokenizer,
        *,
        model_name: str,
        max_model_len: int,
        stop_token_ids: frozenset[int],
        speculation: Speculation,
        weights: str = "checkpoint",
        unsupported: Unsupported = Unsupported(),
    ):
        self.service = service
        self.weights = weights  # what /v1/models says of the target's weights (synthetic ones say so)
        self.unsupported = unsupported
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.stop_token_ids = stop_token_ids
        self.model_name = model_name
        self.speculation = speculation
        self._encode_lock = threading.Lock()  # one tokenizer, used from worker threads

    def encode_prompt(self, prompt: str | None, messages: list | None) -> tuple[list[int], str]:
        if messages is not None:
            msgs = [m.model_dump(exclude_none=True) for m in messages]
            if not getattr(self.tokenizer, "chat_template", None):
                raise InputError("this model has no chat template; send a prompt instead", "messages")
            try:
                ids = self.tokenizer.apply_chat_template(
                    msgs, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            except TemplateError as exc:  # the template's raise_exception (e.g. roles must alternate)
                raise InputError(f"the chat template refused the messages: {exc}", "messages") from None
            return list(ids), "messages"
        if not prompt:
            raise InputError("prompt is empty", "prompt")
        if isinstance(prompt, list):  # token ids
            vocab = len(self.tokenizer)
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise InputError(f"prompt holds token id {bad}, outside the vocabulary [0, {vocab})", "prompt")
            return list(prompt), "prompt"
        return self.tokenizer.encode(prompt), "prompt"

    def _encode_locked(self, prompt: str | None, messages: list | None) -> tuple[list[int], str]:
        with self._encode_lock:
            return self.encode_prompt(prompt, messages)

    async def tokenize(self, prompt: str | None, messages: list | None) -> tuple[list[int], str]:
        """(token ids, the field they came from). A long prompt or chat is encoded on a worker
        thread: it must not stall the event loop that streams (and, in process, drives the rounds).
        A short one (most chat turns: far less work than the hand-off) is encoded here when the
        tokenizer is free, which saves the thread hand-off on the way to the first token."""
        if _chars(prompt, messages) <= INLINE_ENCODE_CHARS and self._encode_lock.acquire(blocking=False):
            try:
                return self.encode_prompt(prompt, messages)
            finally:
                self._encode_lock.release()
        return await asyncio.to_thread(self._encode_locked, prompt, messages)

    async def start(self, **request) -> Generation:
        """One generation of a request (``start_choices`` with n = 1)."""
        return (await self.start_choices(1, **request))[0]

    async def start_choices(
        self,
        n: int,
        *,
        prompt: str | None,
        messages: list | None,
        max_tokens: int,
        sampling: SamplingParams,
        stops: list[str],
        ignore_eos: bool,
        num_speculative_tokens: int | None,
        grammar: tuple[GrammarSpec, str] | None = None,
        logprobs: int | None = None,
        score_prompt: bool = False,
        logprobs_param: str = "logprobs",
    ) -> list[Generation]:
        """Tokenizes (``tokenize``) once and submits ``n`` sessions of the prompt, choice ``i`` seeded
        with ``seed + i`` (``choice_sampling``); the verifier's prefix cache lets them share the
        prompt's K/V. ``prompt`` may be token ids. ``grammar``: the structured output asked for and
        the field that asked, checked here (a grammar the engine cannot compile is an ``InputError``
        naming that field). ``logprobs``: the target's log-probability of each new token with that
        many alternatives, for each choice; ``score_prompt``: of the prompt's tokens too (each choice
        carries them). Raises ``InputError`` naming the field of a request the server cannot run,
        ``QueueFullError`` when the queue cannot take all n (none is left running)."""
        if (logprobs is not None or score_prompt) and self.unsupported.logprobs:
            raise InputError(f"{logprobs_param}: {self.unsupported.logprobs}", logprobs_param)
        if grammar is not None:
            await self._check_grammar(*grammar)
        ids, field = await self.tokenize(prompt, messages)
        if len(ids) >= self.max_model_len:
            raise InputError(
                f"the {field} has {len(ids)} tokens; the context holds {self.max_model_len} "
                "(prompt plus at least one new token)",
                field,
            )
        spec = self.speculation
        k = num_speculative_tokens or spec.num_speculative_tokens
        started: list[Generation] = []
        try:
            for i in range(n):
                session = Session(
                    uuid.uuid4().hex,
                    ids,
                    max_tokens,
                    choice_sampling(sampling, i),
                    k if spec.enabled else 0,
                    frozenset() if ignore_eos else self.stop_token_ids,
                    self.max_model_len,
                    adaptive_speculation=spec.adaptive,
                    drafter_needs_features=spec.needs_features,
                    grammar=grammar[0] if grammar is not None else None,
                    logprobs=logprobs,
                    score_prompt=score_prompt,
                )
                started.append(Generation(self, session, stops))
        except BaseException:
            for gen in started:
                gen.close()
            raise
        return started

    async def _check_grammar(self, spec: GrammarSpec, param: str) -> None:
        if self.unsupported.structured_output:
            raise InputError(f"{param}: {self.unsupported.structured_output}", param)
        try:
            await asyncio.to_thread(check, spec)  # a large schema takes milliseconds: off the event loop
        except ValueError as exc:
            raise InputError(f"{param}: {exc}", param) from None


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """The sampling of choice ``index`` of a request with n > 1: its own seed stream, ``seed + index``
    (wrapping within the seed range); unseeded choices draw from the global generator, greedy ones
    are all the same."""
    if sampling.seed is None or index == 0:
        return sampling
    return sampling.model_copy(update={"seed": (sampling.seed + index) % (SEED_MAX + 1)})
