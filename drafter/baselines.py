"""Baseline drafters for comparison with MoA, trained on the same data and budget
(``moa train`` trains all three in one loop):

* ``EagleDrafter`` — EAGLE-1/2 style: position i reads ``fc(embed(token_i) ⊕ f_{i-1})`` where
  ``f`` is the target's last hidden state (after its final norm, the tensor EAGLE's code takes
  from Hugging Face's ``LlamaModel``), runs one causal decoder layer and predicts ``f_i``; the
  target's LM head turns it into logits. While drafting, ``f`` of drafted positions is the
  drafter's own prediction; verified positions use the target's.
* ``IndependentDrafter`` — a small causal LM (``num_layers`` decoder layers + norm) over the
  target's frozen embeddings and LM head, with no target features.

Both proposers implement the interface of :class:`MoAProposer` (``propose``/``release``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from moa_serve.drafter.config import DrafterConfig
from moa_serve.drafter.model import TargetParts
from moa_serve.drafter.proposer import DraftRequest, ProposerBase, load_for_drafting, rollback_point
from moa_serve.kv_cache import SlotKVCache
from moa_serve.layers import DecoderLayer, RMSNorm


class EagleDrafter(nn.Module):
    feature_kind = "hidden"

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.target.hidden_size
        self.fc = nn.Linear(2 * h, h)
        self.layer = DecoderLayer(cfg.sa_shape())

    def forward_parallel(self, parts: TargetParts, tokens, prev_features, positions, mask):
        """tokens/positions [B, S], prev_features [B, S, H] (f_{i-1} at i) -> predicted f_i [B, S, H]."""
        x = self.fc(torch.cat((parts.embed_tokens(tokens).to(prev_features.dtype), prev_features), -1))
        cos, sin = parts.rotary(positions, x.dtype)
        return self.layer(x, cos, sin, lambda k, v: (k, v, mask))


class IndependentDrafter(nn.Module):
    feature_kind = "none"

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg.sa_shape()) for _ in range(cfg.num_layers or 2))
        self.norm = RMSNorm(cfg.target.hidden_size, cfg.target.rms_norm_eps)

    def forward_parallel(self, parts: TargetParts, tokens, positions, mask):
        x = parts.embed_tokens(tokens)
        cos, sin = parts.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, lambda k, v: (k, v, mask))
        return self.norm(x)


def build_baseline(cfg: DrafterConfig) -> nn.Module:
    if cfg.kind == "eagle":
        return EagleDrafter(cfg)
    if cfg.kind == "independent":
        return IndependentDrafter(cfg)
    raise ValueError(f"not a baseline drafter kind: {cfg.kind!r}")


# ---------------------------------------------------------------------------------- proposers
@dataclass
class _Sess:
    slot: int
    fed: list[int] = field(default_factory=list)  # tokens whose K/V in the cache are kept
    feats: torch.Tensor | None = None  # verified hidden states [n, H] (EAGLE)

    @property
    def num_features(self) -> int:
        return 0 if self.feats is None else self.feats.shape[0]


class _BaselineProposer(ProposerBase):
    """Shared drafting loop of the baseline proposers (same interface as ``MoAProposer``):
    per session a slot KV cache over the fed tokens, rolled back to the longest prefix still
    committed; all sessions of a batch draft one token per step together."""

    needs_features = True
    uses_features = True

    def __init__(self, cfg: DrafterConfig, model: nn.Module, parts: TargetParts, num_layers: int,
                 max_sessions: int = 16, max_model_len: int = 2048, draft_vocab: torch.Tensor | None = None):
        self.cfg = cfg
        self.model = model.eval()
        self.parts = parts.eval()
        p = parts.lm_head.weight
        self.dtype, self.device = p.dtype, p.device
        sh = cfg.sa_shape()
        self.cache = SlotKVCache(num_layers, max_sessions, sh.num_kv_heads, sh.head_dim, max_model_len,
                                 self.dtype, self.device)
        self._init_lm_head(cfg, draft_vocab)
        self.sessions: dict[str, _Sess] = {}

    @classmethod
    def load(cls, drafter: str, target: str | None = None, dtype="float32", device="cpu", max_sessions=16,
             max_model_len=2048, target_model=None):
        cfg, state, draft_vocab, target_model, dt = load_for_drafting(drafter, target, dtype, device, target_model)
        model = build_baseline(cfg)
        model.load_state_dict(state)
        n = 1 if cfg.kind == "eagle" else len(model.layers)
        return cls(cfg, model.to(device, dt), TargetParts(target_model, 0), n, max_sessions, max_model_len,
                   draft_vocab)

    def release(self, session_id: str) -> None:
        s = self.sessions.pop(session_id, None)
        if s is not None:
            self.cache.free(s.slot)

    def _session(self, sid: str) -> _Sess:
        s = self.sessions.get(sid)
        if s is None:
            s = self.sessions[sid] = _Sess(self.cache.allocate())
        return s

    def _take_features(self, r: DraftRequest, s: _Sess) -> bool:
        return True

    def _draft(self, live, results) -> None:
        firsts = []
        for r, s in live:
            m = rollback_point(s.fed, r.committed)
            del s.fed[m:]
            self.cache.lengths[s.slot] = m
            firsts.append(m)
        drafts = [[] for _ in live]
        probs = [[] for _ in live]
        prev_out = None
        idx = list(range(len(live)))
        for step in range(max(r.num_drafts for r, _ in live)):
            idx = [i for i in idx if step < live[i][0].num_drafts]
            if not idx:
                break
            if step == 0:
                toks = [live[i][0].committed[firsts[i]:] for i in idx]
                starts = [firsts[i] for i in idx]
            else:
                toks = [[drafts[i][-1]] for i in idx]
                starts = [len(live[i][0].committed) + step - 1 for i in idx]
            out = self._forward([live[i] for i in idx], toks, starts, prev_out, idx, step)
            prev_out = {i: out[b] for b, i in enumerate(idx)}
            logits = (out @ self.lm_head_weight.T).float()
            for b, i in enumerate(idx):
                self._choose(logits[b], live[i][0], drafts[i], probs[i])
            self.stats["steps"] += 1
        for i, (r, s) in enumerate(live):
            self._after_drafting(r, s, drafts[i])
            res = results[r.session_id]
            res.drafts = drafts[i]
            if not r.sampling.greedy:
                res.probs = torch.stack(probs[i])

    def _after_drafting(self, r, s, drafts) -> None:
        self.cache.lengths[s.slot] = len(s.fed)

    def _forward(self, batch, toks, starts, prev_out, idx, step) -> torch.Tensor:
        """Feeds each session its tokens at positions starts[b]...; returns the last fed
        position's output [B, H] (before the LM head)."""
        width = max(len(t) for t in toks)
        tokens = torch.zeros(len(batch), width, dtype=torch.long)
        for b, t in enumerate(toks):
            tokens[b, :len(t)] = torch.tensor(t)
        qlens = torch.tensor([len(t) for t in toks])
        slots = torch.tensor([s.slot for _, s in batch])
        self.cache.lengths[slots] = torch.tensor(starts)
        positions = self.cache.positions_for(slots, width)
        x = self._inputs(batch, tokens.to(self.device), toks, starts, prev_out, idx, step)
        cos, sin = self.parts.rotary(positions.to(self.device), x.dtype)
        x = self.cache.run_layers(self._layers(), x, cos, sin, slots, qlens)
        x = self._final(x)
        for (_, s), t, st in zip(batch, toks, starts):
            if step == 0 or self.keeps_drafts:
                s.fed.extend(t)
            self.cache.lengths[s.slot] = st + len(t)
        rows = torch.arange(len(batch), device=self.device)
        return x[rows, (qlens - 1).to(self.device)]


