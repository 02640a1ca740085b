"""Autoscaling the pools on sessions (Ray Serve 2.60 custom autoscaling policy).

What Ray 2.60 offers, and how it is used here:

* a deployment may define ``record_autoscaling_stats() -> dict[str, float]``; each replica
  calls it periodically (every ``look_back_period_s x 0.2``) and pushes the values to the
  controller (every ``RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S``, 10 s by default);
  the pools report ``{"sessions": <sessions used in the last ACTIVE_WINDOW_S>}``;
* ``autoscaling_config.policy = {"policy_function": "module:Class", "policy_kwargs": {...}}``
  replaces the request-count policy; a class is instantiated once with ``policy_kwargs`` and
  called every control-loop tick with an ``AutoscalingContext`` whose ``aggregated_metrics``
  holds each running replica's custom metrics averaged over ``look_back_period_s``;
* Ray wraps the policy (``_apply_autoscaling_config``): ``upscale_delay_s`` /
  ``downscale_delay_s``, up/downscaling factors, and the ``min_replicas``..``max_replicas``
  bounds still apply.

The Router keeps Ray's default policy: its ongoing requests *are* sessions (one HTTP request
per generation, streamed or not) plus the requests waiting for admission.
"""

from __future__ import annotations

import math

SESSIONS_METRIC = "sessions"
POLICY_PATH = "moa_serve.deployments.autoscaling:SessionsPolicy"


class SessionsPolicy:
    """desired replicas = ceil(sessions held by all replicas / target sessions per replica)."""

    def __init__(self, target_sessions_per_replica: float, metric: str = SESSIONS_METRIC):
        if target_sessions_per_replica <= 0:
            raise ValueError("target_sessions_per_replica must be > 0")
        self.target = float(target_sessions_per_replica)
        self.metric = metric

    def desired(self, sessions_per_replica: dict, current: int) -> int:
        if not sessions_per_replica:  # no report yet (replicas starting): hold
            return current
        total = sum(float(v) for v in sessions_per_replica.values())
        return math.ceil(total / self.target - 1e-9)

    def __call__(self, ctx):
        metrics = ctx.aggregated_metrics or {}
        per_replica = metrics.get(self.metric) or {}
        desired = self.desired(per_replica, ctx.target_num_replicas)
        state = dict(ctx.policy_state or {})
        state["moa_sessions"] = float(sum(per_replica.values())) if per_replica else None
        return desired, state


def policy_options(target_sessions_per_replica: float) -> dict:
    return {
        "policy_function": POLICY_PATH,
        "policy_kwargs": {"target_sessions_per_replica": float(target_sessions_per_replica)},
    }
