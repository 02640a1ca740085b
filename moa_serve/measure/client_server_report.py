"""The report of ``moa cs-bench``: per profile and method the speed, server calls and bytes per token,
per method what the offline continuation kept of the target's, the issue's targets checked on them;
written as ``results.json`` and ``results.md``."""

from __future__ import annotations

import json
from pathlib import Path

# the method-name prefix of a drafter alone and of its hybrids, and the key of their targets
HYBRID_KEYS = (("", "4g_moa"), ("lookup + ", "4g_lookup_moa"), ("lookup + outputs + ", "4g_outputs_moa"))


def _summ(runs: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in runs)
    elapsed = sum(r["elapsed_s"] for r in runs)
    rounds = sum(r["rounds"] for r in runs)
    verified = sum(r["verified_tokens"] for r in runs)
    calls = sum(r["server_calls"] for r in runs)
    up, down = sum(r["bytes_up"] for r in runs), sum(r["bytes_down"] for r in runs)
    drafted, accepted = sum(r["drafted_tokens"] for r in runs), sum(r["accepted_tokens"] for r in runs)
    same = [r["identical"] for r in runs]
    n = max(1, tokens)
    tau = verified / rounds if rounds else 0.0
    return {
        "prompts": len(runs),
        "tokens": tokens,
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(tokens / elapsed, 3) if elapsed else 0.0,
        "ms_per_token": round(1000 * elapsed / n, 2),
        "server_calls": calls,
        "calls_per_100_tokens": round(100 * calls / n, 2),
        "calls_per_token": round(calls / n, 4),
        "rounds": rounds,
        "mean_accepted_length": round(tau, 4),
        "inverse_tau": round(1 / tau, 4) if tau else None,
        "draft_acceptance": round(accepted / drafted, 4) if drafted else None,
        "lookup_draft_share": round(sum(r.get("lookup_drafted_tokens", 0) for r in runs) / drafted, 4)
        if drafted
        else None,
        "bytes_up": up,
        "bytes_down": down,
        "bytes_up_per_token": round(up / n, 1),
        "bytes_down_per_token": round(down / n, 1),
        "bytes_per_token": round((up + down) / n, 1),
        "identical": sum(same),
        "identical_all": all(same) if same else None,
        "device_draft_s": round(sum(r["device_draft_s"] for r in runs), 3),
    }


def write_report(
    args, methods, profiles, prompts, plain_runs, per_run, cut_runs, partial: bool, packing: dict | None = None
) -> dict:
    ptok = sum(r["tokens"] for r in plain_runs)
    pel = sum(r["elapsed_s"] for r in plain_runs)
    table = []
    for prof in profiles:
        for m in methods:
            rows = [r for r in per_run if r["profile"] == prof and r["method"] == m.name]
            if rows:
                table.append({"profile": prof, "method": m.name, "kind": m.kind, **_summ(rows)})
    disc = []
    for m in methods:
        ran = [r for r in cut_runs if r["method"] == m.name]
        # a target that stopped before the cut leaves nothing to continue: not counted
        rows = [r for r in ran if r["cut"] and r["target_continuation_tokens"] > 0]
        if not rows:
            continue
        maths = [r for r in rows if "answer" in r]
        disc.append(
            {
                "method": m.name,
                "prompts": len(rows),
                "not_cut": len(ran) - len(rows),
                "cut": len(rows),
                "verified_before_cut": round(sum(r["verified_tokens"] for r in rows) / len(rows), 2),
                "offline_tokens": round(sum(r["offline_tokens"] for r in rows) / len(rows), 2),
                "mean_tokens_until_divergence": round(sum(r["tokens_until_divergence"] for r in rows) / len(rows), 2),
                "tokens_until_divergence": [r["tokens_until_divergence"] for r in rows],
                "full_match": sum(r["full_match"] for r in rows),
                "verified_identical": all(r["verified_identical"] for r in rows),
                "math_prompts": len(maths),
                "math_answer_matches_target": sum(r["answer_matches_target"] for r in maths),
                "math_answer_matches_reference": sum(r["answer_matches_reference"] for r in maths),
            }
        )
    targets = _targets(table, disc)
    result = {
        "partial": partial,
        "target": args.target,
        "dtype": args.dtype,
        "drafters": args.drafter,
        "profiles": profiles,
        "max_new_tokens": args.max_new_tokens,
        "num_speculative_tokens": args.num_speculative_tokens,
        "adaptive_k": not args.fixed_k,
        "feature_codec": args.feature_codec,
        "device_slowdown": args.device_slowdown,
        "threads": args.threads,
        "prompt_format": args.prompt_format,
        "branching": getattr(args, "branching", "chain"),
        "server_packed_layers": (packing or {}).get("packed", 0),
        "server_matmul_precision": (packing or {}).get("matmul_precision", "highest"),
        "prompts": [
            {
                "question_id": p["question_id"],
                "category": p["category"],
                "prompt_tokens": len(p["ids"]),
                "target_tokens": len(p.get("target_ids", [])),
            }
            for p in prompts
        ],
        "plain_target": {
            "tokens": ptok,
            "elapsed_s": round(pel, 3),
            "tokens_per_s": round(ptok / pel, 3) if pel else 0.0,
        },
        "cut_profile": args.cut_profile,
        "cut_after_tokens": args.cut_after_tokens,
        "offline_chunk": args.offline_chunk,
        "runs": table,
        "disconnection": disc,
        "targets": targets,
        "per_run": per_run,
        "per_cut_run": cut_runs,
    }
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (out / "results.md").write_text(markdown(result), encoding="utf-8")
    return result


