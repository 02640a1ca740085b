"""Awaiting fake pools for RoundService that speak the delta protocol (``base`` + ``tokens``,
``resync``, chunked prefill, ``needs_features_from``) over a deterministic toy "model": groups
interleave on ``asyncio.sleep``, so ordering, failure and timeout defects show up without Ray
and without real models. Used by tests/engine/test_service_*.py, tests/engine/test_draft_gate.py
and tests/integration/test_router_loss.py.

The toy target's greedy next token is a function of the whole prefix; the fake feature of
position p is the number p, so the fake drafter checks that it got the right positions."""

from __future__ import annotations

import asyncio
from collections.abc import Container

import torch

from moa_serve.engine.options import RoundOptions
from moa_serve.engine.pool_calls import Pools
from moa_serve.engine.round_service import RoundService
from moa_serve.engine.session import Session
from moa_serve.protocol import DraftResult, VerifyResult

VOCAB = 97


def next_token(seq: list[int]) -> int:
    return (seq[-1] * 31 + (seq[-2] if len(seq) > 1 else 0) * 7 + len(seq)) % VOCAB


def reference(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


def fake_features(start: int, end: int) -> torch.Tensor:
    return torch.arange(start, end, dtype=torch.float32)[:, None].repeat(1, 3)


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class _FakePool:
    """What both fakes share: a delay per call, scripted events by call number (1-based):
    ``fail_on[n] = exc`` raises, ``hang_on`` computes then hangs (the call "ran there" but times
    out here), ``evict_on[n] = sid`` forgets a session first; ``fail_groups`` always raise."""

    def __init__(self, delay: float = 0.0, reverse: bool = False):
        self.delay, self.reverse = delay, reverse
        self.copies: dict[str, list[int]] = {}
        self.calls: list[tuple] = []  # (group, requests)
        self.fail_on: dict[int, Exception] = {}
        self.fail_groups: dict = {}
        self.hang_on: set[int] = set()
        self.evict_on: dict[int, str] = {}
        self.errors: list[str] = []

    async def __call__(self, group, reqs):
        self.calls.append((group, list(reqs)))
        n = len(self.calls)
        await asyncio.sleep(self.delay)
        if group in self.fail_groups:
            raise self.fail_groups[group]
        if n in self.fail_on:
            raise self.fail_on[n]
        if n in self.evict_on:
            self.evict(self.evict_on[n])
        out = [self._one(q) for q in reqs]
        if n in self.hang_on:
            await asyncio.sleep(3600)
        return out[::-1] if self.reverse else out

    def _copy(self, q) -> list[int] | None:
        """The replica's copy after this request, or None when it lacks ``base`` tokens."""
        old = self.copies.get(q.session_id)
        if q.base > (len(old) if old is not None else 0):
            return None
        return (old or [])[: q.base] + list(q.tokens)


class FakeVerifier(_FakePool):
    def __init__(self, chunk: int = 0, **kw):
        super().__init__(**kw)
        self.chunk = chunk  # committed tokens prefilled per call (0: all at once)
        self.cached: dict[str, int] = {}
        self.token_rounds: dict[str, int] = {}  # results that carried tokens, per session

    def evict(self, sid: str) -> None:
        self.copies.pop(sid, None)
        self.cached.pop(sid, None)

    def _one(self, q) -> VerifyResult:
        old = self.copies.get(q.session_id) or []
        copy = self._copy(q)
        if copy is None:
            return VerifyResult(q.session_id, [], 0, 0, None, resync=True)
        cached = min(self.cached.get(q.session_id, 0), _lcp(old, copy), len(copy) - 1)
        self.copies[q.session_id] = copy
        if self.chunk and len(copy) - cached > self.chunk + 1:  # a chunk of the prompt, nothing else
            if q.drafts:
                self.errors.append(f"{q.session_id}: drafts while prefilling")
            end = cached + self.chunk
            self.cached[q.session_id] = end
            return VerifyResult(
                q.session_id,
                [],
                0,
                cached,
                fake_features(cached, end),
                num_computed=self.chunk,
                prefill_remaining=len(copy) - end,
            )
        seq, acc = list(copy), []
        for d in q.drafts:
            if d != next_token(seq):
                break
            acc.append(d)
            seq.append(d)
        new = acc + [next_token(seq)]
        end = len(copy) + len(acc)  # positions now cached (the new bonus token is not)
        # multi-step decoding, as the runner does it: more tokens, their features not attached
        forwards = 1
        while (
            (not q.drafts or not q.want_features)
            and forwards < q.decode_steps
            and (q.max_tokens <= 0 or len(new) < q.max_tokens)
            and new[-1] not in q.stop_token_ids
        ):
            new.append(next_token(seq + new))
            forwards += 1
        self.cached[q.session_id] = end + len(new) - 1 - len(acc)
        self.copies[q.session_id] = copy + new
        self.token_rounds[q.session_id] = self.token_rounds.get(q.session_id, 0) + 1
        start = cached  # features of the newly cached positions, or from where the sender lacks them
        if q.want_features and q.features_from is not None:
            start = max(0, min(start, q.features_from))
        feats = fake_features(start, end) if q.want_features else None
        # as the runner counts it: each extra decode step computes one more position
        return VerifyResult(
            q.session_id,
            new,
            len(acc),
            start,
            feats,
            num_computed=len(copy) - cached + len(q.drafts) + len(new) - 1 - len(acc),
        )


class FakeDrafter(_FakePool):
    def __init__(self, wrong_every: int = 0, **kw):
        super().__init__(**kw)
        self.wrong_every = wrong_every  # every n-th draft is wrong
        self.held: dict[str, int] = {}
        self.received: dict[str, list[int]] = {}  # feature positions received, per session
        self._n = 0

    def evict(self, sid: str) -> None:
        self.copies.pop(sid, None)
        self.held.pop(sid, None)

    def _one(self, q) -> DraftResult:
        copy = self._copy(q)
        if copy is None:
            return DraftResult(q.session_id, [], resync=True)
        self.copies[q.session_id] = copy
        held = self.held.get(q.session_id, 0)
        if q.feature_start > held:
            return DraftResult(q.session_id, [], needs_features_from=held)
        if q.features is not None:
            if not torch.equal(q.features, fake_features(q.feature_start, q.feature_start + len(q.features))):
                self.errors.append(f"{q.session_id}: features from {q.feature_start} are not those positions")
            self.held[q.session_id] = q.feature_start + len(q.features)
            self.received.setdefault(q.session_id, []).extend(range(q.feature_start, self.held[q.session_id]))
        drafts, seq = [], list(copy)
        for _ in range(q.num_drafts):
            self._n += 1
            t = next_token(seq)
            if self.wrong_every and self._n % self.wrong_every == 0:
                t = (t + 1) % VOCAB
            drafts.append(t)
            seq.append(t)
        return DraftResult(q.session_id, drafts)


class FakeRelease:
    def __init__(self, *pools, fail: int = 0, delay: float = 0.001):
        self.pools, self.fail, self.delay = pools, fail, delay
        self.released: list[str] = []
        self.calls = 0

    async def __call__(self, group, ids):
        self.calls += 1
        await asyncio.sleep(self.delay)
        if self.fail:
            self.fail -= 1
            raise ConnectionError("release failed")
        for sid in ids:
            for p in self.pools:
                p.evict(sid)
        self.released += ids


def make_session(i: int, prompt_len: int = 6, max_new: int = 20, k: int = 3) -> Session:
    prompt = [(i * 13 + j * 5 + 1) % VOCAB for j in range(prompt_len)]
    return Session(f"s{i}", prompt, max_new, num_speculative_tokens=k, max_model_len=256)


def make_service(verifier, drafter=None, **kw):
    release = FakeRelease(*(p for p in (verifier, drafter) if p is not None))
    kw.setdefault("retry_backoff_s", 0.01)
    kw.setdefault("speculation_governor", False)  # these tests follow every round's drafts
    kw.setdefault("decode_steps", 1)  # one token per draft-free round, as these tests count them
    extra = {k: kw.pop(k) for k in ("features", "lookup", "groups", "observer") if k in kw}
    pools = Pools(verifier, drafter, release, cut=kw.pop("cut", None))
    return RoundService(pools, RoundOptions(**kw), **extra), release


async def run_all(svc, sessions):
    """Every session to completion through ``svc``, which is then stopped: their (tokens, finish)."""
    outs = await asyncio.gather(*(collect(svc, svc.submit(s)) for s in sessions))
    await svc.stop()
    return outs


async def collect(svc, tracked) -> tuple[list[int], str]:
    toks, finish = [], None
    async for ev in svc.stream(tracked):
        toks += ev.tokens
        finish = ev.finish_reason
    return toks, finish


def requests_of(pool, sid):
    return [q for _, reqs in pool.calls for q in reqs if q.session_id == sid]


class ScriptedGovernor:
    """Speculation on/off by round number (1-based), as a SpeculationGovernor would decide;
    ``observed``: whether each round it was shown speculated."""

    def __init__(self, on_rounds: Container[int]):
        self.on_rounds, self.rounds = on_rounds, 0
        self.observed: list[bool] = []

    def speculate(self, sessions: int, cap: int | None = None) -> bool:
        self.rounds += 1
        return self.rounds in self.on_rounds

    def next_speculates(self, sessions: int, cap: int | None = None) -> bool:
        return self.rounds + 1 in self.on_rounds

    def observe(self, sessions, speculated, seconds, tokens, draft_s=0.0) -> None:
        self.observed.append(speculated)

    def snapshot(self) -> dict:
        return {}
