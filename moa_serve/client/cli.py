"""``moa client generate``: generate against a MoA-Serve server in client-server mode, drafting
on this machine (the device) and verifying on the server."""

from __future__ import annotations

import json
import os
import sys

from moa_serve.cli_args import (
    DEFAULT_DRAFTER,
    CLIError,
    add_model_args,
    check_generation_args,
    prompt_tokens,
    sampling_params,
    tree_shape,
)
from moa_serve.client import (
    DeviceDrafter,
    HandshakeError,
    LinkPolicy,
    OfflineError,
    RemoteGenerator,
    ServerError,
    Transport,
)
from moa_serve.client.generate import AUTO
from moa_serve.client.transport import API_KEY_ENV


def cmd_client_generate(args) -> int:
    check_generation_args(args)
    if args.timeout is not None and not args.timeout > 0:
        raise CLIError(f"--timeout must be > 0 seconds, got {args.timeout}")
    sampling = sampling_params(args)
    branching = AUTO if args.branching == AUTO else tree_shape(args)
    device = DeviceDrafter.load(args.drafter, args.target, args.dtype, args.max_model_len, args.device)
    transport = transport_of(args)
    gen = RemoteGenerator(
        device,
        transport,
        num_speculative_tokens=args.num_speculative_tokens,
        adaptive_k=not args.fixed_k,
        feature_codec=args.feature_codec,
        branching=branching,
        link=LinkPolicy(offline=args.offline),
    )
    prompt = prompt_tokens(device.tokenizer, args.prompt, args.chat)
    try:
        res = gen.generate(prompt, args.max_new_tokens, sampling, ignore_eos=args.ignore_eos)
    except (HandshakeError, OfflineError, ServerError) as exc:
        raise CLIError(str(exc)) from None
    finally:
        transport.close()
    if args.json:
        print(
            json.dumps(
                {
                    **res.as_dict(),
                    "server": args.server,
                    "drafter": args.drafter,
                    "dtype": str(device.dtype).removeprefix("torch."),
                    "feature_codec": args.feature_codec,
                    "branching": branching if branching == AUTO else branching.label,
                    "device_weights_mib": round(device.weight_bytes() / 2**20, 1),
                }
            )
        )
    else:
        print(res.text)
        print(
            f"[{res.num_tokens} tokens ({res.verified_tokens} verified, {res.offline_tokens} offline), "
            f"{res.tokens_per_s:.1f} tok/s, {res.server_calls} server calls, "
            f"{res.bytes_up} B up / {res.bytes_down} B down, mean accepted length {res.mean_accepted_length:.2f}]",
            file=sys.stderr,
        )
    return 0


def transport_of(args) -> Transport:
    """The link to ``--server``, sending ``--api-key`` (default: $MOA_API_KEY) when there is one."""
    return Transport(args.server, timeout_s=args.timeout, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None)


def register(sub) -> None:
    c = sub.add_parser("client", help="client-server mode: draft on this device, verify on a MoA-Serve server")
    csub = c.add_subparsers(dest="client_command", required=True)
    g = csub.add_parser("generate", help="generate through a server's /v1/cs API")
    g.add_argument("--server", required=True, help="base URL of the server, e.g. http://127.0.0.1:8000")
    g.add_argument(
        "--api-key",
        default=None,
        help=f"the server's API key, sent as `Authorization: Bearer` on every "
        f"call (default: ${API_KEY_ENV}; a key on the command line shows in the process list, the "
        "environment variable does not)",
    )
    add_model_args(g, drafter=False)
    g.set_defaults(target=None)
    g.add_argument(
        "--drafter",
        default=f"hybrid+outputs:{DEFAULT_DRAFTER}",
        help="drafter checkpoint (the server's: the handshake checks), or hybrid:<checkpoint>: prompt "
        "lookup drafts where the text repeats itself (greedy only, online and offline), or "
        "hybrid+outputs:<checkpoint> (the default): lookup, then the target's earlier replies, then "
        "the checkpoint; its target parts are read from --target (default: the checkpoint's target)",
    )
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--num-speculative-tokens", "-k", type=int, default=8, help="the most drafts per round")
    g.add_argument(
        "--fixed-k",
        action="store_true",
        help="always draft -k tokens (default: adapt K to the measured round trip and acceptance)",
    )
    g.add_argument(
        "--offline",
        choices=["degrade", "strict"],
        default="degrade",
        help="when the server is unreachable: keep writing with the drafter (unverified, corrected on "
        "reconnection) or fail",
    )
    g.add_argument("--feature-codec", choices=["float16", "int8"], default="float16")
    g.add_argument(
        "--branching",
        default="auto",
        help="tree drafts (greedy): candidates per draft depth, e.g. 4-2 (the drafter's runners-up go "
        "with its chain and are verified beside it), 8-3-2@0.05 (only those it rates >= 0.05); "
        "'chain' = none; 'auto' (default): 8-3-2@0.03 while the measured round trip is >= 50 ms, "
        "chains on faster links",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="a fixed deadline in seconds per server call, retries included (default: follow the link: "
        "4 x the p99 round trip of the last 32 calls, within 2-30 s; at least 15 s for the first "
        "call and for a call that waits for a prefill); a call past its deadline takes the client "
        "offline",
    )
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_client_generate)
