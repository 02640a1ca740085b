"""Lossless acceptance of draft tokens.

Greedy: keep drafts while they equal the target's argmax, then add the target's own token.
Sampling: speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023) — accept
draft x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample from the
residual max(0, p_i - q_i) (normalised); when every draft passes, sample a bonus token from
p_{K}. ``p`` and ``q`` are the *warped* distributions (temperature, top-k, top-p) of target
and drafter, so the output follows the target's warped distribution exactly.
"""

from __future__ import annotations

import hashlib

import torch

from moa_serve.sampling import SamplingParams


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] (float32) after temperature, top-k and top-p."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each token
        drop_sorted = before >= params.top_p  # keeps the smallest prefix whose mass reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def generator_for(params: SamplingParams, position: int, stream: str, device="cpu") -> torch.Generator | None:
    """A generator that depends only on (seed, position, stream): reproducible across replicas
    and rounds; ``None`` (global RNG) when the request has no seed."""
    if params.seed is None:
        return None
    digest = hashlib.blake2b(f"{params.seed}:{position}:{stream}".encode(), digest_size=8).digest()
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF)
    return gen


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def accept_greedy(target_logits: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
    """target_logits [K+1, V] at the positions predicting each draft and the bonus.
    Returns (number of drafts accepted, the target's next token)."""
    choice = target_logits.argmax(-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == choice[n]:
        n += 1
    return n, choice[n]


def accept_sampling(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: list[int],
                    generator: torch.Generator | None) -> tuple[int, int]:
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
