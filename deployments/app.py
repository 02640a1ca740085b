"""``build_app(args)``: the Ray Serve application from a validated ``AppConfig`` — used by
``serve run deployments/configs/*.yaml`` (``import_path: moa_serve.deployments.app:build_app``)."""

from __future__ import annotations

from ray import serve
from ray.serve.config import RequestRouterConfig

from moa_serve.deployments.config import AppConfig, PoolConfig, RouterConfig
from moa_serve.deployments.pools import DrafterPool, VerifierPool
from moa_serve.deployments.router import Router

AFFINITY = RequestRouterConfig(request_router_class="moa_serve.deployments.affinity:SessionGroupRouter")


# Replicas share cores (verifier, drafter, router, on small nodes all together). OpenMP's
# active waiting collapses a forward when its threads are not all scheduled: measured here, a
# SmolLM2 decode step took 1.9-2.4 s instead of ~50 ms with a second 2-thread process on 2 cores;
# passive waiting keeps it near 75 ms. A single process alone (moa generate/bench) runs faster
# with the default, so only the replicas get it; a runtime_env that sets it wins.
REPLICA_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def _options(pool: PoolConfig | RouterConfig) -> dict:
    actor = pool.ray_actor_options.model_dump(exclude_none=True)
    runtime_env = dict(actor.get("runtime_env") or {})
    runtime_env["env_vars"] = {**REPLICA_ENV, **(runtime_env.get("env_vars") or {})}
    actor["runtime_env"] = runtime_env
    return {
        "autoscaling_config": pool.autoscaling_config.model_dump(exclude_none=True),
        "ray_actor_options": actor,
        "max_ongoing_requests": pool.max_ongoing_requests,
    }


def build_app(args: dict | AppConfig) -> serve.Application:
    cfg = args if isinstance(args, AppConfig) else AppConfig.model_validate(args)
    plain = cfg.model_dump()
    verifier = VerifierPool.options(**_options(cfg.verifier_pool), request_router_config=AFFINITY).bind(plain)
    drafter = None
    if cfg.drafter is not None:
        drafter = DrafterPool.options(**_options(cfg.drafter_pool), request_router_config=AFFINITY).bind(plain)
    return Router.options(**_options(cfg.router)).bind(plain, verifier, drafter)
