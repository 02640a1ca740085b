"""The torch verifier backend: target model + per-session KV cache + lossless acceptance + the
MoA feature head.

One ``verify`` call runs ONE target forward over every session of the call, packed along one
token axis (no padding in the matmuls): decode steps (the last committed token and the drafts)
first, then prefill chunks under a per-forward token budget (``max_num_batched_tokens``, as
vLLM's chunked prefill), so a long prompt never stalls the other sessions' rounds: it is
prefilled over several calls, and answers with no tokens (``prefill_remaining``) until done.

Which slot holds which session, and the prefix cache over released sessions' K/V, live in
``slots.py``; the fixed-shape forward a CUDA graph replays in ``static_forward.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from moa_serve.grammar import Grammars
from moa_serve.kernels import cpu as cpu_kernels
from moa_serve.kernels import gpu_invariant
from moa_serve.kernels.packed import pack_target
from moa_serve.model.kv_cache import PackedBatch
from moa_serve.model.layers import fuse_dense_projections, use_matmul, use_rms_norm
from moa_serve.model.target import TargetModel
from moa_serve.model_files import (
    load_state_dict,
    load_tokenizer,
    read_config,
    resolve_model_path,
    stop_token_ids,
    target_dtype,
)
from moa_serve.protocol import VerifyRequest, VerifyResult
from moa_serve.sampling import SamplingParams, generator_for, warp_probs
from moa_serve.synthetic import describe, random_target
from moa_serve.verifier.acceptance import accept_greedy, accept_sampling
from moa_serve.verifier.api import NO_FEATURES, FeatureSource, TargetBackend
from moa_serve.verifier.logprobs import token_logprobs
from moa_serve.verifier.torch.slots import HeldSession, SlotTable
from moa_serve.verifier.torch.static_features import StaticFeatures
from moa_serve.verifier.torch.static_forward import StaticForward, packed_layout

log = logging.getLogger(__name__)

MIN_PREFILL_CHUNK = 32  # a waiting prefill always advances by at least this much per call


# a KV cache dtype other than the target's (``auto``); bfloat16 halves the cache and the bytes attention
# reads, K/V rounded once when written (as vLLM's --kv-cache-dtype; batch invariance is kept)
KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class _Work:
    req: VerifyRequest
    session: HeldSession
    start: int  # first position fed this call (= session.cached before the call)
    fed: list[int]  # tokens fed: uncached committed tokens (maybe a chunk of them), then drafts, then alternatives
    done: bool  # every committed token is in the cache after this call: the target answers
    remaining: int = 0  # committed tokens still uncached after this call
    alt_depth: list[int] = field(default_factory=list)  # per alternative fed (the last ones): its draft's index
    accepted_alt: int | None = None  # the alternative the target accepted (index among them)

    @property
    def chain(self) -> int:
        """Tokens fed before the alternatives."""
        return len(self.fed) - len(self.alt_depth)


def _alternatives(req: VerifyRequest) -> list[tuple[int, int]]:
    """The request's alternatives as (draft index, token), shallowest first."""
    return [(i, a) for i, row in enumerate(req.alternatives[: len(req.drafts)]) for a in row]


def _with_alternatives(req: VerifyRequest, tokens: list[int]) -> tuple[list[int], list[int]]:
    """``tokens`` (uncached committed tokens + drafts) followed by the request's alternatives, and
    each alternative's draft index."""
    alts = _alternatives(req)
    return tokens + [a for _, a in alts], [i for i, _ in alts]


