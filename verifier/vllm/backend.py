"""The target in stock vLLM, MoA drafts from a draft source (the vLLM backend).

vLLM keeps its scheduler, paged KV cache, continuous batching and rejection sampler; MoA plugs in
through vLLM's ``custom_class`` speculative method (``speculative_config={"method":
"custom_class", "model": "moa_serve.verifier.vllm.backend.MoAStepProposer"}``):

* ``MoAStepProposer.load_model`` receives the target ``nn.Module``, vLLM's own class, compiled or
  captured in CUDA graphs as vLLM builds it. A MoA drafter's features — every layer's post-RoPE
  keys and values — are where the forward put them, in vLLM's paged KV cache: ``CachedFeatures``
  gathers them after the step through the step's slot mapping (:mod:`.paged_kv`), with the
  step's ``query_start_loc``/sequence lengths from the runner, so each row is a (request,
  position). An EAGLE-style drafter's final-norm output is in no cache: a Llama-family target is
  then served by the registered class of :mod:`moa_serve.verifier.vllm.model`, which keeps it in
  a buffer inside the forward (``KeptFeatures``). Where neither serves, an eager engine falls back
  to ``HookedFeatures``: forward hooks.
* After each verify forward vLLM calls ``propose(sampled_token_ids, num_tokens_no_spec,
  token_ids_cpu, slot_mappings=)`` once for the whole batch (rows in ``input_batch.req_ids``
  order). The proposer hands every row, with the K/V of the positions the step verified, to
  ``StepDrafting``: one batched call to the draft source. The checkpoint's feature head (LSA +
  Ekv2E) runs on those K/V only when a request drafts (batched over the call's requests), so
  steps the speculation governor runs without drafts do not pay for it.
* vLLM verifies custom drafts without draft probabilities: greedy is exact; sampling accepts a
  draft x with probability p(x) and otherwise samples from p without x — lossless, at the
  acceptance of a one-hot q (min(1, p/q) with the drafter's q would accept more when q(x) < 1).
  Drafts are therefore taken greedily from the drafter: with q treated as one-hot, the draft
  maximising the chance of acceptance is the drafter's best guess of argmax p.

The proposer reaches its ``StepDrafting`` and the runner's request ids through ``bind``, run in
the worker with ``LLM.collective_rpc`` (the engine runs in-process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Prefix caching stays on: the positions a cache hit skips
get their features from ``PrefixFeatures``.
"""

from __future__ import annotations

import itertools
import logging
import threading

import torch

from moa_serve.verifier.api import FeatureSource
from moa_serve.verifier.vllm import model as vllm_model
from moa_serve.verifier.vllm import paged_kv
from moa_serve.verifier.vllm.step_drafting import StepDrafting, StepRow

log = logging.getLogger(__name__)

PROPOSER_CLASS = "moa_serve.verifier.vllm.backend.MoAStepProposer"

# binding key -> (StepDrafting, feature source or None, hooks); filled before bind()
_BINDINGS: dict[str, tuple] = {}
_keys = itertools.count()
_lock = threading.Lock()


def register_binding(drafting: StepDrafting, features: FeatureSource | None, hooks: bool = False) -> str:
    """``hooks``: the drafter's features through forward hooks (the eager fallback) whatever else
    the engine could do."""
    with _lock:
        key = f"moa-binding-{next(_keys)}"
        _BINDINGS[key] = (drafting, features, hooks)
    return key


def bind_worker(worker, key: str) -> str:
    """Run in the vLLM worker (``LLM.collective_rpc(bind_worker, args=(key,))``): connects the
    runner's proposer to its drafting state and the runner (for request ids)."""
    runner = worker.model_runner
    proposer = getattr(runner, "drafter", None)
    if not isinstance(proposer, MoAStepProposer):
        raise TypeError(f"the engine's proposer is {type(proposer).__name__}, not MoAStepProposer")
    drafting, features, hooks = _BINDINGS.pop(key)
    proposer.bind(runner, drafting, features, hooks=hooks)
    sample_plainly_without_drafts(runner)
    return type(runner).__name__


