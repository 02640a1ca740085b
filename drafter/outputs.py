"""Drafting from the target's earlier outputs (no model): an index of replies the target wrote
before, looked up by the context's last tokens — the idea of REST (He et al. 2023, a datastore of
text) and SuffixDecoding (Oliaro et al. 2024, the deployment's own previous outputs).

A small instruction-tuned model answers in set phrases ("Here's a ...", "In conclusion, ...",
"Let's break it down step by step"), and those phrases continue the same way in its other
answers. ``OutputStore`` holds token sequences (the packed self-distilled replies of
``drafter/selfdistill/``: the target's greedy answers to training prompts, never to a benchmark's)
and, for each n in [min_n, max_n], every n-gram that has a following token. A lookup takes the
longest suffix of the context found at least ``min_support`` times, then walks the continuations
of all its occurrences one token at a time, proposing the most frequent next token while at least
``min_confidence`` of the occurrences still agree (and keeping only the occurrences that took it).

The index is numpy arrays — per n, the sorted 64-bit hashes of the n-grams and where each ends —
so a million tokens index in seconds into tens of MB, and a lookup is a few binary searches. A hash
collision can only propose a wrong draft, which verification rejects: drafts never change output.
"""

from __future__ import annotations

import gzip
import json
import os
from collections import Counter
from pathlib import Path

import numpy as np

from moa_serve.model_files import load_tokenizer, resolve_model_path

# How sure the store must be, by what stands behind it (tuned on Spec-Bench, README "Output store"):
# with no model (``lookup+outputs``) any suffix of 2+ tokens and its most frequent continuation
# beat no draft; in front of a trained drafter (``hybrid+outputs:``) the store drafts only from a
# suffix of 3+ tokens and while most of its occurrences agree, and the model drafts elsewhere.
GATE_ALONE = (2, 0.0)
GATE_BEFORE_MODEL = (3, 0.5)

_MULT = 1_000_003
_MASK = (1 << 64) - 1
_SEP = -1  # between sequences: no n-gram spans it, no continuation crosses it
_FEW = 48  # occurrences counted in Python rather than NumPy (OutputStore._continuations)
PACKED = Path(__file__).resolve().parent / "selfdistill"


def _signed(v: int) -> int:
    v &= _MASK
    return v - (1 << 64) if v >= 1 << 63 else v


def _hash(tokens) -> int:
    v = 0
    for t in tokens:
        v = (v * _MULT + int(t) + 2) & _MASK
    return _signed(v)