class EagleProposer(_BaselineProposer):
    """EAGLE-style drafting: verified positions read the target's hidden states (from the
    verifier's "hidden" feature head); drafted positions read the drafter's own predictions and
    are never kept in the cache (they are recomputed with the target's features once verified)."""

    keeps_drafts = False

    def _layers(self):
        return [self.model.layer]

    def _final(self, x):
        return x

    def _take_features(self, r: DraftRequest, s: _Sess) -> bool:
        if r.features is not None and len(r.features):
            if r.feature_start > s.num_features:
                return False
            f = r.features.to(self.device, self.dtype)
            s.feats = f if s.feats is None or r.feature_start == 0 else torch.cat((s.feats[:r.feature_start], f))
        elif r.feature_start > s.num_features:
            return False
        # drafting at the last committed position P needs the features of positions < P
        return r.num_drafts == 0 or s.num_features >= len(r.committed) - 1

    def _inputs(self, batch, tokens, toks, starts, prev_out, idx, step):
        b, w = tokens.shape
        h = self.cfg.target.hidden_size
        prev = torch.zeros(b, w, h, dtype=self.dtype, device=self.device)
        for bi, ((_, s), t, st) in enumerate(zip(batch, toks, starts)):
            if step == 0:
                lo = max(st - 1, 0)
                f = s.feats[lo:st - 1 + len(t)]
                prev[bi, len(t) - f.shape[0]:len(t)] = f
            else:
                prev[bi, 0] = prev_out[idx[bi]]
        x = self.model.fc(torch.cat((self.parts.embed_tokens(tokens), prev), -1))
        return x


class IndependentProposer(_BaselineProposer):
    """A small causal LM drafting alone (no target features)."""

    needs_features = False
    uses_features = False
    keeps_drafts = True

    def _layers(self):
        return list(self.model.layers)

    def _final(self, x):
        return self.model.norm(x)

    def _inputs(self, batch, tokens, toks, starts, prev_out, idx, step):
        return self.parts.embed_tokens(tokens)


class HiddenFeatures(nn.Module):
    """The verifier-side "feature head" of EAGLE-style drafters: the target's last hidden state
    (after the final norm) of each newly verified position, passed through unchanged."""

    input_kind = "hidden"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def load_proposer(drafter: str, **kw):
    """The proposer of a drafter checkpoint, by its config's ``kind``."""
    from moa_serve.drafter.checkpoint import load_drafter
    from moa_serve.drafter.proposer import MoAProposer

    cfg, _ = load_drafter(drafter)
    cls = {"moa": MoAProposer, "eagle": EagleProposer, "independent": IndependentProposer}[cfg.kind]
    return cls.load(drafter, **kw)
