"""Drafting with the MoA draft head for many sessions at once.

Per session the proposer keeps (in slot caches): the SA keys/values of the tokens it has fed,
the TLI layers' keys/values (when N > 0), and the CA keys/values projected from the features
of verified positions. A round's request carries the session's committed tokens and the
features of newly verified positions; the proposer rolls its SA cache back to the longest
prefix still committed, feeds the rest, then drafts K tokens one step at a time, every
session of the batch in the same step. A draft only ever sees features of verified positions
(the inference form of the T-step bounded mask).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from moa_serve.drafter.checkpoint import DRAFT_VOCAB_KEY, load_drafter
from moa_serve.drafter.config import DrafterConfig
from moa_serve.drafter.model import DraftHead, MoADrafter, TargetParts
from moa_serve.engine.sampling import GREEDY, SamplingParams
from moa_serve.kv_cache import SlotKVCache
from moa_serve.models import load_state_dict, parse_dtype, read_config, resolve_model_path
from moa_serve.verifier.acceptance import generator_for, sample, warp_probs
from moa_serve.verifier.target_model import TargetModel


@dataclass
class DraftRequest:
    session_id: str
    committed: list[int]
    num_drafts: int
    feature_start: int = 0
    features: torch.Tensor | None = None  # [n, H] for positions feature_start ...
    sampling: SamplingParams = GREEDY


@dataclass
class DraftResult:
    session_id: str
    drafts: list[int]
    probs: torch.Tensor | None = None  # [K, V] when sampling
    needs_features_from: int | None = None  # features missing: resend from this position


@dataclass
class _Session:
    slot: int
    fed: list[int] = field(default_factory=list)  # tokens in the SA cache
    num_features: int = 0


def load_for_drafting(drafter: str, target: str | None, dtype, device, target_model: TargetModel | None):
    """A drafter checkpoint and the target it borrows from (loaded unless given), checked to match.
    Returns (config, state without the draft vocabulary, draft vocabulary or None, target, dtype)."""
    cfg, state = load_drafter(drafter)
    dt = parse_dtype(dtype)
    if target_model is None:
        path = resolve_model_path(target or cfg.target_name_or_path)
        target_model = TargetModel.from_state_dict(read_config(path), load_state_dict(path), dt, device)
    if target_model.arch != cfg.target:
        raise ValueError(f"the drafter was made for another target: {cfg.target} != {target_model.arch}")
    draft_vocab = state.pop(DRAFT_VOCAB_KEY, None)
    return cfg, state, draft_vocab, target_model, dt


def rollback_point(fed: list[int], committed: list[int]) -> int:
    """Length of the longest prefix of the fed tokens that is still committed, never covering the
    last committed token (it is always fed again: drafting starts from its output)."""
    m, limit = 0, min(len(fed), len(committed) - 1)
    while m < limit and fed[m] == committed[m]:
        m += 1
    return m


class ProposerBase:
    """What every proposer shares: the propose() protocol (features first, then one batched
    drafting loop), choosing a draft token (greedy, or sampled with its distribution kept), and
    mapping a restricted draft vocabulary back to the target's."""

    needs_features = True
    vocab_size: int
    draft_vocab: torch.Tensor | None
    stats: dict

    def _init_lm_head(self, cfg: DrafterConfig, draft_vocab: torch.Tensor | None) -> None:
        """The borrowed LM head, restricted to the draft vocabulary when the checkpoint has one, and
        the drafting counters."""
        p = self.parts.lm_head.weight
        self.vocab_size = cfg.target.vocab_size
        self.draft_vocab = draft_vocab.to(self.device) if draft_vocab is not None else None
        self.lm_head_weight = p[self.draft_vocab] if self.draft_vocab is not None else p
        self.stats = {"steps": 0, "draft_s": 0.0}

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[DraftResult]:
        t0 = time.perf_counter()
        results = {r.session_id: DraftResult(r.session_id, []) for r in requests}
        live = []
        for r in requests:
            s = self._session(r.session_id)
            if not self._take_features(r, s):
                results[r.session_id].needs_features_from = s.num_features
            elif r.num_drafts > 0:
                live.append((r, s))
        if live:
            self._draft(live, results)
        self.stats["draft_s"] += time.perf_counter() - t0
        return [results[r.session_id] for r in requests]

    def _choose(self, logits: torch.Tensor, r: DraftRequest, drafts: list[int], probs: list) -> int:
        """One draft token from one row of draft logits; appends it (and q when sampling)."""
        if r.sampling.greedy:
            j = int(logits.argmax())
            tok = int(self.draft_vocab[j]) if self.draft_vocab is not None else j
        else:
            q = self._full_vocab(warp_probs(logits[None], r.sampling)[0])
            tok = sample(q, generator_for(r.sampling, len(r.committed) + len(drafts), "draft"))
            probs.append(q)
        drafts.append(tok)
        return tok

    def _full_vocab(self, q: torch.Tensor) -> torch.Tensor:
        if self.draft_vocab is None:
            return q.cpu()
        full = torch.zeros(self.vocab_size, dtype=q.dtype, device=q.device)
        full[self.draft_vocab] = q
        return full.cpu()


