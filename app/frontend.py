"""Between HTTP and the round service: prompts to tokens (chat templates), a session per
request, token events to text deltas (incremental detokenization, stop strings)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from moa_serve.engine.sampling import SamplingParams
from moa_serve.engine.service import RoundService
from moa_serve.engine.session import Session


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


class Generation:
    """One running request: yields text deltas, then exposes the final statistics."""

    def __init__(self, frontend: "Frontend", session: Session, stops: list[str]):
        self.id = uuid.uuid4().hex
        self.frontend = frontend
        self.session = session
        self.stops = stops
        self.tracked = frontend.service.submit(session)
        self.text = ""
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.session.prompt)

    def stats(self) -> dict:
        return self.session.stats()

    async def deltas(self):
        tok = self.frontend.tokenizer
        hold = max((len(s) for s in self.stops), default=1) - 1
        emitted = 0
        async for ev in self.frontend.service.stream(self.tracked):
            self.token_ids.extend(ev.tokens)
            full = tok.decode(self.token_ids, skip_special_tokens=True)
            finish = ev.finish_reason
            cut = self._stop_at(full)
            if cut is not None:
                full, finish = full[:cut], "stop"
            elif finish is None and full.endswith("\ufffd"):
                continue  # an incomplete UTF-8 sequence: wait for the next tokens
            if finish is not None and finish.startswith("error"):
                raise RuntimeError(finish)
            limit = len(full) if finish is not None else max(emitted, len(full) - hold)
            piece = full[emitted:limit]
            emitted = limit
            self.text = full[:emitted]
            if finish is not None:
                self.finish_reason = "stop" if finish == "stop" else finish
                if cut is not None:
                    self.frontend.service.abort(self.tracked)  # free the caches now
                    self.finish_reason = "stop"
                yield Delta(piece, ev.tokens, self.finish_reason)
                return
            if piece or ev.tokens:
                yield Delta(piece, ev.tokens)

    def _stop_at(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    async def run(self) -> "Generation":
        async for _ in self.deltas():
            pass
        return self


class Frontend:
    def __init__(self, service: RoundService, tokenizer, *, max_model_len: int, stop_token_ids: frozenset[int],
                 num_speculative_tokens: int, speculative: bool, model_name: str,
                 adaptive_speculation: bool = False):
        self.service = service
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.stop_token_ids = stop_token_ids
        self.num_speculative_tokens = num_speculative_tokens
        self.speculative = speculative
        self.model_name = model_name
        self.adaptive_speculation = adaptive_speculation

    def encode_prompt(self, prompt: str | None, messages: list | None) -> tuple[list[int], str]:
        if messages is not None:
            msgs = [m.model_dump(exclude_none=True) for m in messages]
            if not getattr(self.tokenizer, "chat_template", None):
                raise InputError("this model has no chat template; send a prompt instead", "messages")
            ids = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
            return list(ids), "messages"
        if not prompt:
            raise InputError("prompt is empty", "prompt")
        return self.tokenizer.encode(prompt), "prompt"

    def start(self, *, prompt: str | None, messages: list | None, max_tokens: int, sampling: SamplingParams,
              stops: list[str], ignore_eos: bool, num_speculative_tokens: int | None) -> Generation:
        ids, field = self.encode_prompt(prompt, messages)
        if len(ids) >= self.max_model_len:
            raise InputError(f"the {field} has {len(ids)} tokens; the context holds {self.max_model_len} "
                             "(prompt plus at least one new token)", field)
        k = num_speculative_tokens or self.num_speculative_tokens
        session = Session(uuid.uuid4().hex, ids, max_tokens, sampling, k if self.speculative else 0,
                          frozenset() if ignore_eos else self.stop_token_ids, self.max_model_len,
                          adaptive_speculation=self.adaptive_speculation)
        return Generation(self, session, stops)
