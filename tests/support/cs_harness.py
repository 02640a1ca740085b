"""A client-server mode server without Ray, for tests: the Router's stack (RoundService over an
in-process TorchTargetRunner, ClientSessions, the FastAPI app) served by uvicorn on 127.0.0.1
(ports 8200-8299), and httpx transports that drop responses or cut the link on cue."""

from __future__ import annotations

import contextlib

import httpx
import torch

from moa_serve.app import state
from moa_serve.app.http import create_app
from moa_serve.drafter.checkpoint import load_draft_vocab
from moa_serve.drafter.registry import load_feature_source
from moa_serve.measure import client_server_stack as local_server
from moa_serve.measure.client_server_stack import LocalStack
from moa_serve.model_files import load_tokenizer, resolve_model_path, stop_token_ids
from moa_serve.protocol import DraftResult
from moa_serve.verifier.torch.runner import TorchTargetRunner


class Server(LocalStack):
    """One "Router replica" over a float32 runner of ``target``: a new one is a server restart (it
    knows no session). Records every verify call; ``verify_hook(requests)`` runs before each."""

    def __init__(self, target, drafter, *, ttl_s: float = 300.0, max_model_len: int = 512, verify_hook=None):
        path = resolve_model_path(str(target))
        runner = TorchTargetRunner(
            str(path),
            "float32",
            "cpu",
            max_sessions=8,
            max_model_len=max_model_len,
            features=load_feature_source(str(drafter) if drafter else None),
            draft_vocab=load_draft_vocab(str(drafter)) if drafter else None,
        )
        self.tokenizer = load_tokenizer(path)
        self.verify_calls: list[list] = []
        self.verify_hook = verify_hook
        super().__init__(
            runner,
            self.tokenizer,
            stop_token_ids(path, self.tokenizer),
            model_name=str(target),
            drafter=str(drafter) if drafter else None,
            ttl_s=ttl_s,
            on_verify=self._record,
        )

    def _record(self, reqs) -> None:
        self.verify_calls.append(list(reqs))
        if self.verify_hook is not None:
            self.verify_hook(reqs)


@contextlib.contextmanager
def serving(target, drafter, **kw):
    """A ``Server`` installed in the app and served by uvicorn: yields (server, uvicorn); then
    stops it and uninstalls it."""
    srv = Server(target, drafter, **kw).install()
    uv = Uvicorn(create_app())
    try:
        yield srv, uv
    finally:
        uv.stop()
        state.install(cs=None, frontend=None)


def free_port(lo: int = 8200, hi: int = 8300) -> int:
    return local_server.free_port(lo, hi)


class Uvicorn(local_server.UvicornThread):
    """The app on 127.0.0.1, ports 8200-8299, in a thread; ``stop()`` ends it."""

    def __init__(self, app):
        super().__init__(app, (8200, 8300))


class FaultyTransport(httpx.BaseTransport):
    """Wraps a real transport. ``drop_response_of`` = call numbers (1-based, among calls whose path
    contains ``match``) whose request reaches the server but whose response is lost; ``cut`` /
    ``restore()`` take the link down and up (calls fail before reaching the server);
    ``on_call(n, request)`` runs before matching call n."""

    def __init__(self, inner: httpx.BaseTransport | None = None, match: str = "/verify"):
        self.inner = inner or httpx.HTTPTransport()
        self.match = match
        self.drop_response_of: set[int] = set()
        self.cut = False
        self.refused = 0  # calls that failed while cut
        self.matched = 0
        self.on_call = None

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.match in request.url.path:
            self.matched += 1
            if self.on_call is not None:
                self.on_call(self.matched, request)
        if self.cut:
            self.refused += 1
            raise httpx.ConnectError("link cut (test)", request=request)
        resp = self.inner.handle_request(request)
        if self.match in request.url.path and self.matched in self.drop_response_of:
            resp.read()
            resp.close()
            raise httpx.ReadError("response lost (test)", request=request)
        return resp

    def close(self) -> None:
        self.inner.close()


