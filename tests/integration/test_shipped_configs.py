"""Every shipped config that runs on one machine starts as a user starts it: ``serve run
deployments/configs/<name>`` as a subprocess (its own Ray on this machine's cores, served on a
loopback port), ready (``/readyz`` 200), then one short greedy generation. Only a start that
hangs fails it (``tests/support/ray_harness.py`` ``READY_TIMEOUT_S``): how long a start takes depends
on the machine and its load (``local-cpu-2x.yaml`` starts four pool replicas on two cores), and the
runner prints it (``serve run: ready after N s``).

``local-cpu.yaml`` is started the same way (``serve run`` through ``moa_serve.loadtest.runner``)
and served under load by ``tests/integration/test_loadtest_cluster.py``; it is not started twice more here, to
keep CI within its time. ``gpu.yaml``, ``gpu-vllm.yaml`` and ``gpu-1x.yaml`` need GPUs (``device: cuda``): their
validation runs here (tests/deployments/test_config_validation.py), ``gpu-1x.yaml`` is started by
``tools/gpu/served_check.sh`` on a GPU (and by the same script at ``device: cpu`` with stories260k,
tools/gpu/README.md#the-served-check; tests/tools/test_served_check.py checks the config it derives).
``local-cpu-vllm.yaml``'s verifier replica
compiles its forward here with torch.compile's tracing but without inductor's code generation
(``VLLM_CPU_CI_ENV``, set by conftest.py): with inductor it is ready in about 140 s on 2 cores
(docs/vllm-backend.md, Limitations)."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import REPO, require_vllm
from tests.support.ray_harness import serve_run

CONFIGS = REPO / "deployments" / "configs"
STARTED_HERE = ["local-cpu-2x.yaml", "local-cpu-vllm.yaml"]
STARTED_BY_THE_LOAD_TEST = ["local-cpu.yaml"]
NEEDS_GPUS = ["gpu.yaml", "gpu-vllm.yaml", "gpu-1x.yaml"]


def test_every_shipped_config_is_started_by_a_test():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(
        STARTED_HERE + STARTED_BY_THE_LOAD_TEST + NEEDS_GPUS
    )
    assert all(
        name in (REPO / "tests" / "integration" / "test_loadtest_cluster.py").read_text()
        for name in STARTED_BY_THE_LOAD_TEST
    )


@pytest.mark.parametrize("name", STARTED_HERE)
def test_a_shipped_config_serves_after_serve_run(name, tmp_path):
    if "vllm" in name:
        require_vllm()
    with serve_run(CONFIGS / name, tmp_path) as url:
        r = httpx.post(
            url + "/v1/generate",
            timeout=60,
            json={
                "messages": [{"role": "user", "content": "What is Ray Serve?"}],
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == len(body["token_ids"]) == 6 and body["text"]
    assert "cannot be placed" not in (tmp_path / "serve.log").read_text(errors="replace")