def sample_plainly_without_drafts(runner) -> None:
    """A step in which no request verifies a draft runs as vLLM runs without speculation: one
    logits row per request and its ``Sampler``, instead of the rejection sampler. vLLM 0.32's
    runner takes the speculative path in every step of an engine built with speculation
    (``GPUModelRunner._prepare_inputs``: ``use_spec_decode = self.speculative_config is not
    None``), so every step the governor runs without drafts would pay for speculative metadata
    (``_calc_spec_decode_metadata``: index arithmetic and five host-to-device copies;
    docs/benchmarks.md#vllm-backend), a bonus-token sampler, rejection kernels and the output
    parsing of a speculative step. With no drafts the two are the same computation: the
    logits are one row per request either way (the last scheduled token's), and the rejection
    sampler's bonus token is the plain sampler's token (the draft tokens it would combine with
    penalties are empty); the runner's bookkeeping reads a [requests, 1] output as a step without
    speculation."""
    sample, metadata = runner._sample, runner._calc_spec_decode_metadata
    empty = torch.zeros(0, dtype=torch.int32, device=runner.device)
    constant: dict[int, tuple] = {}

    def _sample(logits, spec_decode_metadata):
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
            spec_decode_metadata = None
        return sample(logits, spec_decode_metadata)

    def _calc_spec_decode_metadata(num_draft_tokens, cu_num_scheduled_tokens):
        if num_draft_tokens.any():
            return metadata(num_draft_tokens, cu_num_scheduled_tokens)
        from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

        n = len(num_draft_tokens)
        if n not in constant:  # what does not change between steps of n requests
            rows = torch.arange(n, dtype=torch.int32, device=runner.device)
            constant[n] = ([0] * n, torch.zeros_like(rows), rows + 1, rows)
        zeros, cu_drafts, cu_sampled, rows = constant[n]
        return SpecDecodeMetadata(
            draft_token_ids=empty,
            num_draft_tokens=zeros,
            cu_num_draft_tokens=cu_drafts,
            cu_num_sampled_tokens=cu_sampled,
            target_logits_indices=empty,
            bonus_logits_indices=rows,
            logits_indices=torch.from_numpy(cu_num_scheduled_tokens - 1).to(runner.device),
        )

    runner._sample = _sample
    runner._calc_spec_decode_metadata = _calc_spec_decode_metadata


class StepFeatures:
    """What the target's forward computed for each flattened token of the last step, read after it:
    per layer the post-RoPE keys and the values ("per_layer_kv", MoA), or the final-norm hidden
    state ("hidden", EAGLE-style), and the step's per-request query layout (``query_start_loc``,
    ``seq_lens``). ``active``: whether the last step's features were kept at all."""

    def __init__(self, kind: str, num_kv_heads: int, head_dim: int):
        if kind not in vllm_model.KINDS:
            raise ValueError(f"unknown feature kind {kind!r}")
        self.kind = kind
        self.kv_heads, self.head_dim = num_kv_heads, head_dim
        self.active = True
        self.query_start_loc: list[int] = []
        self.seq_lens: list[int] = []
        self.num_tokens = 0

    def rows(self, start: int, end: int) -> torch.Tensor:
        """The feature head's input for flattened tokens [start, end): [n, num_layers, KVH * 2 *
        head_dim] (per KV head its key then its value, the layout of ``SlotKVCache.per_layer_kv``)
        or [n, hidden]; a new tensor."""
        return self.rows_at(list(range(start, end)))

    def rows_at(self, tokens: list[int]) -> torch.Tensor:
        """``rows`` for any flattened tokens (one gather for all of them)."""
        raise NotImplementedError

    def _layout(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[L, n, KVH * head_dim] keys and values -> [n, L, KVH * 2 * head_dim]."""
        layers, n = k.shape[:2]
        kv = torch.cat(
            (k.reshape(layers, n, self.kv_heads, self.head_dim), v.reshape(layers, n, self.kv_heads, self.head_dim)),
            dim=-1,
        )
        return kv.transpose(0, 1).reshape(n, layers, -1)


class AfterStepFeatures(StepFeatures):
    """Features read after the step, with the step's query layout from the runner (the CPU-side
    arrays vLLM built the step's attention metadata from: ``query_start_loc`` and the sequence
    lengths, exact with vLLM's asynchronous scheduling off, as it is for a ``custom_class``
    proposer). Nothing host-side runs inside the forward."""

    def __init__(self, runner, kind: str, num_kv_heads: int, head_dim: int):
        super().__init__(kind, num_kv_heads, head_dim)
        self.runner = runner

    def refresh(self, num_requests: int, slot_mappings=None) -> None:
        """The last step's layout (``slot_mappings``: what vLLM hands its proposer)."""
        r = self.runner
        self.query_start_loc = r.query_start_loc.np[: num_requests + 1].tolist()
        self.seq_lens = r.optimistic_seq_lens_cpu[:num_requests].tolist()
        self.num_tokens = self.query_start_loc[-1] if num_requests else 0

    def _check(self, tokens: list[int]) -> None:
        if any(t < 0 or t >= self.num_tokens for t in tokens):
            raise IndexError(f"tokens {tokens} are not all among the step's {self.num_tokens}")


