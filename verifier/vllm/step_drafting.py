"""Drafts for a verifier that schedules its own steps (the vLLM backend), framework-free.

vLLM decides which requests run in each engine step; after the step's verify forward it asks its
proposer for the next drafts of every running request at once. ``StepDrafting`` turns that
moment into one batched call to a draft source (an in-process proposer, or the drafter pool): per
request the committed tokens travel as a delta against what the source already holds, together
with the features of the positions the target newly verified, exactly as the Router sends them
with the torch backend (``DraftRequest``).

Per request it keeps every verified position's features (the target's paged cache cannot give
them back; ``PrefixFeatures`` keeps them by block for prefixes the verifier's prefix cache will
skip), so a drafter replica that lost a session (``resync``) or some features
(``needs_features_from``) gets them again in the same step. A drafter that reads only the latest
verified feature (``latest_feature_only``: MoA trained with ``cross_attention_latest_only``) needs
none of that: per request only the newest verified position's feature-head input is kept (one row,
replaced every step), its feature is computed only when the request drafts and sent alone, so
steps without drafts cost no feature work, a long pause costs no backlog, and a prefix-cache hit
needs no stored features.

When the source fails (a drafter replica died, a timeout) the step goes on without drafts —
target-only decoding — and drafting is retried after ``retry_after_s``; every session is then
resent whole (the replica may be new).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from moa_serve.engine.draft_length import DraftLength
from moa_serve.protocol import DraftRequest, DraftResult
from moa_serve.sampling import GREEDY
from moa_serve.verifier.vllm.feature_cache import PrefixFeatures

log = logging.getLogger(__name__)


class DraftSource(Protocol):
    """What the step drafter calls: an in-process proposer, or a drafter pool handle."""

    def propose(self, requests: list[DraftRequest]) -> list[DraftResult]: ...

    def release(self, session_ids: list[str]) -> None: ...


class ProposerSource:
    """A proposer in this process (``moa generate --backend vllm``, ``moa bench``)."""

    def __init__(self, proposer):
        self.proposer = proposer

    def propose(self, requests: list[DraftRequest]) -> list[DraftResult]:
        return self.proposer.propose(requests)

    def release(self, session_ids: list[str]) -> None:
        for sid in session_ids:
            self.proposer.release(sid)


@dataclass
class StepRow:
    """One running request after an engine step."""

    session_id: str
    tokens: Sequence[int]  # all its tokens (prompt + output); the newest is not in the target cache yet
    feature_start: int = 0  # position of feature_input[0]: where this step's forward began for the request
    # the feature head's input for the positions this step verified (n may be 0), turned into
    # features by ``StepDrafting.feature_fn`` only when the request drafts (a step the governor
    # runs without drafts costs none)
    feature_input: torch.Tensor | None = None
    sampled: bool = True  # the step produced tokens (False: mid chunked prefill, nothing to draft from)


class FeatureBuffer:
    """Features of one request's verified positions, growing in place (amortized doubling)."""

    def __init__(self):
        self.data: torch.Tensor | None = None
        self.length = 0

    def put(self, start: int, feats: torch.Tensor) -> bool:
        """Writes features of positions start.. (dropping any at or after ``start``: rejected
        drafts, a re-prefill). False, with nothing written, if positions before ``start`` are
        missing (their forward was skipped, e.g. a prefix-cache hit)."""
        if start > self.length:
            return False
        end = start + feats.shape[0]
        if self.data is None or end > self.data.shape[0]:
            cap = max(end, 2 * (self.data.shape[0] if self.data is not None else 64))
            grown = feats.new_empty(cap, feats.shape[1])
            if self.data is not None:
                grown[:start] = self.data[:start]
            self.data = grown
        self.data[start:end] = feats
        self.length = end
        return True

    def since(self, start: int) -> torch.Tensor | None:
        if self.data is None or start >= self.length:
            return None
        return self.data[start : self.length].clone()


class PendingInputs:
    """Feature-head inputs of positions ``start..`` not turned into features yet."""

    def __init__(self):
        self.start = 0
        self.chunks: list[torch.Tensor] = []
        self.length = 0  # positions held

    @property
    def end(self) -> int:
        return self.start + self.length

    def put(self, start: int, inputs: torch.Tensor) -> None:
        """Inputs of positions start.. (``start`` within [self.start, self.end]), dropping any
        held at or after ``start``."""
        keep = start - self.start
        if keep < self.length:
            rows = torch.cat(self.chunks)[:keep] if keep else None
            self.chunks = [rows] if rows is not None else []
            self.length = keep
        self.chunks.append(inputs)
        self.length += inputs.shape[0]

    def take(self) -> torch.Tensor | None:
        """All held inputs (then empty, starting where they ended)."""
        if not self.length:
            return None
        rows = torch.cat(self.chunks)
        self.start, self.chunks, self.length = self.end, [], 0
        return rows


