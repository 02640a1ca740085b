"""``moa fidelity`` — what a ``matmul_precision`` costs in fidelity, against ``highest``.

For each precision (``low``: 8-bit activations times the GGUF's integers; ``medium``: bfloat16
products; ``highest``: float32 products of the same de-quantized weights), the target alone (the
engine of ``moa generate --drafter none``) is run on

* **greedy agreement**: held-out Spec-Bench questions (first turns, chat template, no system
  prompt), ``--max-new-tokens`` each; per prompt the index of the first token that differs from
  ``highest``'s greedy output (None: identical);
* **perplexity**: held-out text (by default the source passages of Spec-Bench's ``summarization``
  and ``rag`` questions, none of them among the greedy prompts), raw text without a template, the
  first ``--ppl-tokens`` tokens of each; each token scored given the ones before it in one
  teacher-forced forward of the verifier's model (its KV cache, its packed kernels). Also the share
  of positions whose top-1 token is ``highest``'s.

Writes ``--out`` (JSON, every prompt's result) and the same name with ``.md`` (the table).
"""

from __future__ import annotations

from moa_serve.cli_args import DEFAULT_TARGET
from moa_serve.commands.bench import printing_command
from moa_serve.measure.fidelity_report import markdown
from moa_serve.measure.fidelity_run import run_fidelity
from moa_serve.measure.questions import DEFAULT_QUESTIONS

cmd_fidelity = printing_command(run_fidelity, markdown)


def register(sub) -> None:
    p = sub.add_parser("fidelity", help="greedy agreement and perplexity of each matmul_precision against highest")
    p.add_argument("--target", default=DEFAULT_TARGET, help="a target with a GGUF (the packed CPU kernels)")
    p.add_argument(
        "--precisions",
        default="low,medium,highest",
        help="comma-separated matmul precisions; highest is the reference and must be among them",
    )
    p.add_argument("--questions", default=DEFAULT_QUESTIONS, help="Spec-Bench-format JSONL (held-out prompts)")
    p.add_argument("--limit", type=int, default=0, help="at most N greedy prompts (0 = all)")
    p.add_argument("--per-category", type=int, default=1, help="at most N greedy prompts per category (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--ppl-categories",
        default="summarization,rag",
        help="categories whose first turns (not used as greedy prompts) are the perplexity texts",
    )
    p.add_argument("--ppl-texts", type=int, default=10, help="perplexity texts")
    p.add_argument("--ppl-tokens", type=int, default=512, help="tokens scored per text (its first ones)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--out", default="fidelity.json")
    p.set_defaults(func=cmd_fidelity)