class OutputStore:
    """Token sequences indexed by their n-grams (``min_n``..``max_n``) for ``propose``: the most
    frequent continuation of the longest suffix found at least ``min_support`` times, token by token
    while at least ``min_confidence`` of the occurrences agree (looking at the latest
    ``max_candidates`` occurrences of a very common suffix)."""

    def __init__(
        self,
        sequences,
        min_n: int = 2,
        max_n: int = 6,
        min_support: int = 1,
        min_confidence: float = 0.0,
        max_candidates: int = 4096,
    ):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"an output store needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if min_support < 1 or not 0.0 <= min_confidence <= 1.0:
            raise ValueError("an output store needs min_support >= 1 and 0 <= min_confidence <= 1")
        self.min_n, self.max_n = min_n, max_n
        self.min_support, self.min_confidence = min_support, min_confidence
        self.max_candidates = max_candidates
        flat: list[int] = []
        self.num_sequences = 0
        for seq in sequences:
            if len(seq):
                flat.extend(int(t) for t in seq)
                flat.append(_SEP)
                self.num_sequences += 1
        self.data = np.asarray(flat, dtype=np.int64)
        self._index = {n: self._build(n) for n in range(min_n, max_n + 1)}

    def _build(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        d = self.data
        count = len(d) - n  # n-grams [i, i + n) with a token at i + n after them
        if count <= 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        h = np.zeros(count, dtype=np.uint64)
        ok = d[n : n + count] != _SEP  # a continuation, not the separator
        for j in range(n):
            part = d[j : j + count]
            ok &= part != _SEP
            h = h * np.uint64(_MULT) + (part + 2).astype(np.uint64)  # wraps mod 2**64, as _hash
        h = h.view(np.int64)[ok]
        ends = np.nonzero(ok)[0] + n  # where each n-gram's continuation starts
        order = np.argsort(h, kind="stable")
        return h[order], ends[order]

    def __len__(self) -> int:
        """Tokens held (separators excluded)."""
        return len(self.data) - self.num_sequences

    def propose(
        self, tokens: list[int], k: int, min_n: int | None = None, min_confidence: float | None = None
    ) -> tuple[list[int], int]:
        """Up to ``k`` drafts continuing ``tokens``, and the length of the suffix they continue
        (0: no suffix of at least ``min_n`` tokens found ``min_support`` times, no drafts).
        ``min_n`` (at least the index's) and ``min_confidence`` override the store's own."""
        drafts, n, _ = self.propose_tree(tokens, k, (), 0.0, min_n, min_confidence)
        return drafts, n

    def propose_tree(
        self,
        tokens: list[int],
        k: int,
        widths: tuple[int, ...],
        min_value: float = 0.0,
        min_n: int | None = None,
        min_confidence: float | None = None,
    ) -> tuple[list[int], int, list[list[int]]]:
        """``propose`` plus, per draft depth i < len(widths), up to ``widths[i] - 1`` runners-up: the
        next most frequent continuations there, verified beside draft i (tree drafts); with
        ``min_value`` > 0 only those whose estimate (the shares of the drafts before times their
        own share) reaches it (``TreeShape``'s meaning)."""
        if k <= 0:
            return [], 0, []
        lowest = self.min_n if min_n is None else max(self.min_n, min_n)
        conf = self.min_confidence if min_confidence is None else min_confidence
        for n in range(min(self.max_n, len(tokens)), lowest - 1, -1):
            hashes, ends = self._index[n]
            v = _hash(tokens[-n:])
            # the Router looks up every session every round: one search where the suffix is absent
            # (most longer suffixes), the method rather than np.searchsorted's wrapper
            lo = int(hashes.searchsorted(v, "left"))
            if lo == len(hashes) or hashes[lo] != v:
                continue
            hi = int(hashes.searchsorted(v, "right"))
            if hi - lo < self.min_support:
                continue
            starts = ends[lo:hi]
            if hi - lo > self.max_candidates:  # the latest occurrences when there are very many (a common bigram)
                starts = np.sort(starts)[-self.max_candidates :]
            drafts, alternatives = self._walk(starts, k, conf, widths, min_value)
            if drafts:
                return drafts, n, alternatives
            return [], 0, []  # the longest suffix found disagrees on what follows: no guess
        return [], 0, []

    def _walk(
        self, starts: np.ndarray, k: int, min_confidence: float, widths: tuple[int, ...] = (), min_value: float = 0.0
    ) -> tuple[list[int], list[list[int]]]:
        """The drafts (and runners-up) that the occurrences ending at ``starts`` continue with."""
        drafts: list[int] = []
        alternatives: list[list[int]] = []
        reach = 1.0
        for j in range(k):
            width = widths[j] if j < len(widths) else 1
            starts, nxt, ranked = self._continuations(starts, j, max(1, width))
            if not len(nxt):
                break
            total = len(nxt)
            best, most = ranked[0]
            if most < self.min_support or most < min_confidence * total:
                break
            drafts.append(best)
            alternatives.append(
                [t for t, c in ranked[1:width] if c >= self.min_support and reach * (c / total) >= min_value]
            )
            reach *= most / total
            if isinstance(starts, np.ndarray):
                starts = starts[nxt == best]
            else:
                starts = [i for i, t in zip(starts, nxt) if t == best]
        return drafts, alternatives

    def _continuations(self, starts, j: int, top: int) -> tuple:
        """(the occurrences that go on past ``j`` tokens, the token each goes on with, the ``top``
        most frequent of those as (token, count), the smaller id first on ties). Once few
        occurrences are left (most suffixes have few) they are counted in Python: a dozen NumPy
        calls per draft token cost more than the counting."""
        if len(starts) <= _FEW:
            data = self.data
            starts = starts.tolist() if isinstance(starts, np.ndarray) else starts
            nxt = [int(data[i + j]) for i in starts]
            if _SEP in nxt:
                starts = [i for i, t in zip(starts, nxt) if t != _SEP]
                nxt = [t for t in nxt if t != _SEP]
            counts = Counter(nxt)
            return starts, nxt, sorted(counts.items(), key=lambda tc: (-tc[1], tc[0]))[:top]
        nxt = self.data[starts + j]
        keep = nxt != _SEP
        starts, nxt = starts[keep], nxt[keep]
        values, counts = np.unique(nxt, return_counts=True)
        order = np.argsort(-counts, kind="stable")[:top]  # most frequent first, the smaller id on ties
        return starts, nxt, [(int(values[i]), int(counts[i])) for i in order]

    @classmethod
    def from_texts(cls, texts: list[str], tokenizer, **kw) -> "OutputStore":
        ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []
        return cls(ids, **kw)


def reply_files(source: str | Path) -> list[Path]:
    p = Path(source).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.name.endswith((".jsonl", ".jsonl.gz")))
    else:
        files = [p] if p.is_file() else []
    if not files:
        raise FileNotFoundError(f"output store {str(source)!r}: no .jsonl or .jsonl.gz files of replies there")
    return files


