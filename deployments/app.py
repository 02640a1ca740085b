"""``build_app(args)``: the Ray Serve application from a validated ``AppConfig`` — used by
``serve run deployments/configs/*.yaml`` (``import_path: moa_serve.deployments.app:build_app``).

A config that cannot work is refused here, with the reason and the arithmetic, before any
replica starts: sessions the Routers admit against the sessions the pools hold (in
``AppConfig``), each pool replica's weights + caches against its memory (``fit.py``), and, when
it builds inside a running Ray cluster (``serve run``, ``serve.run`` after ``ray.init``), every
replica's CPU and GPU reservation against the cluster's nodes (``placement_report``).
``moa config check`` (``config_check.py``) prints the same checks without Ray."""

from __future__ import annotations

import logging
import os

import ray
from ray import serve

from moa_serve.deployments import fit
from moa_serve.deployments.affinity import AFFINITY
from moa_serve.deployments.autoscaling import policy_options
from moa_serve.deployments.config import (
    AppConfig,
    ConfigError,
    GatewayConfig,
    PoolConfig,
    RouterConfig,
    drain_warnings,
    placement_report,
    reservations,
    session_warnings,
)
from moa_serve.deployments.gateway import Gateway
from moa_serve.deployments.pools import DrafterPool, VerifierPool
from moa_serve.deployments.router import Router
from moa_serve.deployments.vllm_pool import VllmVerifier
from moa_serve.verifier.vllm.engine import INSTALL_HINT, vllm_available

log = logging.getLogger("ray.serve")


# Replicas share cores (verifier, drafter, router, on small nodes all together). OpenMP's
# active waiting collapses a forward when its threads are not all scheduled: with a second
# multi-threaded process on the same cores, a decode step spins away whole scheduler time slices
# instead of a few milliseconds; passive waiting keeps it close to its time alone. A single
# process alone (moa generate/bench) runs faster with the default, so only the replicas get it; a
# runtime_env that sets it wins (local-cpu.yaml's only verifier spins, on cores of its own).
REPLICA_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def _options(pool: PoolConfig | RouterConfig | GatewayConfig, env: dict | None = None) -> dict:
    actor = pool.ray_actor_options.model_dump(exclude_none=True)
    runtime_env = dict(actor.get("runtime_env") or {})
    runtime_env["env_vars"] = {**REPLICA_ENV, **(env or {}), **(runtime_env.get("env_vars") or {})}
    actor["runtime_env"] = runtime_env
    autoscaling = pool.autoscaling_config.model_dump(exclude_none=True)
    if isinstance(pool, PoolConfig):  # pools scale on the sessions they hold
        autoscaling.pop("target_sessions_per_replica", None)
        autoscaling["policy"] = policy_options(pool.target_sessions())
    return {
        "autoscaling_config": autoscaling,
        "ray_actor_options": actor,
        "max_ongoing_requests": pool.max_ongoing_requests,
        "graceful_shutdown_timeout_s": pool.graceful_shutdown_timeout_s,
    }


def validate(
    cfg: AppConfig, target: fit.ModelShape | None = None, drafter: fit.DrafterShape | None = None
) -> list[fit.Fit]:
    """Raises ConfigError for a config that cannot work; logs the ones that waste or thrash."""
    results = fit.check_fit(cfg, target, drafter)
    warnings = session_warnings(cfg) + drain_warnings(cfg, dict(os.environ)) + fit.host_warnings(cfg, results)
    for w in warnings:
        log.warning("config: %s", w)
    for f in results:
        log.info("memory fit: %s", f.describe())
    return results


# set in the Ray containers of a KubeRay cluster (the operator injects them): its autoscaler adds
# worker Pods for replicas that wait, so a cluster smaller than the config at build time is normal
KUBERAY_ENV = ("KUBERAY_GEN_RAY_START_CMD", "RAY_CLUSTER_NAME")


def cluster_nodes() -> list[dict[str, float]] | None:
    """The CPU and GPU totals of each live node of the Ray cluster this process is connected to;
    None outside one (``build_app`` called before ``ray.init``: nothing to check against)."""
    if not ray.is_initialized():
        return None
    return [
        {r: float(n.get("Resources", {}).get(r, 0.0)) for r in ("CPU", "GPU")} for n in ray.nodes() if n.get("Alive")
    ]


def cluster_may_grow() -> bool:
    return any(os.environ.get(k) for k in KUBERAY_ENV)


def check_placement(cfg: AppConfig, nodes: list[dict[str, float]] | None, may_grow: bool = False) -> None:
    """Raises ConfigError when the replicas at start cannot all be placed on ``nodes``; logs what
    waits on a cluster that may grow, or once autoscaling passes what the cluster holds."""
    if nodes is None:
        return
    problems, warnings = placement_report(reservations(cfg), nodes, may_grow)
    for w in warnings:
        log.warning("config: %s", w)
    if problems:
        raise ConfigError("this config cannot be placed on this Ray cluster:\n  - " + "\n  - ".join(problems))


def build_app(args: dict | AppConfig) -> serve.Application:
    cfg = args if isinstance(args, AppConfig) else AppConfig.model_validate(args)
    validate(cfg)
    check_placement(cfg, cluster_nodes(), cluster_may_grow())
    if cfg.backend == "vllm":
        if not vllm_available():
            raise ConfigError(f"backend: vllm, but {INSTALL_HINT}")
    drafter = None
    if cfg.drafter_checkpoint is not None:  # prompt lookup alone needs no pool: the Router drafts
        drafter = DrafterPool.options(**_options(cfg.drafter_pool), request_router_config=AFFINITY).bind(cfg)
    if cfg.backend == "vllm":  # vLLM batches every user's steps; its replica calls the drafter pool
        # vLLM steps on its own thread: OpenMP gives a new thread OMP_NUM_THREADS (Ray: num_cpus),
        # not the main thread's setting, and vLLM's CPU attention insists both agree
        pool = cfg.verifier_pool
        verifier = VllmVerifier.options(**_options(pool, {"OMP_NUM_THREADS": str(pool.threads())})).bind(cfg, drafter)
        return _ingress(cfg, verifier, None)
    verifier = VerifierPool.options(**_options(cfg.verifier_pool), request_router_config=AFFINITY).bind(cfg)
    return _ingress(cfg, verifier, drafter)


def _ingress(cfg: AppConfig, verifier, drafter) -> serve.Application:
    """The Gateway (HTTP) in front of the Routers. Calls to a Router carry an affinity key (a
    lane, a client-server session id), so they stick to one Router replica while it lives. With
    ``router.in_gateway`` each Gateway replica runs its Router itself and calls the pools."""
    if cfg.router.in_gateway:
        return Gateway.options(**_options(cfg.gateway)).bind(cfg, None, verifier, drafter)
    router = Router.options(**_options(cfg.router), request_router_config=AFFINITY).bind(cfg, verifier, drafter)
    return Gateway.options(**_options(cfg.gateway)).bind(cfg, router)
