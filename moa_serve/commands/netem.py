"""Network emulation: an asyncio TCP proxy with the network settings of the MoA paper's client-server
scenario (:data:`PROFILES`: two cities 300 km apart, and the paper's emulated 5G and 4G links).

``moa netem`` and ``python -m moa_serve.commands.netem``: the command line of the proxy in
``moa_serve/measure/netem.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
import sys
from typing import Any

from moa_serve.measure.netem import CUT_MODES, PROFILES, NetemProxy


def _address(text: str, listen: bool) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # [::1]:8000
    lowest = 0 if listen else 1
    if not (sep and host and port.isdigit() and lowest <= int(port) <= 65535):
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port in {lowest}..65535, got {text!r}")
    return host, int(port)


def _listen_address(text: str) -> tuple[str, int]:
    return _address(text, listen=True)


def _upstream_address(text: str) -> tuple[str, int]:
    return _address(text, listen=False)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--profile",
        required=True,
        choices=list(PROFILES),
        help="; ".join(prof.describe() for prof in PROFILES.values()).replace("%", "%%"),
    )
    p.add_argument(
        "--listen",
        required=True,
        type=_listen_address,
        metavar="HOST:PORT",
        help="where clients connect (port 0: any free port, printed at start)",
    )
    p.add_argument(
        "--upstream",
        required=True,
        type=_upstream_address,
        metavar="HOST:PORT",
        help="the server traffic is forwarded to",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the delay and drop draws (reproducible runs)")
    p.add_argument(
        "--cut-after",
        type=_seconds,
        metavar="SECONDS",
        help="cut the link this many seconds after the first connection is accepted",
    )
    p.add_argument(
        "--cut-mode",
        choices=CUT_MODES,
        default="blackhole",
        help="blackhole: stop forwarding, clients time out; reset: RST every connection, refuse new ones",
    )


async def _serve(args: argparse.Namespace) -> int:
    proxy = NetemProxy(args.profile, args.upstream, args.listen, args.seed, args.cut_after, args.cut_mode)
    try:
        host, port = await proxy.start()
    except OSError as exc:
        print(f"moa netem: error: cannot listen on {args.listen[0]}:{args.listen[1]}: {exc}", file=sys.stderr)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    cut = "" if args.cut_after is None else f", cut ({args.cut_mode}) {args.cut_after:g} s after the first connection"
    print(
        f"netem {proxy.profile.describe()}; listening on {host}:{port} -> {args.upstream[0]}:{args.upstream[1]}"
        f" (seed {args.seed}{cut}); Ctrl-C to stop",
        flush=True,
    )
    await stop.wait()
    await proxy.stop()
    print(proxy.stats.summary(), file=sys.stderr, flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_serve(args))


def register(sub: Any) -> None:
    """Add ``moa netem`` to the ``moa`` command's subparsers."""
    p = sub.add_parser("netem", help="TCP proxy emulating the paper's network settings (local, wan, 5g, 4g)")
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    """``python -m moa_serve.commands.netem ...``: the same options as ``moa netem``."""
    parser = argparse.ArgumentParser(prog="moa netem", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
