"""``moa config check``: what build_app checks of a serve config, printed without Ray (fast: no
cluster, no weights; the SmolLM2 configs read ../shared/models, gpu.yaml a Llama-3-8B config.json)."""

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from moa_serve.cli import main
from moa_serve.deployments import config_check, fit
from moa_serve.deployments.config_check import applications
from tests.deployments.test_config_validation import LLAMA3_8B

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "deployments" / "configs"
LOCAL = ["local-cpu.yaml", "local-cpu-2x.yaml", "local-cpu-vllm.yaml"]


@pytest.fixture
def llama3_models(tmp_path, monkeypatch):
    d = tmp_path / "models" / "Meta-Llama-3-8B-Instruct"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(LLAMA3_8B))
    monkeypatch.setenv("MOA_MODEL_DIR", str(d.parent))


def check(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["config", "check", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("name", LOCAL)
def test_the_local_configs_pass_on_a_2_core_machine(capsys, name):  # MOA_MODEL_DIR: ../shared/models (conftest)
    rc, out, err = check(capsys, str(CONFIGS / name), "--node", "2")
    assert rc == 0, err
    assert "ok: build_app would accept this application" in out
    assert re.search(r"verifier_pool: weights [\d.]+ GiB \+ KV cache [\d.]+ GiB .* <= [\d.]+ GiB", out)
    assert "against the nodes: 2 CPU / 0 GPU" in out and ("VerifierPool" in out or "VllmVerifier" in out)
    assert "sessions at most" in out
    if name == "local-cpu.yaml":  # the Router in the Gateway, prompt lookup: no drafter pool
        assert "gateway (router.in_gateway) max_replicas 1: 64 sessions at most" in out
        assert "all 64 <= 128 x max_replicas 1 = 128" in out and "drafter_pool" not in out
        assert "dtype auto counted as float32" in out
    if name == "local-cpu-2x.yaml":  # two groups of 32 over two replicas of each pool
        assert "drafter_pool: a group's 32 <= max_sessions 32 of one replica; all 64 <= 32 x max_replicas 2 = 64" in out
        assert "at start: 2 CPU, 0 GPU" in out


@pytest.mark.parametrize("name,kv", [("gpu.yaml", "48.01"), ("gpu-vllm.yaml", "48.00")])
def test_gpu_yaml_passes_on_the_nodes_its_comment_names(capsys, llama3_models, name, kv):
    text = (CONFIGS / name).read_text()
    comment = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    command = re.search(r"`moa (config check [^`]+)`", comment)
    assert command, "gpu.yaml's comments say how to check it"
    argv = shlex.split(command.group(1))[2:]
    rc, out, err = check(capsys, *[str(REPO / a) if a.endswith(".yaml") else a for a in argv])
    assert rc == 0, err
    assert f"verifier_pool: weights 14.96 GiB + KV cache {kv} GiB" in out and "<= 72.00 GiB" in out
    assert "drafter_pool:" in out and "<= 18.00 GiB" in out
    assert "at start: 18 CPU, 1.25 GPU" in out
    # on one machine without those GPUs the replicas cannot be placed: build_app would refuse
    rc, _, err = check(capsys, str(CONFIGS / name), "--node", "16")
    assert rc == 1 and "placement: the replicas at start reserve 1.25 GPUs" in err and "the cluster has 0" in err
    # unless an autoscaler adds nodes (KubeRay): then they wait
    rc, out, _ = check(capsys, str(CONFIGS / name), "--node", "16", "--cluster-may-grow")
    assert rc == 0 and "until the cluster adds nodes" in out


def test_the_kuberay_manifest_holds_gpu_yaml():
    ((_, manifest),) = applications(REPO / "k8s" / "base" / "rayservice.yaml")
    assert manifest == yaml.safe_load((CONFIGS / "gpu.yaml").read_text())["applications"][0]["args"]


def test_a_config_that_does_not_fit_its_memory_exits_1_with_the_numbers(capsys, tmp_path):
    cfg = yaml.safe_load((CONFIGS / "local-cpu.yaml").read_text())
    args = cfg["applications"][0]["args"]
    args["verifier_pool"]["max_sessions"] = 4096  # 4,096 full contexts of 2,049 positions in bf16
    args["verifier_pool"]["ray_actor_options"]["memory"] = 8 * 2**30
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc, out, err = check(capsys, str(path))
    assert rc == 1 and "ok:" not in out
    assert "do not fit its memory" in err
    assert re.search(
        r"verifier_pool: weights 0.50 GiB \+ KV cache 180.\d\d GiB .* > 7.20 GiB \(0.9 x ray_actor_options.memory\)",
        err,
    )
    assert "lower max_sessions or max_model_len" in err


def test_an_invalid_config_names_the_field(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"target": "smollm2-135m-instruct", "verifier_pool": {"max_sessions": 0}}))
    rc, _, err = check(capsys, str(path))
    assert rc == 1 and "verifier_pool.max_sessions: Input should be greater than or equal to 1" in err
    # sessions the pools cannot hold: the model validator's message, with its numbers
    path.write_text(yaml.safe_dump({"target": "smollm2-135m-instruct", "router": {"max_sessions_per_round": 32}}))
    rc, _, err = check(capsys, str(path))
    assert rc == 1 and "router.max_sessions_per_round (32) > verifier_pool.max_sessions (16)" in err


def test_an_unreadable_file_or_one_without_an_application_exits_2(capsys, tmp_path):
    rc, _, err = check(capsys, str(tmp_path / "missing.yaml"))
    assert rc == 2 and "missing.yaml" in err
    path = tmp_path / "other.yaml"
    path.write_text(yaml.safe_dump({"applications": [{"name": "x", "import_path": "other:app", "args": {}}]}))
    rc, _, err = check(capsys, str(path))
    assert rc == 2 and "no application built by moa_serve.deployments.app:build_app" in err


def test_replicas_that_fit_one_by_one_but_not_together_on_this_host_are_a_warning(capsys, monkeypatch):
    monkeypatch.setattr(fit, "host_memory", lambda: 7 * 2**30)  # each replica fits 0.9 x 7 GiB; all four do not
    rc, out, _ = check(capsys, str(CONFIGS / "local-cpu-2x.yaml"), "--node", "2")
    assert rc == 0 and "<= 6.30 GiB (0.9 x host RAM)" in out
    assert re.search(r"warning: all pool replicas together need 7.\d GiB, more than this host's 7.0 GiB", out)


def test_without_nodes_it_checks_against_this_machine(capsys, monkeypatch):
    monkeypatch.setattr(config_check, "this_machine", lambda: [{"CPU": 1.0, "GPU": 0.0}])
    rc, out, err = check(capsys, str(CONFIGS / "local-cpu-2x.yaml"))  # four replicas of 0.5 CPU
    assert "against this machine: 1 CPU / 0 GPU" in out
    assert rc == 1 and "placement: the replicas at start reserve 2 CPUs" in err and "but the cluster has 1" in err
