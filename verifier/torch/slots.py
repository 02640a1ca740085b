"""The torch verifier's KV slots and prefix cache: which slot holds which session, and what a
released session's slot still holds.

Sessions travel as token deltas (``VerifyRequest.base``); a session this replica does not hold
answers ``resync``. When every slot is taken, the least recently used session that is not in the
call is evicted (it resyncs later): a full cache never fails a request.

Prefix caching: a released session's slot keeps its K/V (``retained``, least recently used first,
given back only when a slot is needed), and a new session starts from the longest prefix of its
tokens already in the cache: it takes over a retained slot whose tokens it all reuses, or copies the
shared positions from another slot (live, or retained: a partial match leaves the retained prefix in
place for a later repeat of its own prompt). A released session frees the retained slots whose
tokens its own contain. Its prefill then covers only what differs (a repeated prompt: one token; a
shared system prompt: the rest of the prompt). The fixed-order kernels make a token's K/V independent of
the batch and chunk it was computed in, so reused positions are bitwise those a fresh prefill
would write.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from moa_serve.grammar import GrammarState
from moa_serve.model.kv_cache import SlotKVCache
from moa_serve.protocol import VerifyRequest

log = logging.getLogger(__name__)

MIN_PREFIX_COPY = 16  # positions worth copying from another slot (a retained slot reused whole is taken at any length)


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of a and b, at most ``limit``: windows compared as
    slices (C speed) that double while they match, then halved inside the first that does not, so
    the cost follows the length of the match, not of the lists."""
    end = min(len(a), len(b), limit)
    lo, step = 0, 16
    while lo < end:  # a[:lo] == b[:lo]
        hi = min(end, lo + step)
        if a[lo:hi] == b[lo:hi]:
            lo, step = hi, 2 * step
            continue
        while hi - lo > 1:  # the first difference is in [lo, hi)
            mid = (lo + hi) // 2
            if a[lo:mid] == b[lo:mid]:
                lo = mid
            else:
                hi = mid
        return lo
    return lo


class ContextTooLongError(ValueError):
    pass


class CacheFullError(RuntimeError):
    """Every slot is held by a session of the current call: the call is too large for the replica."""


@dataclass
class HeldSession:
    """A session this replica holds: its slot and its copy of the committed tokens."""

    slot: int
    committed: list[int] = field(default_factory=list)  # this replica's copy of the committed tokens
    cached: int = 0  # committed[:cached] have their K/V in the cache
    grammar: GrammarState | None = None  # structured output: the matcher over the generated tokens


