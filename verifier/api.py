"""The narrow boundary of a verifier backend (torch today, vLLM later): plain data that
crosses process boundaries (Ray) unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moa_serve.engine.sampling import GREEDY, SamplingParams


@dataclass
class VerifyRequest:
    session_id: str
    committed: list[int]  # every committed token of the session (prompt included)
    drafts: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [K, V] drafter distributions when sampling
    sampling: SamplingParams = GREEDY
    want_features: bool = True


@dataclass
class VerifyResult:
    session_id: str
    tokens: list[int]  # accepted drafts followed by one token of the target's own
    num_accepted: int
    feature_start: int  # position of features[0]
    features: torch.Tensor | None  # [n, F] MoA features of positions newly in the target cache
    num_computed: int = 0  # tokens the target forward processed for this session (prefill included)


class TargetBackend:
    """What the round scheduler needs from a verifier."""

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        raise NotImplementedError

    def release(self, session_id: str) -> None:
        raise NotImplementedError
