"""Admission of requests on an ingress replica: the running ``Frontend`` (503 until the ingress has
installed one) and ``Readiness``, which holds generation requests back with a 503 until the pools
have answered the readiness check. The routes of ``app/http.py`` and ``app/client_server.py`` share both."""

from __future__ import annotations

import asyncio
import logging

from moa_serve.app import state
from moa_serve.app.errors import unavailable
from moa_serve.app.frontend import Frontend

log = logging.getLogger(__name__)

# how long a generation request waits for the first readiness check of this replica before it is
# answered 503 (the check asks every pool for its info, 5 s per pool at most)
READY_WAIT_S = 5.0


def running_frontend() -> Frontend:
    """The installed ``Frontend``; 503 while the ingress has not installed one yet."""
    fe = state.get("frontend")
    if fe is None:
        raise unavailable("the server is starting: no frontend yet")
    return fe


class Readiness:
    """Admits generation requests once the ingress's readiness check (``state["ready"]``, the
    check behind ``/readyz``) has passed: before that, a request would wait on a pool that is still
    loading, so it gets 503 with Retry-After instead. Concurrent requests share one check; a
    success is kept (pool failures are the round service's to retry) until a generation fails for
    good (``recheck``): the next requests run the check again, and while the pools do not answer
    they get 503 with Retry-After instead of being admitted to fail one by one with a 500."""

    def __init__(self, wait_s: float):
        self.wait_s = wait_s
        self.ready = False
        self.served = False  # the check passed once: a failing check now means pools lost, not loading
        self._pending: asyncio.Future | None = None

    def recheck(self) -> None:
        """A generation failed after every retry: admit no more until the check passes again."""
        self.ready = False

    async def check(self) -> tuple[bool, dict]:
        """Runs (or joins) the readiness check: (ready, detail)."""
        check = state.get("ready")
        if check is None:  # an ingress without pools (tests, the one-process client-server server)
            return True, {}
        loop = asyncio.get_running_loop()
        if self._pending is None or self._pending.done() or self._pending.get_loop() is not loop:
            self._pending = asyncio.ensure_future(check())
        ok, detail = await asyncio.shield(self._pending)
        self.ready = self.ready or ok
        self.served = self.served or ok
        return ok, detail

    async def admit(self) -> None:
        """Returns when the server is ready; raises ApiError 503 otherwise."""
        if self.ready or state.get("ready") is None:
            return
        try:
            ok, _detail = await asyncio.wait_for(self.check(), self.wait_s)
        except TimeoutError:
            ok = False
        except Exception:  # noqa: BLE001 - a check that fails says "not ready", like /readyz
            log.warning("readiness check failed", exc_info=True)
            ok = False
        if not ok:
            raise unavailable(
                "the server's pools do not answer (see /readyz)"
                if self.served
                else "the server is starting: its pools are not ready yet (see /readyz)"
            )
