"""``moa vllm-bench`` — the vLLM backend under closed-loop load, side by side in one process.

Every configuration is a ``VllmEngine`` on the same target, built once: ``none`` (vLLM without
speculation), ``ngram`` (vLLM's own prompt-lookup proposer), and any drafter spec (a MoA
checkpoint, ``lookup``, …), with the speculation governor and each drafting step's draft length
chosen from measured costs (``<spec>``, as a served config runs it), with the governor and K
drafts in every drafting step (``<spec>@fullk``) or with neither (``<spec>@fixed``: K drafts
every step). For each number of users, each configuration in turn
keeps that many requests in flight for ``--duration`` seconds (a finished request is replaced at
once by the user's next Spec-Bench prompt; the same prompt sequence for every configuration) and
reports tokens/s over the window, per-request latency, and τ (tokens per verify step of a
request). It measures the engine in-process — no HTTP, no Ray — so that the three ways of
running vLLM differ only in how drafts are made.

``--repeats R`` runs every (users, config) cell R times, the configurations in turn within each
repeat, in reverse order every other repeat: a machine that slows or speeds up over minutes (a
shared VM does, by tens of per cent) then weighs on every configuration alike. Each cell is
compared with the reference's cell of the same repeat and users; the table gives the geometric
mean of those ratios and their range.

Writes ``--out`` (JSON) and the same name with ``.md``.
"""

from __future__ import annotations

from moa_serve.cli_args import DEFAULT_TARGET
from moa_serve.commands.bench import printing_command
from moa_serve.measure.questions import DEFAULT_QUESTIONS
from moa_serve.measure.vllm_bench_report import markdown
from moa_serve.measure.vllm_bench_run import MODIFIERS, run_vllm_bench


def register(sub) -> None:
    p = sub.add_parser("vllm-bench", help="the vLLM backend under closed-loop load: none vs n-gram vs drafters")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument(
        "--configs",
        default="vllm,none,ngram,smollm2-135m-instruct-moa,smollm2-135m-instruct-moa@fixed",
        help="comma-separated: vllm (stock vLLM alone), none (this backend, no speculation), ngram, "
        "a drafter spec (governed); modifiers after '@': " + "; ".join(f"@{k}: {v}" for k, v in MODIFIERS.items()),
    )
    p.add_argument("--users", default="1,4,16", help="closed-loop users, comma-separated")
    p.add_argument("--duration", type=float, default=60.0, help="seconds per (users, config) cell")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every cell this many times, the configs in alternating order (drift weighs on all alike)",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="run the configs at once, taking turns one engine step each; tok/s over each engine's own "
        "steps (resolves a per cent or two on a machine whose speed drifts)",
    )
    p.add_argument("--questions", default=DEFAULT_QUESTIONS)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--out", default="vllm-bench.json")
    p.set_defaults(func=printing_command(run_vllm_bench, markdown))
