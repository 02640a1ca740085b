"""Time from a link cut to the client's first offline token, client-server mode over ``moa netem``.

The reported scenario in one process: the server's client-server stack (the Router's, without
Ray: ``moa_serve.measure.client_server_stack``) on 127.0.0.1, a ``netem`` proxy in front of it, and the
device running ``moa client generate``'s defaults (the hybrid+outputs drafter, ``--offline
degrade``, branching auto, its transport's default deadline). The link is cut ``--cut-after``
seconds after the handshake (the first connection, as ``moa netem --cut-after`` counts) and restored
``--restore-after`` seconds after the cut (0: never). Prints one JSON line: the time from the cut
to the first offline token, whether the generation completed, how the tail was verified and
corrected, and whether the output equals plain target decoding.

    MOA_MODEL_DIR=DIR python3 tools/bench/client_offline.py --cut-mode blackhole   # DIR: the models folder
"""

from __future__ import annotations

import argparse
import json
import threading
import time

from moa_serve.app.http import create_app
from moa_serve.cli_args import DEFAULT_DRAFTER, DEFAULT_TARGET, prompt_tokens
from moa_serve.client import DeviceDrafter, RemoteGenerator, Transport
from moa_serve.client.generate import AUTO
from moa_serve.drafter.spec import DrafterSpec
from moa_serve.measure.client_server_run import plain_engine, server_stack
from moa_serve.measure.client_server_stack import UvicornThread
from moa_serve.measure.netem import netem_proxy
from moa_serve.measure.target import load_target
from moa_serve.sampling import GREEDY

PORTS = (8400, 8500)
PROMPT = "Explain why the sky is blue in a short paragraph."


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--drafter", default=f"hybrid+outputs:{DEFAULT_DRAFTER}")
    p.add_argument("--profile", default="4g")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cut-mode", choices=["blackhole", "reset"], default="blackhole")
    p.add_argument("--cut-after", type=float, default=4.0, help="seconds after the handshake")
    p.add_argument("--restore-after", type=float, default=20.0, help="seconds after the cut (0: never)")
    p.add_argument(
        "--stop-at-offline", action="store_true", help="stop at the first offline token (a link that never comes back)"
    )
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--ignore-eos", action="store_true", help="write all --max-new-tokens")
    p.add_argument("--max-model-len", type=int, default=1024)
    return p.parse_args(argv)


class Server:
    """The target on the packed kernels behind the client-server API, on 127.0.0.1."""

    def __init__(self, args):
        target = load_target(args.target, "float32", "cpu")
        self.tm, self.tok = target.model, target.tokenizer
        self.plain = plain_engine(target, args.max_model_len)
        server_stack(target, DrafterSpec.parse(args.drafter).checkpoint, args.max_model_len, args.target).install()
        self.http = UvicornThread(create_app(), PORTS)

    def stop(self) -> None:
        self.http.stop()


class Outage:
    """Cuts the link ``cut_after`` s after ``start()``, restores it ``restore_after`` s later."""

    def __init__(self, proxy, mode: str, cut_after: float, restore_after: float):
        self.proxy, self.mode = proxy, mode
        self.cut_after, self.restore_after = cut_after, restore_after
        self.cut_at: float | None = None
        self._timers: list[threading.Timer] = []

    def start(self) -> None:
        self._later(self.cut_after, self._cut)

    def _later(self, delay: float, fn) -> None:
        timer = threading.Timer(delay, fn)
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def _cut(self) -> None:
        self.cut_at = time.perf_counter()
        self.proxy.cut(self.mode)
        if self.restore_after > 0:
            self._later(self.restore_after, self.proxy.restore)

    def cancel(self) -> None:
        for timer in self._timers:
            timer.cancel()


def drive(run, stop_at_offline: bool) -> float | None:
    """Iterates the run; returns when its first offline token came (None: never)."""
    for ev in run:
        if ev.kind == "offline":
            first = time.perf_counter()
            if stop_at_offline:
                return first
            break
    else:
        return None
    for _ in run:
        pass
    return first


def measure(args, server: Server) -> dict:
    device = DeviceDrafter.load(args.drafter, args.target, "float32", args.max_model_len)
    ids = prompt_tokens(device.tokenizer, args.prompt, chat=True)
    ref = server.plain.generate([ids], args.max_new_tokens, GREEDY, 1, ignore_eos=args.ignore_eos)[0].token_ids
    upstream = ("127.0.0.1", server.http.port)
    with netem_proxy(args.profile, upstream, seed=args.seed) as px:
        t = Transport(f"http://{px.host}:{px.port}")  # the client's default deadline
        gen = RemoteGenerator(device, t, num_speculative_tokens=8, branching=AUTO)
        outage = Outage(px, args.cut_mode, args.cut_after, args.restore_after)
        gen.handshake()
        outage.start()
        run = gen.start(ids, args.max_new_tokens, ignore_eos=args.ignore_eos)
        try:
            off = drive(run, args.stop_at_offline)
        finally:
            outage.cancel()
            if args.stop_at_offline:
                run.close()
            t.close()
    res = run.result()
    cut = outage.cut_at
    return {
        "profile": args.profile,
        "cut_mode": args.cut_mode,
        "cut_after_s": args.cut_after,
        "restore_after_s": args.restore_after or None,
        "cut": cut is not None,
        "cut_to_first_offline_token_s": round(off - cut, 3) if cut is not None and off is not None else None,
        "num_tokens": res.num_tokens,
        "requested_tokens": args.max_new_tokens,
        "finish_reason": res.finish_reason,
        "verified_tokens": res.verified_tokens,
        "offline_generated": res.offline_generated,
        "unverified_tail": res.offline_tokens,
        "corrections": res.corrections,
        "corrected_tokens": res.corrected_tokens,
        "disconnections": res.disconnections,
        "server_calls": res.server_calls,
        "retries": res.retries,
        "identical_to_target": res.token_ids == list(ref[: len(res.token_ids)]),
        "elapsed_s": round(res.elapsed_s, 2),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    server = Server(args)
    try:
        print(json.dumps(measure(args, server)), flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