@dataclass(frozen=True)
class RunnerOptions:
    """The tuning knobs of a torch verifier (what the pool config sets beside the model)."""

    max_num_batched_tokens: int = 512  # per-forward token budget (chunked prefill)
    load_format: str = "auto"  # "auto": the folder's weights; "dummy": random ones (moa_serve/synthetic.py)
    packed_weights: str = "auto"  # "auto": the packed CPU kernels where they apply; "off"
    prefix_caching: bool = True
    matmul_precision: str = "highest"
    kv_cache_dtype: str = "auto"  # "auto" (the target's dtype) or one of KV_CACHE_DTYPES
    # forwards at fixed row counts over preallocated buffers (verifier/torch/static_forward.py): "auto" on a
    # GPU, replayed from CUDA graphs; "on": the same fixed-shape path on any device, without capture
    # on a CPU (what the tests compare with the planned path); "off": every forward planned eagerly
    static_forward: str = "auto"
    # on a GPU, batch-invariant Triton matmuls and attention (moa_serve/kernels/gpu_invariant.py), so a
    # session's greedy tokens do not depend on the batch it is verified in: "auto" (on where Triton
    # runs) or "off" (cuBLAS and SDPA: faster per call, lossless only in float32 and then up to ties)
    batch_invariant: str = "auto"

    def __post_init__(self):
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of auto, {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}"
            )
        if self.batch_invariant not in ("auto", "off"):
            raise ValueError(f"batch_invariant must be auto or off; got {self.batch_invariant!r}")
        if self.static_forward not in ("auto", "on", "off"):
            raise ValueError(f"static_forward must be auto, on or off; got {self.static_forward!r}")


