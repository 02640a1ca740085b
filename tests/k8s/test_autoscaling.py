"""Worker groups and autoscaling: min/max replicas agree with the Serve autoscaling ranges, the
gpu-prod sizes worked out by hand, packing by Ray's GPU rules, KubeRay's autoscaler settings."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from tests.support.k8s_manifests import (
    KUSTOMIZATIONS,
    ROOT,
    _pyproject_pin,
    embedded_serve_config,
    env_of,
    ray_container,
    render,
    the_rayservice,
)

TARGET_OF = {"base": render.TARGETS[0], "gpu-prod": render.TARGETS[0], "cpu-dev": render.TARGETS[1]}


def _pod_capacity(group: dict) -> tuple[int, int]:
    shape = render.pod_shape(group)
    return shape.cpus, shape.gpus


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_worker_groups_match_serve_autoscaling_ranges(name, built):
    """Independent of render.py's packing: for each group, minReplicas/maxReplicas lie between
    the resource lower bound (total demand / Pod capacity) and the no-sharing upper bound
    (each pool on Pods of its own), at the Serve min and max replica counts."""
    rs = the_rayservice(built[name])
    app = render.app_config_class().model_validate(render.the_application(embedded_serve_config(rs))["args"])
    groups = {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    placement = dict(TARGET_OF[name].placement)
    assert set(placement) == set(groups), "every worker group hosts some Serve deployment"

    for group_name, pools in placement.items():
        g = groups[group_name]
        cpus, gpus = _pod_capacity(g)
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        assert g["replicas"] == g["minReplicas"], "start at the size the Serve minimum needs"
        for bound, field in (("min_replicas", "minReplicas"), ("max_replicas", "maxReplicas")):
            lower, upper, cpu_total, gpu_total = 0, 0, Fraction(0), Fraction(0)
            for pool in pools:
                if pool == "router" and app.router.in_gateway:
                    continue  # no Router deployment: it runs inside each Gateway replica
                cfg = getattr(app, pool)
                n = getattr(cfg.autoscaling_config, bound)
                c, gp = Fraction(str(cfg.ray_actor_options.num_cpus)), Fraction(str(cfg.ray_actor_options.num_gpus))
                assert c <= cpus and gp <= max(gpus, 0), f"{pool} replica does not fit a {group_name} Pod"
                if gp > 0:
                    assert gpus > 0, f"{pool} needs a GPU but group {group_name} has none"
                else:
                    assert gpus == 0, f"{pool} needs no GPU: keep it off GPU Pods"
                by_gpu = (gpus // gp if gp >= 1 else (1 // gp) * gpus) if gp else math.inf
                per_pod = min(cpus // c if c else math.inf, by_gpu)
                upper += 0 if per_pod is math.inf else math.ceil(n / per_pod)
                cpu_total += n * c
                gpu_total += n * gp
            lower = max(math.ceil(cpu_total / cpus) if cpus else 0, math.ceil(gpu_total / gpus) if gpus else 0)
            assert lower <= g[field] <= upper, (group_name, field, lower, g[field], upper)


def test_gpu_prod_sizes():
    """The numbers for today's gpu.yaml, worked out by hand: Pods of 1 GPU / 8 CPUs hold one
    verifier (1 GPU, 4 CPUs) or four drafters (0.25 GPU, 2 CPUs each); CPU Pods of 4 CPUs
    hold two of the Gateway and the Routers (2 CPUs each)."""
    sizes = render.render(render.TARGETS[0]).sizes
    app = render.app_config_class().model_validate(
        render.the_application(render.load_yaml(ROOT / "deployments/configs/gpu.yaml"))["args"]
    )
    v, d, r = app.verifier_pool.autoscaling_config, app.drafter_pool.autoscaling_config, app.router.autoscaling_config
    assert (sizes["gpu"].min_pods, sizes["gpu"].max_pods) == (
        v.min_replicas + math.ceil(d.min_replicas / 4),
        v.max_replicas + math.ceil(d.max_replicas / 4),
    )
    g = app.gateway.autoscaling_config
    assert (sizes["cpu"].min_pods, sizes["cpu"].max_pods) == (
        math.ceil((g.min_replicas + r.min_replicas) / 2),
        math.ceil((g.max_replicas + r.max_replicas) / 2),
    )


def test_packing_follows_rays_gpu_rules():
    F = Fraction
    one_gpu, two_gpu = render.PodShape(8, 1), render.PodShape(16, 2)
    assert render.pods_needed([], one_gpu) == 0
    assert render.pods_needed([(F(0), F(0))] * 5, one_gpu) == 0  # 0-resource replicas
    assert render.pods_needed([(F(4), F(1))] + [(F(2), F(1, 4))] * 4, one_gpu) == 2
    assert render.pods_needed([(F(4), F(1))] + [(F(2), F(1, 4))] * 4, two_gpu) == 1
    assert render.pods_needed([(F(1), F(3, 10))] * 4, one_gpu) == 2  # 0.3 x 3 fit on one GPU, not 4
    assert render.pods_needed([(F(1), F(3, 5))] * 2, two_gpu) == 1  # fractions never span GPUs
    assert render.pods_needed([(F(1), F(3, 5))] * 3, two_gpu) == 2
    assert render.pods_needed([(F(3), F(0))] * 3, render.PodShape(4, 0)) == 3  # CPU-bound
    with pytest.raises(render.RenderError):
        render.pods_needed([(F(1), F(2))], one_gpu)  # never fits
    with pytest.raises(render.RenderError):
        render.pods_needed([(F(1), F(3, 2))], two_gpu)  # 1.5 GPUs: not whole


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_kuberay_autoscaling(name, built):
    rs = the_rayservice(built[name])
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    opts = cluster["autoscalerOptions"]
    assert opts["version"] == "v2" and opts["idleTimeoutSeconds"] >= 0
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0", "CPU-only head hosting no replicas"
    # The sizing assumes Serve's pack scheduler (largest replicas first, best fit).
    assert env_of(ray_container(head["template"]))["RAY_SERVE_USE_PACK_SCHEDULING_STRATEGY"]["value"] == "1"
    # Serve's high-throughput mode (HAProxy ingress, gRPC between replicas) needs the same
    # environment on every Ray container: replicas read it where they run
    for template in [head["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]:
        env = env_of(ray_container(template))
        assert env["RAY_SERVE_ENABLE_HA_PROXY"]["value"] == env["RAY_SERVE_THROUGHPUT_OPTIMIZED"]["value"] == "1"
    assert cluster["rayVersion"] == _pyproject_pin("ray")
    for g in cluster["workerGroupSpecs"]:  # autoscaler v2 requirement (KubeRay validation)
        assert g["template"]["spec"].get("restartPolicy") in (None, "Never")