class SlotTable:
    """The sessions a runner holds, least recently used first, over the slots of its ``cache``;
    ``retained``: slot -> the tokens whose K/V a released session left in it (with
    ``prefix_caching``), least recently used first. Counts evictions and prefix hits in ``stats``."""

    def __init__(self, cache: SlotKVCache, max_model_len: int, prefix_caching: bool, stats: dict):
        self.cache = cache
        self.max_model_len = max_model_len
        self.prefix_caching = prefix_caching
        self.stats = stats
        self.sessions: OrderedDict[str, HeldSession] = OrderedDict()
        self.retained: OrderedDict[int, list[int]] = OrderedDict()

    def release(self, session_id: str) -> None:
        s = self.sessions.pop(session_id, None)
        if s is None:
            return
        if self.prefix_caching and s.cached > 0:
            held = s.committed[: s.cached]
            # a retained prefix that this one contains (the same prompt answered again) is freed: one
            # slot per distinct prefix, so repeats do not crowd other prompts out of the cache
            for slot in [
                slot
                for slot, old in self.retained.items()
                if len(old) <= len(held) and common_prefix(old, held, len(old)) == len(old)
            ]:
                del self.retained[slot]
                self.cache.free(slot)
            self.retained[s.slot] = held
        else:
            self.cache.free(s.slot)

    @property
    def free_slots(self) -> int:
        return self.cache.num_free + len(self.retained)

    def _slot(self, keep: set[str]) -> int:
        """A slot for a new session: a free one, else the least recently used retained one, else
        the least recently used idle session's (evicted: it resyncs later)."""
        if self.cache.num_free == 0:
            if self.retained:
                old, _ = self.retained.popitem(last=False)
                self.cache.free(old)
            else:
                victim = next((sid for sid in self.sessions if sid not in keep), None)
                if victim is None:
                    raise CacheFullError(
                        f"all {self.cache.num_slots} KV slots are used by sessions of this call; "
                        "send fewer sessions per call or raise max_sessions"
                    )
                log.info("KV cache full: evicting idle session %s", victim)
                self.cache.free(self.sessions.pop(victim).slot)
                self.stats["evictions"] += 1
        return self.cache.allocate()

    def _new_session(self, session_id: str, keep: set[str], tokens: list[int], reuse: bool) -> HeldSession:
        """A session for ``tokens``, starting from the longest prefix of them already cached."""
        best, best_len, live = None, 0, False
        if reuse and self.prefix_caching:
            limit = len(tokens) - 1  # the last token is always fed (its logits answer)
            for slot, held in self.retained.items():
                m = common_prefix(held, tokens, limit)
                if m > best_len:
                    best, best_len, live = slot, m, False
            for s in self.sessions.values():
                m = common_prefix(s.committed, tokens, min(limit, s.cached))
                if m > best_len and m >= MIN_PREFIX_COPY:
                    best, best_len, live = s.slot, m, True
        # take over a retained slot (K/V in place) only when its whole prefix is reused, or when it is
        # the only slot there is to take; a partial match (another prompt's shared system prompt) is
        # copied instead, so the retained prefix still answers a later repeat of its own prompt
        from_retained = best is not None and not live
        take_over = from_retained and (
            best_len == len(self.retained[best]) or (self.cache.num_free == 0 and len(self.retained) == 1)
        )
        if from_retained and not take_over and best_len < MIN_PREFIX_COPY:
            best, best_len, from_retained = None, 0, False  # too short to be worth a copy
        if take_over:
            del self.retained[best]
            slot = best
        else:
            if from_retained:
                self.retained.move_to_end(best)  # just used: not the one _slot gives back
            slot = self._slot(keep)
            if best is not None:  # copy the shared positions from the other slot
                self.cache.k[:, slot, :, :best_len] = self.cache.k[:, best, :, :best_len]
                self.cache.v[:, slot, :, :best_len] = self.cache.v[:, best, :, :best_len]
        if best is not None:
            self.stats["prefix_hits"] += 1
            self.stats["prefix_tokens"] += best_len
        s = self.sessions[session_id] = HeldSession(slot, tokens[:best_len], best_len)  # _take sets the length
        return s

    def waits_for_sibling(self, req: VerifyRequest, arriving: list[list[int]]) -> bool:
        """A new session whose prompt another new session of the call (an earlier choice of the same
        request, n > 1) is about to prefill, beyond what the cache already holds: it answers
        ``resync`` and comes back in the follow-up call of the same round, where it copies the
        sibling's K/V instead of computing it again."""
        if not (self.prefix_caching and req.base == 0 and arriving) or req.session_id in self.sessions:
            return False
        limit = len(req.tokens) - 1
        shared = max(common_prefix(t, req.tokens, limit) for t in arriving)
        if shared < MIN_PREFIX_COPY:
            return False
        held = max(
            [common_prefix(old, req.tokens, limit) for old in self.retained.values()]
            + [common_prefix(s.committed, req.tokens, min(limit, s.cached)) for s in self.sessions.values()],
            default=0,
        )
        return shared > held

    def take(self, req: VerifyRequest, keep: set[str], reuse: bool) -> HeldSession | None:
        """The session with its committed copy updated from the request's delta (None: resync).
        ``reuse``: a new session may start from a cached prefix (not when its features only come
        from a forward)."""
        s = self.sessions.get(req.session_id)
        if s is None or len(s.committed) < req.base:
            if req.base > 0:
                return None
            if s is None:
                s = self._new_session(req.session_id, keep, list(req.tokens), reuse)
        self.sessions.move_to_end(req.session_id)
        base, tokens = req.base, list(req.tokens)
        length = base + len(tokens)
        if not length:
            raise ValueError(f"session {req.session_id}: no tokens to verify")
        need = length + len(req.drafts)
        if need > self.max_model_len:
            raise ContextTooLongError(
                f"session {req.session_id}: {need} tokens exceed the context of {self.max_model_len}"
            )
        # keep the cached K/V of the longest prefix still committed; the last committed token is
        # always fed again (its logits predict the first draft). The first ``base`` tokens are the
        # replica's own: only the delta is compared and written, never the whole context.
        limit = min(s.cached, length - 1)
        m = limit if limit <= base else base + common_prefix(s.committed[base:], tokens, limit - base)
        if req.score_from is not None:  # the logits that score position p come from feeding p - 1
            m = min(m, max(0, req.score_from - 1))
        del s.committed[base:]
        s.committed.extend(tokens)
        s.cached = m
        self.cache.lengths[s.slot] = m
        return s