class TorchTargetRunner(TargetBackend):
    """``target``: the target's model directory or GGUF (a path, or a name under
    ``MOA_MODEL_DIR``), or an already built ``TargetModel``. ``features``: the verifier-side half
    of the drafter served (the drafter registry's ``load_feature_source``); None: no features."""

    def __init__(
        self,
        target: str | TargetModel,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        max_sessions: int = 16,
        max_model_len: int = 2048,
        features: FeatureSource | None = None,
        draft_vocab: torch.Tensor | None = None,
        options: RunnerOptions = RunnerOptions(),
    ):
        packed_weights, matmul_precision = options.packed_weights, options.matmul_precision
        kv_cache_dtype = options.kv_cache_dtype
        model = target if isinstance(target, TargetModel) else None
        path = resolve_model_path(target) if model is None else None
        self.dtype = target_dtype(dtype, device, path, model)
        self.device = torch.device(device)
        self.packing: dict = {"packed": 0, "reason": "packed_weights is off"}
        if model is None and options.load_format == "dummy":
            model = random_target(read_config(path), self.dtype, self.device)
            self.packing = {"packed": 0, "reason": describe("dummy")}
        elif model is None:
            model = TargetModel.from_state_dict(read_config(path), load_state_dict(path), self.dtype, self.device)
            if packed_weights == "auto":
                self.packing = pack_target(model, path, matmul_precision)
        elif packed_weights == "auto":
            self.packing = {"packed": 0, "reason": "the runner was given an already built model"}
        # inference only: a forward outside inference mode (a benchmark's, a test's) must not make the
        # KV cache part of an autograd graph, which would keep every such forward's activations alive
        model.requires_grad_(False)
        self.model = model
        self.arch = model.arch
        self.max_model_len = min(max_model_len, self.arch.max_position_embeddings)
        self.max_num_batched_tokens = options.max_num_batched_tokens
        kv_dtype = self.dtype if kv_cache_dtype == "auto" else KV_CACHE_DTYPES[kv_cache_dtype]
        self.cache = model.new_cache(max_sessions, self.max_model_len, kv_dtype)
        # batch-invariant attention (every token alone over its slot, fixed order, float32 sums over a
        # float32 or bfloat16 cache) where it runs: the C kernel on a CPU, Triton on a GPU
        hd = self.arch.head_dim
        # (on a CPU only under Triton's interpreter: how the tests reach them)
        on_gpu_kernels = (
            options.batch_invariant == "auto" and gpu_invariant.available(self.device) and hd & (hd - 1) == 0
        )
        self.attention_kernel = on_gpu_kernels or (
            self.cache.k.dtype in (torch.float32, torch.bfloat16)
            and self.device.type == "cpu"
            and hd % 8 == 0
            and hd <= 256
            and cpu_kernels.library() is not None
        )
        if self.device.type != "cpu" or on_gpu_kernels:  # fewer, larger GEMMs per layer on a GPU, and
            # the fused q/k/v that rope_store reads (on a CPU: under the interpreter, in the tests)
            self.packing["fused_projections"] = fuse_dense_projections(model.model.layers)
        if on_gpu_kernels:
            self.packing["batch_invariant_matmuls"] = use_matmul(model, gpu_invariant.matmul)
            self.packing["batch_invariant_norms"] = use_rms_norm(model, gpu_invariant.rms_norm)
        # the fixed-shape forward (below) needs the invariant attention: padding rows must not touch real ones
        wanted = options.static_forward == "on" or (options.static_forward == "auto" and self.device.type == "cuda")
        if kv_dtype != self.dtype and not self.attention_kernel:
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype} with a {str(self.dtype).removeprefix('torch.')} target "
                f"needs the CPU attention kernel ({cpu_kernels.unavailable_reason() or 'not for this device'})"
            )
        self.features = (features or NO_FEATURES).prepared(self.device, self.dtype)
        # a drafter that reads only the freshest feature: each span's last position is computed,
        # zeros stand in for the others (never read), so a prefill pays the LSA once, not per token
        self.latest_feature_only = self.features.latest_only
        self.draft_vocab = draft_vocab  # maps a drafter's [K, V'] probabilities back to the vocabulary
        # structured output over the target's vocabulary: set (``grammars``), or built from the model's
        # tokenizer when a request first asks for a grammar
        self._grammars, self._model_path = None, path
        self._grammars_lock = threading.Lock()
        self.stats = {
            "forwards": 0,
            "tokens": 0,
            "forward_s": 0.0,
            "evictions": 0,
            "resyncs": 0,
            "prefix_hits": 0,
            "prefix_tokens": 0,
            "alternatives_accepted": 0,
            "steps_cut": 0,
            "prefix_waits": 0,
        }
        self.slots = SlotTable(self.cache, self.max_model_len, options.prefix_caching, self.stats)
        self.static = (
            StaticForward(
                model, self.cache, options.max_num_batched_tokens, graphs=self.device.type == "cuda", stats=self.stats
            )
            if wanted and self.attention_kernel
            else None
        )
        # the feature head at fixed row counts beside the fixed-shape forward (a cache-reading source)
        self.static_features = (
            StaticFeatures(
                self.features,
                self.cache,
                self.dtype,
                options.max_num_batched_tokens,
                graphs=self.device.type == "cuda",
                stats=self.stats,
            )
            if self.static is not None and self.features is not NO_FEATURES and hasattr(self.features, "rows")
            else None
        )
        # set from another thread (``cut_steps``): the verify running or next ends its multi-step
        # decoding after the forward in progress
        self._cut = threading.Event()

    def cut_steps(self) -> None:
        """Someone waits for the caller's next call (a new session to prefill): the multi-step
        decoding of the verify call running now (or of the next one, if none runs) stops after its
        current forward. Its tokens so far are returned as usual; nothing is lost, the caller only
        gets fewer tokens from this call. Safe from any thread."""
        self._cut.set()

    # ------------------------------------------------------------------ structured output
    @property
    def grammars(self) -> Grammars:
        with self._grammars_lock:
            if self._grammars is None:
                if self._model_path is None:
                    raise ValueError("structured output needs the target's tokenizer: set the runner's grammars")
                tokenizer = load_tokenizer(self._model_path)
                self._grammars = Grammars(tokenizer, self.arch.vocab_size, stop_token_ids(self._model_path, tokenizer))
            return self._grammars

    @grammars.setter
    def grammars(self, grammars: Grammars) -> None:
        self._grammars = grammars

    def _constrain(self, req: VerifyRequest, s: HeldSession) -> VerifyRequest:
        """A constrained session's matcher brought to its committed tokens, and the request's drafts
        cut at the first one the grammar forbids (no tree alternatives: each would need a mask of
        its own)."""
        if req.grammar is None:
            s.grammar = None
            return req
        if s.grammar is None or s.grammar.spec != req.grammar:
            s.grammar = self.grammars.state(req.grammar)
        s.grammar.sync(s.committed[req.grammar_start :])
        n = s.grammar.allowed_prefix(list(req.drafts))
        if n == len(req.drafts) and not req.alternatives:
            return req
        probs = req.draft_probs[:n] if req.draft_probs is not None and n else None
        return dataclasses.replace(req, drafts=list(req.drafts[:n]), draft_probs=probs, alternatives=[])

    def _grammar_mask(self, rows: list[tuple[HeldSession, VerifyRequest, int]], total: int) -> torch.Tensor | None:
        """The token bitmask [total, W] of a forward's logits rows: each constrained session's
        positions (``(session, request, first row)``: its drafts' and the bonus'), every token
        allowed elsewhere. None when no session is constrained."""
        rows = [(s, r, i) for s, r, i in rows if s.grammar is not None]
        if not rows:
            return None
        mask = self.grammars.bitmask(total)
        for s, r, first in rows:
            s.grammar.sync(s.committed[r.grammar_start :])
            s.grammar.fill(mask, first, list(r.drafts))
        return mask

    # ------------------------------------------------------------------ sessions (slots.py)
    @property
    def sessions(self) -> OrderedDict[str, HeldSession]:
        return self.slots.sessions

    @property
    def retained(self) -> OrderedDict[int, list[int]]:
        return self.slots.retained

    def release(self, session_id: str) -> None:
        self.slots.release(session_id)

    @property
    def free_slots(self) -> int:
        return self.slots.free_slots

    # ------------------------------------------------------------------ planning
    def _tree_ok(self, req: VerifyRequest, s: HeldSession) -> VerifyRequest:
        """The request without its alternatives where they cannot be verified: when sampling
        (acceptance over a tree is greedy here), or when the cache has no room to store them."""
        if not req.alternatives:
            return req
        n_alt = len(_alternatives(req))
        if not req.sampling.greedy or len(s.committed) + len(req.drafts) + n_alt > self.max_model_len:
            return dataclasses.replace(req, alternatives=[])
        return req

    def _plan(self, pending: list[tuple[VerifyRequest, HeldSession]]) -> list[_Work]:
        """Decode steps always run; prefills share what is left of the token budget, in order."""
        decode, prefill = [], []
        for req, s in pending:
            req = self._tree_ok(req, s)
            (decode if len(s.committed) - s.cached == 1 else prefill).append((req, s))

        def answering(r: VerifyRequest, s: HeldSession) -> _Work:
            fed, depth = _with_alternatives(r, s.committed[s.cached :] + list(r.drafts))
            return _Work(r, s, s.cached, fed, True, alt_depth=depth)

        work = [answering(r, s) for r, s in decode]
        budget = self.max_num_batched_tokens - sum(len(w.fed) for w in work)
        for i, (r, s) in enumerate(prefill):
            uncached = len(s.committed) - s.cached
            room = max(budget, MIN_PREFILL_CHUNK if i == 0 else 0)
            if uncached + len(r.drafts) + len(_alternatives(r)) <= room:
                w = answering(r, s)
            elif room > 0:
                chunk = min(uncached, room)
                w = _Work(r, s, s.cached, s.committed[s.cached : s.cached + chunk], chunk == uncached, uncached - chunk)
                if w.done:  # the prompt fits but its drafts do not: answer without drafts
                    w.req = dataclasses.replace(r, drafts=[], draft_probs=None, alternatives=[])
            else:
                w = _Work(r, s, s.cached, [], False, uncached)
            budget -= len(w.fed)
            work.append(w)
        return work

    # ------------------------------------------------------------------ verify
    @torch.inference_mode()
    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        try:
            return self._verify(requests)
        finally:
            self._cut.clear()  # a cut asked before this call ended was for it, whether it returned or raised

    def _verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        keep = {r.session_id for r in requests}
        if len(keep) != len(requests):
            raise ValueError("a verify call names a session twice")
        results: dict[str, VerifyResult] = {}
        pending, arriving = [], []
        for r in requests:
            if self.slots.waits_for_sibling(r, arriving):
                self.stats["prefix_waits"] += 1
                results[r.session_id] = VerifyResult(r.session_id, [], 0, 0, None, resync=True)
                continue
            if r.base == 0 and r.session_id not in self.sessions:
                arriving.append(r.tokens)
            # features that only a forward computes (EAGLE-style hidden states) rule out prefix reuse
            s = self.slots.take(r, keep, reuse=not (r.want_features and not self.features.from_cache))
            if s is None:
                self.stats["resyncs"] += 1
                results[r.session_id] = VerifyResult(r.session_id, [], 0, 0, None, resync=True)
            else:
                pending.append((self._constrain(r, s), s))
        work = self._plan(pending)
        fed = [w for w in work if w.fed]
        for w in work:
            if not w.fed:
                results[w.req.session_id] = VerifyResult(
                    w.req.session_id, [], 0, w.start, None, prefill_remaining=w.remaining
                )
        if fed:
            for w, res in zip(fed, self._forward(fed)):
                results[w.req.session_id] = res
            self._decode_more(fed, results)
        return [results[r.session_id] for r in requests]

    def _decode_more(self, work: list[_Work], results: dict[str, VerifyResult]) -> None:
        """Multi-step decoding: sessions that asked for ``decode_steps`` > 1 take part in that many
        forwards in all, one token of the target's own per further forward, one packed forward
        per step for all of them (the call's transport and scheduling are paid once for several
        tokens), never past ``max_tokens``. A session that sent drafts goes on after its accepted
        drafts and correction, if it wants no features: its accepted drafts are a gain, not a
        substitute for later steps. Features of these positions are not attached: the sender asks
        for them later (``features_from``), so a feature head that cannot recompute them (hidden
        states) keeps single steps."""
        can_features = self.features.from_cache
        live = [
            w
            for w in work
            if w.done and w.req.decode_steps > 1 and (not w.req.want_features or (can_features and not w.req.drafts))
        ]
        # the steps after the verified drafts sample from the target alone
        plain = {w.req.session_id: dataclasses.replace(w.req, drafts=[], draft_probs=None) for w in live}
        step = 1  # forwards so far
        while True:
            live = [
                w
                for w in live
                if step < w.req.decode_steps
                and (w.req.max_tokens <= 0 or len(results[w.req.session_id].tokens) < w.req.max_tokens)
                and results[w.req.session_id].tokens[-1] not in w.req.stop_token_ids
                and len(w.session.committed) < self.max_model_len
            ]
            if not live:
                return
            if self._cut.is_set():
                self.stats["steps_cut"] += 1
                return
            t0 = time.perf_counter()
            hidden = self._packed_forward(
                [w.session.slot for w in live],
                [w.session.cached for w in live],
                [[w.session.committed[-1]] for w in live],
                [[] for _ in live],
            )
            reqs = [plain[w.req.session_id] for w in live]
            mask = self._grammar_mask([(w.session, r, i) for i, (w, r) in enumerate(zip(live, reqs))], len(live))
            logits, host, choice = self._logits_and_choice(hidden, reqs, mask)
            scored = []  # (row, token, top) of the sessions that want log-probabilities
            for i, w in enumerate(live):
                s, r = w.session, results[w.req.session_id]
                position = w.req.base + len(w.req.tokens) + len(r.tokens)  # this token's index
                _, tok = self._accept(
                    plain[w.req.session_id], None if host is None else host[i : i + 1], choice[i : i + 1], position
                )
                if w.req.logprobs is not None:
                    scored.append((i, tok, w.req.logprobs))
                s.cached += 1
                s.committed.append(tok)
                self.cache.lengths[s.slot] = s.cached
                r.tokens.append(tok)
                r.num_computed += 1
            self._attach_logprobs(logits, scored, [results[live[i].req.session_id] for i, _, _ in scored])
            step += 1
            self.stats["forwards"] += 1
            self.stats["tokens"] += len(live)
            self.stats["forward_s"] += time.perf_counter() - t0

    def _forward(self, work: list[_Work]) -> list[VerifyResult]:
        t0 = time.perf_counter()
        twins = [[w.chain - len(w.req.drafts) + d for d in w.alt_depth] for w in work]
        hidden = self._packed_forward(
            [w.session.slot for w in work], [w.start for w in work], [w.fed for w in work], twins
        )  # [N, H]
        # logits only where needed: the last committed token, each draft and each alternative of
        # answering sessions
        rows, offset, constrained = [], 0, []
        for w in work:
            if w.done:
                k = len(w.req.drafts)
                first = offset + w.chain - k - 1
                constrained.append((w.session, w.req, len(rows)))
                rows.extend(range(first, first + k + 1 + len(w.alt_depth)))
            offset += len(w.fed)
        logits, host, choice = (
            self._logits_and_choice(
                hidden[rows], [w.req for w in work if w.done], self._grammar_mask(constrained, len(rows))
            )
            if rows
            else (None, None, [])
        )
        scores = self._scores(work, hidden)
        self.stats["forwards"] += 1
        self.stats["tokens"] += hidden.shape[0]
        self.stats["forward_s"] += time.perf_counter() - t0

        results, row, scored, scored_results = [], 0, [], []
        for w in work:
            s = w.session
            if not w.done:  # a prefill chunk: cache it, answer nothing yet
                s.cached += len(w.fed)
                results.append(
                    VerifyResult(
                        w.req.session_id, [], 0, w.start, None, num_computed=len(w.fed), prefill_remaining=w.remaining
                    )
                )
                continue
            k, n_alt = len(w.req.drafts), len(w.alt_depth)
            n_acc, nxt = self._accept(
                w.req, None if host is None else host[row : row + k + 1], choice[row : row + k + 1]
            )
            out = list(w.req.drafts[:n_acc]) + [nxt]
            out_rows = list(range(row, row + n_acc + 1))  # the logits row that chose or accepted each token
            alt = self._accepted_alternative(w, n_acc, nxt) if n_alt else None
            if alt is not None:  # the target's token at the first rejected depth was an alternative
                out.append(choice[row + k + 1 + alt])  # the target's token after it
                out_rows.append(row + k + 1 + alt)
                n_acc += 1
                self._move_alternative(w, alt, n_acc)
            if w.req.logprobs is not None:
                scored.extend((i, t, w.req.logprobs) for i, t in zip(out_rows, out))
                scored_results.extend([None] * (len(out) - 1))
            row += k + 1 + n_alt
            kept = w.chain - k + n_acc  # uncached committed tokens + accepted drafts
            s.cached = w.start + kept
            s.committed.extend(out)  # the replica's copy: what it returned is committed next round
            results.append(
                VerifyResult(
                    w.req.session_id, out, n_acc, feature_start=w.start, features=None, num_computed=len(w.fed)
                )
            )
            if w.req.logprobs is not None:
                scored_results.append(results[-1])
        self._attach_logprobs(logits, scored, scored_results)
        for w, r in zip(work, results):
            if w.req.session_id in scores:
                r.scores_start, r.scores = scores[w.req.session_id]
        for w in work:
            self.cache.lengths[w.session.slot] = w.session.cached
        self._attach_features(work, results, hidden)
        return results

    def _packed_forward(
        self, slots: list[int], starts: list[int], fed: list[list[int]], twins: list[list[int]]
    ) -> torch.Tensor:
        """One forward over the sessions' new tokens packed one after another: final-norm hidden
        states [N, H]. The fixed-shape (graph-replayed) forward when it covers the call, else the
        forward planned for this call's shapes."""
        if self.static is not None:
            positions, store_at = packed_layout(starts, [len(f) for f in fed], twins)
            token_slots = [s for s, f in zip(slots, fed) for _ in f]
            hidden = self.static([t for f in fed for t in f], token_slots, positions, store_at)
            if hidden is not None:
                return hidden
        batch = PackedBatch(
            self.cache, slots, starts, [len(f) for f in fed], self.device, kernel=self.attention_kernel, twins=twins
        )
        return self.model.forward_packed(torch.tensor([t for f in fed for t in f], device=self.device), batch)

    def _logits_and_choice(
        self, hidden: torch.Tensor, answering: list[VerifyRequest], mask: torch.Tensor | None = None
    ):
        """The LM head over ``hidden`` [n, H] and each row's argmax as a list (one host sync for
        the whole call). The float32 logits come to the host only when a request samples (its
        acceptance runs there); for greedy calls only the argmax leaves the device (on a GPU the
        logits of a large call are hundreds of MB). ``mask``: the grammars' token bitmask of the
        rows (``_grammar_mask``), applied before the argmax and the sampling read the logits.
        Returns (the raw logits where they were computed, before the mask: log-probabilities are
        the target's own, as vLLM's ``raw_logprobs``; host logits or None; argmax list)."""
        logits = self.model.lm_head(hidden).float()
        raw = logits
        if mask is not None:
            if any(r.logprobs is not None for r in answering):
                raw = logits.clone()  # the mask writes -inf in place; the log-probabilities read raw
            self.grammars.apply(logits, mask)
        choice = logits.argmax(-1).tolist()
        if any(not r.sampling.greedy for r in answering):
            return raw, logits.cpu(), choice
        return raw, None, choice

    @staticmethod
    def _attach_logprobs(logits: torch.Tensor | None, scored: list[tuple[int, int, int]], results: list) -> None:
        """The log-probabilities of ``scored`` tokens ((logits row, token, top) each), computed in one
        go; ``results[i]`` is the result the i-th belongs to, given at the last token of its result
        (each result's tokens are scored in order)."""
        if not scored:
            return
        values = token_logprobs(logits[[i for i, _, _ in scored]], [t for _, t, _ in scored], [n for _, _, n in scored])
        start = 0
        for i, r in enumerate(results):
            if r is not None:
                r.logprobs = (r.logprobs or []) + values[start : i + 1]
                start = i + 1

    def _scores(self, work: list[_Work], hidden: torch.Tensor) -> dict[str, tuple[int, list]]:
        """Prompt scoring: for each session that asks (``score_from``), the log-probabilities of the
        committed tokens this call fed (from ``score_from`` on), each scored by the row of the token
        before it: (position of the first, their values)."""
        rows, tokens, top, spans, offset = [], [], [], {}, 0
        for w in work:
            r, s = w.req, w.session
            committed_fed = w.chain - len(r.drafts) if w.done else len(w.fed)
            if r.score_from is not None:
                first = max(r.score_from, w.start + 1)
                last = min(w.start + committed_fed, len(s.committed))  # positions scored: [first, last)
                if last > first:
                    spans[r.session_id] = (first, len(tokens), last - first)
                    rows.extend(offset + p - 1 - w.start for p in range(first, last))
                    tokens.extend(s.committed[first:last])
                    top.extend([r.logprobs or 0] * (last - first))
            offset += len(w.fed)
        if not rows:
            return {}
        values = token_logprobs(self.model.lm_head(hidden[rows]), tokens, top)
        return {sid: (first, values[i : i + n]) for sid, (first, i, n) in spans.items()}

    def _accepted_alternative(self, w: _Work, n_acc: int, token: int) -> int | None:
        """Index (among the work's alternatives) of the alternative at the first rejected draft's
        depth that is the target's own token there, or None."""
        if n_acc >= len(w.req.drafts):
            return None
        for j, depth in enumerate(w.alt_depth):
            if depth == n_acc and w.fed[w.chain + j] == token:
                return j
        return None

    def _move_alternative(self, w: _Work, alt: int, n_acc: int) -> None:
        """An accepted alternative's K/V (every layer) from where it was stored to its position,
        that of the draft it replaces (the ``n_acc``-th accepted)."""
        slot, src = w.session.slot, w.start + w.chain + alt
        dst = w.start + w.chain - len(w.req.drafts) + n_acc - 1
        self.cache.k[:, slot, :, dst] = self.cache.k[:, slot, :, src]
        self.cache.v[:, slot, :, dst] = self.cache.v[:, slot, :, src]
        w.accepted_alt = alt
        self.stats["alternatives_accepted"] += 1

    def _accept(
        self, req: VerifyRequest, logits: torch.Tensor | None, choice: list[int], position: int | None = None
    ) -> tuple[int, int]:
        """(accepted drafts, next token): greedy from ``choice`` (the argmax rows); sampling from
        ``logits`` (host float32 rows, given whenever the request samples)."""
        params: SamplingParams = req.sampling
        drafts = list(req.drafts)
        if params.greedy:
            return accept_greedy(choice, drafts)
        p = warp_probs(logits, params)
        if position is None:
            position = len(req.tokens) + req.base
        gen = generator_for(params, position, "verify")
        if not drafts:
            return accept_sampling(p, p[:0], [], gen)
        if req.draft_probs is None:  # deterministic drafts (prompt lookup): q is one-hot at each draft
            q = torch.zeros(len(drafts), p.shape[-1], dtype=p.dtype)
            q[torch.arange(len(drafts)), torch.tensor(drafts)] = 1.0
            return accept_sampling(p, q, drafts, gen)
        return accept_sampling(p, self._full_vocab(req.draft_probs.float(), req.session_id), drafts, gen)

    def _full_vocab(self, q: torch.Tensor, session_id: str) -> torch.Tensor:
        """Drafter probabilities over the target vocabulary ([K, V'] over a draft vocabulary are
        scattered back; tokens outside it have probability 0 under the drafter)."""
        vocab = self.arch.vocab_size
        if q.shape[-1] == vocab:
            return q
        if self.draft_vocab is None or q.shape[-1] != len(self.draft_vocab):
            raise ValueError(
                f"session {session_id}: draft_probs has {q.shape[-1]} columns; expected {vocab} "
                "or the drafter's draft vocabulary size"
            )
        full = torch.zeros(q.shape[0], vocab, dtype=q.dtype)
        full[:, self.draft_vocab.cpu()] = q
        return full

    def _attach_features(self, work: list[_Work], results: list[VerifyResult], hidden: torch.Tensor) -> None:
        """Features of the positions each session newly holds in the cache (prefill chunks too)."""
        source = self.features
        if source is NO_FEATURES or not any(w.req.want_features for w in work):
            return  # nothing to read (every verify call of a server without a model drafter)
        spans, offset, rows = [], 0, []
        for w in work:
            start = w.start
            # a new session (base 0) wants features from position 0, reused prefix included
            want_from = w.req.features_from if w.req.features_from is not None else (0 if w.req.base == 0 else None)
            if w.req.want_features and source.from_cache and want_from is not None:
                start = max(0, min(start, want_from))  # catch up from the cache
            end = w.session.cached if w.req.want_features else start
            spans.append((start, end))
            rows.append(offset)
            offset += len(w.fed)
        slot_spans = [(w.session.slot, a, e) for w, (a, e) in zip(work, spans)]
        feats = None
        if self.static_features is not None:
            slots, positions, sizes = source.rows(slot_spans)
            feats = self.static_features(slots, positions)
        if feats is None:
            inputs, sizes = source.inputs(
                self.cache,
                slot_spans,
                [self._hidden_rows(hidden, w, o, e - a) for w, o, (a, e) in zip(work, rows, spans)],
            )
            if sum(sizes) == 0:
                return
            feats = source(inputs.to(self.dtype))  # a bfloat16 cache widens here
        feats = feats.cpu()
        for r, (a, e), chunk in zip(results, spans, torch.split(feats, sizes)):
            if e - a > len(chunk):  # latest_only: zeros for the positions never read
                chunk = torch.cat([chunk.new_zeros(e - a - len(chunk), chunk.shape[1]), chunk])
            r.feature_start, r.features = a, (chunk if len(chunk) else None)

    @staticmethod
    def _hidden_rows(hidden: torch.Tensor, w: _Work, offset: int, n: int):
        """The target's hidden states of a session's ``n`` newly cached positions, ``offset`` its
        first row in the call's forward: the last one is that of the accepted alternative if any."""

        def rows() -> torch.Tensor:
            chunk = hidden[offset : offset + n]
            if w.accepted_alt is not None and n > 0:  # the last position holds the accepted alternative
                chunk = torch.cat((chunk[:-1], hidden[offset + w.chain + w.accepted_alt][None]))
            return chunk

        return rows
