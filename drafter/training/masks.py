"""Attention masks of MoA distillation (pure functions; True = may attend).

``visible[b, j]`` says whether the target's features of position j are available to the drafter:
prompt positions (verified before any drafting) and, inside the response, every T-th position
("variable future length": the bounded mask cuts the visible features every T tokens, so the
drafter learns to draft up to T tokens ahead of its freshest feature). ``start[b, i]`` is the last
visible position <= i (-1 if none).
"""

from __future__ import annotations

import torch


def every_t_visible(is_prompt: torch.Tensor, period: torch.Tensor) -> torch.Tensor:
    """is_prompt bool [B, S], period long [B] -> visible bool [B, S]: prompt positions and every
    position whose index is a multiple of the sequence's period (as the reference draws it)."""
    idx = torch.arange(is_prompt.shape[1], device=is_prompt.device)[None]
    return is_prompt | (idx % period[:, None] == 0)


def last_visible(visible: torch.Tensor) -> torch.Tensor:
    """visible bool [B, S] -> start long [B, S]: last visible position <= i, -1 where none."""
    idx = torch.arange(visible.shape[1], device=visible.device)[None].expand_as(visible)
    cand = torch.where(visible, idx, torch.full_like(idx, -1))
    return torch.cummax(cand, dim=1).values


def causal_mask(batch: int, seq: int, device=None) -> torch.Tensor:
    """bool [B, 1, S, S]: j <= i."""
    return torch.ones(seq, seq, dtype=torch.bool, device=device).tril()[None, None].expand(batch, 1, seq, seq)


def bounded_cross_mask(visible: torch.Tensor) -> torch.Tensor:
    """The T-step bounded CA mask, bool [B, 1, S, S]: query i may read the features of j iff
    j <= start_i (the last visible position <= i). Features of positions after start_i (not yet
    verified at drafting time) can never influence query i. A row with no visible position is all
    False (callers make position 0 visible: it is a prompt token)."""
    s = visible.shape[1]
    start = last_visible(visible)  # [B, S]
    j = torch.arange(s, device=visible.device)
    return (j[None, None, :] <= start[:, :, None]).unsqueeze(1)


def latest_cross_mask(visible: torch.Tensor) -> torch.Tensor:
    """The CA mask of a drafter that reads only its freshest feature, bool [B, 1, S, S]: query i
    reads the features of j = start_i alone (at serving: the last verified position). Training
    and serving then see the same thing, which the bounded mask does not quite give: in training,
    the response positions between two visible ones carry no feature."""
    s = visible.shape[1]
    start = last_visible(visible)
    j = torch.arange(s, device=visible.device)
    return (j[None, None, :] == start[:, :, None]).unsqueeze(1)


def staircase_self_mask(visible: torch.Tensor) -> torch.Tensor:
    """The staircase SA mask, bool [B, 1, S, S]: query i sees the tokens after its last visible
    position up to itself (start_i < j <= i), and always itself (the reference's
    ``(j >= start + 1) & (j <= i) | (j == i)``)."""
    s = visible.shape[1]
    start = last_visible(visible)
    i = torch.arange(s, device=visible.device)
    j = i
    m = (j[None, None, :] > start[:, :, None]) & (j[None, None, :] <= i[None, :, None])
    m = m | torch.eye(s, dtype=torch.bool, device=visible.device)[None]
    return m.unsqueeze(1)


def self_mask(visible: torch.Tensor, use_staircase: torch.Tensor) -> torch.Tensor:
    """Per-sequence SA mask: staircase where ``use_staircase[b]``, plain causal otherwise."""
    b, s = visible.shape
    causal = causal_mask(b, s, visible.device)
    if not bool(use_staircase.any()):
        return causal
    return torch.where(use_staircase[:, None, None, None], staircase_self_mask(visible), causal)


def staircase_probability(progress: float) -> float:
    """Probability that a sequence uses the staircase SA mask at training progress in [0, 1].
    Follows the reference code (``~(rand < epoch / (max_epochs / 2))``): 1 at the start, falling
    linearly to 0 at half of training ("force the SA to focus on the current context at the start
    of the training"), then plain causal only."""
    return max(0.0, 1.0 - progress / 0.5)
