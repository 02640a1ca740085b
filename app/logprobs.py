"""Log-probabilities in the shapes the APIs answer with: OpenAI's chat
(``choices[].logprobs.content[]``: ``token``, ``logprob``, ``bytes``, ``top_logprobs``), OpenAI's
completions (``choices[].logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``) and the native ``/v1/generate`` (token ids).

A token's text is its piece of the decoded text in context (the decode of a few tokens before it
and of it, minus the decode of those before), so a SentencePiece token keeps its leading space
and the pieces of a reply join to its text; special tokens are written out (``</s>``)."""

from __future__ import annotations

from moa_serve.protocol import TokenLogprobs

CONTEXT_TOKENS = 4  # tokens decoded before each one to find its piece of the text
FLOOR = -9999.0  # a log-probability of -inf (float32 underflow) is written as this (JSON has no -inf)


def _value(x: float) -> float:
    return max(x, FLOOR)


class TokenTexts:
    """Each token's text at its position, from one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def pieces(self, before: list[int], tokens: list[int]) -> list[str]:
        """The texts of ``tokens[i]`` after ``before + tokens[:i]``."""
        ctx = list(before[-CONTEXT_TOKENS:])
        out = []
        for t in tokens:
            out.append(self.piece(ctx, t))
            ctx = (ctx + [t])[-CONTEXT_TOKENS:]
        return out

    def piece(self, before: list[int], token: int) -> str:
        window = list(before[-CONTEXT_TOKENS:])
        head, full = self._decode(window), self._decode(window + [token])
        return full[len(head) :] if full.startswith(head) else self._decode([token])


def chat_content(texts: TokenTexts, before: list[int], tokens: list[int], lps: list[TokenLogprobs]) -> list[dict]:
    """OpenAI chat's ``logprobs.content``: one entry per token."""
    out = []
    for i, (t, lp) in enumerate(zip(tokens, lps)):
        ctx = (before + tokens[:i])[-CONTEXT_TOKENS:]
        text = texts.piece(ctx, t)
        top = []
        for alt, value in lp.top:
            alt_text = text if alt == t else texts.piece(ctx, alt)
            top.append({"token": alt_text, "logprob": _value(value), "bytes": list(alt_text.encode())})
        out.append({"token": text, "logprob": _value(lp.logprob), "bytes": list(text.encode()), "top_logprobs": top})
    return out


def completion_logprobs(
    texts: TokenTexts, before: list[int], tokens: list[int], lps: list[TokenLogprobs | None], offset: int = 0
) -> dict:
    """OpenAI completions' ``logprobs`` of ``tokens`` (an entry of None: a token without one, the
    prompt's first); ``offset``: the characters of the choice's text before the first token.
    ``top_logprobs`` holds the most likely tokens and the token itself (as vLLM)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i, (t, lp) in enumerate(zip(tokens, lps)):
        ctx = (before + tokens[:i])[-CONTEXT_TOKENS:]
        text = texts.piece(ctx, t)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_value(lp.logprob))
        top = {texts.piece(ctx, alt): _value(value) for alt, value in lp.top if alt != t}
        top[text] = _value(lp.logprob)
        out["top_logprobs"].append(top)
    return out


def completion_text_length(logprobs: dict) -> int:
    """Characters the tokens of a completions ``logprobs`` cover (the next chunk's first offset)."""
    return sum(len(t) for t in logprobs["tokens"])


def native(tokens: list[int], lps: list[TokenLogprobs]) -> list[dict]:
    """``/v1/generate``'s ``logprobs``: token ids, no texts."""
    return [
        {
            "token_id": t,
            "logprob": _value(lp.logprob),
            "top_logprobs": [{"token_id": alt, "logprob": _value(v)} for alt, v in lp.top],
        }
        for t, lp in zip(tokens, lps)
    ]
