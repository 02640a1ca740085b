"""Which sessions' verify call asks the verifier for drafter features: one small policy per
drafter kind, chosen once when the round service is built.

Features are what a model drafter reads of the target (MoA: per-layer K/V through its feature
head; EAGLE-style: the last hidden state). Prompt lookup reads none. A remote (client-server)
session's drafter is on the user's device and gets features whenever the server has a feature
drafter for it, whatever the server drafts its own sessions with."""

from __future__ import annotations

from typing import Callable


class FeaturePolicy:
    """No features for anyone (no model drafter, here or on devices)."""

    #: draft only sessions whose features are current (skipped ones are caught up by a verify first)
    drafts_need_current_features = False

    def wanted(self, remote_ids: set[str], cap: int | None, next_round_drafts: Callable[[], bool]) -> bool | set[str]:
        """``True`` (every session), ``False`` (none) or the ids of the sessions that want them.
        ``remote_ids``: the round's sessions drafting on a device; ``cap``: this round's draft limit
        (0: it drafts nothing); ``next_round_drafts``: whether the next round is expected to draft
        (asked only when it matters)."""
        return False


class RemoteFeatures(FeaturePolicy):
    """The server drafts without features (prompt lookup, or nothing) but serves devices whose
    drafter needs them: only remote sessions ask."""

    def wanted(self, remote_ids, cap, next_round_drafts):
        return remote_ids


class AlwaysFeatures(FeaturePolicy):
    """A drafter pool whose features only come from verifying (EAGLE-style hidden states): every
    verify asks, drafting or not."""

    def wanted(self, remote_ids, cap, next_round_drafts):
        return True


class RecomputedFeatures(FeaturePolicy):
    """MoA: features are computed from the verifier's per-layer K/V cache, so positions skipped
    while not drafting can be recomputed later. Rounds that draft ask for them; rounds that do
    not, and whose successor is not expected to either, skip them (remote sessions still get
    theirs), so speculation turned off costs what plain decoding does."""

    drafts_need_current_features = True

    def wanted(self, remote_ids, cap, next_round_drafts):
        if cap != 0 or next_round_drafts():
            return True
        return remote_ids


def feature_policy(drafter_pool: bool, recomputable: bool = False, remote_drafter: bool = False) -> FeaturePolicy:
    """The policy for a server with (or without) a drafter pool whose features can (or cannot) be
    recomputed from the verifier's cache, serving (or not) devices with a feature drafter."""
    if drafter_pool:
        return RecomputedFeatures() if recomputable else AlwaysFeatures()
    return RemoteFeatures() if remote_drafter else FeaturePolicy()
