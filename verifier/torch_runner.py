"""The torch verifier backend: target model + per-session KV cache + lossless acceptance + the
MoA feature head. One ``verify`` call runs one batched target forward for every session
whose new tokens are short (decode rounds) and one forward per long prefill."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from moa_serve.drafter.model import FeatureHead
from moa_serve.engine.sampling import SamplingParams
from moa_serve.models import load_state_dict, parse_dtype, read_config, resolve_model_path
from moa_serve.verifier.acceptance import accept_greedy, accept_sampling, generator_for, warp_probs
from moa_serve.verifier.api import TargetBackend, VerifyRequest, VerifyResult
from moa_serve.verifier.target_model import TargetModel

log = logging.getLogger(__name__)

PREFILL_ALONE = 64  # sessions with more new tokens than this get a forward of their own


class ContextTooLongError(ValueError):
    pass


@dataclass
class _Session:
    slot: int
    cached: list[int] = field(default_factory=list)  # tokens whose K/V are in the cache


@dataclass
class _Work:
    req: VerifyRequest
    session: _Session
    start: int  # first position fed this round
    fed: list[int]  # committed-but-uncached tokens followed by drafts


class TorchTargetRunner(TargetBackend):
    def __init__(self, target: str, dtype: str | torch.dtype = "float32", device: str = "cpu",
                 max_sessions: int = 16, max_model_len: int = 2048, feature_head: FeatureHead | None = None,
                 model: TargetModel | None = None):
        self.dtype = parse_dtype(dtype)
        self.device = torch.device(device)
        if model is None:
            path = resolve_model_path(target)
            model = TargetModel.from_state_dict(read_config(path), load_state_dict(path), self.dtype, self.device)
        self.model = model
        self.arch = model.arch
        self.max_model_len = min(max_model_len, self.arch.max_position_embeddings)
        self.cache = model.new_cache(max_sessions, self.max_model_len)
        self.feature_head = feature_head.to(self.device, self.dtype).eval() if feature_head is not None else None
        self.sessions: dict[str, _Session] = {}
        self.stats = {"forwards": 0, "tokens": 0, "forward_s": 0.0}

    # ------------------------------------------------------------------ sessions
    def release(self, session_id: str) -> None:
        s = self.sessions.pop(session_id, None)
        if s is not None:
            self.cache.free(s.slot)

    @property
    def free_slots(self) -> int:
        return self.cache.num_free

    def _session(self, session_id: str) -> _Session:
        s = self.sessions.get(session_id)
        if s is None:
            s = self.sessions[session_id] = _Session(self.cache.allocate())
        return s

    def _plan(self, req: VerifyRequest) -> _Work:
        if not req.committed:
            raise ValueError(f"session {req.session_id}: no tokens to verify")
        need = len(req.committed) + len(req.drafts)
        if need > self.max_model_len:
            raise ContextTooLongError(
                f"session {req.session_id}: {need} tokens exceed the context of {self.max_model_len}")
        s = self._session(req.session_id)
        m = 0
        limit = min(len(s.cached), len(req.committed) - 1)  # the last committed token is always fed
        while m < limit and s.cached[m] == req.committed[m]:
            m += 1
        self.cache.lengths[s.slot] = m
        del s.cached[m:]
        return _Work(req, s, m, req.committed[m:] + list(req.drafts))

    # ------------------------------------------------------------------ verify
    @torch.inference_mode()
    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        work = [self._plan(r) for r in requests]
        short = [w for w in work if len(w.fed) <= PREFILL_ALONE]
        groups = ([short] if short else []) + [[w] for w in work if len(w.fed) > PREFILL_ALONE]
        results: dict[str, VerifyResult] = {}
        for group in groups:
            for w, res in zip(group, self._verify_group(group)):
                results[w.req.session_id] = res
        return [results[r.session_id] for r in requests]

    def _verify_group(self, group: list[_Work]) -> list[VerifyResult]:
        t0 = time.perf_counter()
        width = max(len(w.fed) for w in group)
        tokens = torch.zeros(len(group), width, dtype=torch.long)
        for b, w in enumerate(group):
            tokens[b, :len(w.fed)] = torch.tensor(w.fed)
        qlens = torch.tensor([len(w.fed) for w in group])
        slots = torch.tensor([w.session.slot for w in group])
        hidden = self.model.forward_ragged(tokens.to(self.device), qlens, slots, self.cache)
        # logits only where they are needed: the last committed token and each draft
        rows, cols = [], []
        for b, w in enumerate(group):
            k = len(w.req.drafts)
            first = len(w.fed) - k - 1
            rows += [b] * (k + 1)
            cols += list(range(first, first + k + 1))
        logits = self.model.lm_head(hidden[rows, cols]).float().cpu()
        self.stats["forwards"] += 1
        self.stats["tokens"] += int(qlens.sum())
        self.stats["forward_s"] += time.perf_counter() - t0

        results, offset = [], 0
        for w in group:
            k = len(w.req.drafts)
            n_acc, nxt = self._accept(w.req, logits[offset:offset + k + 1])
            offset += k + 1
            kept = len(w.fed) - k + n_acc  # uncached committed tokens + accepted drafts
            self.cache.lengths[w.session.slot] = w.start + kept
            w.session.cached.extend(w.fed[:kept])
            results.append(VerifyResult(w.req.session_id, list(w.req.drafts[:n_acc]) + [nxt], n_acc,
                                        feature_start=w.start, features=None, num_computed=len(w.fed)))
        self._attach_features(group, results, hidden)
        return results

    def _accept(self, req: VerifyRequest, logits: torch.Tensor) -> tuple[int, int]:
        params: SamplingParams = req.sampling
        if params.greedy:
            return accept_greedy(logits, list(req.drafts))
        p = warp_probs(logits, params)
        position = len(req.committed)
        gen = generator_for(params, position, "verify")
        if not req.drafts:
            return accept_sampling(p, p[:0], [], gen)
        if req.draft_probs is None:
            raise ValueError(f"session {req.session_id}: sampling with drafts needs the drafter's probabilities")
        return accept_sampling(p, req.draft_probs.float(), list(req.drafts), gen)

    @property
    def feature_kind(self) -> str:
        """What the feature head reads: "per_layer_kv" (MoA's FeatureHead), "hidden" (EAGLE-style:
        the target's last hidden state, after its final norm, of newly verified positions) or
        "none" (no features)."""
        if self.feature_head is None:
            return "none"
        return getattr(self.feature_head, "input_kind", "per_layer_kv")

    def _attach_features(self, group: list[_Work], results: list[VerifyResult],
                         hidden: torch.Tensor | None = None) -> None:
        if self.feature_head is None:
            return
        spans = []
        for w, r in zip(group, results):
            end = int(self.cache.lengths[w.session.slot])
            spans.append((w.start, end) if w.req.want_features else (end, end))
        if self.feature_kind == "hidden":
            kv = [hidden[b, :e - a] for b, (a, e) in enumerate(spans)]
        else:
            kv = [self.cache.per_layer_kv(w.session.slot, a, b) for w, (a, b) in zip(group, spans)]
        sizes = [x.shape[0] for x in kv]
        if sum(sizes) == 0:
            return
        feats = self.feature_head(torch.cat(kv)).cpu()
        for r, (a, _), chunk in zip(results, spans, torch.split(feats, sizes)):
            r.feature_start, r.features = a, chunk
