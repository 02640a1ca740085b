"""The arguments and checks the ``moa`` subcommands share: the model options, sampling,
``--branching``, the prompt as token ids, and ``CLIError`` (a bad argument: ``moa`` prints it and
exits with status 2). ``moa_serve.cli`` and every module registering a subcommand read them here."""

from __future__ import annotations

import argparse

from pydantic import ValidationError

from moa_serve.drafter.spec import parse_branching
from moa_serve.sampling import SamplingParams

DEFAULT_TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_DRAFTER = "smollm2-135m-instruct-moa"


class CLIError(Exception):
    pass


def add_model_args(p: argparse.ArgumentParser, drafter: bool = True) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="Hugging Face id or path of the target LLM")
    if drafter:
        p.add_argument(
            "--drafter",
            default=DEFAULT_DRAFTER,
            help="MoA drafter checkpoint folder (or a packaged one's name); 'none' = target only",
        )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="auto: bfloat16 on GPUs and CPUs with native bf16, float32 elsewhere",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--max-model-len", type=int, default=2048)
    add_kernel_args(
        p,
        "auto: a float32 CPU target from a GGUF keeps its 4/8-bit blocks, de-quantized in registers",
        "packed CPU target (torch backend): medium multiplies bfloat16-rounded activations and weights "
        "(float32 sums) on CPUs with AVX512-BF16; low rounds activations to 8-bit blocks and multiplies the "
        "GGUF's integers (llama.cpp's CPU arithmetic, AVX2); highest multiplies in float32",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="torch backend: the target's KV cache dtype (auto = the target's dtype; bfloat16 halves it)",
    )


def add_load_format_arg(p: argparse.ArgumentParser) -> None:
    """``--load-format``: the target's weights from its folder, or random ones (a synthetic target)."""
    p.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default="auto",
        help="dummy: a synthetic target for benchmarks: the architecture of --target's config.json (e.g. the "
        "shipped llama-3-8b-shape), random weights drawn on --device, no checkpoint read; its output is noise",
    )


def add_kernel_args(p: argparse.ArgumentParser, packed_help: str, precision_help: str) -> None:
    """``--packed-weights`` and ``--matmul-precision``: how a CPU target runs on the packed kernels."""
    p.add_argument("--packed-weights", choices=["auto", "off"], default="auto", help=packed_help)
    p.add_argument("--matmul-precision", choices=["highest", "medium", "low"], default="highest", help=precision_help)


def sampling_params(args) -> SamplingParams:
    """``--temperature``, ``--top-p``, ``--top-k``, ``--seed`` (a CLIError naming the option that is out of range)."""
    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise CLIError(f"--{str(err['loc'][0]).replace('_', '-')}: {err['msg']}") from None


def drafter_arg(value: str | None) -> str | None:
    """``--drafter`` as a drafter spec: None for 'none'."""
    return None if value is None or value.lower() == "none" else value


def tree_shape(args):
    """``--branching`` as a TreeShape (a CLIError naming the option when it does not parse or cannot run)."""
    try:
        shape = parse_branching(args.branching)
    except ValueError as exc:
        raise CLIError(f"--branching: {exc}") from None
    if shape and getattr(args, "backend", "torch") == "vllm":
        raise CLIError("--branching: tree drafts run on --backend torch (vLLM verifies chains)")
    return shape


def prompt_tokens(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        return list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return tokenizer.encode(prompt)


def check_generation_args(args) -> None:
    """The length arguments every generating command shares."""
    if args.num_speculative_tokens < 1:
        raise CLIError("--num-speculative-tokens must be >= 1")
    if args.max_new_tokens < 1:
        raise CLIError("--max-new-tokens must be >= 1")
