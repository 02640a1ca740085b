"""The GPU check's ``results.md``: its results as tables."""

from __future__ import annotations


def _table(rows: list[dict], cols: list[str]) -> str:
    if not rows:
        return "(none)\n"
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append(
            "| "
            + " | ".join(
                _cell(r.get(c, r.get("skipped", "")) if c in r or "skipped" not in r else r["skipped"]) for c in cols
            )
            + " |"
        )
    return "\n".join(out) + "\n"


def _cell(v) -> str:
    if isinstance(v, dict):
        return str(v.get("ms", v))
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


# the correctness section's comparisons, each over 1 and over 16 sessions
CORRECTNESS_CHECKS = (
    "plain_1_vs_plain_16",
    "moa_1_vs_plain_1",
    "moa_16_vs_plain_16",
    "replay_1_vs_plain_1",
    "replay_16_vs_plain_16",
)


def markdown(results: dict) -> str:
    s = results["sections"]
    lines = ["# MoA-Serve GPU check", ""]
    env = s.get("env", {})
    lines.append(
        "Device: "
        + ", ".join(f"{k} {env[k]}" for k in ("gpu", "device", "torch", "cuda", "transformers") if env.get(k))
        + f"; toy: {env.get('toy')}; elapsed {results['meta'].get('elapsed_s')} s"
    )
    lines.append("")
    for name, part in (
        ("correctness", _correctness),
        ("invariance", _invariance),
        ("production", _production),
        ("fit", _fit),
        ("e2e", _e2e),
        ("attention", _attention),
    ):
        section = s.get(name, {})
        if section:
            lines += part(section)
    errs = {k: v["error"] for k, v in s.items() if isinstance(v, dict) and "error" in v}
    for k, v in errs.items():
        lines.append(f"**{k} failed**: `{v.splitlines()[-1] if v else v}`\n")
    return "\n".join(lines)


def _correctness(c: dict) -> list[str]:
    lines = ["## Correctness: greedy speculative vs plain decoding (stories260k)", ""]
    rows = []
    for dt, v in c.items():
        if not isinstance(v, dict):
            continue
        if "skipped" in v:
            rows.append({"dtype": dt, "check": v["skipped"]})
            continue
        for key in CORRECTNESS_CHECKS:
            r = v[key]
            rows.append(
                {
                    "dtype": dt,
                    "check": key,
                    "identical": f"{r['identical']}/{r['sessions']}",
                    "first divergence": r["first_divergence"],
                }
            )
    lines.append(_table(rows, ["dtype", "check", "identical", "first divergence"]))
    return lines


def _invariance(inv: dict) -> list[str]:
    lines = []
    for name, v in inv.items():
        if not isinstance(v, dict) or "rows" not in v:
            continue
        lines += [f"## Batch invariance ({name}, {v['dtype']}): row results alone vs in a batch of {v['batch']}", ""]
        rows = []
        for op, r in v.items():
            if isinstance(r, dict):
                rows.append(
                    {
                        "op": op,
                        **{
                            f"{m} rows": ("bitwise" if x["bitwise"] else f"diff {x['max_abs_diff']:.3g}")
                            for m, x in r.items()
                        },
                    }
                )
        lines.append(_table(rows, ["op"] + [f"{m} rows" for m in v["rows"]]))
        lines.append(f"Not batch-invariant: {', '.join(v['not_batch_invariant']) or 'none'}\n")
    return lines


def _production(p: dict) -> list[str]:
    lines = ["## Production shape: verify latency (ms, one call, MoA features included)", ""]
    lines.append(
        _table(
            p.get("verify", []),
            ["B", "K+1", "ms", "forward_only", "device_busy_ms", "host_overhead_ms", "tokens_per_s_verified"],
        )
    )
    lines += ["## What batch invariance costs: one forward, ms (served: graphs + Triton matmuls and attention)", ""]
    lines.append(
        _table(
            p.get("invariance_cost", []),
            ["B", "T", "served_ms", "graph_cublas_ms", "eager_cublas_sdpa_ms", "invariance_cost", "vs_eager"],
        )
    )
    if "invariance_cost_skipped" in p:
        lines.append(f"Not measured: {p['invariance_cost_skipped']}\n")
    lines.append(f"Runner statistics: {p.get('runner_stats', {})}\n")
    lines += ["## Drafting latency per K (paper-sized MoA draft head)", ""]
    lines.append(_table(p.get("draft", []), ["B", "K", "ms", "ms_per_step", "device_busy_ms", "host_overhead_ms"]))
    lines.append(f"Static draft steps (CUDA graphs): {p.get('draft_static_steps')}\n")
    lines += ["## One engine round (draft + verify + commit), K = 4", ""]
    lines.append(_table(p.get("round", []), ["B", "ms", "draft_ms", "verify_ms", "device_busy_ms", "host_overhead_ms"]))
    if p.get("round_profile"):
        rp = p["round_profile"]
        lines += [f"Host functions of a round at B = {rp['B']} by own time (cProfile, ms per round):", ""]
        lines.append(_table(rp["top"], ["function", "calls", "own_ms", "cumulative_ms"]))
    return lines


def _fit(f: dict) -> list[str]:
    lines = ["## Memory: deployments/fit.py for gpu.yaml vs measured", ""]
    for r in f.get("fit_py", []):
        lines.append(f"- fit.py {r['describe']}")
    if "fit_py_error" in f:
        lines.append(f"- fit.py not run: {f['fit_py_error']}")
    for key in ("measured_verifier", "measured_drafter"):
        if key in f:
            lines.append(f"- {key}: " + ", ".join(f"{k} {v}" for k, v in f[key].items()))
    if isinstance(f.get("measured"), str):
        lines.append(f"- measured: {f['measured']}")
    lines.append("")
    return lines


def _e2e(e: dict) -> list[str]:
    lines = [
        f"## End to end: engine at controlled acceptance vs no speculation "
        f"({e.get('new_tokens')} new tokens, {e.get('prompt_tokens')}-token prompts)",
        "",
    ]
    lines.append(
        _table(
            e.get("rows", []),
            [
                "B",
                "K",
                "tau_target",
                "tau",
                "tokens_per_s",
                "speedup",
                "anchor_tokens_per_s",
                "vs_anchor",
                "est_moa_tok_s",
                "est_moa_speedup",
                "identical_to_plain",
            ],
        )
    )
    lines.append(e.get("note", "") + "\n")
    return lines


def _attention(a: dict) -> list[str]:
    lines = ["## Attention kernels: per token vs chunked (GPU us, B sessions x 1 token, 8,192-position cache)", ""]
    cols = ["B", "context", "per_token_us", "chunked_us", "chunked_speedup", "chunked_row_alone_bitwise"]
    lines.append(_table(a.get("rows", []), cols + ["max_abs_diff"]))
    if "skipped" in a:
        lines.append(f"Not measured: {a['skipped']}\n")
    if "running" in a:
        lines.append(f"The run ended inside `{a['running']}` (a kernel fault ends the process).\n")
    return lines
