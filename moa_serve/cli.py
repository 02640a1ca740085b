"""``moa`` — the command line of MoA-Serve."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from moa_serve.cli_args import (
    CLIError,
    add_load_format_arg,
    add_model_args,
    check_generation_args,
    drafter_arg,
    prompt_tokens,
    sampling_params,
    tree_shape,
)
from moa_serve.client.cli import register as register_client
from moa_serve.commands.bench import register as register_bench
from moa_serve.commands.cs_bench import register as register_cs_bench
from moa_serve.commands.fidelity import register as register_fidelity
from moa_serve.commands.netem import register as register_netem
from moa_serve.commands.regenerate import register as register_regenerate
from moa_serve.commands.vllm_bench import register as register_vllm_bench
from moa_serve.deployments.config_check import register as register_config
from moa_serve.drafter.checkpoint import init_drafter
from moa_serve.drafter.registry import load_feature_source, load_proposer
from moa_serve.drafter.training.diagnose import register as register_diagnose
from moa_serve.drafter.training.shrink_vocab import register as register_shrink_vocab
from moa_serve.drafter.training.train import register as register_train
from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.loadtest.runner import LoadTestError
from moa_serve.loadtest.runner import add_arguments as add_loadtest_arguments
from moa_serve.loadtest.runner import run as run_loadtest
from moa_serve.synthetic import describe
from moa_serve.verifier.vllm.engine import INSTALL_HINT, VllmEngine, VllmOptions, vllm_available


def _load_engine(args):
    """The generating engine of ``--backend``."""
    if args.backend == "vllm":
        if not vllm_available():
            raise CLIError(f"--backend vllm: {INSTALL_HINT}")
        if args.load_format == "dummy":
            raise CLIError("--load-format dummy: the synthetic target runs on --backend torch")
        if args.device != "cpu" or args.matmul_precision != "highest" or args.kv_cache_dtype != "auto":
            raise CLIError(
                "--backend vllm: --device, --matmul-precision and --kv-cache-dtype are "
                "torch-backend options (vLLM picks its platform itself; its KV cache follows --dtype)"
            )
        drafter = drafter_arg(args.drafter)
        return VllmEngine(
            args.target,
            drafter,
            VllmOptions(
                num_speculative_tokens=args.num_speculative_tokens,
                dtype=args.dtype,
                max_model_len=args.max_model_len,
                max_num_seqs=1,
                seed=args.seed or 0,
                adaptive_speculation=args.adaptive_k,
            ),
            features=load_feature_source(drafter),
            proposer_factory=load_proposer,
        )
    if args.load_format == "dummy" and drafter_arg(args.drafter) not in (None, "lookup"):
        raise CLIError("--load-format dummy: a synthetic target drafts with --drafter none or lookup")
    return SpeculativeEngine.load(
        args.target,
        drafter_arg(args.drafter),
        args.dtype,
        args.device,
        max_sessions=1,
        max_model_len=args.max_model_len,
        packed_weights=args.packed_weights,
        matmul_precision=args.matmul_precision,
        kv_cache_dtype=args.kv_cache_dtype,
        load_format=args.load_format,
    )


def cmd_generate(args) -> int:
    check_generation_args(args)
    sampling = sampling_params(args)
    shape = tree_shape(args)
    engine = _load_engine(args)
    if shape:
        if not getattr(engine.proposer, "branches", False):
            raise CLIError(
                f"--branching: the drafter {drafter_arg(args.drafter)!r} drafts chains only "
                "(tree drafts need a trained drafter, hybrid:<checkpoint>, or lookup+outputs)"
            )
        engine.proposer.set_tree(shape)
    prompt = prompt_tokens(engine.tokenizer, args.prompt, args.chat)
    if len(prompt) >= engine.max_model_len:
        raise CLIError(f"--prompt: {len(prompt)} tokens do not fit the context of {engine.max_model_len} tokens")
    res = engine.generate(
        [prompt],
        args.max_new_tokens,
        sampling,
        args.num_speculative_tokens,
        ignore_eos=args.ignore_eos,
        adaptive_speculation=args.adaptive_k,
    )[0]
    if args.json:
        print(
            json.dumps(
                {
                    "text": res.text,
                    "token_ids": res.token_ids,
                    "num_tokens": res.num_tokens,
                    "finish_reason": res.finish_reason,
                    "rounds": res.rounds,
                    "mean_accepted_length": round(res.mean_accepted_length, 4),
                    "drafted_tokens": res.drafted_tokens,
                    "accepted_tokens": res.accepted_tokens,
                    "elapsed_s": round(res.elapsed_s, 4),
                    "tokens_per_s": round(res.tokens_per_s, 2),
                    "target": args.target,
                    "drafter": drafter_arg(args.drafter),
                    "dtype": str(engine.dtype if args.backend == "vllm" else engine.verifier.dtype).removeprefix(
                        "torch."
                    ),
                    "backend": args.backend,
                    "weights": describe(args.load_format),
                    "branching": shape.label,
                    **(
                        {}
                        if args.backend == "vllm"
                        else {
                            "matmul_precision": engine.verifier.packing.get("matmul_precision", "highest"),
                            "kv_cache_dtype": str(engine.verifier.cache.k.dtype).removeprefix("torch."),
                        }
                    ),
                }
            )
        )
    else:
        print(res.text)
        print(
            f"[{res.num_tokens} tokens, {res.tokens_per_s:.1f} tok/s, {res.rounds} rounds, "
            f"mean accepted length {res.mean_accepted_length:.2f}]",
            file=sys.stderr,
        )
    return 0


def cmd_drafter_init(args) -> int:
    if args.target_layer_inference < 0:
        raise CLIError("--target-layer-inference must be >= 0")
    out = init_drafter(args.target, args.out, seed=args.seed, target_layer_inference=args.target_layer_inference)
    print(f"wrote an untrained MoA drafter for {args.target} to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moa", description="MoA-Serve: Mixture-of-Attentions speculative decoding")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text in one process (speculative or plain)")
    add_model_args(g)
    add_load_format_arg(g)
    g.add_argument(
        "--backend",
        choices=["torch", "vllm"],
        default="torch",
        help="who runs the target: MoA-Serve's PyTorch runner, or stock vLLM with the drafter "
        "plugged in as its proposer (needs the [vllm] extra)",
    )
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-new-tokens tokens")
    g.add_argument(
        "--adaptive-k",
        action="store_true",
        help="draft about as many tokens as recent rounds accepted (at most -k); --backend vllm: each step's "
        "length from its measured costs and acceptance",
    )
    g.add_argument(
        "--branching",
        default="chain",
        help="tree drafts (greedy, torch backend): candidates per draft depth, e.g. 4-2, or 8-3-2@0.05 "
        "(only those the drafter rates >= 0.05); 'chain' = none",
    )
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("drafter", help="drafter checkpoints")
    dsub = d.add_subparsers(dest="drafter_command", required=True)
    di = dsub.add_parser("init", help="write an untrained MoA drafter sized for a target")
    di.add_argument("--target", required=True)
    di.add_argument("--out", required=True)
    di.add_argument("--seed", type=int, default=0)
    di.add_argument("--target-layer-inference", type=int, default=0, choices=[0, 1, 2, 3])
    di.set_defaults(func=cmd_drafter_init)
    register_diagnose(dsub)
    register_shrink_vocab(dsub)

    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands() -> list:
    return [
        register_train,
        register_bench,
        register_regenerate,
        _register_loadtest,
        register_netem,
        register_client,
        register_cs_bench,
        register_vllm_bench,
        register_fidelity,
        register_config,
    ]


def _cmd_loadtest(args) -> int:
    try:
        return run_loadtest(args)
    except LoadTestError as exc:
        raise CLIError(str(exc)) from None


def _register_loadtest(sub) -> None:
    lt = sub.add_parser("loadtest", help="Locust load test at several user levels (starts a cluster from --config)")
    add_loadtest_arguments(lt)
    lt.set_defaults(func=_cmd_loadtest)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return args.func(args)
    except (CLIError, ValueError) as exc:  # bad arguments, unknown models, mismatched checkpoints
        print(f"moa: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
