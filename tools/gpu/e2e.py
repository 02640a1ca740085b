"""The GPU check's ``e2e`` section: the in-process engine with a replaying proposer at controlled
acceptance against the same engine without speculation, and plain decoding beside the anchor."""

from __future__ import annotations

import random
import time

import torch

from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.verifier.torch.runner import RunnerOptions, TorchTargetRunner
from tools.gpu.anchor import anchor_row
from tools.gpu.harness import (
    Run,
    compare,
    free,
    sync,
)
from tools.gpu.replay import ReplayProposer, corruption_for


def e2e_section(run: Run, models: dict, dtype: torch.dtype) -> None:
    """The engine with a replaying proposer at controlled acceptance against plain decoding."""
    sec = run.section("e2e")
    d, sz = run.device, run.sizes
    target = models["target"]
    vocab = target.arch.vocab_size
    n_new, plen = sz["e2e_new"], sz["e2e_prompt"]
    bmax = max(sz["e2e_b"])
    runner = TorchTargetRunner(
        target,
        dtype,
        str(d),
        max_sessions=bmax,
        max_model_len=plen + n_new + 16,
        options=RunnerOptions(max_num_batched_tokens=8192, prefix_caching=False),
    )
    g = random.Random(2)
    prompts_all = [[g.randrange(vocab) for _ in range(plen)] for _ in range(bmax)]
    draft_ms = {
        (r["B"], r["K"]): r["ms"] for r in run.results["sections"].get("production", {}).get("draft", []) if "ms" in r
    }
    sec["rows"] = []
    sec["new_tokens"], sec["prompt_tokens"] = n_new, plen
    sec["note"] = (
        "the replaying proposer drafts for free; est_moa_tok_s adds the measured MoA drafting "
        "latency (production section) per round"
    )
    plain = SpeculativeEngine(runner, None, None, frozenset(), max_batch=bmax)
    plain.generate(prompts_all[:1], 4, ignore_eos=True)  # warm-up
    for b in sz["e2e_b"]:
        if run.left() < 15:
            sec["rows"].append({"B": b, "skipped": "out of time"})
            continue
        prompts = prompts_all[:b]
        plain.max_batch = b
        sync(d)
        t = time.perf_counter()
        base = plain.generate(prompts, n_new, ignore_eos=True)
        sync(d)
        base_s = time.perf_counter() - t
        refs = [o.token_ids for o in base]
        base_tps = b * n_new / base_s
        row = {
            "B": b,
            "K": 0,
            "tau_target": None,
            "tokens_per_s": round(base_tps, 1),
            "s": round(base_s, 3),
            "speedup": 1.0,
        }
        sec["rows"].append(row)
        # the graphed plain-PyTorch step over the same weights, at the generation's mean context
        anchor = anchor_row(target, b, plen + n_new // 2, reps=sz["reps"] * 4)
        row.update(anchor_tokens_per_s=anchor["tokens_per_s"], vs_anchor=round(base_tps / anchor["tokens_per_s"], 3))
        sec.setdefault("anchor", []).append(anchor)
        run.save()
        diverged: dict[int, list[int]] = {}  # session -> a speculative output that is not the plain one
        for tau in sz["e2e_tau"]:
            for k in sz["e2e_k"]:
                p = corruption_for(tau, k)
                if p is None:
                    continue
                row = {"B": b, "K": k, "tau_target": tau, "corruption": round(p, 4)}
                sec["rows"].append(row)
                if run.left() < 5:
                    row["skipped"] = "out of time"
                    continue
                proposer = ReplayProposer(prompts, refs, p, vocab, seed=int(tau * 10) + k)
                engine = SpeculativeEngine(runner, proposer, None, frozenset(), max_batch=b)
                sync(d)
                t = time.perf_counter()
                outs = engine.generate(prompts, n_new, num_speculative_tokens=k, ignore_eos=True)
                sync(d)
                s = time.perf_counter() - t
                tps = b * n_new / s
                row.update(
                    tau=round(sum(o.mean_accepted_length for o in outs) / b, 3),
                    rounds=engine.last_stats.rounds,
                    tokens_per_s=round(tps, 1),
                    s=round(s, 3),
                    speedup=round(tps / base_tps, 3),
                    identical_to_plain=compare([o.token_ids for o in outs], refs)["identical"],
                )
                for i, o in enumerate(outs):
                    if o.token_ids != refs[i]:
                        diverged.setdefault(i, o.token_ids)
                dm = draft_ms.get((b, k))
                if dm is not None:
                    est = s + engine.last_stats.rounds * dm / 1e3
                    row["est_moa_tok_s"] = round(b * n_new / est, 1)
                    row["est_moa_speedup"] = round(b * n_new / est / base_tps, 3)
                run.save()
        if diverged:  # which side is off: each diverging session decoded alone, plainly
            for i in sorted(diverged)[:4]:
                alone = plain.generate([prompts[i]], n_new, ignore_eos=True)[0].token_ids
                sec.setdefault("divergence", []).append(
                    {
                        "B": b,
                        "session": i,
                        "plain_batch_vs_alone": compare([refs[i]], [alone])["first_divergence"],
                        "speculative_vs_alone": compare([diverged[i]], [alone])["first_divergence"],
                    }
                )
            run.save()
    sec["status"] = "done"
    del runner
    free(d)
