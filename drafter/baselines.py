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
from moa_serve.drafter.moa_model import TargetParts
from moa_serve.drafter.proposer import ProposerBase, last_position
from moa_serve.model.kv_cache import PackedBatch, SlotKVCache
from moa_serve.model.layers import DecoderLayer, RMSNorm
from moa_serve.protocol import DraftRequest


class EagleDrafter(nn.Module):
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
    committed: list[int] = field(default_factory=list)  # this replica's copy of the committed tokens
    fed: list[int] = field(default_factory=list)  # tokens whose K/V in the cache are kept
    feats: torch.Tensor | None = None  # verified hidden states [n, H] (EAGLE)
    agreed: int = 0  # fed[:agreed] == committed[:agreed] is known without comparing

    @property
    def num_features(self) -> int:
        return 0 if self.feats is None else self.feats.shape[0]


class _BaselineProposer(ProposerBase):
    """Shared drafting loop of the baseline proposers (same interface as ``MoAProposer``):
    per session a slot KV cache over the fed tokens, rolled back to the longest prefix still
    committed; all sessions of a batch draft one token per step together."""

    needs_features = True
    uses_features = True
    session_cls = _Sess

    def __init__(
        self,
        cfg: DrafterConfig,
        model: nn.Module,
        parts: TargetParts,
        num_layers: int,
        max_sessions: int = 16,
        max_model_len: int = 2048,
        draft_vocab: torch.Tensor | None = None,
    ):
        self._bind(cfg, parts)
        self.model = model.eval()
        sh = cfg.sa_shape()
        self.cache = SlotKVCache(
            num_layers, max_sessions, sh.num_kv_heads, sh.head_dim, max_model_len, self.dtype, self.device
        )
        self._init_lm_head(cfg, draft_vocab)
        self._init_sessions(max_sessions, max_model_len)
        self.fused = self._pack_layers(self.model, list(self._layers()), sh)
        self.static_cache = self.cache
        if self.device.type == "cuda":
            self.use_static_steps(graphs=True)

    @classmethod
    def from_checkpoint(cls, cfg, state, parts, dt, device, max_sessions, max_model_len, draft_vocab):
        model = build_baseline(cfg)
        model.load_state_dict(state)
        n = 1 if cfg.kind == "eagle" else len(model.layers)
        return cls(cfg, model.to(device, dt), parts, n, max_sessions, max_model_len, draft_vocab)

    # ------------------------------------------------------------------ slots
    def _allocate(self) -> int:
        return self.cache.allocate()

    def _free_slot(self, slot: int) -> None:
        self.cache.free(slot)

    def _set_lengths(self, slots: torch.Tensor, lengths: torch.Tensor) -> None:
        self.cache.lengths[slots] = lengths

    # ------------------------------------------------------------------ drafting
    def _take_features(self, r: DraftRequest, s: _Sess) -> bool:
        return True

    def _start(self, live, slots):
        return {"prev": None}  # the previous step's output per batch row (EAGLE's f of a draft)

    def _narrow(self, ctx, sel, slots):
        return {"prev": ctx["prev"][sel.to(self.device)]}

    def _forward(self, ctx, batch, tokens, qlens, slots, step, feed) -> torch.Tensor:
        """Feeds each session its tokens [B, T] (qlens real ones) at the slot's next positions;
        returns the last fed position's output [B, H] (before the LM head)."""
        positions = self.cache.positions_for(slots, tokens.shape[1]).to(self.device)
        x = self._inputs(ctx, batch, tokens, step, feed)
        cos, sin = self.parts.rotary(positions, x.dtype)
        x = self._final(
            self._run_layers(self.cache, self.fused, list(self._layers()), x, cos, sin, slots, qlens, positions)
        )
        self.cache.lengths[slots] += qlens
        ctx["prev"] = out = last_position(x, qlens)[:, 0]
        return out

    def _static_inputs(self, ctx, slots):
        return None, ctx["prev"]

    def _static_step(self, tokens, slots, positions, store_at, extra, prev):
        """One draft step over fixed-shape device tensors (``StaticDraftSteps``): the drafter's
        layers over its cache. Returns the output before the LM head [N, H], which is also the
        next step's ``prev`` (EAGLE-style; unused by an independent drafter)."""
        x = self._static_embed(tokens, prev)
        cos, sin = self.parts.rotary(positions, x.dtype)
        cos, sin = cos[0][:, None], sin[0][:, None]  # [N, 1, hd]: broadcast over heads
        batch = PackedBatch.static(self.cache, slots, positions, store_at)
        for i, layer in enumerate(self._layers()):
            x = layer.forward_packed(x, cos, sin, batch.attention(i))
        x = self._final(x)
        return x, x


class EagleProposer(_BaselineProposer):
    """EAGLE-style drafting: verified positions read the target's hidden states (from the
    verifier's "hidden" feature head); drafted positions read the drafter's own predictions and
    are never kept in the cache (they are recomputed with the target's features once verified)."""

    keeps_drafts = False
    kinds = ("eagle",)

    def _layers(self):
        return [self.model.layer]

    def _final(self, x):
        return x

    def _take_features(self, r: DraftRequest, s: _Sess) -> bool:
        if r.features is not None and len(r.features):
            if r.feature_start > s.num_features:
                return False
            f = r.features.to(self.device, self.dtype)
            s.feats = f if s.feats is None or r.feature_start == 0 else torch.cat((s.feats[: r.feature_start], f))
        elif r.feature_start > s.num_features:
            return False
        # drafting at the last committed position P needs the features of positions < P
        return r.num_drafts == 0 or s.num_features >= len(s.committed) - 1

    def _inputs(self, ctx, batch, tokens, step, feed):
        """fc(embed(token_i) ⊕ f_{i-1}): at the first step f comes from the target's hidden
        states of the fed positions (zero before position 0), afterwards from the drafter's own
        previous output."""
        b, w = tokens.shape
        if step == 0:
            prev = torch.zeros(b, w, self.cfg.target.hidden_size, dtype=self.dtype, device=self.device)
            for bi, ((_, s, _), t) in enumerate(zip(batch, feed)):
                st = len(s.fed)  # the first fed position
                f = s.feats[max(st - 1, 0) : st - 1 + len(t)]
                prev[bi, len(t) - f.shape[0] : len(t)] = f
        else:
            prev = ctx["prev"][:, None]
        return self.model.fc(torch.cat((self.parts.embed_tokens(tokens), prev), -1))

    def _static_embed(self, tokens, prev):
        return self.model.fc(torch.cat((self.parts.embed_tokens(tokens), prev), -1))


class IndependentProposer(_BaselineProposer):
    """A small causal LM drafting alone (no target features)."""

    needs_features = False
    uses_features = False
    keeps_drafts = True
    kinds = ("independent",)

    def _layers(self):
        return list(self.model.layers)

    def _final(self, x):
        return self.model.norm(x)

    def _inputs(self, ctx, batch, tokens, step, feed):
        return self.parts.embed_tokens(tokens)

    def _static_inputs(self, ctx, slots):
        return None, None

    def _static_embed(self, tokens, prev):
        return self.parts.embed_tokens(tokens)
