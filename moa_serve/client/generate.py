"""Generation in client-server mode, on the device.

The device is a remote drafter pool of one: its proposer drafts locally exactly as a drafter
replica would (``DraftRequest`` with the committed tokens and the features it has not seen), the
server verifies the drafts in a shared round and answers the committed tokens plus the features
of the newly committed positions, which feed the next draft. K follows the measured round trip
and acceptance (``adaptive.KController``).

When the link goes down (``--offline degrade``, the default) the device keeps writing with the
drafter alone: those tokens are *offline* (unverified) events. A link is down once a call misses
its deadline, which follows the measured round trips (``deadline.CallDeadline``): a blackholed
link is noticed within seconds, a reset one at once. It probes the server with backoff;
once back, it sends the unverified tail as drafts (idempotent rounds: a round whose answer was
lost is answered again) and emits a *correction* where the target parts from it. A server that
lost the session answers 409 and gets the committed ids again (a new session). ``strict`` raises
``OfflineError`` instead. Every verified token is the target's own: the output equals plain
target decoding, except an unverified tail left when the server never came back."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from moa_serve.client.adaptive import KController
from moa_serve.client.device import DeviceDrafter
from moa_serve.client.transport import ResyncError, ServerError, Transport, Unreachable
from moa_serve.client_server import wire
from moa_serve.drafter.spec import TreeShape, parse_branching
from moa_serve.engine.session import FeatureStore
from moa_serve.protocol import DraftRequest
from moa_serve.sampling import GREEDY, SamplingParams

OFFLINE_MODES = ("degrade", "strict")
LOCAL_ID = "device"  # the local proposer's one session
# ``branching="auto"``: a dynamic tree while the measured round trip is long, chains otherwise. A
# tree pays over a slow link (emulated 4G) and costs over a fast one (loopback), with the threshold
# between (docs/benchmarks.md#client-server): where the link dominates a round, the server's wider
# verify is cheap next to the calls it saves.
AUTO = "auto"
AUTO_TREE = TreeShape((8, 3, 2), 0.03)
AUTO_MIN_ROUND_TRIP_S = 0.05


@dataclass(frozen=True)
class LinkPolicy:
    """What the client does when the server cannot be reached. ``offline``: ``degrade`` keeps
    writing with the drafter alone (unverified tokens, corrected when the link returns; at most
    ``offline_chunk`` of them per step) or ``strict`` stops (``OfflineError``). Reconnects back off
    from ``reconnect_backoff_s`` doubling up to ``max_backoff_s``; once the generation has ended
    offline, ``final_reconnects`` more attempts try to verify what was written."""

    offline: str = "degrade"
    offline_chunk: int = 4
    reconnect_backoff_s: float = 0.25
    max_backoff_s: float = 4.0
    final_reconnects: int = 8

    def __post_init__(self):
        if self.offline not in OFFLINE_MODES:
            raise ValueError(f"offline must be one of {OFFLINE_MODES}, got {self.offline!r}")


class HandshakeError(RuntimeError):
    """The device's drafter, target parts or tokenizer are not the server's."""


class OfflineError(ConnectionError):
    """``strict`` mode: the server is unreachable."""


@dataclass
class ClientEvent:
    """``verified``: generated tokens [position, position + n) are the target's. ``offline``: the
    drafter alone wrote them (unverified). ``correction``: the offline tokens from ``position`` on
    were wrong: the output is cut there and continues with ``tokens`` (verified)."""

    kind: str
    position: int
    tokens: list[int]


@dataclass
class ClientResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    verified_tokens: int
    offline_tokens: int  # unverified tokens at the end of the output (the server never came back)
    offline_generated: int  # tokens the drafter wrote offline (later verified, corrected or left)
    corrections: int
    corrected_tokens: int  # offline tokens replaced by a correction
    disconnections: int
    first_offline_s: float | None  # from the run's start to its first offline token (None: never offline)
    rounds: int  # answered rounds, the first (prefill) one included
    tree_rounds: int  # rounds whose drafts went as a tree (alternatives beside them)
    drafted_tokens: int
    accepted_tokens: int
    server_calls: int
    retries: int
    resyncs: int
    bytes_up: int
    bytes_down: int
    elapsed_s: float
    k: dict = field(default_factory=dict)
    events: list[ClientEvent] = field(default_factory=list, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def mean_accepted_length(self) -> float:
        return self.verified_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_dict(self) -> dict:
        n = max(1, self.num_tokens)
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "num_tokens": self.num_tokens,
            "finish_reason": self.finish_reason,
            "verified_tokens": self.verified_tokens,
            "offline_tokens": self.offline_tokens,
            "offline_generated": self.offline_generated,
            "corrections": self.corrections,
            "corrected_tokens": self.corrected_tokens,
            "disconnections": self.disconnections,
            "first_offline_s": None if self.first_offline_s is None else round(self.first_offline_s, 4),
            "server_calls": self.server_calls,
            "retries": self.retries,
            "resyncs": self.resyncs,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "bytes_per_token": round((self.bytes_up + self.bytes_down) / n, 1),
            "calls_per_token": round(self.server_calls / n, 4),
            "rounds": self.rounds,
            "tree_rounds": self.tree_rounds,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "elapsed_s": round(self.elapsed_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "k": self.k,
        }


class RemoteGenerator:
    def __init__(
        self,
        device: DeviceDrafter,
        transport: Transport,
        *,
        num_speculative_tokens: int = 4,
        adaptive_k: bool = True,
        feature_codec: str = "float16",
        branching: "TreeShape | str | tuple | None" = None,
        link: LinkPolicy | None = None,
    ):
        if feature_codec not in wire.FEATURE_CODECS:
            raise ValueError(f"feature_codec must be one of {wire.FEATURE_CODECS}, got {feature_codec!r}")
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        link = link or LinkPolicy()
        self.device, self.transport = device, transport
        self.k_max, self.adaptive_k = num_speculative_tokens, adaptive_k
        self.feature_codec, self.link = feature_codec, link
        # tree drafts (greedy): the drafter's runners-up per depth go with the chain, verified beside
        # it; "auto": AUTO_TREE while the round trip is long (a drafter that cannot branch: chains)
        branches = getattr(device.proposer, "branches", False)
        self.auto_tree = AUTO_TREE if branching == AUTO and branches else None
        self.branching = TreeShape() if branching == AUTO else parse_branching(branching)
        if branches:
            device.proposer.set_tree(self.branching)  # (a device reused by another generator included)
        elif self.branching:
            raise ValueError(f"drafter {device.name}: tree drafts need a trained drafter")
        self.identity: dict | None = None

    def handshake(self) -> dict:
        """The server's identity, checked against the device's (raises HandshakeError)."""
        if self.identity is not None:
            return self.identity
        try:
            ident = self.transport.info()
        except Unreachable as exc:
            raise OfflineError(f"the server is unreachable: {exc}") from exc
        ours = self.device.fingerprints
        for part in ("target", "tokenizer"):
            if ident.get(part) != ours[part]:
                raise HandshakeError(
                    f"the server's {part} (fingerprint {ident.get(part)}) is not the device's ({ours[part]}): "
                    f"the drafter {self.device.name} and its {part} must be the server's target {ident.get('model')!r}"
                )
        if self.device.needs_features:
            if ident.get("drafter") is None:
                raise HandshakeError(
                    "the server computes no drafter features (it serves no MoA or EAGLE-style "
                    f"drafter); the drafter {self.device.name} needs them"
                )
            if ident["drafter"] != ours["drafter"]:
                raise HandshakeError(
                    f"the drafter {self.device.name} (fingerprint {ours['drafter']}) is not the server's "
                    f"{ident.get('drafter_kind')} drafter ({ident['drafter']}): the server's verifier computes the "
                    "features with its own drafter's feature head, so the device must run that same checkpoint"
                )
        self.identity = ident
        return ident

    def start(
        self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams = GREEDY, ignore_eos: bool = False
    ) -> "GenerationRun":
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if not prompt:
            raise ValueError("prompt is empty")
        return GenerationRun(self, self.handshake(), list(prompt), max_new_tokens, sampling, ignore_eos)

    def generate(
        self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams = GREEDY, ignore_eos: bool = False
    ) -> ClientResult:
        run = self.start(prompt, max_new_tokens, sampling, ignore_eos)
        for _ in run:
            pass
        return run.result()


class GenerationRun:
    """One generation: iterate for its events, then ``result()``."""

    def __init__(
        self,
        gen: RemoteGenerator,
        ident: dict,
        prompt: list[int],
        max_new: int,
        sampling: SamplingParams,
        ignore_eos: bool,
    ):
        self.g, self.t, self.proposer = gen, gen.transport, gen.device.proposer
        # prompt lookup (a hybrid device) drafts only when greedy, online and offline alike (offline,
        # copying the context the target copies keeps the tail on its path longer: README); when
        # sampling, a copied draft has no distribution to send, so the trained drafter drafts alone
        self.drafting = self.proposer if sampling.greedy else gen.device.model
        self.max_new, self.sampling, self.ignore_eos = max_new, sampling, ignore_eos
        self.stops = frozenset() if ignore_eos else frozenset(ident["stop_token_ids"])
        self.max_drafts = int(ident["max_drafts"])
        self.max_alternatives = int(ident.get("max_alternatives", 0))  # 0: a server without tree drafts
        self.prompt_len = len(prompt)
        self.verified = list(prompt)  # committed: prompt + verified output
        self.tail: list[int] = []  # offline tokens, not verified yet
        self.tail_probs: list[torch.Tensor] = []  # their drafter distributions (sampling)
        self.features = FeatureStore()  # the server's features, by position
        # the server sends only each round's freshest feature (its drafter reads no other one)
        self.latest_only = ident.get("feature_positions") == "latest"
        self.fed_features = 0  # the local proposer holds features [0, fed_features)
        self.features_from: int | None = None  # ask the server to resend from here
        self.sid, self.round, self.finish = "", 1, None
        self.server_finished = False
        self.k = KController(gen.k_max, adaptive=gen.adaptive_k)
        self.tree = gen.branching  # the shape the device drafts this round
        if gen.auto_tree is not None:  # starts with chains (an earlier run may have left the tree)
            self.proposer.set_tree(self.tree)
        self.stats = {
            "rounds": 0,
            "tree_rounds": 0,
            "drafted": 0,
            "accepted": 0,
            "offline_generated": 0,
            "corrections": 0,
            "corrected_tokens": 0,
            "disconnections": 0,
            "resyncs": 0,
        }
        self.events: list[ClientEvent] = []
        self._offline_at: float | None = None  # when the first offline token was written
        self._calls0, self._retries0 = self.t.calls, self.t.retries
        self._up0, self._down0 = self.t.bytes_up, self.t.bytes_down
        self._t0 = self._t1 = time.perf_counter()
        self._iter = self._run()

    def __iter__(self) -> Iterator[ClientEvent]:
        return self

    def __next__(self) -> ClientEvent:
        ev = next(self._iter)
        self.events.append(ev)
        return ev

    def close(self) -> None:
        """Ends the run early; its server session is freed as at the end."""
        self._iter.close()

    @property
    def generated(self) -> int:
        return len(self.verified) - self.prompt_len

    @property
    def room(self) -> int:
        return self.max_new - self.generated - len(self.tail)

    # ------------------------------------------------------------------ the loop
    def _run(self) -> Iterator[ClientEvent]:
        try:
            try:
                yield from self._apply(*self._create(), [])
            except Unreachable as exc:  # nothing verified yet, no features: nothing to draft from
                raise OfflineError(f"the server is unreachable: {exc}") from exc
            while self.finish is None and self.generated < self.max_new:
                try:
                    yield from self._online_round()
                except Unreachable as exc:
                    if self.g.link.offline == "strict":
                        raise OfflineError(
                            f"the server became unreachable after {self.generated} verified tokens "
                            f"({exc}); --offline degrade would keep writing with the drafter"
                        ) from exc
                    yield from self._offline()
            self.finish = self.finish or "length"
        finally:
            self._t1 = time.perf_counter()
            self.proposer.release(LOCAL_ID)  # a hybrid releases its model's session too
            if self.sid and not self.server_finished:
                try:  # free the server's caches now rather than at its TTL
                    self.t.delete(self.sid)
                except (Unreachable, ServerError):
                    pass

    def _online_round(self) -> Iterator[ClientEvent]:
        if self.tail:  # verifying what was written offline
            drafts, probs = self._tail_drafts()
            yield from self._apply(*self._verify(drafts, probs), drafts)
            return
        k = min(self.k.k(), self.room - 1)
        self._choose_tree()
        t0 = time.perf_counter()
        drafts, probs, alternatives = self._draft(k) if k > 0 else ([], None, [])
        draft_s = time.perf_counter() - t0
        self.stats["tree_rounds"] += bool(alternatives)
        header, tensors = self._verify(drafts, probs, alternatives=alternatives)
        self.k.observe(len(drafts), int(header["accepted"]), draft_s, self.t.last_round_trip_s)
        yield from self._apply(header, tensors, drafts)

    def _choose_tree(self) -> None:
        """``branching="auto"``: the tree while the measured round trip is long, a chain otherwise."""
        if self.g.auto_tree is None:
            return
        rtt = self.k.round_trip_s
        want = self.g.auto_tree if rtt is not None and rtt >= AUTO_MIN_ROUND_TRIP_S else TreeShape()
        if want != self.tree:
            self.proposer.set_tree(want)
            self.tree = want

    def _offline(self) -> Iterator[ClientEvent]:
        """Writes with the drafter alone, probing the server with backoff; returns once a verify
        of the tail got through (or, when the output is complete, after the last probes failed)."""
        self.stats["disconnections"] += 1
        backoff = self.g.link.reconnect_backoff_s
        next_try, failed_at_end = time.monotonic() + backoff, 0
        while True:
            done = self.room <= 0 or bool(self.tail and self.tail[-1] in self.stops)
            if not done:
                pos = self.generated + len(self.tail)
                drafts, probs, _ = self._draft(min(self.g.link.offline_chunk, self.room))
                for i, tok in enumerate(drafts):
                    if tok in self.stops:
                        drafts = drafts[: i + 1]
                        break
                if drafts:
                    self.tail += drafts
                    if probs is not None:
                        self.tail_probs += list(probs[: len(drafts)])
                    self.stats["offline_generated"] += len(drafts)
                    if self._offline_at is None:
                        self._offline_at = time.perf_counter()
                    yield ClientEvent("offline", pos, list(drafts))
                else:
                    done = True
            if not done and time.monotonic() < next_try:
                continue
            if done:
                time.sleep(max(0.0, next_try - time.monotonic()))
            drafts, probs = self._tail_drafts()
            try:
                reply = self._verify(drafts, probs, attempts=1)
            except Unreachable:
                backoff = min(self.g.link.max_backoff_s, 2 * backoff)
                next_try = time.monotonic() + backoff
                if done:
                    failed_at_end += 1
                    if failed_at_end >= self.g.link.final_reconnects:
                        self.finish = "offline"  # the tail stays unverified
                        return
                continue
            yield from self._apply(*reply, drafts)
            return

    # ------------------------------------------------------------------ the device's drafter
    def _draft(self, k: int) -> tuple[list[int], torch.Tensor | None, list[list[int]]]:
        """k drafts after the committed tokens and the offline tail, from the local proposer, their
        distributions (sampling) and their alternatives (tree drafts)."""
        for _ in range(2):
            start = self.fed_features
            req = DraftRequest(
                LOCAL_ID, self.verified + self.tail, k, start, self.features.since(start), self.sampling, base=0
            )
            r = self.drafting.propose([req])[0]
            if r.needs_features_from is None:
                self.fed_features = self.features.end
                return list(r.drafts), r.probs, self._alternatives(r.alternatives)
            self.fed_features = min(r.needs_features_from, self.features.end)  # resend from there
        return [], None, []

    def _alternatives(self, alternatives: list[list[int]]) -> list[list[int]]:
        """As many of the drafter's alternatives as the server verifies per round, shallowest first."""
        out, room = [], self.max_alternatives
        for row in alternatives:
            out.append(list(row[:room]))
            room -= len(out[-1])
        while out and not out[-1]:
            out.pop()
        return out

    def _tail_drafts(self) -> tuple[list[int], torch.Tensor | None]:
        drafts = self.tail[: self.max_drafts]
        probs = torch.stack(self.tail_probs[: len(drafts)]) if self.tail_probs and not self.sampling.greedy else None
        return drafts, probs

    # ------------------------------------------------------------------ the server
    def _verify(
        self, drafts: list[int], probs, attempts: int | None = None, alternatives: list[list[int]] | None = None
    ):
        body = {"round": self.round, "committed_length": len(self.verified), "draft_ids": drafts}
        if alternatives:
            body["alternatives"] = alternatives
        if self.features_from is not None:
            body["features_from"] = self.features_from
        try:
            return self.t.verify(self.sid, body, {"draft_probs": probs} if probs is not None else None, attempts)
        except ResyncError:  # the server lost the session (restart, expiry): resend the committed ids
            self.stats["resyncs"] += 1
            return self._create(attempts)

    def _create(self, attempts: int | None = None):
        self.sid, self.round = secrets.token_urlsafe(12), 0  # 16 characters: a short URL per round
        s = self.sampling
        body = {
            "session_id": self.sid,
            "token_ids": self.verified,
            "max_tokens": self.max_new - self.generated,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "seed": s.seed,
            "ignore_eos": self.ignore_eos,
            "fingerprints": self.g.device.fingerprints,
            "want_features": self.g.device.needs_features,
            "feature_codec": self.g.feature_codec,
            "features_from": self.features.end,
        }
        try:
            return self.t.create(body, attempts)
        except ServerError as exc:
            if exc.kind == "fingerprint_mismatch":
                raise HandshakeError(f"the server refused the device's drafter: {exc}") from None
            raise

    def _apply(self, header: dict, tensors: dict, drafts: list[int]) -> Iterator[ClientEvent]:
        """Commits a round's answer; events: verified tokens, and a correction where the offline
        tail parts from them."""
        feats = wire.decode_features(tensors)
        start = int(header["feature_start"]) if feats is not None else 0
        if feats is not None and self.latest_only and start > self.features.end:
            # zeros stand in for the older positions' features: the drafter never reads them
            self.features.add(self.features.end, feats.new_zeros(start - self.features.end, feats.shape[1]))
        if feats is not None and not self.features.add(start, feats):
            self.features_from = self.features.end  # a hole: ask for them again
        elif feats is not None:
            self.features_from = None
        tokens = [int(t) for t in header["tokens"]]
        pos = self.generated
        self.round = int(header["round"]) + 1
        self.verified += tokens
        self.stats["rounds"] += 1
        self.stats["drafted"] += len(drafts)
        self.stats["accepted"] += int(header["accepted"])
        self.finish = header.get("finish_reason")
        self.server_finished = self.finish is not None
        j = 0  # how far the offline tail agrees with the target
        while j < min(len(tokens), len(self.tail)) and tokens[j] == self.tail[j]:
            j += 1
        if j == len(self.tail):  # no tail, or all of it verified (then maybe the target's next token)
            self.tail, self.tail_probs = [], []
            yield ClientEvent("verified", pos, tokens)
        elif j == len(tokens):  # all answered tokens agree; the rest of the tail waits its turn
            del self.tail[:j], self.tail_probs[:j]
            yield ClientEvent("verified", pos, tokens)
            if self.finish is not None:  # ... unless the target stopped there
                yield self._correct(pos + j, [], len(self.tail))
        else:  # the target parts from the tail at j
            if j:
                yield ClientEvent("verified", pos, tokens[:j])
            yield self._correct(pos + j, tokens[j:], len(self.tail) - j)

    def _correct(self, position: int, tokens: list[int], dropped: int) -> ClientEvent:
        """Drops the rest of the offline tail (``dropped`` tokens): the output is cut at ``position``
        and continues with ``tokens``."""
        self.stats["corrections"] += 1
        self.stats["corrected_tokens"] += dropped
        self.tail, self.tail_probs = [], []
        return ClientEvent("correction", position, tokens)

    # ------------------------------------------------------------------ the outcome
    def result(self) -> ClientResult:
        out = self.verified[self.prompt_len :] + self.tail
        tok = self.g.device.tokenizer
        st = self.stats
        return ClientResult(
            token_ids=out,
            text=tok.decode(out, skip_special_tokens=True) if tok is not None else "",
            finish_reason=self.finish or "incomplete",
            verified_tokens=self.generated,
            offline_tokens=len(self.tail),
            tree_rounds=st["tree_rounds"],
            offline_generated=st["offline_generated"],
            corrections=st["corrections"],
            corrected_tokens=st["corrected_tokens"],
            disconnections=st["disconnections"],
            first_offline_s=None if self._offline_at is None else self._offline_at - self._t0,
            rounds=st["rounds"],
            drafted_tokens=st["drafted"],
            accepted_tokens=st["accepted"],
            server_calls=self.t.calls - self._calls0,
            retries=self.t.retries - self._retries0,
            resyncs=st["resyncs"],
            bytes_up=self.t.bytes_up - self._up0,
            bytes_down=self.t.bytes_down - self._down0,
            elapsed_s=self._t1 - self._t0,
            k=self.k.snapshot(),
            events=list(self.events),
        )