class CachedFeatures(AfterStepFeatures):
    """The default for MoA ("per_layer_kv"): every layer's post-RoPE K/V gathered from vLLM's paged
    cache through the step's slot mapping (:mod:`moa_serve.verifier.vllm.paged_kv`), on vLLM's own
    model class, compiled or graph-captured: the forward computes nothing extra."""

    def __init__(self, model, runner, num_kv_heads: int, head_dim: int):
        super().__init__(runner, "per_layer_kv", num_kv_heads, head_dim)
        layers = paged_kv.attention_layers(model)
        self.layer_name = layers[0].layer_name if layers else None
        self.cache = paged_kv.PagedKV(layers, num_kv_heads, head_dim, runner.kv_cache_config.num_blocks)
        self.slot_mapping: torch.Tensor | None = None

    def refresh(self, num_requests: int, slot_mappings=None) -> None:
        super().refresh(num_requests, slot_mappings)
        if isinstance(slot_mappings, list):  # one dict per micro-batch (ubatching); never on CPU
            raise RuntimeError("micro-batched steps: the drafter's features cannot follow their slots")
        if slot_mappings is None:  # the runner's own (what vLLM builds the step's mappings from)
            self.slot_mapping = self.runner.input_batch.block_table[0].slot_mapping.gpu
        else:
            self.slot_mapping = slot_mappings[self.layer_name]

    def rows_at(self, tokens: list[int]) -> torch.Tensor:
        self._check(tokens)
        idx = torch.tensor(tokens, dtype=torch.long, device=self.slot_mapping.device)
        return self.cache.gather(self.slot_mapping.index_select(0, idx))


class KeptFeatures(AfterStepFeatures):
    """An EAGLE-style drafter's final hidden states ("hidden"), which no cache holds: the
    registered model class (:mod:`moa_serve.verifier.vllm.model`) keeps every token's in a buffer
    inside its forward, compiled or graph-captured; read after the step."""

    def __init__(self, model, runner, kind: str, num_kv_heads: int, head_dim: int):
        super().__init__(runner, kind, num_kv_heads, head_dim)
        if getattr(model, "kept_kind", None) != kind:
            raise ValueError(f"the model keeps {getattr(model, 'kept_kind', None)!r}, the drafter reads {kind!r}")
        self.model = model

    def rows_at(self, tokens: list[int]) -> torch.Tensor:
        self._check(tokens)
        kept = self.model.kept(self.num_tokens)
        return kept.index_select(0, torch.tensor(tokens, dtype=torch.long, device=kept.device))


