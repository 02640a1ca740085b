"""The ingress: FastAPI routes around the RoundService, which batches the draft/verify rounds
of all users; pool calls go through Ray Serve handles with session-group affinity."""

from __future__ import annotations

import asyncio
import logging

from ray import serve
from ray.serve.handle import DeploymentHandle

from moa_serve.app import state
from moa_serve.app.frontend import Frontend
from moa_serve.app.http import create_app
from moa_serve.deployments.config import AppConfig
from moa_serve.deployments.metrics import PrometheusObserver
from moa_serve.engine.service import RoundService

log = logging.getLogger("ray.serve")
api = create_app()


@serve.deployment(name="Router")
@serve.ingress(api)
class Router:
    def __init__(self, cfg: dict, verifier: DeploymentHandle, drafter: DeploymentHandle | None = None):
        from moa_serve.engine.engine import stop_token_ids
        from moa_serve.models import load_tokenizer, read_config, resolve_model_path

        self.cfg = AppConfig.model_validate(cfg)
        self.verifier = verifier
        self.drafter = drafter
        path = resolve_model_path(self.cfg.target, weights=False)  # tokenizer + config only
        tokenizer = load_tokenizer(path)
        max_model_len = min(self.cfg.max_model_len, read_config(path).max_position_embeddings)
        r = self.cfg.router
        self.service = RoundService(
            self._verify, self._draft if drafter is not None else None, self._release,
            num_groups=r.session_groups, max_sessions_per_round=r.max_sessions_per_round,
            max_queued=r.max_queued_requests, observer=PrometheusObserver())
        state.install(
            frontend=Frontend(self.service, tokenizer, max_model_len=max_model_len,
                              stop_token_ids=stop_token_ids(path, tokenizer),
                              num_speculative_tokens=self.cfg.num_speculative_tokens,
                              speculative=drafter is not None, model_name=self.cfg.model_name or self.cfg.target,
                              adaptive_speculation=self.cfg.adaptive_speculation),
            ready=self.ready, retry_after_s=r.retry_after_s)

    async def _verify(self, group: int, requests):
        return await self.verifier.verify.remote(requests, group=group)

    async def _draft(self, group: int, requests):
        return await self.drafter.propose.remote(requests, group=group)

    async def _release(self, group: int, session_ids: list[str]) -> None:
        calls = [self.verifier.release.remote(session_ids, group=group)]
        if self.drafter is not None:
            calls.append(self.drafter.release.remote(session_ids, group=group))
        await asyncio.gather(*calls, return_exceptions=True)

    async def ready(self):
        pools = {"verifier": self.verifier, **({"drafter": self.drafter} if self.drafter is not None else {})}
        detail = {}
        for name, handle in pools.items():
            try:
                detail[name] = await asyncio.wait_for(handle.info.remote(), 5.0)
            except Exception as exc:
                detail[name] = {"error": type(exc).__name__}
        ok = all("error" not in d for d in detail.values())
        return ok, {"pools": detail}