@dataclass
class _Track:
    features: FeatureBuffer = field(default_factory=FeatureBuffer)
    pending: PendingInputs = field(default_factory=PendingInputs)
    sent_tokens: int = 0  # committed tokens the source holds
    sent_features: int = 0  # features the source holds
    features_broken: bool = False  # a gap in the features: this request gets no drafts
    stored: tuple[int, int | None] = (0, None)  # blocks of it in prefix_features, and their chain hash
    # latest_feature_only: (position, feature-head input [1, ...]) of the newest verified position,
    # and (position, feature [1, H]) of the newest one computed
    latest_input: tuple[int, torch.Tensor] | None = None
    latest_feature: tuple[int, torch.Tensor] | None = None
    last_tokens: int = 0  # tokens at the previous step (acceptance statistics)
    sampled: bool = False  # whether a step sampled a token for it yet (its prompt is past)
    last_drafts: int = 0  # drafts proposed at the previous step
    drafted: int = 0  # drafts this request verified so far
    accepted: int = 0  # of those, accepted by the target


@dataclass
class StepStats:
    steps: int = 0  # engine steps with at least one request asking for drafts
    calls: int = 0  # calls to the draft source (retries included)
    drafted: int = 0  # drafts handed to the verifier
    verified_rounds: int = 0  # request-steps that verified drafts
    accepted: int = 0  # drafts the target accepted in those request-steps
    resyncs: int = 0  # sessions the source asked to resend
    failures: int = 0  # source calls that raised
    skipped_steps: int = 0  # steps without drafts because the source was down
    governed_steps: int = 0  # steps the governor ran without drafts (speculation did not pay)
    dropped_features: int = 0  # sessions that stopped drafting: too long without a draft
    prefix_restored: int = 0  # requests whose prefix-cached positions got their features from the store
    features_missing: int = 0  # requests that began past position 0 with no features for the gap: no drafts
    feature_s: float = 0.0  # computing lazy features (inside draft_s)
    draft_s: float = 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["draft_s"] = round(self.draft_s, 4)
        d["feature_s"] = round(self.feature_s, 4)
        d["acceptance_rate"] = round(self.accepted / self.drafted, 4) if self.drafted else 0.0
        return d


@dataclass
class StepFeatures:
    """How a drafter's features reach ``StepDrafting``.

    ``needed``: the drafter reads features (False: prompt lookup, an independent drafter).
    ``fn``: lazy features: rows carry the feature head's inputs, and ``fn`` (batched over the
    sessions of a draft call; None: the inputs are the features) turns them into features only for
    sessions that draft. A session holding more than ``max_pending_positions`` inputs has them
    computed while speculation is in force, and otherwise drops them (bounded memory) and decodes
    without drafts to its end (``_bound_pending``).
    ``latest_only``: the drafter reads only the freshest verified feature (MoA with
    cross_attention_latest_only): only that position's input is kept, its feature computed when the
    request drafts and sent alone (the drafter takes features past a gap).
    ``prefix_cache``: the features of prefixes the verifier's prefix cache will skip (None: it has
    none)."""

    needed: bool = True
    fn: Callable | None = None
    latest_only: bool = False
    max_pending_positions: int = 64
    prefix_cache: PrefixFeatures | None = None


