"""What a verifier backend is to the rest of the system, beside the wire data of
:mod:`moa_serve.protocol`: the calls the round scheduler makes (``TargetBackend``), and the
verifier-side half of a drafter (``FeatureSource``), which the drafter registry builds per drafter
kind so that a verifier never needs to know which drafter it serves."""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from moa_serve.protocol import VerifyRequest, VerifyResult


class TargetBackend:
    """What the round scheduler needs from a verifier."""

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        raise NotImplementedError

    def release(self, session_id: str) -> None:
        raise NotImplementedError


class FeatureSource(Protocol):
    """How a drafter's features come out of the target: what is read for the positions a verify
    call newly holds in its cache, and the head that turns it into the features sent to the drafter.

    ``from_cache``: the inputs are read back from the K/V cache (MoA's per-layer K/V), so the
    features of any cached position can be recomputed: a reused prefix, a catch-up from
    ``features_from``, positions decoded in multi-step calls. Otherwise (EAGLE-style hidden states)
    only the positions the call's forward computed have them.
    ``latest_only``: the drafter reads only the freshest verified feature; the others in a span are
    never read (zeros stand in for them).
    A source that reads the cache may also give ``rows(spans)``: the (slot, position) pairs
    ``inputs`` gathers and the count per span, so that the verifier can run the gather and the head
    at fixed shapes (``verifier/torch/static_features.py``)."""

    from_cache: bool
    latest_only: bool

    def prepared(self, device: torch.device, dtype: torch.dtype) -> FeatureSource:
        """This source on the verifier's device and dtype, ready for inference."""

    def inputs(
        self, cache, spans: list[tuple[int, int, int]], hidden: list[Callable[[], torch.Tensor]]
    ) -> tuple[torch.Tensor, list[int]]:
        """The head's inputs for a verify call's sessions, packed in a row, and how many rows each
        session has: for each ``(slot, start, end)`` span, positions ``start``..``end`` of the
        session in cache ``slot`` (end - start rows, or fewer, the last ones, with ``latest_only``);
        ``hidden[i]()`` gives the target's final hidden states [end - start, H] of span i's
        positions, computed in this call."""

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        """Features [n, F] from the inputs."""


class NoFeatures:
    """The source of a drafter that reads no target features (prompt lookup, an independent
    drafter, no drafter): nothing is read, nothing computed."""

    from_cache = True  # nothing to recompute: every position's (absent) features are available
    latest_only = False

    def prepared(self, device, dtype) -> NoFeatures:
        return self

    def inputs(self, cache, spans, hidden) -> tuple[torch.Tensor, list[int]]:
        return torch.empty(0), [0] * len(spans)

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs


NO_FEATURES = NoFeatures()
