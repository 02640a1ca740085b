"""``moa bench`` — vanilla vs speculative decoding on Spec-Bench-format questions, in one run.

For every question (turns run one after another, each method continuing its own conversation)
the target alone and each drafter generate with the same settings, interleaved question by
question so that load on the machine hits all methods alike. Reported per category and overall:
τ (mean tokens committed per verify round, the target's bonus token included), tokens/s,
speed-up over vanilla, and the fraction of greedy turns whose tokens equal vanilla's (judge it in
float32: bf16 batched/unbatched numerics may flip near-tied logits).

Writes ``--out`` (JSON), the same name with ``.md`` (table) and ``.png`` (bar chart).
"""

from __future__ import annotations

from moa_serve.cli_args import DEFAULT_DRAFTER, add_load_format_arg, add_model_args
from moa_serve.measure.questions import DEFAULT_QUESTIONS
from moa_serve.measure.spec_bench_report import markdown
from moa_serve.measure.spec_bench_run import run_bench


def printing_command(run, table):
    """A benchmark's subcommand: runs it, prints its Markdown table and where the results went."""

    def cmd(args) -> int:
        print(table(run(args)))
        print(f"wrote {args.out}")
        return 0

    return cmd


cmd_bench = printing_command(run_bench, markdown)


def register(sub) -> None:
    p = sub.add_parser("bench", help="Spec-Bench: vanilla vs speculative decoding (τ, tokens/s, speed-up, identity)")
    # --target, --dtype, --device, --max-model-len, --packed-weights, --matmul-precision, --kv-cache-dtype
    add_model_args(p, drafter=False)
    add_load_format_arg(p)
    p.add_argument(
        "--drafter",
        default=DEFAULT_DRAFTER,
        help="drafter checkpoint folder (or packaged name); comma-separated for several; 'none' = vanilla only",
    )
    p.add_argument("--questions", default=DEFAULT_QUESTIONS, help="Spec-Bench-format JSONL")
    p.add_argument("--limit", type=int, default=0, help="at most N questions (0 = all)")
    p.add_argument("--per-category", type=int, default=0, help="at most N questions per category (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", "-k", default="5", help="K, or a comma-separated list")
    p.add_argument(
        "--branching",
        default="",
        help="tree drafts (greedy, torch backend): candidates per draft depth, e.g. 4-2-2 (the top 4 at "
        "the first depth, the top 2 at the next two, verified as leaves beside the drafted chain); "
        "8-3-2@0.05: only candidates the drafter rates at least 0.05 (dynamic); comma-separated for "
        "several ('chain' = none)",
    )
    p.add_argument(
        "--system-prompt",
        choices=["none", "default"],
        default="none",
        help="none: prompts without a system prompt (the paper's evaluation); default: with the "
        "system prompt the chat template inserts, as a served chat request gets it",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--backend",
        choices=["torch", "vllm"],
        default="torch",
        help="vllm: the target in stock vLLM (one engine per method; 'lookup' = vLLM's n-gram proposer)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--out", default="results.json")
    p.set_defaults(func=cmd_bench)
