"""The two Ray Serve pools: thin async wrappers around the framework-free verifier and
proposer.

One worker thread per replica (a single-thread executor) runs every forward *and* every
release, in arrival order. A caller that gives up (a draft timeout cancels the call) never lets
a second call touch the caches while the first still runs: the next call waits in the
executor's queue behind it. Each reply carries the replica id and where the time went
(``PoolReply``), so the Router can count work per replica and split a round's wall time into
compute and everything else.

Each replica reports the sessions it used recently to Ray (``record_autoscaling_stats``: the
pools autoscale on sessions; ``record_routing_stats``: the affinity router places new groups on
the least-loaded replica).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time

import torch
from ray import serve

from moa_serve.client_server.fingerprint import model_fingerprint
from moa_serve.deployments.autoscaling import SESSIONS_METRIC
from moa_serve.deployments.config import AppConfig, PoolConfig
from moa_serve.deployments.metrics import PoolMetrics
from moa_serve.drafter.checkpoint import load_draft_vocab
from moa_serve.drafter.registry import load_feature_source, load_proposer
from moa_serve.drafter.spec import parse_branching
from moa_serve.protocol import PoolReply
from moa_serve.synthetic import describe
from moa_serve.verifier.torch.runner import RunnerOptions, TorchTargetRunner

log = logging.getLogger("ray.serve")

ACTIVE_WINDOW_S = 15.0  # a session used within this window counts as held by the replica


def _threads(pool: PoolConfig) -> None:
    torch.set_num_threads(pool.threads())


def _replica_name() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return f"pid-{os.getpid()}"


class _Pool:
    pool_name = "pool"

    def __init__(self, cfg: AppConfig, pool: PoolConfig):
        """``pool``: this pool's section of ``cfg``; its threads are set for the process."""
        self.cfg = cfg
        _threads(pool)
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="moa-forward")
        self._replica = _replica_name()
        self._metrics = PoolMetrics(self.pool_name)
        self._seen: dict[str, float] = {}  # session id -> last use (monotonic)
        self.calls = 0
        self.engine = None  # what the calls run on: the subclass sets its runner or proposer

    # ------------------------------------------------------------------ the worker thread
    async def _run(self, method: str, fn, *args, shield: bool = False) -> PoolReply:
        submitted = time.perf_counter()

        def work():
            start = time.perf_counter()
            out = fn(*args)
            return out, time.perf_counter() - start, start - submitted

        fut = asyncio.get_running_loop().run_in_executor(self._worker, work)
        # cancelling the caller's await (a timeout) skips a call still queued; a running one finishes
        # on the worker thread before the next call starts. Releases always run.
        out, compute_s, queued_s = await (asyncio.shield(fut) if shield else fut)
        self.calls += 1
        self._metrics.call(method, compute_s, queued_s)
        return PoolReply(out, self._replica, compute_s, queued_s)

    def _touch(self, requests) -> None:
        now = time.monotonic()
        for r in requests:
            self._seen[r.session_id] = now

    def _release_ids(self, session_ids) -> None:
        for sid in session_ids:
            self._seen.pop(sid, None)

    def active_sessions(self) -> int:
        cutoff = time.monotonic() - ACTIVE_WINDOW_S
        stale = [s for s, t in self._seen.items() if t < cutoff]
        for s in stale:
            del self._seen[s]
        return len(self._seen)

    # ------------------------------------------------------------------ Ray hooks
    async def record_autoscaling_stats(self) -> dict[str, float]:
        n = self.active_sessions()
        self._metrics.set_sessions(n)
        return {SESSIONS_METRIC: float(n)}

    async def record_routing_stats(self) -> dict[str, float]:
        return {"sessions": float(self.active_sessions())}

    # ------------------------------------------------------------------ calls both pools answer
    async def release(self, session_ids: list[str], group=None) -> PoolReply:
        """Frees the sessions' caches on ``self.engine`` (the runner or the proposer), behind any
        running call; a caller that gives up does not cancel it."""
        self._release_ids(session_ids)

        def release_all():
            for sid in session_ids:
                self.engine.release(sid)

        return await self._run("release", release_all, shield=True)

    def _info(self) -> dict:
        return {"replica": self._replica, "active_sessions": self.active_sessions(), "calls": self.calls}


@serve.deployment(name="VerifierPool")
class VerifierPool(_Pool):
    pool_name = "verifier"

    def __init__(self, cfg: AppConfig):
        super().__init__(cfg, cfg.verifier_pool)
        pool = cfg.verifier_pool
        options = RunnerOptions(
            max_num_batched_tokens=pool.max_num_batched_tokens,
            packed_weights=self.cfg.packed_weights,
            prefix_caching=pool.prefix_caching,
            matmul_precision=self.cfg.matmul_precision,
            kv_cache_dtype=self.cfg.kv_cache_dtype,
            static_forward=self.cfg.static_forward,
            batch_invariant=self.cfg.batch_invariant,
            load_format=self.cfg.load_format,
        )
        self.runner = self.engine = TorchTargetRunner(
            self.cfg.target,
            self.cfg.dtype,
            self.cfg.device,
            pool.max_sessions,
            self.cfg.max_model_len,
            load_feature_source(self.cfg.feature_drafter),
            draft_vocab=load_draft_vocab(self.cfg.feature_drafter),
            options=options,
        )
        self.target_fingerprint = model_fingerprint(self.runner.model)  # client-server handshake
        log.info("VerifierPool %s ready: %s (%s)", self._replica, self.cfg.target, describe(self.cfg.load_format))

    async def verify(self, requests, group=None) -> PoolReply:
        self._touch(requests)
        return await self._run("verify", self.runner.verify, requests)

    async def cut_steps(self, group=None) -> None:
        """A newcomer waits for the group's next verify call: the running one stops its multi-step
        decoding after its current forward. Runs here, on the event loop, not behind the call in
        the worker thread."""
        self.runner.cut_steps()

    async def info(self, group=None) -> dict:
        return {
            **self._info(),
            "max_model_len": self.runner.max_model_len,
            "free_slots": self.runner.free_slots,
            "sessions": len(self.runner.sessions),
            "retained_slots": len(self.runner.retained),
            "runner": dict(self.runner.stats),
            "target_fingerprint": self.target_fingerprint,
        }


@serve.deployment(name="DrafterPool")
class DrafterPool(_Pool):
    pool_name = "drafter"

    def __init__(self, cfg: AppConfig):
        super().__init__(cfg, cfg.drafter_pool)
        pool = cfg.drafter_pool
        # a hybrid's prompt lookup runs in the Router: the pool serves the trained drafter
        self.proposer = self.engine = load_proposer(
            self.cfg.drafter_checkpoint,
            target=self.cfg.target,
            dtype=self.cfg.dtype,
            device=self.cfg.device,
            max_sessions=pool.max_sessions,
            max_model_len=self.cfg.max_model_len,
        )
        self.proposer.set_tree(parse_branching(self.cfg.branching))  # tree drafts for greedy sessions
        log.info("DrafterPool %s ready: %s", self._replica, self.cfg.drafter_checkpoint)

    async def propose(self, requests, group=None) -> PoolReply:
        self._touch(requests)
        return await self._run("propose", self.proposer.propose, requests)

    async def info(self, group=None) -> dict:
        return {**self._info(), "sessions": len(self.proposer.sessions)}