def pack_replies(entry: dict) -> list[str]:
    """The target's replies a pack line holds (``reply``: one; ``replies``: several, in turn order)."""
    return entry["replies"] if "replies" in entry else [entry["reply"]]


def read_replies(source: str | Path) -> list[str]:
    """The replies in ``.jsonl`` / ``.jsonl.gz`` files (or a folder of them): lines with ``reply``
    or ``replies`` (``moa regenerate --pack``) or chat ``messages`` (its unpacked output: the
    assistant turns)."""
    texts: list[str] = []
    for f in reply_files(source):
        opener = gzip.open if f.name.endswith(".gz") else open
        with opener(f, "rt", encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                row = json.loads(line)
                if "reply" in row or "replies" in row:
                    texts.extend(pack_replies(row))
                else:
                    texts.extend(m["content"] for m in row.get("messages", []) if m.get("role") == "assistant")
    return texts


MANIFEST = PACKED / "manifest.json"


def packed_outputs(target: str) -> list[Path]:
    """The packs of the target's self-distilled replies shipped in ``drafter/selfdistill/``, as
    ``manifest.json`` lists them under the target's last path part, lower case (no entry: none)."""
    stem = Path(str(target).rstrip("/")).name.lower()
    listed = json.loads(MANIFEST.read_text(encoding="utf-8")).get(stem, [])
    return [PACKED / name for name in listed]


def load_output_store(target: str, tokenizer, source: str | Path | None = None, **kw) -> OutputStore:
    """The output store of ``source`` (files or a folder of replies), by default the packs shipped
    for ``target``."""
    if source is None:
        packs = packed_outputs(target)
        if not packs:
            raise FileNotFoundError(
                f"no packed outputs of {target!r} in {MANIFEST} (an entry {Path(str(target)).name.lower()!r}): "
                "an output store needs the target's own earlier replies (moa regenerate, then --pack)"
            )
    texts = read_replies(source) if source is not None else [t for p in packs for t in read_replies(p)]
    return OutputStore.from_texts(texts, tokenizer, **kw)


_CACHE: dict[tuple, OutputStore] = {}


def output_store_for(target: str | None) -> OutputStore:
    """The output store a ``+outputs`` drafter spec reads for ``target``: the files or folder in
    ``$MOA_OUTPUTS`` if set, else the packs shipped for that target. Built once per process (every
    session and proposer shares it)."""
    if not target:
        raise ValueError("an output store needs the target's name (its tokenizer and its packed replies)")
    source = os.environ.get("MOA_OUTPUTS") or None
    key = (str(target), source)
    if key not in _CACHE:
        tokenizer = load_tokenizer(resolve_model_path(str(target), weights=False))
        _CACHE[key] = load_output_store(str(target), tokenizer, source)
    return _CACHE[key]
