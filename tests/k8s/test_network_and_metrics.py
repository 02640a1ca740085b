"""Who reaches the Ray Pods and how they are watched: the NetworkPolicy admits the API port only
from labelled clients, Prometheus scraping and gpu-prod's PodMonitor, the HTTP API Service."""

from __future__ import annotations

import pytest

from tests.support.k8s_manifests import KUSTOMIZATIONS, ROOT, port_named, ray_container, ray_pods, the_rayservice


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_network_policy_admits_the_api_port_only_from_labelled_clients(name, built):
    objs = built[name]
    [policy] = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert policy["apiVersion"] == "networking.k8s.io/v1"
    assert policy["metadata"].get("namespace") == the_rayservice(objs)["metadata"].get("namespace")
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"] and "egress" not in spec
    for role, _, template in ray_pods(the_rayservice(objs)):  # it isolates every Ray Pod
        assert spec["podSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items(), role
    own = {"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "moa-serve"}}}
    clients = {"podSelector": {"matchLabels": {"moa-serve/client": "true"}}}
    for rule in spec["ingress"]:
        assert rule.get("from"), f"a rule without `from` admits every Pod: {rule}"
        for peer in rule["from"]:
            assert "ipBlock" not in peer, rule
        ports = {p["port"] for p in rule.get("ports") or []}
        if rule["from"] == [own]:
            assert not ports  # the Ray Pods among themselves: every port
        elif rule["from"] == [clients]:
            assert ports == {8000}
        else:  # infrastructure from other namespaces, each to named ports
            [peer] = rule["from"]
            assert peer["namespaceSelector"] == {} and peer["podSelector"]["matchLabels"], rule
            assert ports and ports <= {8000, 8265, 8080}, rule
    assert any(rule["from"] == [clients] for rule in spec["ingress"])
    for doc in ("docs/security.md", "docs/kubernetes.md"):
        assert "moa-serve/client" in (ROOT / doc).read_text(), f"{doc} names the client label"


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_prometheus_scraping(name, built):
    rs = the_rayservice(built[name])
    for role, group, template in ray_pods(rs):
        port = int(group["rayStartParams"].get("metrics-export-port", 8080))
        ann = template["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == port, role
        assert ann["prometheus.io/path"] == "/metrics"
        assert port_named(ray_container(template), "metrics") == port, role


def test_gpu_prod_podmonitor_selects_every_ray_pod(built):
    objs = built["gpu-prod"]
    [pm] = [o for o in objs if o["kind"] == "PodMonitor"]
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    selector = pm["spec"]["selector"]["matchLabels"]
    for role, _, template in ray_pods(the_rayservice(objs)):
        labels = dict(template["metadata"]["labels"], **{"ray.io/is-ray-node": "yes"})  # KubeRay adds it
        assert selector.items() <= labels.items(), role
        assert port_named(ray_container(template), "metrics")
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["metrics"]
    assert pm["metadata"]["namespace"] == the_rayservice(objs)["metadata"]["namespace"]


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_http_api_service(name, built):
    rs = the_rayservice(built[name])
    svc = rs["spec"]["serveService"]
    assert svc["metadata"]["name"] == "moa-serve-http"
    assert svc["spec"]["type"] == "ClusterIP"
    assert "selector" not in svc["spec"], "KubeRay sets the selector (active cluster)"
