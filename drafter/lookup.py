"""Drafting without a model: prompt lookup (n-gram matching over the session's own tokens), and
a hybrid that takes the lookup draft where the text repeats and a trained drafter's elsewhere.

Prompt lookup (Saxena 2023; vLLM's ``ngram`` method) finds the latest earlier place where the
session's last ``n`` tokens occurred (``n`` from ``max_n`` down to ``min_n``) and proposes the
tokens that followed there. Text that copies its context (extraction, summarisation, code edits,
RAG answers quoting their sources) is drafted for free. An index per session, updated as tokens
are committed, makes a lookup a few dictionary reads whatever the context length.

Where the session's own tokens have no match, an optional :class:`~moa_serve.drafter.outputs.OutputStore`
(the target's earlier replies) is looked up the same way (specs ``lookup+outputs`` and
``hybrid+outputs:<checkpoint>``); its matches are reported as the negative suffix length, so the
draft gate keeps their acceptance apart from the context's.

Both speak the proposer protocol of :mod:`moa_serve.drafter.proposer` (token deltas, ``resync``,
``release``). Lookup drafts are deterministic: when sampling they carry no distribution and the
verifier treats them as one-hot (q = 1 at the draft), which keeps rejection sampling exact: a
draft x is accepted with probability p(x), otherwise the token is drawn from p without x.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from moa_serve.protocol import DraftRequest, DraftResult


class NgramIndex:
    """For one token sequence: for each n in [min_n, max_n], the n-gram ending at each position
    -> the latest such end position that has a following token. Appending tokens updates it;
    any other change rebuilds it."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._last: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self._indexed = 0  # end positions < _indexed are in the index

    def set_tokens(self, tokens: list[int]) -> None:
        """Makes the index describe ``tokens`` (incremental when the old tokens are a prefix)."""
        old = self.tokens
        if len(tokens) < len(old) or tokens[: len(old)] != old:
            self._last = [{} for _ in range(self.max_n + 1)]
            self._indexed = 0
        self.tokens = list(tokens)
        # an end position i is indexed once token i + 1 exists (a continuation to propose)
        for i in range(self._indexed, len(self.tokens) - 1):
            for n in range(self.min_n, min(self.max_n, i + 1) + 1):
                self._last[n][tuple(self.tokens[i - n + 1 : i + 1])] = i
        self._indexed = max(self._indexed, len(self.tokens) - 1)

    def propose(self, k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching
        suffix, and that suffix's length (0: no match, no drafts)."""
        t, end = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            i = self._last[n].get(tuple(t[end - n :]))
            if i is not None:
                return t[i + 1 : i + 1 + k], n
        return [], 0


class LookupTable:
    """The n-gram indexes of many sessions, least recently used evicted past ``max_sessions``.
    ``draft(session_id, tokens, k)`` is all a caller holding the tokens needs (the Router does
    this for its own sessions: no drafter replica, no call)."""

    def __init__(
        self,
        min_n: int = 2,
        max_n: int = 4,
        max_sessions: int = 1024,
        max_model_len: int = 2048,
        store=None,
        store_gate: tuple[int, float] | None = None,
    ):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.max_sessions = max_sessions
        self.max_model_len = max_model_len
        self.store = store  # an OutputStore: the target's earlier replies, where the context has no match
        # (shortest suffix, share of its occurrences that must agree on each draft) for the store's
        # drafts; None: the store's own settings
        self.store_gate = store_gate
        self.sessions: OrderedDict[str, NgramIndex] = OrderedDict()  # least recently used first
        self.stats = {"evicted": 0, "matched": 0, "unmatched": 0, "drafts": 0, "from_outputs": 0}

    def get(self, session_id: str, create: bool, keep: set[str] = frozenset()) -> NgramIndex | None:
        idx = self.sessions.get(session_id)
        if idx is not None:
            self.sessions.move_to_end(session_id)
            return idx
        if not create:
            return None
        if len(self.sessions) >= self.max_sessions:
            victim = next((sid for sid in self.sessions if sid not in keep), None)
            if victim is None:
                raise RuntimeError(f"prompt lookup full: all {self.max_sessions} sessions are in use")
            del self.sessions[victim]
            self.stats["evicted"] += 1
        idx = self.sessions[session_id] = NgramIndex(self.min_n, self.max_n)
        return idx

    def propose_match(self, idx: NgramIndex, num_drafts: int) -> tuple[list[int], int]:
        """Up to ``num_drafts`` lookup drafts for an up-to-date index (never past the context), and
        the length of the n-gram they continue (0: none; negative: a suffix found in the output
        store, the context having none)."""
        drafts, n, _ = self.propose_tree(idx, num_drafts)
        return drafts, n

    def propose_tree(self, idx: NgramIndex, num_drafts: int, tree=None) -> tuple[list[int], int, list[list[int]]]:
        """``propose_match`` and, for drafts from the output store under a ``TreeShape``, their
        runners-up per depth (verified beside them: greedy sessions only). A session's own n-gram
        drafts stay chains."""
        k = min(num_drafts, self.max_model_len + 1 - len(idx.tokens))
        if k <= 0 or not idx.tokens:
            return [], 0, []
        drafts, n = idx.propose(k)
        alternatives: list[list[int]] = []
        if not drafts and self.store is not None:
            min_n, min_conf = self.store_gate or (None, None)
            widths, min_value = (tree.widths, tree.min_value) if tree else ((), 0.0)
            drafts, n, alternatives = self.store.propose_tree(idx.tokens, k, widths, min_value, min_n, min_conf)
            n = -n
            self.stats["from_outputs"] += len(drafts)
        self.stats["matched" if drafts else "unmatched"] += 1
        self.stats["drafts"] += len(drafts)
        return drafts, n if drafts else 0, alternatives if any(alternatives) else []

    def draft_match(
        self, session_id: str, tokens: list[int], num_drafts: int, keep: set[str] = frozenset()
    ) -> tuple[list[int], int]:
        """Drafts for a session holding ``tokens``, and the length of the n-gram they continue."""
        idx = self.get(session_id, create=True, keep=keep)
        idx.set_tokens(tokens)
        return self.propose_match(idx, num_drafts)

    def draft(self, session_id: str, tokens: list[int], num_drafts: int, keep: set[str] = frozenset()) -> list[int]:
        return self.draft_match(session_id, tokens, num_drafts, keep)[0]

    def release(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)


class PromptLookupProposer:
    """Drafts by n-gram lookup in each session's committed tokens (prompt and output), behind the
    proposer protocol (the in-process engine, a drafter replica, a client's device)."""

    needs_features = False
    draft_vocab = None

    def __init__(self, **table_options):
        """``table_options``: the LookupTable's (min_n, max_n, max_sessions, max_model_len, store,
        store_gate)."""
        self.table = LookupTable(**table_options)
        self.tree = None  # a TreeShape: the output store's drafts go with their runners-up
        self.stats = {"steps": 0, "draft_s": 0.0, "resync": 0}

    @property
    def branches(self) -> bool:
        """Tree drafts need candidates beside the drafts: the output store has them (how often
        each continuation followed), a session's own n-gram match does not."""
        return self.table.store is not None

    def set_tree(self, shape) -> None:
        if shape and not self.branches:
            raise ValueError(
                "prompt lookup drafts chains only: tree drafts need a trained drafter, "
                "hybrid:<checkpoint>, or the output store (lookup+outputs)"
            )
        self.tree = shape or None

    @property
    def sessions(self) -> OrderedDict[str, NgramIndex]:
        return self.table.sessions

    @property
    def max_sessions(self) -> int:
        return self.table.max_sessions

    def sync(self, r: DraftRequest, in_call: set[str]) -> NgramIndex | None:
        """The session's index brought up to date with ``copy[:base] + tokens``; None when this
        proposer holds fewer than ``base`` of its tokens (the caller answers ``resync``)."""
        idx = self.table.get(r.session_id, create=r.base == 0, keep=in_call)
        if idx is None or r.base > len(idx.tokens):
            return None
        idx.set_tokens(idx.tokens[: r.base] + list(r.tokens))
        return idx

    def lookup(self, idx: NgramIndex, r: DraftRequest) -> tuple[list[int], list[list[int]]]:
        """A request's drafts and, under a tree shape and greedy, their alternatives."""
        drafts, _, alternatives = self.table.propose_tree(idx, r.num_drafts, self.tree if r.sampling.greedy else None)
        return drafts, alternatives

    def propose(self, requests: list[DraftRequest]) -> list[DraftResult]:
        t0 = time.perf_counter()
        in_call = {r.session_id for r in requests}
        out = []
        for r in requests:
            idx = self.sync(r, in_call)
            if idx is None:
                self.stats["resync"] += 1
                out.append(DraftResult(r.session_id, [], resync=True))
            else:
                drafts, alternatives = self.lookup(idx, r)
                out.append(DraftResult(r.session_id, drafts, alternatives=alternatives))
        self.stats["steps"] += 1
        self.stats["draft_s"] += time.perf_counter() - t0
        return out

    def release(self, session_id: str) -> None:
        self.table.release(session_id)


class HybridProposer:
    """Prompt lookup first, a trained drafter (MoA, EAGLE-style, independent) otherwise: a
    session whose last ``min_n``..``max_n`` tokens occurred before gets the lookup draft; the
    others are drafted by the model in one batched call. The model proposer sees every request
    (the lookup ones with ``num_drafts=0``), so its tokens and features stay current."""

    def __init__(self, lookup: PromptLookupProposer, model):
        self.lookup = lookup
        self.model = model
        self.needs_features = getattr(model, "needs_features", True)
        self.draft_vocab = getattr(model, "draft_vocab", None)
        self.stats = {"lookup_drafts": 0, "model_drafts": 0, "draft_s": 0.0}

    @property
    def sessions(self):
        return self.model.sessions

    branches = True

    def set_tree(self, shape) -> None:
        """Tree drafts where the model drafts and where the output store does (a session's own
        n-gram drafts stay chains)."""
        self.model.set_tree(shape)
        if self.lookup.branches:
            self.lookup.set_tree(shape)

    @property
    def max_sessions(self) -> int:
        return self.model.max_sessions

    def propose(self, requests: list[DraftRequest]) -> list[DraftResult]:
        t0 = time.perf_counter()
        in_call = {r.session_id for r in requests}
        from_lookup: dict[str, tuple[list[int], list[list[int]]]] = {}
        lost = set()  # sessions the lookup copy lacks (evicted): both copies start over
        for r in requests:
            idx = self.lookup.sync(r, in_call)
            if idx is None:
                lost.add(r.session_id)
            else:
                drafts, alternatives = self.lookup.lookup(idx, r)
                if drafts:
                    from_lookup[r.session_id] = drafts, alternatives
        asked = [
            DraftRequest(r.session_id, r.tokens, 0, r.feature_start, r.features, r.sampling, r.base)
            if r.session_id in from_lookup
            else r
            for r in requests
        ]
        results = self.model.propose(asked)
        for res in results:
            drafts, alternatives = from_lookup.get(res.session_id, (None, []))
            if res.session_id in lost and not res.resync:
                res.resync, res.drafts, res.probs = True, [], None
            if res.resync or res.needs_features_from is not None:
                if res.resync:  # start both copies over together
                    self.lookup.release(res.session_id)
                continue
            if drafts is not None:
                res.drafts, res.probs, res.alternatives = drafts, None, alternatives  # one-hot: no q needed
                self.stats["lookup_drafts"] += len(drafts)
            else:
                self.stats["model_drafts"] += len(res.drafts)
        self.stats["draft_s"] += time.perf_counter() - t0
        return results

    def release(self, session_id: str) -> None:
        self.lookup.release(session_id)
        self.model.release(session_id)
