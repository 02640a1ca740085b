"""``moa cs-bench`` — client-server mode across emulated networks, and on disconnection.

One in-process server (the Router's stack without Ray: ``RoundService`` over a float32
``TorchTargetRunner`` + ``ClientSessions`` + the FastAPI app, served by uvicorn on 127.0.0.1),
reached by the device through ``moa_serve.measure.netem`` proxies (``local``, ``wan``, ``5g``, ``4g``).
The target's weights are loaded once; the verifier's *feature head* is the one of the drafter
under test (the server computes MoA's K/V features with MoA's head, EAGLE-style's hidden states
for EAGLE; independent and API-only need none), so the server's state is switched between
drafters — one server, one HTTP listener, one set of target weights.

Methods: each ``--drafter`` checkpoint (MoA, EAGLE-style, independent) as a device drafter, and
**API-only**: no drafter, the device asks the server for the next token every round (K = 0).
For every profile, prompt and method (methods interleaved prompt by prompt): tokens/s, ms per
token, server calls per 100 tokens, bytes up/down per token (HTTP bytes as the client counts
them), τ (tokens committed per answered round, prefill round included) and whether the greedy
output equals plain target decoding (computed once per prompt in the same process).

Device/server compute ratio (the paper: the server has 3x the client's FLOPS): on this machine
both sides share the same CPU, so the device is slowed in wall time: every ``propose`` call of
the device drafter is followed by a sleep of ``(device_slowdown - 1)`` times its measured
duration (``--device-slowdown``, default 3). Sleeping burns no CPU, so the server is not slowed.

Disconnection: per prompt and method, over ``--cut-profile``, the link is cut (``reset``: every
connection RST, new ones refused) as soon as ``--cut-after-tokens`` tokens are verified; the
client runs ``--offline degrade`` and writes the rest with its drafter alone. Reported: tokens
until the first divergence from the target's own continuation, whether the whole continuation
matched, and on math prompts whether the final answer (last number in the text) equals the
target's own and the dataset's reference.

Writes ``--out``/results.json and ``--out``/results.md.
"""

from __future__ import annotations

from moa_serve.cli_args import DEFAULT_TARGET, add_kernel_args
from moa_serve.measure.client_server_report import markdown
from moa_serve.measure.client_server_run import DEFAULT_CATEGORIES, DEFAULT_DRAFTERS, DEFAULT_PROFILES, run_cs_bench
from moa_serve.measure.questions import DEFAULT_QUESTIONS


def add_arguments(p) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="the server's target LLM")
    p.add_argument(
        "--drafter",
        default=DEFAULT_DRAFTERS,
        help="comma-separated device drafter checkpoints (MoA, EAGLE-style, independent), each also as "
        "hybrid:<checkpoint> (prompt lookup first, online and greedy) or hybrid+outputs:<checkpoint> "
        "(then the target's earlier replies); 'none': only API-only",
    )
    p.add_argument("--no-api-only", action="store_true", help="skip the API-only client (no drafter, K = 0)")
    p.add_argument("--profiles", default=DEFAULT_PROFILES, help="netem profiles, comma-separated")
    p.add_argument("--questions", default=DEFAULT_QUESTIONS, help="Spec-Bench-format JSONL (held-out prompts)")
    p.add_argument("--categories", default=DEFAULT_CATEGORIES, help="categories to take prompts from ('' = all)")
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--limit", type=int, default=0, help="at most this many prompts (0: no limit)")
    p.add_argument(
        "--prompt-format",
        choices=["chat", "plain"],
        default="chat",
        help="chat: the first turn in the chat template; plain: its text only",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=8, help="the most drafts per round")
    p.add_argument("--fixed-k", action="store_true", help="always draft -k tokens (default: the client's adaptive K)")
    p.add_argument(
        "--branching",
        default="chain",
        help="tree drafts: candidates per draft depth (e.g. 4-2, or 8-3-2@0.05: dynamic); "
        "comma-separated shapes run every drafter once per shape ('chain' = none; 'auto' = the "
        "client's default: 8-3-2@0.03 while the round trip is >= 50 ms)",
    )
    p.add_argument("--feature-codec", choices=["float16", "int8"], default="float16")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="server and device (float32: greedy identity is exact)",
    )
    p.add_argument("--max-model-len", type=int, default=1024)
    add_kernel_args(
        p,
        "auto: the server's target runs on the packed kernels, as a verifier replica does",
        "the server's packed matmuls (the config's matmul_precision): medium multiplies bf16-rounded "
        "values with float32 sums on AVX512-BF16 CPUs; plain decoding, the reference, runs the same",
    )
    p.add_argument(
        "--device-slowdown",
        type=float,
        default=3.0,
        help="the device's drafting takes this many times its measured time (the server has this many "
        "times the device's compute; the paper: 3)",
    )
    p.add_argument("--cut-profile", default="4g", help="the link the disconnection runs go through")
    p.add_argument("--cut-after-tokens", type=int, default=16, help="cut the link after this many verified tokens")
    p.add_argument(
        "--offline-chunk",
        type=int,
        default=4,
        help="drafts per drafter call while offline (the client's default: 4); EAGLE-style drafts only "
        "one call past the last target feature, so this bounds its offline continuation",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per HTTP call (default: follow the measured round trips, as the client does)",
    )
    p.add_argument("--seed", type=int, default=0, help="netem seed (+ the prompt's index)")
    p.add_argument("--out", required=True, help="folder for results.json and results.md")


def register(sub) -> None:
    p = sub.add_parser(
        "cs-bench",
        help="client-server mode benchmark: drafters vs API-only across emulated networks, and on disconnection",
    )
    add_arguments(p)

    def cmd(args) -> int:
        result = run_cs_bench(args)
        print(markdown(result))
        return 0

    p.set_defaults(func=cmd)
