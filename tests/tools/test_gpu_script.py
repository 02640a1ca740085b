"""The GPU check (tools/gpu) at toy size on CPU: the script runs end to end, writes its files with
every section and table, and greedy speculative decoding equals plain decoding on stories260k."""

import json
import os
from pathlib import Path

import pytest
import torch

from moa_serve.kernels import cpu as cpu_kernels
from moa_serve.model.layers import DecoderLayer, LayerShape, fuse_dense_projections
from moa_serve.protocol import DraftRequest
from tests.support.scripts import run_python
from tools.gpu.replay import ReplayProposer, corruption_for, tau_for
from tools.gpu.report import CORRECTNESS_CHECKS

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory, stories_path):
    out = tmp_path_factory.mktemp("gpu-toy")
    env = dict(os.environ, MOA_MODEL_DIR=str(stories_path.parent))
    proc = run_python(
        [
            str(REPO / "tools" / "gpu" / "bench_gpu.py"),
            "--toy",
            "--device",
            "cpu",
            "--out",
            str(out),
            "--budget-s",
            "120",
        ],
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text())


def test_toy_run_writes_every_section(toy_run):
    out, res = toy_run
    assert res["meta"]["finished"]
    s = res["sections"]
    for name in ("env", "correctness", "production", "fit", "e2e"):
        assert s[name]["status"] == "done", (name, s[name].get("error"))
    assert {(r["B"], r["K+1"]) for r in s["production"]["verify"]} == {(1, 1), (1, 4), (4, 1), (4, 4)}
    assert all("ms" in r and "forward_only" in r for r in s["production"]["verify"])
    assert all("ms_per_step" in r for r in s["production"]["draft"])
    assert all("verify_ms" in r for r in s["production"]["round"])
    assert s["production"]["round_profile"]["top"][0]["own_ms"] > 0  # where a round's host time goes
    fit = {r["pool"]: r for r in s["fit"]["fit_py"]}  # fit.py's arithmetic for gpu.yaml
    assert round(fit["verifier_pool"]["kv_gib"]) == 48 and fit["drafter_pool"]["total_gib"] > 0
    rows = s["e2e"]["rows"]
    assert {r["B"] for r in rows} == {1, 4}
    spec = [r for r in rows if r["K"] > 0]
    assert spec and all(r["identical_to_plain"] == r["B"] and r["speedup"] > 0 for r in spec)
    assert "bitwise" in json.dumps(s["invariance"]["production_shape"])
    md = (out / "results.md").read_text()
    for title in ("Correctness", "Batch invariance", "verify latency", "Drafting latency", "fit.py", "End to end"):
        assert title in md


def test_toy_round_profile_reports_each_part(tmp_path, stories_path):
    env = dict(os.environ, MOA_MODEL_DIR=str(stories_path.parent))
    proc = run_python(
        [
            str(REPO / "tools" / "gpu" / "profile_round.py"),
            "--toy",
            "--out",
            str(tmp_path),
            "--batch-sizes",
            "1,2",
            "--rounds",
            "2",
        ],
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = (tmp_path / "profile_round.txt").read_text()
    for b in (1, 2):
        assert (
            f"engine round, {b} session(s), K = 4:" in text and f"kernels of one engine round, {b} session(s)" in text
        )
    assert "host functions by tottime" in text and "run_round" in text


def test_toy_run_greedy_speculative_equals_plain_on_cpu(toy_run):
    _, res = toy_run
    for dtype in ("float32", "bfloat16"):
        c = res["sections"]["correctness"][dtype]
        for key in CORRECTNESS_CHECKS:
            assert c[key]["all_identical"], (dtype, key, c[key])
    assert res["sections"]["correctness"]["float32"]["moa_16_vs_plain_16"]["sessions"] == 16


def test_corruption_gives_the_asked_tau():
    for tau, k in ((1.5, 2), (2.5, 4), (4.5, 7)):
        p = corruption_for(tau, k)
        assert abs(tau_for(1 - p, k) - tau) < 1e-6
    assert corruption_for(3.5, 2) is None  # beyond K + 1


def test_replay_proposer_replays_and_corrupts():
    prompts, refs = [[1, 2, 3], [4, 5]], [[7, 8, 9, 10], [11, 12, 13]]
    clean = ReplayProposer(prompts, refs, 0.0, 100)
    out = clean.propose([DraftRequest("a", [1, 2, 3, 7], 3), DraftRequest("b", [4, 5], 2)])
    assert out[0].drafts == [8, 9, 10] and out[1].drafts == [11, 12]
    noisy = ReplayProposer(prompts, refs, 1.0, 100)
    assert all(d != r for d, r in zip(noisy.propose([DraftRequest("a", [1, 2, 3], 4)])[0].drafts, refs[0]))


def test_fused_dense_projections_keep_the_layer():
    shape = LayerShape(64, 4, 2, 16, 96)
    torch.manual_seed(0)
    layer = DecoderLayer(shape).eval()
    x = torch.randn(5, 64)
    cos, sin = torch.ones(5, 1, 16), torch.zeros(5, 1, 16)

    def attention(q, k, v):  # a stand-in: every query reads its own value
        return v.repeat_interleave(2, dim=1)

    with torch.no_grad():
        want = layer.forward_packed(x, cos, sin, attention)
        assert fuse_dense_projections([layer]) == 2
        assert fuse_dense_projections([layer]) == 0  # already fused
        got = layer.forward_packed(x, cos, sin, attention)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    qkv = layer.self_attn.qkv.weight
    assert layer.self_attn.k_proj.weight.data_ptr() == qkv[64:].data_ptr()  # views, not copies


def test_cpu_kernels_refuse_device_tensors():
    q = torch.empty(1, 4, 16, device="meta")
    with pytest.raises(ValueError, match="CPU tensors only"):
        cpu_kernels.attention(q, q, q, q, q)