def http_client(url: str, transport: httpx.BaseTransport | None = None, timeout: float = 60.0) -> httpx.Client:
    return httpx.Client(base_url=url, transport=transport, timeout=timeout)


# ---------------------------------------------------------------------- proposers for tests
class _Copies:
    """The committed copy per session, from the delta protocol (``copy[:base] + tokens``), and the
    features received (checked to arrive without holes)."""

    needs_features = True
    max_model_len = 512

    def __init__(self):
        self.copies: dict[str, list[int]] = {}
        self.features: dict[str, int] = {}
        self.feature_log: list[tuple[int, int]] = []  # (feature positions held, committed length) per draft call

    def _take(self, r) -> list[int]:
        c = self.copies.get(r.session_id, [])[: r.base] + list(r.tokens)
        self.copies[r.session_id] = c
        held = self.features.get(r.session_id, 0)
        assert r.feature_start <= held, f"features from {r.feature_start} but only {held} held"
        if r.features is not None:
            held = max(held, r.feature_start + len(r.features))
        self.features[r.session_id] = held
        self.feature_log.append((held, len(c)))
        return c

    def release(self, session_id: str) -> None:
        self.copies.pop(session_id, None)
        self.features.pop(session_id, None)


class OracleProposer(_Copies):
    """Greedy drafts that are the target's own continuation (``reference`` = prompt + the target's
    greedy output), except at the absolute positions in ``wrong``; off the reference path it
    drafts junk. Drafts are accepted exactly as far as told."""

    def __init__(self, reference: list[int], vocab: int, wrong: set[int] = frozenset()):
        super().__init__()
        self.ref, self.vocab, self.wrong = list(reference), vocab, set(wrong)
        # tree drafts: with a branching, the right token at a wrong position is sent as an
        # alternative there (with a wrong one before it)
        self.branching: tuple[int, ...] = ()

    branches = True

    def set_tree(self, shape) -> None:
        self.branching = shape.widths

    def propose(self, reqs):
        out = []
        for r in reqs:
            c = self._take(r)
            on_path = c == self.ref[: len(c)]
            drafts, alternatives = [], []
            for p in range(len(c), len(c) + r.num_drafts):
                alternatives.append([])
                if on_path and p < len(self.ref) and p not in self.wrong:
                    drafts.append(self.ref[p])
                else:
                    base = self.ref[p] if p < len(self.ref) else (drafts[-1] if drafts else c[-1])
                    drafts.append((base + 1) % self.vocab)
                    if self.branching and on_path and p < len(self.ref):
                        alternatives[-1] = [(base + 2) % self.vocab, self.ref[p]]
                    on_path = False
            out.append(DraftResult(r.session_id, drafts, alternatives=alternatives if self.branching else []))
        return out


class ToySampler(_Copies):
    """A sampling drafter: q = softmax((guide(tokens) + a fixed random row of the previous token) /
    0.8), drafts sampled with generators seeded by position. ``guide`` (e.g. the target's own
    logits) makes it often right. Deterministic given the committed tokens, so the in-process
    engine and a client-server run see the same drafts and distributions."""

    def __init__(self, vocab: int, guide=None, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, vocab, generator=g)
        self.guide = guide

    def propose(self, reqs):
        out = []
        for r in reqs:
            c = self._take(r)
            seq, drafts, probs = list(c), [], []
            for step in range(r.num_drafts):
                logits = self.table[seq[-1]] + (self.guide(seq) if self.guide is not None else 0)
                q = torch.softmax(logits / 0.8, -1)
                g = torch.Generator().manual_seed(len(c) * 131 + step)
                seq.append(int(torch.multinomial(q, 1, generator=g)))
                drafts.append(seq[-1])
                probs.append(q)
            out.append(DraftResult(r.session_id, drafts, torch.stack(probs) if probs else None))
        return out
