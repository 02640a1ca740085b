"""The two Ray Serve pools: thin async wrappers around the framework-free verifier and
proposer. One forward runs at a time per replica (torch uses the replica's threads); calls
from several session groups queue behind each other."""

from __future__ import annotations

import asyncio
import logging
import os

from ray import serve

from moa_serve.deployments.config import AppConfig, PoolConfig

log = logging.getLogger("ray.serve")


def _threads(pool: PoolConfig) -> None:
    import torch

    n = pool.torch_threads or max(1, int(pool.ray_actor_options.num_cpus or 1))
    torch.set_num_threads(n)


def _replica_name() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return f"pid-{os.getpid()}"


class _Pool:
    def __init__(self):
        self._lock = asyncio.Lock()

    async def _run(self, fn, *args):
        async with self._lock:
            return await asyncio.to_thread(fn, *args)


@serve.deployment(name="VerifierPool")
class VerifierPool(_Pool):
    def __init__(self, cfg: dict):
        super().__init__()
        from moa_serve.engine.engine import load_feature_head
        from moa_serve.verifier.torch_runner import TorchTargetRunner

        self.cfg = AppConfig.model_validate(cfg)
        _threads(self.cfg.verifier_pool)
        self.runner = TorchTargetRunner(self.cfg.target, self.cfg.dtype, self.cfg.device,
                                        self.cfg.verifier_pool.max_sessions, self.cfg.max_model_len,
                                        load_feature_head(self.cfg.drafter))
        log.info("VerifierPool %s ready: %s", _replica_name(), self.cfg.target)

    async def verify(self, requests, group: int | None = None):
        return await self._run(self.runner.verify, requests)

    async def release(self, session_ids: list[str], group: int | None = None) -> None:
        for sid in session_ids:
            self.runner.release(sid)

    async def info(self, group: int | None = None) -> dict:
        return {"replica": _replica_name(), "max_model_len": self.runner.max_model_len,
                "free_slots": self.runner.free_slots, "sessions": len(self.runner.sessions)}


@serve.deployment(name="DrafterPool")
class DrafterPool(_Pool):
    def __init__(self, cfg: dict):
        super().__init__()
        from moa_serve.drafter.proposer import MoAProposer

        self.cfg = AppConfig.model_validate(cfg)
        _threads(self.cfg.drafter_pool)
        self.proposer = MoAProposer.load(self.cfg.drafter, target=self.cfg.target, dtype=self.cfg.dtype,
                                         device=self.cfg.device, max_sessions=self.cfg.drafter_pool.max_sessions,
                                         max_model_len=self.cfg.max_model_len)
        log.info("DrafterPool %s ready: %s", _replica_name(), self.cfg.drafter)

    async def propose(self, requests, group: int | None = None):
        return await self._run(self.proposer.propose, requests)

    async def release(self, session_ids: list[str], group: int | None = None) -> None:
        for sid in session_ids:
            self.proposer.release(sid)

    async def info(self, group: int | None = None) -> dict:
        return {"replica": _replica_name(), "sessions": len(self.proposer.sessions)}
