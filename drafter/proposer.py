"""Drafting with the MoA draft head for many sessions at once.

Per session the proposer keeps its copy of the session's committed tokens and (in slot caches)
the SA keys/values of the tokens it has fed, the TLI layers' keys/values (when N > 0), and the
CA keys/values projected from the features of verified positions. A round's request carries the
committed tokens as a delta (``copy[:base] + tokens``) and the features of newly verified
positions; the proposer rolls its SA cache back to the longest prefix still committed, feeds the
rest, then drafts K tokens one step at a time, every session of the batch in the same step. A
draft only ever sees features of verified positions (the inference form of the T-step bounded
mask).

Caches never fill up: a new session takes the slot of the least recently used session that is
not part of the current call; that session later answers ``resync`` (or asks for its features
again) and is rebuilt from what the Router resends.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from moa_serve.drafter.checkpoint import DRAFT_VOCAB_KEY, load_drafter
from moa_serve.drafter.config import DrafterConfig
from moa_serve.drafter.moa_model import DraftHead, MoADrafter, TargetParts
from moa_serve.drafter.spec import TreeShape
from moa_serve.kernels import cpu as cpu_kernels
from moa_serve.kernels.packed import FusedStack, fuse_projections, pack_bf16_exact, packed_lm_head
from moa_serve.model.kv_cache import PackedBatch, SlotKVCache, invariant_attention
from moa_serve.model.target import TargetArch, TargetModel
from moa_serve.model_files import load_selected_tensors, read_config, resolve_model_path, target_dtype
from moa_serve.protocol import DraftRequest, DraftResult
from moa_serve.sampling import generator_for, sample, warp_probs


@dataclass
class _Session:
    slot: int
    committed: list[int] = field(default_factory=list)  # this replica's copy of the committed tokens
    fed: list[int] = field(default_factory=list)  # tokens in the SA cache
    num_features: int = 0
    agreed: int = 0  # fed[:agreed] == committed[:agreed] is known without comparing


def load_for_drafting(drafter: str, target: str | None, dtype, device, target_model: TargetModel | None):
    """A drafter checkpoint and the target parts it borrows, checked to match. With
    ``target_model`` (the in-process engine) the parts share its modules; without, only the
    tensors the drafter needs are read from the target's weights (embeddings, LM head, final
    norm, the last N layers for TLI). Returns (config, state without the draft vocabulary, draft
    vocabulary or None, target parts, dtype)."""
    cfg, state = load_drafter(drafter)
    path = None if target_model is not None else resolve_model_path(target or cfg.target_name_or_path)
    dt = target_dtype(dtype, device, path, target_model)
    tli = cfg.target_layer_inference if cfg.kind == "moa" else 0
    if target_model is not None:
        _check_target(cfg, target_model.arch)
        parts = TargetParts(target_model, tli)
    else:
        hf_config = read_config(path)
        arch = TargetArch.from_hf_config(hf_config)
        _check_target(cfg, arch)  # before reading any weights
        state_parts = load_selected_tensors(path, TargetParts.wanted(arch, tli))
        parts = TargetParts.from_state_dict(hf_config, state_parts, tli, dt, device)
        parts.source_path = path  # where packed (GGUF) weights may come from
    draft_vocab = state.pop(DRAFT_VOCAB_KEY, None)
    return cfg, state, draft_vocab, parts, dt


def _check_target(cfg: DrafterConfig, arch: TargetArch) -> None:
    if arch != cfg.target:
        raise ValueError(f"the drafter was made for another target: {cfg.target} != {arch}")


def rollback_point(fed: list[int], committed: list[int], agreed: int = 0) -> int:
    """Length of the longest prefix of the fed tokens that is still committed, never covering the
    last committed token (it is always fed again: drafting starts from its output). The first
    ``agreed`` tokens are known to match: only the tokens after them are compared."""
    limit = min(len(fed), len(committed) - 1)
    m = min(agreed, limit)
    while m < limit and fed[m] == committed[m]:
        m += 1
    return m


def last_position(x: torch.Tensor, qlens: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...] -> [B, 1, ...]: each row's last real position (qlens[b] - 1)."""
    if x.shape[1] == 1:
        return x
    rows = torch.arange(x.shape[0], device=x.device)
    return x[rows, (qlens - 1).to(x.device)][:, None]


