"""Updates and drains lose no stream on Kubernetes: every worker Pod drains its Ray node before
SIGTERM (preStop) within a grace period that covers the Gateway's drain, every HAProxy keeps a
reloaded process's connections at least as long, and an upgrade to a new Ray cluster keeps the old
one until its streams can have ended (docs/kubernetes.md#updates-and-drains)."""

from __future__ import annotations

import pytest

from tests.support.k8s_manifests import (
    KUSTOMIZATIONS,
    embedded_serve_config,
    env_of,
    ray_container,
    ray_pods,
    render,
    the_rayservice,
)


def stream_drain_s(rs: dict) -> int:
    [app] = embedded_serve_config(rs)["applications"]
    return render.stream_drain_s(render.app_config_class().model_validate(app["args"]))


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_every_worker_pod_drains_its_node_within_a_grace_period_longer_than_the_stream_drain(name, built):
    rs = the_rayservice(built[name])
    drain = stream_drain_s(rs)
    workers = [(group, t) for group, _, t in ray_pods(rs) if group != "head"]
    assert workers
    for group, template in workers:
        assert template["spec"]["terminationGracePeriodSeconds"] == drain + render.PRESTOP_MARGIN_S, group
        hook = ray_container(template)["lifecycle"]["preStop"]["exec"]["command"]
        assert hook == ["python", "-m", "moa_serve.deployments.drain"], group


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_every_haproxy_keeps_a_reloaded_process_connections_as_long_as_the_drain(name, built):
    rs = the_rayservice(built[name])
    drain = stream_drain_s(rs)
    for group, _, template in ray_pods(rs):
        env = env_of(ray_container(template))
        if env.get("RAY_SERVE_ENABLE_HA_PROXY", {}).get("value") != "1":
            continue
        assert int(env["RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S"]["value"]) >= drain, group


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_an_upgrade_keeps_the_old_cluster_until_its_streams_can_have_ended(name, built):
    rs = the_rayservice(built[name])
    assert rs["spec"]["upgradeStrategy"]["type"] == "NewCluster"
    assert rs["spec"]["rayClusterDeletionDelaySeconds"] >= stream_drain_s(rs) + render.PRESTOP_MARGIN_S


def test_the_drain_follows_the_gateway_of_the_serve_config():
    cfg = render.app_config_class().model_validate(
        {"target": "t", "router": {"session_groups": 1}, "gateway": {"graceful_shutdown_timeout_s": 300.5}}
    )
    assert render.stream_drain_s(cfg) == 301  # whole seconds, rounded up
    assert render.service_values(cfg)["rayClusterDeletionDelaySeconds"] == 301 + render.PRESTOP_MARGIN_S
