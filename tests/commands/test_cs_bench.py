"""``moa cs-bench`` end to end on stories260k: one prompt, the local profile, an (untrained) MoA
drafter and API-only, the disconnection run; the report's fields and the identity flag."""

import json

import pytest

from moa_serve.cli import main
from moa_serve.measure.client_server_run import final_number


def test_final_number():
    assert final_number("so 17 x $18 = $306.") == "306"
    assert final_number("total 1,000.50 dollars") == "1000.5"
    assert final_number("#### 3\nand then 7") == "3"
    assert final_number("no digits") is None
    assert final_number("x = -0.50") == "-0.5" and final_number("3.0 apples") == "3"
    assert final_number("9" * 30) == "9" * 30  # digits kept as written, no float rounding


def test_cs_bench_local_one_prompt(tmp_path, stories_path, stories_drafter):
    q = tmp_path / "q.jsonl"
    q.write_text(
        json.dumps(
            {
                "question_id": 1,
                "category": "math_reasoning",
                "turns": ["Once upon a time there was a little girl"],
                "reference": ["#### 3"],
            }
        )
        + "\n"
    )
    out = tmp_path / "out"
    rc = main(
        [
            "cs-bench",
            "--target",
            str(stories_path),
            "--drafter",
            f"{stories_drafter},hybrid:{stories_drafter}",
            "--profiles",
            "local",
            "--questions",
            str(q),
            "--categories",
            "",
            "--prompt-format",
            "plain",
            "--max-new-tokens",
            "40",
            "--cut-profile",
            "local",
            "--cut-after-tokens",
            "4",
            "--max-model-len",
            "256",
            "-k",
            "4",
            "--branching",
            "chain,3-2",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert (out / "results.md").read_text().startswith("# moa cs-bench")
    assert res["partial"] is False and res["profiles"] == ["local"] and len(res["prompts"]) == 1
    runs = {r["method"]: r for r in res["runs"]}
    assert set(runs) == {"MoA", "lookup + MoA", "MoA, tree 3-2", "lookup + MoA, tree 3-2", "API-only"}
    assert res["branching"] == "chain,3-2"
    for r in runs.values():
        for f in (
            "tokens_per_s",
            "ms_per_token",
            "calls_per_100_tokens",
            "bytes_up_per_token",
            "bytes_down_per_token",
            "mean_accepted_length",
            "identical_all",
        ):
            assert f in r
        assert r["profile"] == "local" and r["tokens"] > 0 and r["tokens_per_s"] > 0
        assert r["identical_all"] is True and r["identical"] == 1  # greedy, float32: plain target decoding
        assert r["server_calls"] == r["rounds"] and r["calls_per_token"] <= r["inverse_tau"] + 1e-9
    assert runs["MoA"]["lookup_draft_share"] == 0 and runs["lookup + MoA"]["lookup_draft_share"] > 0
    api = runs["API-only"]
    assert api["mean_accepted_length"] == 1.0 and api["draft_acceptance"] is None
    assert runs["MoA"]["bytes_down_per_token"] > api["bytes_down_per_token"]  # features travel down
    disc = {d["method"]: d for d in res["disconnection"]}
    assert set(disc) == set(runs)
    assert all(d["cut"] == 1 and d["verified_identical"] for d in disc.values())
    assert disc["API-only"]["offline_tokens"] == 0 and disc["API-only"]["mean_tokens_until_divergence"] == 0
    assert disc["MoA"]["offline_tokens"] > 0 and disc["MoA"]["math_prompts"] == 1
    cut = [r for r in res["per_cut_run"] if r["method"] == "MoA"][0]
    assert cut["verified_tokens"] >= 4 and cut["finish_reason"] == "offline"
    assert {"answer", "target_answer", "reference_answer", "answer_matches_target"} <= set(cut)
    assert "targets" in res and "calls_per_token_le_inverse_tau" in res["targets"]


def test_disconnection_target_needs_something_to_compare_against():
    from moa_serve.measure.client_server_report import _targets

    moa = {"method": "MoA", "mean_tokens_until_divergence": 1.0}
    assert "disconnection_moa_longest" not in _targets([], [moa])  # nothing to be longer than
    eagle = {"method": "EAGLE-style", "mean_tokens_until_divergence": 2.0}
    assert _targets([], [moa, eagle])["disconnection_moa_longest"]["met"] is False


def test_targets_are_checked_for_each_hybrid_of_moa():
    """The drafters alone, with prompt lookup, and with the output store too: each MoA variant is
    compared with API-only and with the EAGLE-style client of the same variant."""
    from moa_serve.measure.client_server_report import _targets

    def row(method, tps):
        return {
            "profile": "4g",
            "method": method,
            "tokens_per_s": tps,
            "calls_per_token": 0.5,
            "inverse_tau": 0.5,
            "bytes_per_token": 900,
        }

    table = [
        row("API-only", 10.0),
        row("lookup + outputs + MoA", 16.0),
        row("lookup + outputs + EAGLE-style", 12.0),
        row("lookup + MoA", 14.0),
    ]
    t = _targets(
        table,
        [
            {"method": "lookup + outputs + MoA", "mean_tokens_until_divergence": 3.0},
            {"method": "lookup + outputs + EAGLE-style", "mean_tokens_until_divergence": 2.0},
        ],
    )
    assert t["4g_outputs_moa_vs_api_only"] == {"ratio": 1.6, "target": 1.5, "met": True}
    assert t["4g_outputs_moa_vs_outputs_eagle"]["ratio"] == pytest.approx(1.333, abs=1e-3)
    assert t["4g_lookup_moa_vs_api_only"]["met"] is False and "4g_lookup_moa_vs_lookup_eagle" not in t
    assert t["disconnection_outputs_moa_longest"]["met"] is True