class MoAProposer(ProposerBase):
    def __init__(self, cfg: DrafterConfig, head: DraftHead, parts: TargetParts, max_sessions: int = 16,
                 max_model_len: int = 2048, draft_vocab: torch.Tensor | None = None):
        self.cfg = cfg
        self.head = head.eval()
        self.parts = parts.eval()
        p = parts.lm_head.weight
        self.dtype, self.device = p.dtype, p.device
        sa = cfg.sa_shape()
        self.sa_cache = SlotKVCache(1, max_sessions, sa.num_kv_heads, sa.head_dim,
                                    max_model_len, self.dtype, self.device)
        if len(parts.tli):
            t = cfg.target
            self.tli_cache = SlotKVCache(len(parts.tli), max_sessions, t.num_kv_heads, t.head_dim,
                                         max_model_len, self.dtype, self.device)
        ca = cfg.ca_shape()
        self.ca_cache = SlotKVCache(1, max_sessions, ca.num_kv_heads, ca.head_dim, max_model_len,
                                    self.dtype, self.device)
        self._init_lm_head(cfg, draft_vocab)
        self.sessions: dict[str, _Session] = {}

    @classmethod
    def load(cls, drafter: str, target: str | None = None, dtype="float32", device="cpu", max_sessions=16,
             max_model_len=2048, target_model: TargetModel | None = None) -> "MoAProposer":
        cfg, state, draft_vocab, target_model, dt = load_for_drafting(drafter, target, dtype, device, target_model)
        drafter = MoADrafter(cfg)
        drafter.load_flat_state_dict(state)
        parts = TargetParts(target_model, cfg.target_layer_inference)
        return cls(cfg, drafter.draft_head.to(device, dt), parts, max_sessions, max_model_len, draft_vocab)

    # ------------------------------------------------------------------ sessions
    def release(self, session_id: str) -> None:
        s = self.sessions.pop(session_id, None)
        if s is not None:
            for c in self._caches():
                c.free(s.slot)

    def _caches(self):
        return [self.sa_cache, self.ca_cache] + ([self.tli_cache] if len(self.parts.tli) else [])

    def _session(self, session_id: str) -> _Session:
        s = self.sessions.get(session_id)
        if s is None:
            slots = {c.allocate() for c in self._caches()}
            assert len(slots) == 1, "drafter caches out of step"
            s = self.sessions[session_id] = _Session(slots.pop())
        return s

    # ------------------------------------------------------------------ drafting
    def _take_features(self, r: DraftRequest, s: _Session) -> bool:
        if r.features is None or len(r.features) == 0:
            return r.feature_start <= s.num_features
        if r.feature_start > s.num_features:
            return False
        n = r.features.shape[0]
        pos = torch.arange(r.feature_start, r.feature_start + n)
        feats = r.features.to(self.device, self.dtype)[None]
        cos, sin = self.parts.rotary(pos.to(self.device)[None], self.dtype)
        k, v = self.head.cross_attention.project_features(feats, cos, sin)
        self.ca_cache.write(0, torch.tensor([s.slot]), pos[None], k, v)
        s.num_features = r.feature_start + n
        self.ca_cache.lengths[s.slot] = s.num_features
        return True

    def _draft(self, live, results) -> None:
        # roll each SA cache back to the longest prefix of its fed tokens that is still committed
        new_tokens = []
        for r, s in live:
            m = rollback_point(s.fed, r.committed)
            del s.fed[m:]
            self._set_len(s.slot, m)
            new_tokens.append(r.committed[m:])
        drafts = [[] for _ in live]
        probs = [[] for _ in live]
        active = list(range(len(live)))
        step_tokens = new_tokens
        for step in range(max(r.num_drafts for r, _ in live)):
            idx = [i for i in active if step < live[i][0].num_drafts]
            if not idx:
                break
            toks = self._step([live[i] for i in idx], [step_tokens[i] for i in idx], drafts, probs, idx)
            step_tokens = {i: [t] for i, t in zip(idx, toks)}
            active = idx
            self.stats["steps"] += 1
        for i, (r, s) in enumerate(live):
            res = results[r.session_id]
            res.drafts = drafts[i]
            if not r.sampling.greedy:
                res.probs = torch.stack(probs[i])

    def _set_len(self, slot: int, n: int) -> None:
        self.sa_cache.lengths[slot] = n
        if len(self.parts.tli):
            self.tli_cache.lengths[slot] = n

    def _step(self, batch, tokens_per, drafts, probs, idx) -> list[int]:
        """Feeds each session its tokens, drafts one token each."""
        width = max(len(t) for t in tokens_per)
        tokens = torch.zeros(len(batch), width, dtype=torch.long)
        for b, t in enumerate(tokens_per):
            tokens[b, :len(t)] = torch.tensor(t)
        qlens = torch.tensor([len(t) for t in tokens_per])
        slots = torch.tensor([s.slot for _, s in batch])
        positions = self.sa_cache.positions_for(slots, width)
        x = self.parts.embed_tokens(tokens.to(self.device))
        cos, sin = self.parts.rotary(positions.to(self.device), x.dtype)
        x = self.sa_cache.run_layers([self.head.self_attention], x, cos, sin, slots, qlens)
        if not len(self.parts.tli):  # only the last fed position drafts
            last = (qlens - 1).to(self.device)
            rows = torch.arange(len(batch), device=self.device)
            x, cos, sin = x[rows, last][:, None], cos[rows, :, last][:, :, None], sin[rows, :, last][:, :, None]
        n_feat = self.ca_cache.lengths[slots]
        keys, values = self.ca_cache.read(0, slots, int(n_feat.max()))
        mask = (torch.arange(keys.shape[2])[None, :] < n_feat[:, None])[:, None, None, :].to(self.device)
        x = self.head.cross_attention(x, cos, sin, keys, values, mask)
        if len(self.parts.tli):
            x = self.tli_cache.run_layers(self.parts.tli, x, cos, sin, slots, qlens)
            x = self.parts.norm(x)
            rows = torch.arange(len(batch), device=self.device)
            x = x[rows, (qlens - 1).to(self.device)][:, None]
        for (_, s), t in zip(batch, tokens_per):
            s.fed.extend(t)
        for _, s in batch:
            self._set_len(s.slot, len(s.fed))
        logits = (x[:, 0] @ self.lm_head_weight.T).float()
        return [self._choose(logits[b], r, drafts[idx[b]], probs[idx[b]]) for b, (r, _) in enumerate(batch)]
