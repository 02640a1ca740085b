"""Lossless acceptance of draft tokens.

Greedy: keep drafts while they equal the target's argmax, then add the target's own token.
Sampling: speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023) — accept
draft x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample from the
residual max(0, p_i - q_i) (normalised); when every draft passes, sample a bonus token from
p_{K}. ``p`` and ``q`` are the *warped* distributions (temperature, top-k, top-p) of target
and drafter, so the output follows the target's warped distribution exactly.
"""

from __future__ import annotations

import torch

from moa_serve.sampling import sample


def accept_greedy(choice: list[int], drafts: list[int]) -> tuple[int, int]:
    """choice: the target's argmax at the positions predicting each draft and the bonus (K+1
    token ids, computed once for a whole verify call). Returns (number of drafts accepted, the
    target's next token)."""
    n = 0
    while n < len(drafts) and drafts[n] == choice[n]:
        n += 1
    return n, choice[n]


def accept_sampling(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None
) -> tuple[int, int]:
    """target_probs [K+1, V], draft_probs [K, V] (the drafter's distributions the drafts were
    sampled from). Returns (number of drafts accepted, next token)."""
    k = len(drafts)
    if k:
        idx = torch.arange(k)
        tok = torch.tensor(drafts)
        p = target_probs[idx, tok]
        q = draft_probs[idx, tok]
        u = torch.rand(k, generator=generator)
        # accept iff u < p/q, written without dividing (q > 0 for a token that was sampled)
        ok = (u * q < p).tolist()
        for i in range(k):
            if not ok[i]:
                residual = (target_probs[i] - draft_probs[i]).clamp_min(0.0)
                total = residual.sum()
                # residual mass is 0 only if p == q, where rejection has probability 0; guard anyway
                dist = residual / total if total > 0 else target_probs[i]
                return i, sample(dist, generator)
    return k, sample(target_probs[k], generator)
