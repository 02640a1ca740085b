"""Log-probabilities from the target's logits: of the tokens a verify call returned (or of a
prompt's tokens, scored from its prefill), each with the most likely tokens at its position.

They are those of the target's own distribution, ``log_softmax`` of its float32 logits before any
temperature, top-p or top-k (vLLM's ``raw_logprobs``), so a token's log-probability does not
depend on how it was sampled, nor on whether a draft proposed it."""

from __future__ import annotations

import torch

from moa_serve.protocol import TokenLogprobs

MAX_TOP_LOGPROBS = 20  # OpenAI's and vLLM's default bound on top_logprobs / logprobs


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: list[int]) -> list[TokenLogprobs]:
    """``logits`` [n, V] (any device): row i scores ``tokens[i]``, with its ``top[i]`` most likely
    tokens. One transfer to the host for all rows."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0]
    k = max(top)
    if k > 0:
        values, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
        values, ids = values.tolist(), ids.tolist()
    out = []
    for i, value in enumerate(chosen.tolist()):
        alts = list(zip(ids[i][: top[i]], values[i][: top[i]])) if k > 0 else []
        out.append(TokenLogprobs(value, alts))
    return out
