"""tools/gpu/served_check.py without Ray: the config it serves (gpu-1x.yaml, moved to a CPU or to a
synthetic target) validates, and Ray's share of a round comes out of two /v1/stats snapshots."""

import argparse

import yaml

from moa_serve.deployments.config import AppConfig
from tools.gpu import served_check


def args_for(device: str) -> argparse.Namespace:
    return argparse.Namespace(device=device, plan=dict(served_check.PLANS[device]))


def test_the_derived_configs_validate(tmp_path):
    cpu = served_check.derived_config(args_for("cpu"), "stories260k", None, "auto", 64, tmp_path / "cpu.yaml")
    a = yaml.safe_load(cpu.read_text())["applications"][0]["args"]
    cfg = AppConfig.model_validate(a)
    assert cfg.device == "cpu" and all(p.ray_actor_options.num_gpus == 0 for p in cfg.pools().values())
    gpu = served_check.derived_config(args_for("cuda"), "llama-3-8b-shape", None, "dummy", 32, tmp_path / "gpu.yaml")
    cfg = AppConfig.model_validate(yaml.safe_load(gpu.read_text())["applications"][0]["args"])
    assert (cfg.load_format, cfg.drafter, cfg.device) == ("dummy", None, "cuda")
    assert cfg.router.session_groups * cfg.router.max_sessions_per_round == 32
    assert cfg.verifier_pool.ray_actor_options.num_gpus == 0.75  # the one-GPU config's share


def test_ray_overhead_per_round_from_two_snapshots():
    before = {
        "rounds": 10,
        "round_s": 0.1,
        "sessions_in_rounds": 10,
        "round_time_ms": {"verify_calls": 10, "verify_call_ms": 8.0, "verify_compute_ms": 6.0},
    }
    after = {
        "rounds": 30,
        "round_s": 0.5,
        "sessions_in_rounds": 90,
        "round_time_ms": {"verify_calls": 30, "verify_call_ms": 10.0, "verify_compute_ms": 7.0},
    }
    o = served_check.overhead(before, after)
    # 20 calls: 300 - 80 = 220 ms of calls, 210 - 60 = 150 ms of compute; 400 ms of rounds
    assert o["verify_calls"] == 20 and o["verify_call_ms"] == 11.0 and o["verify_compute_ms"] == 7.5
    assert o["verify_overhead_ms"] == 3.5
    assert o["round_ms"] == 20.0 and o["ray_overhead_ms_per_round"] == 12.5 and o["sessions_per_round"] == 4.0
    assert served_check.overhead(after, after) == {"verify_calls": 0, "draft_calls": 0, "rounds": 0}