def _targets(table: list[dict], disc: list[dict]) -> dict:
    """The issue's targets, checked on what was measured (None: not measurable in this run)."""

    def get(prof, kind_name):
        return next((r for r in table if r["profile"] == prof and r["method"] == kind_name), None)

    out: dict = {}
    api = get("4g", "API-only")
    # tree variants ("MoA, tree 4-2") are compared with API-only and with EAGLE-style of the same shape
    suffixes = [""] + sorted({r["method"].partition(", tree ")[2] for r in table if ", tree " in r["method"]})
    for tree in suffixes:
        for prefix, key in HYBRID_KEYS:  # the drafters alone, and hybrids
            sfx, ksfx = (f", tree {tree}", f"_tree{tree}") if tree else ("", "")
            moa, eagle = get("4g", f"{prefix}MoA{sfx}"), get("4g", f"{prefix}EAGLE-style{sfx}")
            if moa and api and api["tokens_per_s"]:
                r = moa["tokens_per_s"] / api["tokens_per_s"]
                out[f"{key}{ksfx}_vs_api_only"] = {"ratio": round(r, 3), "target": 1.5, "met": r >= 1.5}
            if moa and eagle and eagle["tokens_per_s"]:
                r = moa["tokens_per_s"] / eagle["tokens_per_s"]
                out[f"{key}{ksfx}_vs_{key[3:].removesuffix('moa')}eagle"] = {
                    "ratio": round(r, 3),
                    "target": 1.2,
                    "met": r >= 1.2,
                }
    out["calls_per_token_le_inverse_tau"] = {
        f"{r['profile']}/{r['method']}": {
            "calls_per_token": r["calls_per_token"],
            "inverse_tau": r["inverse_tau"],
            "met": r["inverse_tau"] is not None and r["calls_per_token"] <= r["inverse_tau"] + 1e-9,
        }
        for r in table
    }
    out["bytes_per_token_le_2KiB"] = {
        f"{r['profile']}/{r['method']}": {"bytes_per_token": r["bytes_per_token"], "met": r["bytes_per_token"] <= 2048}
        for r in table
    }
    d = {x["method"]: x["mean_tokens_until_divergence"] for x in disc}
    for prefix, key in ((p, k.replace("4g_", "disconnection_") + "_longest") for p, k in HYBRID_KEYS):
        others = [f"{prefix}{o}" for o in ("EAGLE-style", "independent") if f"{prefix}{o}" in d]
        if f"{prefix}MoA" in d and others:  # (with nothing to compare against, nothing is claimed)
            out[key] = {"mean_tokens_until_divergence": d, "met": all(d[f"{prefix}MoA"] > d[o] for o in others)}
    return out


