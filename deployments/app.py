"""``build_app(args)``: the Ray Serve application from a validated ``AppConfig`` — used by
``serve run deployments/configs/*.yaml`` (``import_path: moa_serve.deployments.app:build_app``)."""

from __future__ import annotations

from ray import serve
from ray.serve.config import RequestRouterConfig

from moa_serve.deployments.config import AppConfig, PoolConfig, RouterConfig
from moa_serve.deployments.pools import DrafterPool, VerifierPool
from moa_serve.deployments.router import Router

AFFINITY = RequestRouterConfig(request_router_class="moa_serve.deployments.affinity:SessionGroupRouter")


def _options(pool: PoolConfig | RouterConfig) -> dict:
    opts = {
        "autoscaling_config": pool.autoscaling_config.model_dump(exclude_none=True),
        "ray_actor_options": pool.ray_actor_options.model_dump(exclude_none=True),
        "max_ongoing_requests": pool.max_ongoing_requests,
    }
    return opts


def build_app(args: dict | AppConfig) -> serve.Application:
    cfg = args if isinstance(args, AppConfig) else AppConfig.model_validate(args)
    plain = cfg.model_dump()
    verifier = VerifierPool.options(**_options(cfg.verifier_pool), request_router_config=AFFINITY).bind(plain)
    drafter = None
    if cfg.drafter is not None:
        drafter = DrafterPool.options(**_options(cfg.drafter_pool), request_router_config=AFFINITY).bind(plain)
    return Router.options(**_options(cfg.router)).bind(plain, verifier, drafter)
