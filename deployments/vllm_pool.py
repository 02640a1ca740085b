"""``VllmVerifier``: the verifier pool of ``backend: vllm``.

Each replica runs stock vLLM in-process (``VllmEngine``: its scheduler, paged KV cache,
continuous batching, rejection sampler) on an ``StepLoop`` thread. Drafts come from the drafter
pool: after every engine step, one batched ``propose`` call for all of the replica's running
requests (``PoolDraftSource``, the same DraftRequest protocol and LSA features as the torch
backend's rounds); ``drafter: lookup`` uses vLLM's own n-gram proposer instead. The Router opens
one streaming ``generate`` call per session and receives each step's tokens.

The replica reports its running requests to Ray (``record_autoscaling_stats``: the pool scales on
sessions; ``record_routing_stats``) like the torch pools do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

from ray import serve
from ray.serve.handle import DeploymentHandle

from moa_serve.deployments import fit
from moa_serve.deployments.autoscaling import SESSIONS_METRIC
from moa_serve.deployments.config import AppConfig
from moa_serve.deployments.pools import _replica_name, _threads
from moa_serve.deployments.stats import CallStats
from moa_serve.drafter.registry import load_feature_source, load_proposer
from moa_serve.sampling import SamplingParams
from moa_serve.verifier.vllm.engine import VllmEngine, VllmOptions
from moa_serve.verifier.vllm.step_loop import StepLoop

log = logging.getLogger("ray.serve")


class PoolDraftSource:
    """The drafter pool behind a Serve handle, for ``StepDrafting``. Called on the engine thread
    and blocking: the next verify step needs these drafts anyway. ``group`` is this verifier
    replica's id, so the affinity router keeps its sessions on one drafter replica (the one that
    holds their caches) and spreads the verifier replicas over the drafter replicas."""

    def __init__(self, handle: DeploymentHandle, group: str, timeout_s: float = 5.0):
        self.handle = handle
        self.group = group
        self.timeout_s = timeout_s
        self.calls = CallStats()

    def propose(self, requests):
        # features leave the verifier's device: the drafter replica is another process (maybe GPU)
        requests = [
            dataclasses.replace(r, features=r.features.cpu()) if r.features is not None else r for r in requests
        ]
        t0 = time.perf_counter()
        reply = self.handle.propose.remote(requests, group=self.group).result(timeout_s=self.timeout_s)
        self.calls.record("drafter", reply.replica, time.perf_counter() - t0, reply.compute_s, reply.queued_s)
        return reply.results

    def release(self, session_ids: list[str]) -> None:
        self.handle.release.remote(session_ids, group=self.group)  # not awaited: the pool's LRU backs it up


@serve.deployment(name="VllmVerifier")
class VllmVerifier:
    def __init__(self, cfg: AppConfig, drafter: DeploymentHandle | None = None):
        self.cfg = cfg
        pool = self.cfg.verifier_pool
        self._replica = _replica_name()
        # before vLLM starts: its CPU worker forbids torch.set_num_threads afterwards, and Ray sets
        # OMP_NUM_THREADS to the actor's num_cpus
        _threads(pool)
        kv_gib = fit.vllm_kv_bytes(self.cfg, fit.target_shape(self.cfg)) / fit.GiB
        self.source = PoolDraftSource(drafter, self._replica) if drafter is not None else None
        options = VllmOptions(
            num_speculative_tokens=self.cfg.num_speculative_tokens,
            ngram=self.cfg.drafter == "lookup",
            dtype=self.cfg.dtype,
            max_model_len=self.cfg.max_model_len,
            max_num_seqs=pool.max_sessions,
            kv_cache_gib=kv_gib,
            max_num_batched_tokens=pool.max_num_batched_tokens,
            retry_after_s=self.cfg.router.retry_after_s,
            speculation_governor=self.cfg.router.speculation_governor,
            adaptive_speculation=self.cfg.adaptive_speculation,
            device=self.cfg.device,
            prefix_caching=pool.prefix_caching,
            enforce_eager=pool.enforce_eager,
        )
        checkpoint = self.cfg.drafter_checkpoint
        self.engine = VllmEngine(
            self.cfg.target,
            checkpoint,
            options,
            features=load_feature_source(checkpoint) if checkpoint is not None else None,
            draft_source=self.source,
            proposer_factory=load_proposer,
        )
        self.loop = StepLoop(self.engine, name="vllm-steps").start()
        log.info("VllmVerifier %s ready: %s (drafter %s)", self._replica, self.cfg.target, self.cfg.drafter)

    async def generate(self, prompt: list[int], max_new_tokens: int, sampling: dict, ignore_eos: bool = False):
        """Streams ``Update``s for one request until it finishes; a caller that goes away aborts it."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        rid = uuid.uuid4().hex
        self.loop.submit(
            rid,
            prompt,
            max_new_tokens,
            lambda u: loop.call_soon_threadsafe(updates.put_nowait, u),
            SamplingParams(**sampling),
            ignore_eos,
        )
        finished = False
        try:
            while not finished:
                u = await updates.get()
                while not updates.empty() and u.finish_reason is None:  # steps that queued up: one message
                    more = updates.get_nowait()
                    more.tokens = u.tokens + more.tokens
                    u = more
                finished = u.finish_reason is not None
                u.replica = self._replica
                yield u
        finally:
            if not finished:
                self.loop.abort(rid)

    def _sessions(self) -> int:
        return self.loop.running

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return {SESSIONS_METRIC: float(self._sessions())}

    async def record_routing_stats(self) -> dict[str, float]:
        return {"sessions": float(self._sessions())}

    async def info(self, group=None) -> dict:
        out = {
            "replica": self._replica,
            "backend": "vllm",
            "max_model_len": self.engine.max_model_len,
            "sessions": self._sessions(),
            "engine": self.loop.stats.as_dict(),
            "drafting": self.engine.stats(),
        }
        if self.source is not None:
            out["drafter_calls"] = self.source.calls.as_dict()["replicas"].get("drafter", {})
        return out

    def __del__(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop(timeout_s=5.0)