def markdown(result: dict) -> str:
    lines = [
        f"# moa cs-bench — {result['target']} ({result['dtype']}), {len(result['prompts'])} prompts, "
        f"≤ {result['max_new_tokens']} new tokens, greedy" + (" (partial)" if result["partial"] else ""),
        "",
        f"K ≤ {result['num_speculative_tokens']} ({'adaptive' if result['adaptive_k'] else 'fixed'}), "
        f"features {result['feature_codec']}, device slowdown {result['device_slowdown']:g}× "
        f"(server/device compute ratio), plain target decoding in-process: "
        f"{result['plain_target']['tokens_per_s']:.2f} tok/s"
        + (
            f" (packed kernels, {result['server_packed_layers']} layers, matmul precision "
            f"{result.get('server_matmul_precision', 'highest')})"
            if result.get("server_packed_layers")
            else ""
        )
        + ".",
        "",
        "| profile | method | tok/s | ms/token | calls/100 tok | B up/tok | B down/tok | τ | identical to target |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in result["runs"]:
        lines.append(
            f"| {r['profile']} | {r['method']} | {r['tokens_per_s']:.2f} | {r['ms_per_token']:.1f} | "
            f"{r['calls_per_100_tokens']:.1f} | {r['bytes_up_per_token']:.0f} | "
            f"{r['bytes_down_per_token']:.0f} | {r['mean_accepted_length']:.2f} | "
            f"{r['identical']}/{r['prompts']} |"
        )
    if result["disconnection"]:
        lines += [
            "",
            f"Disconnection over {result['cut_profile']}: link cut (reset) after "
            f"{result['cut_after_tokens']} verified tokens, `--offline degrade`, "
            f"{result.get('offline_chunk', 4)} drafts per offline drafter call"
            + (
                f"; {result['disconnection'][0]['not_cut']} prompt(s) left out: the target stopped before the cut"
                if result["disconnection"][0].get("not_cut")
                else ""
            )
            + ".",
            "",
            "| method | verified before cut | offline tokens | tokens until divergence (mean) | per prompt | "
            "whole continuation matched | math answers = target's | math answers = reference |",
            "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
        ]
        for d in result["disconnection"]:
            mp = d["math_prompts"]
            lines.append(
                f"| {d['method']} | {d['verified_before_cut']:.1f} | {d['offline_tokens']:.1f} | "
                f"{d['mean_tokens_until_divergence']:.2f} | {d['tokens_until_divergence']} | "
                f"{d['full_match']}/{d['prompts']} | "
                + (
                    f"{d['math_answer_matches_target']}/{mp} | {d['math_answer_matches_reference']}/{mp} |"
                    if mp
                    else "no math prompt | no math prompt |"
                )
            )
    t = result["targets"]
    if t:
        lines += ["", "Targets:"]
        for key, v in t.items():  # the speed ratios, as _targets put them
            if "ratio" in v:
                lines.append(
                    f"- {key}: {v['ratio']:.2f}× (target ≥ {v['target']}×) — {'met' if v['met'] else 'NOT met'}"
                )
        c = t["calls_per_token_le_inverse_tau"]
        lines.append(f"- server calls per token ≤ 1/τ: {sum(v['met'] for v in c.values())}/{len(c)} rows")
        b = t["bytes_per_token_le_2KiB"]
        lines.append(f"- ≤ 2 KiB per token: {sum(v['met'] for v in b.values())}/{len(b)} rows")
        for key, who in ((k.replace("4g_", "disconnection_") + "_longest", p + "MoA") for p, k in HYBRID_KEYS):
            if key in t:
                lines.append(
                    f"- on disconnection {who} matches the target longest: {'met' if t[key]['met'] else 'NOT met'}"
                )
    return "\n".join(lines) + "\n"
