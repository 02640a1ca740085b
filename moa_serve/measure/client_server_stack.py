"""The Router's client-server stack in one process, without Ray: a RoundService over a
TorchTargetRunner, ClientSessions and the Frontend (what ``deployments/router.py`` wires around the
pools), and uvicorn serving the app on 127.0.0.1 in a thread. ``moa cs-bench`` and the tests use it."""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable

from moa_serve.app import state
from moa_serve.app.frontend import Frontend, Speculation
from moa_serve.client_server.fingerprint import model_fingerprint
from moa_serve.client_server.sessions import ClientSessions, ServerIdentity
from moa_serve.engine.feature_policy import AlwaysFeatures, FeaturePolicy
from moa_serve.engine.options import RoundOptions
from moa_serve.engine.pool_calls import Pools
from moa_serve.engine.round_service import RoundService


class LocalStack:
    """One "Router replica" over ``runner``: a new one knows no session (a server restart).
    ``on_verify(requests)`` runs before every verify call (tests record or alter them)."""

    def __init__(
        self,
        runner,
        tokenizer,
        stop_token_ids,
        *,
        model_name: str,
        drafter: str | None,
        ttl_s: float = 300.0,
        on_verify: Callable[[list], None] | None = None,
    ):
        self.runner = runner

        async def verify(group, reqs):
            if on_verify is not None:
                on_verify(reqs)
            return runner.verify(reqs)

        async def release(group, ids):
            for i in ids:
                runner.release(i)

        self.service = RoundService(
            Pools(verify, None, release),
            RoundOptions(speculation_governor=False),
            features=AlwaysFeatures() if drafter is not None else FeaturePolicy(),
        )
        self.identity = ServerIdentity.build(
            model=model_name,
            target_fingerprint=model_fingerprint(runner.model),
            tokenizer=tokenizer,
            drafter=drafter,
            vocab_size=runner.arch.vocab_size,
            max_model_len=runner.max_model_len,
            stop_token_ids=stop_token_ids,
        )
        self.cs = ClientSessions(self.service, self.identity, ttl_s=ttl_s)
        self.frontend = Frontend(
            self.service,
            tokenizer,
            max_model_len=runner.max_model_len,
            stop_token_ids=stop_token_ids,
            speculation=Speculation(enabled=False),
            model_name=model_name,
        )

    def install(self) -> "LocalStack":
        """Makes this stack the one the app's routes use."""
        state.install(cs=self.cs, frontend=self.frontend, ready=None, stats=None)
        return self


def free_port(lo: int, hi: int) -> int:
    """The first port in [lo, hi) free on 127.0.0.1."""
    for port in range(lo, hi):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {lo}-{hi - 1}")


class UvicornThread:
    """``app`` on 127.0.0.1 (the first free port in ``ports``) in a daemon thread; ``stop()`` ends it."""

    def __init__(self, app, ports: tuple[int, int]):
        import uvicorn

        self.port = free_port(*ports)
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