class ProposerBase:
    """What every proposer shares: the propose() protocol (token deltas and resync, features
    first, then one batched drafting loop), sessions with least-recently-used eviction, choosing
    draft tokens (greedy, or sampled with their distribution kept), and the draft vocabulary.

    A subclass provides its slot caches (``_allocate``/``_free_slot``/``_set_lengths``), how it
    takes features (``_take_features``), and one drafting step (``_start``/``_narrow``/``_forward``)."""

    needs_features = True
    keeps_drafts = True  # drafted tokens stay in the cache (rolled back next round if rejected)
    session_cls = _Session
    # tree drafts: candidates per draft depth for greedy sessions (e.g. (4, 2): the top 4 tokens at
    # the first depth, the top 2 at the second, the top 1 beyond). The top one is drafted on;
    # the others are its alternatives, verified beside it as leaves. () = a plain chain.
    branching: tuple[int, ...] = ()
    tree_min_value: float = 0.0  # TreeShape.min_value: 0 = every candidate of ``branching``
    kinds: tuple[str, ...] | None = None  # the checkpoint kinds load() accepts (None: any)

    @classmethod
    def load(
        cls,
        drafter: str,
        target: str | None = None,
        dtype="float32",
        device="cpu",
        max_sessions=16,
        max_model_len=2048,
        target_model: TargetModel | None = None,
    ):
        """The proposer of checkpoint ``drafter`` over ``target`` (or ``target_model``'s weights)."""
        cfg, state, draft_vocab, parts, dt = load_for_drafting(drafter, target, dtype, device, target_model)
        if cls.kinds is not None and cfg.kind not in cls.kinds:
            raise ValueError(f"{drafter} is a {cfg.kind!r} drafter: load it with load_proposer")
        return cls.from_checkpoint(cfg, state, parts, dt, device, max_sessions, max_model_len, draft_vocab)

    @classmethod
    def from_checkpoint(cls, cfg, state, parts, dt, device, max_sessions, max_model_len, draft_vocab):
        """The proposer of a loaded checkpoint (its config, state dict and the target's parts)."""
        raise NotImplementedError

    vocab_size: int
    draft_vocab: torch.Tensor | None
    stats: dict

    branches = True  # it can draft trees (set_tree)

    def set_tree(self, shape: TreeShape) -> None:
        """Tree drafts for greedy sessions from now on (``TreeShape()``: chains)."""
        self.branching, self.tree_min_value = shape.widths, shape.min_value

    def _bind(self, cfg: DrafterConfig, parts: TargetParts) -> None:
        """The drafter's config and the target parts it borrows (in eval mode), whose dtype and
        device the drafter's caches take."""
        self.cfg, self.parts = cfg, parts.eval()
        p = parts.lm_head.weight
        self.dtype, self.device = p.dtype, p.device

    def _init_lm_head(self, cfg: DrafterConfig, draft_vocab: torch.Tensor | None) -> None:
        """The borrowed LM head, restricted to the draft vocabulary when the checkpoint has one, and
        the drafting counters."""
        p = self.parts.lm_head.weight
        self.vocab_size = cfg.target.vocab_size
        self.draft_vocab = draft_vocab.to(self.device) if draft_vocab is not None else None
        self.lm_head_weight = p[self.draft_vocab] if self.draft_vocab is not None else p
        # a float32 CPU drafter of a GGUF target reads its head from the 8-bit blocks (4x fewer
        # bytes per draft step, the same float32 values)
        self.lm_head_packed = packed_lm_head(
            self.parts.lm_head, getattr(self.parts, "source_path", None), self.draft_vocab
        )
        self.stats = {"steps": 0, "draft_s": 0.0, "evicted": 0, "resync": 0}

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V'] (V' = the draft vocabulary when the checkpoint has one)."""
        if self.lm_head_packed is not None:
            flat = hidden.reshape(-1, hidden.shape[-1]).float()
            return self.lm_head_packed.matmul_t(flat).reshape(*hidden.shape[:-1], -1)
        return (hidden @ self.lm_head_weight.T).float()

    def _pack_layers(self, module: torch.nn.Module, layers: list, shape) -> FusedStack | None:
        """A float32 CPU drafter whose weights are bf16 values (checkpoints are stored in bf16)
        drafts through the packed kernels: every projection of ``module`` reads the same weights
        as bf16 (half the bytes) and its decoder ``layers`` run as one fused kernel call per step
        instead of ~40 small torch ops per layer (drafting one token at a time is bound by those,
        not by arithmetic). Returns the fused layers, or None (the torch path)."""
        if self.dtype != torch.float32 or self.device.type != "cpu" or not pack_bf16_exact(module)["packed"]:
            return None
        fuse_projections(layers)
        return FusedStack.for_layers(shape, layers)

    @staticmethod
    def _run_layers(
        cache: SlotKVCache,
        fused: FusedStack | None,
        layers: list,
        x: torch.Tensor,
        cos,
        sin,
        slots: torch.Tensor,
        qlens: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """``cache.run_layers`` over the ragged batch x [B, T, H] (session b's first qlens[b] tokens
        are real, at ``positions`` [B, T]), through the fused kernel when there is one: only the
        real tokens go in, padded rows come back as zeros (their outputs are never read)."""
        if fused is None or not fused.usable(x, cache):
            return cache.run_layers(layers, x, cos, sin, slots, qlens)
        b, t, h = x.shape
        positions = positions.clamp(max=cache.max_len)
        if t == 1:
            y = fused(
                x.reshape(b, h).contiguous(),
                cos[:, 0, 0].contiguous(),
                sin[:, 0, 0].contiguous(),
                cache,
                slots,
                positions[:, 0],
            )
            return y.reshape(b, 1, h)
        real = torch.arange(t)[None, :] < qlens[:, None]
        y = fused(
            x[real].contiguous(),
            cos[:, 0][real].contiguous(),
            sin[:, 0][real].contiguous(),
            cache,
            slots.repeat_interleave(qlens),
            positions[real],
        )
        out = x.new_zeros(b, t, h)
        out[real] = y
        return out

    def _init_sessions(self, max_sessions: int, max_model_len: int) -> None:
        self.max_sessions = max_sessions
        self.max_model_len = max_model_len
        self.sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently used first

    # ------------------------------------------------------------------ protocol
    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[DraftResult]:
        t0 = time.perf_counter()
        self._check_capacity(requests)
        self._taken = []  # features taken in this call, stored by _flush_features
        in_call = {r.session_id for r in requests}
        results = {r.session_id: DraftResult(r.session_id, []) for r in requests}
        live = []
        for r in requests:
            s = self._sync(r, in_call)
            if s is None:
                held = self.sessions.get(r.session_id)
                results[r.session_id].resync = True
                results[r.session_id].needs_features_from = held.num_features if held is not None else 0
                self.stats["resync"] += 1
            elif not self._take_features(r, s):
                results[r.session_id].needs_features_from = s.num_features
            else:
                k = min(r.num_drafts, self.max_model_len + 1 - len(s.committed))  # room in the caches
                if k > 0 and s.committed:
                    live.append((r, s, k))
        self._flush_features()
        if live:
            self._draft(live, results)
        self.stats["draft_s"] += time.perf_counter() - t0
        return [results[r.session_id] for r in requests]

    _taken: list[tuple[int, int, torch.Tensor]] = []  # (slot, first position, features) taken in a call

    def _flush_features(self) -> None:
        """Stores the features that ``_take_features`` accepted in this call, all sessions at once
        (a proposer that stores them as it takes them has nothing to do here)."""

    def _check_capacity(self, requests: list[DraftRequest]) -> None:
        """Refuses, before changing anything, a call whose own sessions need more slots than exist
        (every other session can be evicted)."""
        need = {r.session_id for r in requests if r.session_id in self.sessions or r.base == 0}
        if len(need) > self.max_sessions:
            raise RuntimeError(
                f"a draft call for {len(need)} sessions exceeds this drafter's "
                f"max_sessions={self.max_sessions}: split the call or raise max_sessions"
            )

    def _sync(self, r: DraftRequest, in_call: set[str]) -> _Session | None:
        """The session with its committed copy brought up to date (``copy[:base] + tokens``), or
        None (nothing changed) when this replica holds fewer than ``base`` of its tokens."""
        s = self.sessions.get(r.session_id)
        if s is None:
            if r.base > 0:
                return None
            s = self._new_session(r.session_id, in_call)
        elif r.base > len(s.committed):
            return None
        else:
            self.sessions.move_to_end(r.session_id)
        del s.committed[r.base :]
        s.committed.extend(r.tokens)
        s.agreed = min(s.agreed, r.base)
        return s

    def _new_session(self, session_id: str, in_call: set[str]) -> _Session:
        if len(self.sessions) >= self.max_sessions:
            victim = next((sid for sid in self.sessions if sid not in in_call), None)
            if victim is None:
                raise RuntimeError(f"drafter cache full: all {self.max_sessions} slots hold sessions of this call")
            self.release(victim)
            self.stats["evicted"] += 1
        s = self.sessions[session_id] = self.session_cls(self._allocate())
        return s

    def release(self, session_id: str) -> None:
        s = self.sessions.pop(session_id, None)
        if s is not None:
            self._free_slot(s.slot)

    # ------------------------------------------------------------------ drafting
    def _draft(self, live, results) -> None:
        """Rolls each session's cache back to the longest prefix of its fed tokens that is still
        committed, feeds the rest, then drafts one token per step for every session still
        drafting. Token ids stay on the device until the end (one host transfer per call for
        greedy batches)."""
        feed = []
        for _, s, _ in live:
            m = rollback_point(s.fed, s.committed, s.agreed)
            del s.fed[m:]
            feed.append(s.committed[m:])
        slots = torch.tensor([s.slot for _, s, _ in live])
        self._set_lengths(slots, torch.tensor([len(s.fed) for _, s, _ in live]))
        want = [k for _, _, k in live]
        ctx = self._start(live, slots)
        picked, probs, runners_up = [], [[] for _ in live], []
        if not (self.static_first_step and self._draft_static_first(live, want, feed, slots, ctx, picked)):
            self._draft_planned(live, want, feed, slots, ctx, picked, probs, runners_up)
        drafts = [[] for _ in live]
        flat = iter(torch.cat([t for _, t in picked]).tolist())
        for step_rows, _ in picked:
            for i in step_rows:
                drafts[i].append(next(flat))
        alternatives = [[[] for _ in range(k)] for _, _, k in live]
        for step, step_rows, alt in runners_up:
            for i, row in zip(step_rows, alt.tolist()):
                alternatives[i][step] = [a for a in row if a >= 0]  # (kept for greedy sessions below)
        for i, (r, s, _) in enumerate(live):
            s.fed.extend(feed[i])
            s.agreed = len(s.committed)  # fed is the committed tokens, then drafts
            if self.keeps_drafts:
                s.fed.extend(drafts[i][:-1])  # the last draft is never fed
            res = results[r.session_id]
            res.drafts = drafts[i]
            if runners_up and r.sampling.greedy:
                res.alternatives = alternatives[i]
            if probs[i]:
                res.probs = torch.stack(probs[i])
        self._set_lengths(torch.tensor([s.slot for _, s, _ in live]), torch.tensor([len(s.fed) for _, s, _ in live]))

    def _draft_planned(self, live, want, feed, slots, ctx, picked, probs, runners_up) -> None:
        """The draft call's steps one by one: the first feeds each session its new tokens (ragged,
        planned for this call's shapes), the others one token each (from the static steps where
        they apply)."""
        width = max(len(t) for t in feed)
        tokens = torch.tensor([t + [0] * (width - len(t)) for t in feed], device=self.device)
        qlens = torch.tensor([len(t) for t in feed])
        rows = list(range(len(live)))  # the sessions (indices into live) of the current step
        # the drafter's own estimate that the chain is still accepted before each depth (the product
        # of its top-1 probabilities), for tree_min_value
        reach = torch.ones(len(live), device=self.device)
        for step in range(max(want)):
            if step == 1 and self._static_steps_apply(live, ctx, slots):
                self._draft_static(live, want, tokens[:, 0], slots, ctx, picked)
                break
            if step:
                keep = [b for b, i in enumerate(rows) if want[i] > step]
                if len(keep) < len(rows):
                    sel = torch.tensor(keep)
                    rows, slots = [rows[b] for b in keep], slots[sel]
                    tokens = tokens[sel.to(self.device)]
                    ctx = self._narrow(ctx, sel, slots)
                qlens = torch.ones(len(rows), dtype=torch.long)
            batch = [live[i] for i in rows]
            hidden = self._forward(ctx, batch, tokens, qlens, slots, step, feed)
            logits = self._logits(hidden)
            tok, qs = self._pick(logits, batch, step)
            for b, q in qs.items():
                probs[rows[b]].append(q)
            picked.append((rows, tok))
            width = self.branching[step] if step < len(self.branching) else 1
            pruning = self.tree_min_value > 0 and step < len(self.branching)  # reach needs every depth
            if (width > 1 or pruning) and any(r.sampling.greedy for r, _, _ in batch):
                runners_up.append((step, rows, self._runners_up(logits, width, reach, rows)))
            tokens = tok[:, None]
            self.stats["steps"] += 1

    # a StaticDraftSteps: a call's steps after the first from one CUDA graph (use_static_steps); the
    # proposer gives its cache (``static_cache``) and one step (``_static_step``, ``_static_inputs``)
    static_steps = None
    static_cache: SlotKVCache

    def use_static_steps(self, graphs: bool) -> bool:
        """Drafting steps after the first from ``StaticDraftSteps`` (CUDA graphs when ``graphs``; on a
        CPU the same fixed shapes uncaptured). Not for TLI drafters, nor where the batch-invariant
        attention kernels do not run. Returns whether it is on."""
        from moa_serve.drafter.static_steps import StaticDraftSteps
        from moa_serve.kernels import gpu_invariant

        hd = self.cfg.sa_shape().head_dim
        kernel = (
            (gpu_invariant.available(self.device) and hd & (hd - 1) == 0)
            if self.device.type != "cpu"
            else cpu_kernels.library() is not None or gpu_invariant.available("cpu")
        )
        if len(self.parts.tli) or not kernel:
            self.static_steps = None
            return False
        self.static_steps = StaticDraftSteps(self, graphs)
        return True

    # whether a call's first step runs in the static steps too (the proposer's ``_static_step`` can
    # feed a session several tokens: MoA's needs nothing but the tokens and the verified features)
    static_first_step = False

    def _draft_static_first(
        self, live, want: list[int], feed: list[list[int]], slots: torch.Tensor, ctx, picked
    ) -> bool:
        """The whole call, its first step included, from the static steps (one graph on a GPU).
        False when they do not apply (too many sessions, a long feed, sampling, trees): the caller
        then plans the call."""
        if not self._static_steps_apply(live, ctx, slots):
            return False
        extra, carry = self._static_inputs(ctx, slots)
        starts = [len(s.fed) for _, s, _ in live]  # the SA cache's lengths after the rollback
        steps = max(want)
        out = self.static_steps.with_first_step(feed, slots.tolist(), starts, steps, extra, carry)
        if out is None:
            return False
        self._pick_static(out, want, 0, picked)
        return True

    def _static_steps_apply(self, live, ctx, slots: torch.Tensor) -> bool:
        """Whether the rest of this call runs as static steps: greedy chains, few enough sessions,
        and what the proposer's step needs at hand (``_static_ready``)."""
        if self.static_steps is None or self.branching or self.tree_min_value > 0:
            return False
        if not all(r.sampling.greedy for r, _, _ in live) or self.static_steps.size_for(len(live)) is None:
            return False
        return self._static_ready(ctx, slots)

    def _static_ready(self, ctx, slots: torch.Tensor) -> bool:
        return True

    def _draft_static(self, live, want: list[int], first: torch.Tensor, slots: torch.Tensor, ctx, picked) -> None:
        """Steps 1 .. max(want)-1 for every session from the static steps; each session keeps the
        drafts of its own ``want`` (``picked`` gets one entry per step, as the planned loop's)."""
        steps = max(want) - 1
        extra, carry = self._static_inputs(ctx, slots)
        out = self.static_steps(first, slots.tolist(), self.static_cache.lengths[slots].tolist(), steps, extra, carry)
        self._pick_static(out, want, 1, picked)

    def _pick_static(self, out: torch.Tensor, want: list[int], first_step: int, picked) -> None:
        """The static steps' drafts ``out`` [B, steps] (step ``first_step`` on) into ``picked``, one
        entry per step with the sessions that still draft at it, as the planned loop's."""
        every = list(range(len(want)))
        for j in range(out.shape[1]):
            rows = [i for i in every if want[i] > first_step + j]
            picked.append(
                (rows, out[:, j] if len(rows) == len(every) else out[torch.tensor(rows, device=out.device), j])
            )
        self.stats["steps"] += out.shape[1]

    def _runners_up(self, logits: torch.Tensor, width: int, reach: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The tokens ranked 2nd..``width``-th by the drafter, [B, width - 1] target ids (on the device);
        with ``tree_min_value``, -1 for those whose estimated worth (the chain's reach x the token's
        probability) is below it. Updates ``reach`` of the step's ``rows`` (sessions in ``live``)."""
        top = logits.topk(min(width, logits.shape[-1]), dim=-1)
        ids = top.indices[:, 1:]
        ids = self.draft_vocab[ids] if self.draft_vocab is not None else ids
        if self.tree_min_value <= 0:
            return ids
        p = torch.softmax(logits.float(), dim=-1).gather(-1, top.indices)  # [B, width]
        idx = torch.tensor(rows, device=reach.device)
        worth = reach[idx][:, None] * p[:, 1:]
        reach[idx] = reach[idx] * p[:, 0]
        return ids.masked_fill(worth < self.tree_min_value, -1)

    def _pick(self, logits: torch.Tensor, batch, step: int) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Draft tokens of one step from logits [B, V'] over the draft vocabulary: the argmax for
        greedy sessions; for sampling ones a sample of the warped distribution q, returned (float32,
        [V'], on CPU) by batch row. Returns (target token ids [B] on the device, {row: q})."""
        choice = logits.argmax(-1)
        qs = {}
        sampling = [b for b, (r, _, _) in enumerate(batch) if not r.sampling.greedy]
        if sampling:  # one host transfer for every sampling session of the step (seeded CPU generators)
            rows = logits[torch.tensor(sampling, device=logits.device)].float().cpu()
            picked = []
            for j, b in enumerate(sampling):
                r, s, _ = batch[b]
                q = warp_probs(rows[j : j + 1], r.sampling)[0]
                picked.append(sample(q, generator_for(r.sampling, len(s.committed) + step, "draft")))
                qs[b] = q
            choice[torch.tensor(sampling, device=choice.device)] = torch.tensor(
                picked, device=choice.device, dtype=choice.dtype
            )
        if self.draft_vocab is not None:
            choice = self.draft_vocab[choice]
        return choice, qs


class MoAProposer(ProposerBase):
    kinds = ("moa",)

    def __init__(
        self,
        cfg: DrafterConfig,
        head: DraftHead,
        parts: TargetParts,
        max_sessions: int = 16,
        max_model_len: int = 2048,
        draft_vocab: torch.Tensor | None = None,
    ):
        self._bind(cfg, parts)
        self.head = head.eval()
        sa = cfg.sa_shape()
        self.sa_cache = SlotKVCache(
            1, max_sessions, sa.num_kv_heads, sa.head_dim, max_model_len, self.dtype, self.device
        )
        if len(parts.tli):
            t = cfg.target
            self.tli_cache = SlotKVCache(
                len(parts.tli), max_sessions, t.num_kv_heads, t.head_dim, max_model_len, self.dtype, self.device
            )
        ca = cfg.ca_shape()
        self.ca_cache = SlotKVCache(
            1, max_sessions, ca.num_kv_heads, ca.head_dim, max_model_len, self.dtype, self.device
        )
        self._init_lm_head(cfg, draft_vocab)
        self._init_sessions(max_sessions, max_model_len)
        self.sa_fused = self._pack_layers(self.head, [self.head.self_attention], cfg.sa_shape())
        # a CA that sees one feature returns that feature's value whatever the query: its output is
        # computed once per draft call instead of per drafted token (CrossAttentionLayer)
        self.single_feature_ca = bool(cfg.cross_attention_latest_only)
        fuse_projections([self.head.cross_attention])  # its MLP's gate/up, when packed
        self.static_cache = self.sa_cache
        self.static_first_step = True
        if self.device.type == "cuda":
            self.use_static_steps(graphs=True)

    @classmethod
    def from_checkpoint(cls, cfg, state, parts, dt, device, max_sessions, max_model_len, draft_vocab) -> "MoAProposer":
        drafter = MoADrafter(cfg)
        drafter.load_flat_state_dict(state)
        return cls(cfg, drafter.draft_head.to(device, dt), parts, max_sessions, max_model_len, draft_vocab)

    # ------------------------------------------------------------------ slots
    def _caches(self):
        return [self.sa_cache, self.ca_cache] + ([self.tli_cache] if len(self.parts.tli) else [])

    def _allocate(self) -> int:
        slots = {c.allocate() for c in self._caches()}
        assert len(slots) == 1, "drafter caches out of step"
        return slots.pop()

    def _free_slot(self, slot: int) -> None:
        for c in self._caches():
            c.free(slot)

    def _set_lengths(self, slots: torch.Tensor, lengths: torch.Tensor) -> None:
        self.sa_cache.lengths[slots] = lengths
        if len(self.parts.tli):
            self.tli_cache.lengths[slots] = lengths

    # ------------------------------------------------------------------ drafting
    def _take_features(self, r: DraftRequest, s: _Session) -> bool:
        if r.features is None or len(r.features) == 0:
            return r.feature_start <= s.num_features
        if r.feature_start > s.num_features and not self.cfg.cross_attention_latest_only:
            return False
        n = r.features.shape[0]
        self._taken.append((s.slot, r.feature_start, r.features))
        s.num_features = r.feature_start + n
        self.ca_cache.lengths[s.slot] = s.num_features
        return True

    def _flush_features(self) -> None:
        """The CA keys/values of every feature taken in this call: one projection and one cache
        write over all sessions' features packed in a row."""
        if not self._taken:
            return
        taken, self._taken = self._taken, []
        slots = torch.tensor([slot for slot, _, f in taken for _ in range(f.shape[0])])
        pos = torch.cat([torch.arange(start, start + f.shape[0]) for _, start, f in taken])
        feats = torch.cat([f for _, _, f in taken]).to(self.device, self.dtype)[None]  # [1, N, H]
        cos, sin = self.parts.rotary(pos.to(self.device)[None], self.dtype)
        k, v = self.head.cross_attention.project_features(feats, cos, sin)  # [1, KVH, N, hd]
        self.ca_cache.write(0, slots, pos[:, None], k[0].transpose(0, 1)[:, :, None], v[0].transpose(0, 1)[:, :, None])

    def _start(self, live, slots: torch.Tensor):
        """The CA keys/values of the batch's verified positions and their mask, or, for a CA that
        sees one feature, its attention output: fixed while drafting, so read once per call (again
        only when the batch shrinks)."""
        n_feat = self.ca_cache.lengths[slots]
        if self.single_feature_ca and bool((n_feat > 0).all()):  # only the latest value is read
            latest = self.ca_cache.v[0, slots, :, n_feat - 1]  # [B, KVH, hd]
            return None, None, None, self.head.cross_attention.single_feature_output(latest)
        keys, values = self.ca_cache.read(0, slots, int(n_feat.max()))
        idx = torch.arange(keys.shape[2])[None, :]
        mask = idx < n_feat[:, None]
        if self.cfg.cross_attention_latest_only:  # only the last verified position's feature
            mask &= idx >= n_feat[:, None] - 1
        mask = mask[:, None, None, :].to(self.device)
        return keys, values, mask, None

    def _narrow(self, ctx, sel: torch.Tensor, slots: torch.Tensor):
        return self._start(None, slots)

    # ------------------------------------------------------------------ static steps
    def _static_ready(self, ctx, slots: torch.Tensor) -> bool:
        """The single-feature CA's output is at hand, or every session has a verified feature."""
        return ctx[3] is not None or bool((self.ca_cache.lengths[slots] > 0).all())

    def _static_inputs(self, ctx, slots: torch.Tensor):
        """(each session's last feature position, the single-feature CA output or None)."""
        single = ctx[3]
        return (self.ca_cache.lengths[slots] - 1).tolist(), (None if single is None else single[:, 0])

    def _static_step(self, tokens, slots, positions, store_at, last_feature, single):
        """One draft step over fixed-shape device tensors (``StaticDraftSteps``): SA over the SA
        cache, CA over the session's features (or the single-feature output). Returns the hidden
        state before the LM head [N, H] and ``single`` unchanged."""
        sa, ca, head = self.sa_cache, self.ca_cache, self.head
        x = self.parts.embed_tokens(tokens)
        cos, sin = self.parts.rotary(positions, x.dtype)
        cos, sin = cos[0][:, None], sin[0][:, None]  # [N, 1, hd]: broadcast over heads
        x = head.self_attention.forward_packed(
            x, cos, sin, PackedBatch.static(sa, slots, positions, store_at).attention(0)
        )
        if single is not None:
            return head.cross_attention.forward_single_feature(x, single), single
        return head.cross_attention.forward_packed(
            x, cos, sin, lambda q: invariant_attention(q, ca.k[0], ca.v[0], slots, last_feature, last_feature)
        ), None

    def _forward(self, ctx, batch, tokens, qlens, slots, step, feed) -> torch.Tensor:
        """Feeds each session its tokens [B, T] (qlens real ones); returns the hidden state before
        the LM head at each session's last fed position [B, H]."""
        keys, values, mask, single = ctx
        positions = self.sa_cache.positions_for(slots, tokens.shape[1]).to(self.device)
        x = self.parts.embed_tokens(tokens)
        cos, sin = self.parts.rotary(positions, x.dtype)
        x = self._run_layers(
            self.sa_cache, self.sa_fused, [self.head.self_attention], x, cos, sin, slots, qlens, positions
        )
        tli = len(self.parts.tli)
        if not tli and x.shape[1] > 1:  # only the last fed position drafts
            rows = torch.arange(len(batch), device=self.device)
            last = (qlens - 1).to(self.device)
            x, cos, sin = x[rows, last][:, None], cos[rows, :, last][:, :, None], sin[rows, :, last][:, :, None]
        if single is not None:
            x = self.head.cross_attention.forward_single_feature(x, single)
        else:
            x = self.head.cross_attention(x, cos, sin, keys, values, mask)
        if tli:
            x = self.tli_cache.run_layers(self.parts.tli, x, cos, sin, slots, qlens)
            x = last_position(self.parts.norm(x), qlens)
            self.tli_cache.lengths[slots] += qlens
        self.sa_cache.lengths[slots] += qlens
        return x[:, 0]