class StepDrafting:
    def __init__(
        self,
        source: DraftSource,
        num_drafts: int,
        features: StepFeatures | None = None,
        *,
        governor=None,
        length: DraftLength | None = None,
        retry_after_s: float = 5.0,
        clock=time.monotonic,
    ):
        """``governor``: the speculation governor (None: every step drafts); ``length``: chooses
        each drafting step's draft length from measured costs (None: ``num_drafts`` always);
        ``retry_after_s``: how long a failing draft source is left alone; ``clock``: seconds
        (tests pass their own)."""
        if num_drafts < 1:
            raise ValueError("num_drafts must be >= 1")
        f = features or StepFeatures()
        self.source = source
        self.num_drafts = num_drafts
        self.needs_features = f.needed
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.tracks: dict[str, _Track] = {}
        self.stats = StepStats()
        self._down_until = float("-inf")
        self.governor = governor
        self.length = length
        # the worker binding (backend.bind_worker) sets feature_fn and latest_feature_only once the
        # drafter's feature head is on the worker
        self.feature_fn = f.fn
        self.max_pending_positions = f.max_pending_positions
        self.latest_feature_only = f.latest_only
        self.prefix_features = f.prefix_cache
        # (time, batch, drafts handed to its sampled requests, backlog seconds, draft seconds) of the
        # previous step
        self._last: tuple[float, int, int, float, float] | None = None
        self._backlog_s = 0.0  # this step's seconds computing features of positions verified before it

    # ------------------------------------------------------------------ the step
    def step(self, rows: list[StepRow]) -> list[list[int]]:
        """Drafts for every row (empty lists where there are none), one source call for all."""
        now = self.clock()
        self._release_absent({r.session_id for r in rows})
        wanting, committed = [], 0
        # the forward that just ran carried a prompt (a chunk of a prefill, or a prefill's last
        # chunk: the request's first sampled token): its seconds are mostly the prompt's, in either
        # mode, so the governor does not time it (such outliers would sway its moving averages)
        prompted = False
        for r in rows:
            t = self.tracks.setdefault(r.session_id, _Track())
            prompted = prompted or not (r.sampled and t.sampled)
            t.sampled = t.sampled or r.sampled
            if r.sampled and t.last_tokens:
                committed += max(0, len(r.tokens) - t.last_tokens)
            self._account(t, r)
            if self.needs_features and not t.features_broken:
                self._keep_features(t, r)
            if r.sampled and not t.features_broken and len(r.tokens) > 0:
                wanting.append(r)
        self._observe(now, committed, timed=not prompted)
        drafts = {r.session_id: [] for r in rows}
        # the governor's batch size is the step's (requests that sampled), not the number that can
        # draft: a step of 16 requests of which one drafts costs what a step of 16 costs
        batch = sum(r.sampled for r in rows)
        speculate = bool(wanting) and (self.governor is None or self.governor.speculate(batch))
        drafting = speculate and now >= self._down_until
        draft_s = 0.0
        self._bound_pending(rows, wanting, drafting, batch)
        if wanting:
            self.stats.steps += 1
            if not speculate:
                self.stats.governed_steps += 1
            elif not drafting:
                self.stats.skipped_steps += 1
            else:
                t0 = self.clock()
                # a latest-only drafter's request whose newest position was not captured (the
                # governor was expected to keep drafting off) waits for the next step
                fresh = [r for r in wanting if self._fresh(self.tracks[r.session_id], r)]
                k = self.length.choose(batch) if self.length is not None else self.num_drafts
                drafts.update(self._draft(fresh, k))
                draft_s = self.clock() - t0
                self.stats.draft_s += draft_s
                if self.length is not None and any(drafts.values()):  # a failed call times nothing
                    self.length.observe_call(k, draft_s)
        for r in rows:
            t = self.tracks[r.session_id]
            t.last_tokens, t.last_drafts = len(r.tokens), len(drafts[r.session_id])
            self.stats.drafted += t.last_drafts
        # the governor times steps that drafted against steps that did not (whatever the reason)
        handed = sum(len(drafts[r.session_id]) for r in rows if r.sampled)
        self._last = (now, batch, handed, self._backlog_s, draft_s) if wanting else None
        self._backlog_s = 0.0
        return [drafts[r.session_id] for r in rows]

    def wants_features(self, requests: int) -> bool:
        """Asked before a verify forward in which ``requests`` requests will sample: whether its
        features may be needed. Only a latest-only drafter can do without them (a step it skips
        leaves a stale input that is never sent: such a request waits for a fresh one), and only
        while the governor will not draft after this step."""
        return not (
            self.latest_feature_only
            and self.governor is not None
            and not self.governor.next_speculates(max(1, requests))
        )

    def keeps_features(self, session_id: str) -> bool:
        """Whether this request's feature inputs are still wanted (unknown requests: yes)."""
        t = self.tracks.get(session_id)
        return self.needs_features and (t is None or not t.features_broken)

    def _keep_features(self, t: _Track, r: StepRow) -> None:
        if r.feature_input is None or not r.feature_input.shape[0]:
            return
        if self.latest_feature_only:
            t.latest_input = (r.feature_start + r.feature_input.shape[0] - 1, r.feature_input[-1:])
            return
        start = r.feature_start
        if start > t.pending.end and not self._restore_prefix(t, r):
            t.features_broken = True
            self.stats.features_missing += 1
            log.debug(
                "request %s: features missing before position %d (a prefix-cache hit on "
                "positions never featured): it decodes without drafts",
                r.session_id,
                start,
            )
            return
        if start < t.pending.start:  # recomputed positions: some were features already
            t.features.length = min(t.features.length, start)
            t.pending = PendingInputs()
            t.pending.start = start
        t.pending.put(start, r.feature_input)

    def _restore_prefix(self, t: _Track, r: StepRow) -> bool:
        """A new request whose forward began at ``feature_start`` > 0 (its first blocks came from
        the verifier's prefix cache): their features from ``prefix_features``, if held."""
        if self.prefix_features is None or t.features.length or t.pending.end:
            return False
        found = self.prefix_features.lookup(r.tokens, r.feature_start)
        if found is None:
            return False
        feats, t.stored = found
        self.stats.prefix_restored += 1
        t.features.put(0, feats)
        t.pending.start = r.feature_start
        return True

    def _bound_pending(self, rows: list[StepRow], wanting: list[StepRow], drafting: bool, batch: int) -> None:
        """Sessions holding more than ``max_pending_positions`` feature inputs (a long prompt's
        prefill, or many steps without drafts): while speculation is in force (this step drafts,
        or the governor's next step will) their features are computed now, in one feature-head
        call for all of them (the drafting sessions' own happen in ``_draft``); otherwise their
        inputs are dropped and they decode without drafts to their end (bounded memory, no
        feature cost while speculation does not pay)."""
        drafting_ids = {r.session_id for r in wanting} if drafting else set()
        over = [
            r
            for r in rows
            if r.session_id not in drafting_ids
            and self.tracks[r.session_id].pending.length > self.max_pending_positions
        ]
        if not over:
            return
        if drafting or self.governor is None or self.governor.next_speculates(max(1, batch)):
            t0 = time.perf_counter()
            self._materialize(over)
            spent = time.perf_counter() - t0
            self.stats.feature_s += spent
            self.stats.draft_s += spent
            return
        for r in over:
            t = self.tracks[r.session_id]
            t.features_broken, t.pending = True, PendingInputs()
            self.stats.dropped_features += 1

    def _materialize(self, rows: list[StepRow]) -> None:
        """Features of every pending position of these sessions, in one feature-head call. The
        share of its time spent on positions verified before this step (a backlog from steps
        without drafts) is kept apart in ``_backlog_s``: the governor times what a mode costs
        while it lasts, not the catching up when speculation resumes."""
        if self.latest_feature_only:
            self._materialize_latest([self.tracks[r.session_id] for r in rows])
            return
        work = [(r, self.tracks[r.session_id]) for r in rows]
        work = [(r, t, t.pending.start, t.pending.take()) for r, t in work if t.pending.length]
        if not work:
            return
        t0 = self.clock()
        inputs = torch.cat([x for *_, x in work])
        feats = self.feature_fn(inputs) if self.feature_fn is not None else inputs
        fresh = sum(min(r.feature_input.shape[0], x.shape[0]) for r, *_, x in work if r.feature_input is not None)
        self._backlog_s += (self.clock() - t0) * (1 - fresh / inputs.shape[0])
        chunks = torch.split(feats, [x.shape[0] for *_, x in work])
        for (r, t, start, _), chunk in zip(work, chunks):
            t.features.put(start, chunk)
            if self.prefix_features is not None:
                t.stored = self.prefix_features.remember(r.tokens, t.features.data[: t.features.length], t.stored)

    def _materialize_latest(self, tracks: list[_Track]) -> None:
        """The feature of each request's newest verified position (one feature-head row each)."""
        work = [t for t in tracks if t.latest_input is not None]
        if not work:
            return
        inputs = torch.cat([t.latest_input[1] for t in work])
        feats = self.feature_fn(inputs) if self.feature_fn is not None else inputs
        for i, t in enumerate(work):
            t.latest_feature, t.latest_input = (t.latest_input[0], feats[i : i + 1]), None

    def _fresh(self, t: _Track, r: StepRow) -> bool:
        """A latest-only drafter drafts from the newest verified position's feature or not at all
        (its input is missing when the step was not captured)."""
        if not (self.needs_features and self.latest_feature_only):
            return True
        newest = len(r.tokens) - 2
        return any(x is not None and x[0] == newest for x in (t.latest_input, t.latest_feature))

    def _features_held(self, t: _Track) -> int:
        """Positions whose features this request can send: with ``latest_feature_only`` up to its
        newest computed one (the earlier ones are never read)."""
        if self.latest_feature_only:
            return t.latest_feature[0] + 1 if t.latest_feature is not None else 0
        return t.features.length

    def _observe(self, now: float, committed: int, timed: bool) -> None:
        """The previous step, now finished: its seconds, committed tokens and draft call's seconds
        (which price the governor's probes) go to the governor, and the seconds of the verify
        forward that followed, by the rows it verified, to the draft length's cost fit; unless the
        step is not ``timed``."""
        if self._last is None or not timed:
            return
        t, n, handed, backlog_s, draft_s = self._last
        seconds = max(now - t - backlog_s, 1e-6)
        if self.governor is not None:
            self.governor.observe(n, handed > 0, seconds, committed, draft_s)
        if self.length is not None and seconds > draft_s:
            self.length.observe_step(n + handed, seconds - draft_s)

    def _account(self, t: _Track, r: StepRow) -> None:
        if t.last_drafts and r.sampled and len(r.tokens) > t.last_tokens:
            accepted = min(t.last_drafts, len(r.tokens) - t.last_tokens - 1)
            self.stats.verified_rounds += 1
            self.stats.accepted += accepted
            t.drafted += t.last_drafts
            t.accepted += accepted
            if self.length is not None:
                self.length.observe_drafts(t.last_drafts, accepted)

    def request_counts(self, session_id: str) -> tuple[int, int]:
        """(drafts verified, drafts accepted) of a running request so far; a request's counts
        stay readable until the step after it finished."""
        t = self.tracks.get(session_id)
        return (t.drafted, t.accepted) if t is not None else (0, 0)

    def _request(self, r: StepRow, k: int) -> DraftRequest:
        t = self.tracks[r.session_id]
        if t.sent_tokens > len(r.tokens):  # never expected (tokens only grow): resend whole
            t.sent_tokens = t.sent_features = 0
        start, feats = t.sent_features, None
        if self.needs_features and self.latest_feature_only:
            if t.latest_feature is not None and t.latest_feature[0] >= t.sent_features:
                start, feats = t.latest_feature  # alone: the positions before it are never read
        elif self.needs_features:
            feats = t.features.since(t.sent_features)
        return DraftRequest(
            r.session_id,
            [int(x) for x in r.tokens[t.sent_tokens :]],
            k,
            feature_start=start,
            features=feats,
            sampling=GREEDY,
            base=t.sent_tokens,
        )

    def _draft(self, rows: list[StepRow], k: int) -> dict[str, list[int]]:
        """``k`` drafts (at most) for each of these rows, in one call to the source (a second only
        for sessions it asks to resend)."""
        out: dict[str, list[int]] = {}
        if not rows:
            return out
        if self.needs_features:
            t0 = time.perf_counter()
            self._materialize(rows)
            self.stats.feature_s += time.perf_counter() - t0
        pending = rows
        for _ in range(2):  # a second call only for sessions the source asked to resend
            try:
                self.stats.calls += 1
                results = self.source.propose([self._request(r, k) for r in pending])
            except Exception as exc:  # noqa: BLE001 - any drafter failure: verify without drafts
                self._source_down(exc)
                return out
            retry = []
            for r, res in zip(pending, results):
                t = self.tracks[r.session_id]
                if res.resync:
                    self.stats.resyncs += 1
                    t.sent_tokens, t.sent_features = 0, 0
                    retry.append(r)
                    continue
                t.sent_tokens = len(r.tokens)
                if res.needs_features_from is not None:
                    self.stats.resyncs += 1
                    held = self._features_held(t)
                    if self.latest_feature_only:  # from the newest one at most (sent again)
                        held = max(0, held - 1)
                    t.sent_features = min(res.needs_features_from, held)
                    retry.append(r)
                    continue
                t.sent_features = self._features_held(t) if self.needs_features else 0
                out[r.session_id] = [int(x) for x in res.drafts[:k]]
            if not retry:
                break
            pending = retry
        return out

    def _source_down(self, exc: Exception) -> None:
        self.stats.failures += 1
        self._down_until = self.clock() + self.retry_after_s
        for t in self.tracks.values():  # the replica that answers next may hold nothing
            t.sent_tokens = t.sent_features = 0
        log.warning(
            "drafter unavailable (%s: %s): target-only decoding for %.0f s", type(exc).__name__, exc, self.retry_after_s
        )

    # ------------------------------------------------------------------ sessions
    def _release_absent(self, present: set[str]) -> None:
        """Requests no longer running (finished, aborted, preempted) leave the source; a preempted
        one comes back re-prefilled and is sent whole again."""
        gone = [sid for sid in self.tracks if sid not in present]
        if not gone:
            return
        for sid in gone:
            del self.tracks[sid]
        try:
            self.source.release(gone)
        except Exception as exc:  # noqa: BLE001 - the source evicts by LRU anyway
            log.warning("drafter release failed (%s): its LRU will evict", type(exc).__name__)