class HookedFeatures(StepFeatures):
    """The fallback for a target the registered class does not cover: Python forward hooks on the
    target's attention modules (what every layer hands to attention) or its final norm. Hooks run
    only in eager mode (``enforce_eager``); the step's query layout comes from vLLM's forward
    context before the first layer.

    With ``tail`` (a drafter that reads only the latest verified feature) only the last ``tail``
    query tokens of each request are kept — the newest verified position is among them whatever
    the target accepts (a query is at most 1 + K tokens past a prefill chunk's end) — so a step
    copies a few rows per layer instead of every token of every prefill. ``wanted(seq_lens)``, if
    given, is asked before each forward (with the step's per-request sequence lengths); when it
    says no, the step captures nothing (``active`` False): with such a drafter nothing later needs
    this step's features."""

    def __init__(self, model: torch.nn.Module, kind: str, num_kv_heads: int, head_dim: int, tail: int | None = None):
        super().__init__(kind, num_kv_heads, head_dim)
        if tail is not None and (kind != "per_layer_kv" or tail < 1):
            raise ValueError("tail needs per_layer_kv features and tail >= 1")
        self.tail = tail
        self.wanted = None  # (the step's seq_lens) -> whether to capture it; None: always
        self._index: torch.Tensor | None = None  # flat tokens kept (tail), in order
        self._slot_of: torch.Tensor | None = None  # flat token -> its row among the kept ones, or -1
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._hidden: torch.Tensor | None = None
        self._k = self._v = None
        self._handles = []
        layers = model.model.layers
        self._handles.append(layers[0].register_forward_pre_hook(self._on_step))
        if kind == "per_layer_kv":
            for layer in layers:
                self._handles.append(layer.self_attn.attn.register_forward_pre_hook(self._on_attention))
        else:
            self._handles.append(model.model.norm.register_forward_hook(self._on_norm))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _on_step(self, module, args) -> None:
        from vllm.forward_context import get_forward_context

        md = get_forward_context().attn_metadata
        if isinstance(md, list):  # one dict per micro-batch (ubatching); never on CPU
            md = md[0]
        m = next(iter(md.values())) if isinstance(md, dict) else md
        if m is None:  # a dummy/profile run
            self.query_start_loc, self.seq_lens, self.num_tokens = [], [], 0
        else:
            self.query_start_loc = m.query_start_loc.tolist()
            self.seq_lens = m.seq_lens.tolist()
            self.num_tokens = int(self.query_start_loc[-1])
        self.active = self.wanted is None or not self.num_tokens or self.wanted(self.seq_lens)
        self._slot_of = None
        if self.active and self.tail is not None and self.num_tokens:
            q = self.query_start_loc
            index = torch.tensor(
                [i for r in range(len(q) - 1) for i in range(max(q[r], q[r + 1] - self.tail), q[r + 1])]
            )
            self._slot_of = torch.full((self.num_tokens,), -1, dtype=torch.long)
            self._slot_of[index] = torch.arange(len(index))
            self._index = index
        self._kv = []
        self._k = self._v = None
        self._hidden = None

    def _on_attention(self, module, args) -> None:
        if not self.active:
            return
        _, k, v = args[:3]
        if self._slot_of is not None:
            self._kv.append((k.index_select(0, self._index), v.index_select(0, self._index)))
        else:
            self._kv.append((k[: self.num_tokens], v[: self.num_tokens]))

    def _on_norm(self, module, args, output) -> None:
        h = output[0] if isinstance(output, tuple) else output
        self._hidden = h[: self.num_tokens]

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every layer of the last step: [L, T, KVH * head_dim] each (built
        once per step, then gathered from per request)."""
        if self._kv:
            self._k = torch.stack([k for k, _ in self._kv])
            self._v = torch.stack([v for _, v in self._kv])
            self._kv = []
        return self._k, self._v

    def rows_at(self, tokens: list[int]) -> torch.Tensor:
        if self.kind == "hidden":
            return self._hidden[torch.tensor(tokens, dtype=torch.long)].clone()
        k, v = self._stacked()
        idx = torch.tensor(tokens, dtype=torch.long)
        if self._slot_of is not None:
            idx = self._slot_of[idx]
            if bool((idx < 0).any()):
                raise IndexError(f"tokens {tokens} are not all among the last {self.tail} of their query")
        return self._layout(k[:, idx], v[:, idx])


class MoAStepProposer:
    """vLLM's ``custom_class`` proposer: each engine step's drafts for every running request."""

    def __init__(self, vllm_config):
        self.num_drafts = vllm_config.speculative_config.num_speculative_tokens
        self.eager = bool(vllm_config.model_config.enforce_eager)
        hf = vllm_config.model_config.hf_config
        self.num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.model = None
        self.runner = None
        self.drafting: StepDrafting | None = None
        self.features: FeatureSource | None = None
        self.capture: StepFeatures | None = None

    def load_model(self, target_model) -> None:
        self.model = target_model

    def bind(self, runner, drafting: StepDrafting, features: FeatureSource | None, hooks: bool = False) -> None:
        """Where the drafter's features come from: a MoA drafter's per-layer K/V from the paged
        cache (``CachedFeatures``), an EAGLE-style drafter's hidden states from the registered
        class's forward (``KeptFeatures``); with ``hooks``, or where neither can serve an eager
        engine, from forward hooks (``HookedFeatures``)."""
        if drafting.num_drafts != self.num_drafts:
            raise ValueError(f"drafting asks {drafting.num_drafts} drafts, the engine {self.num_drafts}")
        self.runner, self.drafting = runner, drafting
        if features is None:
            return
        if self.model is None:
            raise RuntimeError("bind before load_model: the engine did not hand over its model")
        p = next(self.model.parameters())
        self.features = features.prepared(p.device, p.dtype)
        kind = vllm_model.kind_of(features)
        latest = features.from_cache and features.latest_only
        self.capture = None if hooks else self._after_step_features(kind)
        if self.capture is None:
            if not self.eager:
                raise RuntimeError(
                    f"{type(self.model).__name__} keeps no {kind} features after a compiled step: "
                    "forward hooks need enforce_eager"
                )
            self.capture = HookedFeatures(
                self.model, kind, self.num_kv_heads, self.head_dim, tail=self.num_drafts + 1 if latest else None
            )
            if latest:  # nothing to capture in a step after which the governor will not draft
                self.capture.wanted = self._wants_capture
        drafting.feature_fn = self._features
        drafting.latest_feature_only = latest

    def _after_step_features(self, kind: str) -> StepFeatures | None:
        if kind == "hidden":
            if getattr(self.model, "kept_kind", None) == "hidden":  # the registered class
                return KeptFeatures(self.model, self.runner, kind, self.num_kv_heads, self.head_dim)
            return None
        try:
            return CachedFeatures(self.model, self.runner, self.num_kv_heads, self.head_dim)
        except paged_kv.CacheLayoutError as exc:
            if not self.eager:
                raise RuntimeError(
                    f"the drafter's K/V cannot be read from vLLM's paged cache ({exc}); "
                    "verifier_pool.enforce_eager: true reads them through forward hooks"
                ) from exc
            log.warning("the drafter's K/V cannot be read from vLLM's paged cache (%s): forward hooks", exc)
            return None

    def _wants_capture(self, seq_lens: list[int]) -> bool:
        """Before a forward: whether the drafts asked after it may need its features. The step's
        batch for the governor is the requests that will sample (a request mid-prefill does not:
        its sequence stays short of its known tokens), as ``StepDrafting.step`` counts it."""
        known = self.runner.input_batch.num_tokens_no_spec[: len(seq_lens)]
        return self.drafting.wants_features(sum(int(s >= k) for s, k in zip(seq_lens, known)))

    @torch.inference_mode()
    def _features(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.features(inputs).float().cpu()

    @torch.inference_mode()
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_) -> list[list[int]]:
        n = len(sampled_token_ids)
        if self.drafting is None or n == 0:
            return [[] for _ in range(n)]
        req_ids = self.runner.input_batch.req_ids[:n]
        rows = [
            StepRow(req_ids[r], token_ids_cpu[r, : int(num_tokens_no_spec[r])], sampled=len(sampled_token_ids[r]) > 0)
            for r in range(n)
        ]
        batch = sum(r.sampled for r in rows)  # the governor's batch size, as StepDrafting counts it
        if self.capture is not None:
            self._attach_features(rows, batch, slot_mappings)
        return self.drafting.step(rows)

    def _attach_features(self, rows: list[StepRow], batch: int, slot_mappings=None) -> None:
        """The feature head's inputs for the positions each row's forward verified this step:
        from where its query began up to the last accepted token (rejected drafts' positions are
        dropped; mid-prefill, the whole chunk), or only the last of them for a drafter that reads
        the latest feature alone. ``StepDrafting`` runs the head on them only when the request
        drafts."""
        cap = self.capture
        if isinstance(cap, AfterStepFeatures):
            cap.refresh(len(rows), slot_mappings)
            # a latest-only drafter needs no feature of a step after which the governor will not
            # draft (its request waits for a fresh one): nothing is gathered then
            cap.active = self.drafting.wants_features(batch)
        if not cap.active:  # the governor keeps drafting off: nothing was captured, none needed
            return
        if len(cap.query_start_loc) != len(rows) + 1:
            log.warning(
                "captured %d query rows for %d requests: no features this step", len(cap.query_start_loc) - 1, len(rows)
            )
            return
        latest = self.drafting.latest_feature_only
        gather: list[tuple[StepRow, int]] = []  # latest_feature_only: (row, its flattened token)
        for r, row in enumerate(rows):
            q0, q1 = cap.query_start_loc[r], cap.query_start_loc[r + 1]
            first = cap.seq_lens[r] - (q1 - q0)  # position of the query's first token
            end = min(len(row.tokens) - 1 if row.sampled else cap.seq_lens[r], cap.seq_lens[r])
            start = max(first, end - 1) if latest else first
            row.feature_start = start
            if end > start and self.drafting.keeps_features(row.session_id):
                if latest:
                    gather.append((row, q0 + start - first))
                else:
                    row.feature_input = cap.rows(q0 + start - first, q0 + end - first)
        if gather:  # one gather for the step
            inputs = cap.rows_at([tok for _, tok in gather])
            for i, (row, _) in enumerate(gather):
                row.feature_input = inputs[i : i + 1]
