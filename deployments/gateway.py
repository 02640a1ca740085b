"""The HTTP ingress: FastAPI routes, the Frontend (tokenize, detokenize, stop strings, SSE), and
nothing a replica loss could take away. Each generation runs on a Router replica, which streams
its commits back; the Gateway keeps what it received. When the Router replica dies mid-stream,
``StreamService`` resumes the session on another Router replica: the prompt plus the tokens
already received are the new prompt, the rest of ``max_tokens`` the new limit, the same sampling
parameters (seeded generators depend on the position only). The client's stream goes on without a
repeated or a missing token.

Generations go to ``gateway.lanes`` lanes (by a hash of the session id). A lane is one link to one
Router replica (``moa_serve/engine/lanes.py``): a streaming call that carries the commits of all
the lane's sessions, one batch per round, instead of one stream per session; its calls carry the
lane as the affinity key, so the lane sticks to its replica and its sessions share that Router's
rounds. Router replicas without a lane stand by and take a lane over when its replica dies.
Client-server sessions (``/v1/cs``) live on one Router replica each: their calls carry the session
id as the affinity key; a session whose Router died answers 409 and its device resyncs.

With ``router.in_gateway`` the Gateway runs its Router (``RouterCore``) in its own process: the
same lanes, calls and sessions, without the two calls between processes per first token, and
without a standby to resume on."""

from __future__ import annotations

import asyncio
import uuid
import zlib
from collections import OrderedDict
from contextlib import aclosing

from ray import serve
from ray.serve.handle import DeploymentHandle

from moa_serve.app import state
from moa_serve.app.access import Access
from moa_serve.app.frontend import Frontend, Speculation, Unsupported
from moa_serve.app.http import create_app
from moa_serve.deployments.config import AppConfig
from moa_serve.deployments.router import RouterCore, detached, load_target_info
from moa_serve.engine.lanes import LaneLink
from moa_serve.engine.session import Session
from moa_serve.engine.stream_service import StreamService
from moa_serve.synthetic import describe

api = create_app()

STATS_TIMEOUT_S = 5.0
RESUME_RETRIES = 4  # resumptions of one generation (backoff 0.5, 1, 2, 4 s)
MAX_CS_SESSIONS = 65536  # client-server sessions a Gateway remembers having opened (for DELETE)


def lane_of(session_id: str, lanes: int) -> int:
    return zlib.crc32(session_id.encode()) % lanes


def unwrapped(exc: BaseException) -> BaseException:
    """The replica's own exception behind Ray's wrapper (``RayTaskError`` keeps it as ``cause``)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


class RouterSessions:
    """Client-server sessions (``app/client_server.py``'s ``state["cs"]``) held by the Router replicas: each
    call goes to the replica holding the session (affinity key = session id). ``close`` answers
    from the sessions this Gateway opened (the route needs the answer at once) and closes the
    session on its Router in the background."""

    def __init__(self, call, remember: int = MAX_CS_SESSIONS):
        self.call = call  # the Gateway's call to its Router: call(method, *args, group=..., **kwargs)
        self.remember = remember
        self._open: OrderedDict[str, None] = OrderedDict()  # sessions created here, oldest first
        self._codecs: dict[str, str] = {}  # the feature codec of the reply being framed
        self._closing: set[asyncio.Task] = set()

    async def identity(self):
        return await self.call("cs_identity")

    async def create(self, ids: list[int], *, session_id: str | None = None, **kwargs):
        sid = session_id or uuid.uuid4().hex
        answer = await self.call("cs_create", ids, group=sid, session_id=sid, **kwargs)
        self._open[sid] = None
        self._open.move_to_end(sid)
        while len(self._open) > self.remember:
            self._open.popitem(last=False)
        return answer

    async def verify(self, session_id: str, *args):
        reply, self._codecs[session_id] = await self.call("cs_verify", session_id, *args, group=session_id)
        return reply

    def feature_codec(self, session_id: str) -> str:
        return self._codecs.pop(session_id, "float16")

    def close(self, session_id: str) -> bool:
        if session_id not in self._open:
            return False
        del self._open[session_id]
        task = asyncio.get_running_loop().create_task(self.call("cs_close", session_id, group=session_id))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return True


@serve.deployment(name="Gateway")
@serve.ingress(api)
class Gateway:
    def __init__(
        self,
        cfg: AppConfig,
        router: DeploymentHandle | None,
        verifier: DeploymentHandle | None = None,
        drafter: DeploymentHandle | None = None,
    ):
        """``router``: the Router deployment; None with ``router.in_gateway``, where this replica
        runs a ``RouterCore`` over the pools ``verifier`` and ``drafter`` itself."""
        self.cfg = cfg
        self.router = router
        self.core = RouterCore(self.cfg, verifier, drafter) if router is None else None
        info = load_target_info(self.cfg)
        r, lanes = self.cfg.router, self.cfg.gateway.lanes
        self.links = [self._link(f"lane/{i}") for i in range(lanes)]
        # each lane's Router admits session_groups x max_sessions_per_round; the rest wait here
        self.service = StreamService(
            self._stream,
            max_sessions=lanes * r.session_groups * r.max_sessions_per_round,
            max_queued=r.max_queued_requests,
            stream_retries=RESUME_RETRIES,
            retry_backoff_s=0.5,
            max_queue_wait_s=self.cfg.http_limits.max_queue_wait_s,
        )
        kind = self.cfg.drafter_spec.kind
        state.install(
            cs=RouterSessions(self._call) if self.cfg.backend == "torch" else None,
            cs_unavailable="client-server mode needs backend: torch (this server runs backend: vllm)",
            frontend=Frontend(
                self.service,
                info.tokenizer,
                max_model_len=info.max_model_len,
                stop_token_ids=info.stop_token_ids,
                model_name=self.cfg.model_name or self.cfg.target,
                weights=describe(self.cfg.load_format),
                speculation=Speculation(
                    enabled=self.cfg.drafter is not None,
                    num_speculative_tokens=self.cfg.num_speculative_tokens,
                    adaptive=self.cfg.adaptive_speculation,
                    needs_features=kind in ("moa", "eagle"),
                ),
                unsupported=(
                    Unsupported(
                        structured_output="structured output needs backend: torch (this server runs backend: vllm)",
                        logprobs="log-probabilities need backend: torch (this server runs backend: vllm)",
                    )
                    if self.cfg.backend == "vllm"
                    else Unsupported()
                ),
            ),
            ready=self.ready,
            retry_after_s=r.retry_after_s,
            stats=self.stats,
            access=Access.for_gateway(self.cfg, info.max_model_len, info.vocab_size),
        )  # keys, limits

    async def _call(self, method: str, *args, group: str | None = None, **kwargs):
        """One call to the Router (``group``: the affinity key), raising what the Router raised
        (``LinkLost``, ``QueueFullError``, ``CSError``, ...)."""
        if self.core is not None:
            return await getattr(self.core, method)(*args, group=group, **kwargs)
        try:
            return await detached(lambda: getattr(self.router, method).remote(*args, group=group, **kwargs))
        except Exception as exc:  # noqa: BLE001 - Ray wraps the replica's exception
            raise unwrapped(exc) from None

    def _link(self, lane: str) -> LaneLink:
        """The lane's link to its Router: one stream carrying all its sessions' commits."""

        async def connect(link: str):
            if self.core is not None:
                async with aclosing(self.core.lane(link, group=lane)) as batches:
                    async for batch in batches:
                        yield batch
                return
            batches = detached(lambda: self.router.options(stream=True).lane.remote(link, group=lane))
            try:
                async for batch in batches:
                    yield batch
            finally:  # the link is dropped here: the Router aborts its sessions
                batches.cancel()

        async def start(session: Session, link: str) -> None:
            await self._call("start", session, link, group=lane)

        async def cancel(session_id: str) -> None:
            await self._call("cancel", session_id, group=lane)

        return LaneLink(connect, start, cancel)

    def _stream(self, session: Session):
        """The rest of ``session`` from a Router replica, over its lane's link: its committed
        tokens are the prompt (a resumed session goes on from what this Gateway received)."""
        return self.links[lane_of(session.id, len(self.links))].open(session)

    async def stats(self) -> dict:
        """The Router replica of lane 0 (its rounds, pools, groups) and this Gateway's streams
        (``gateway``: admitted, resumed after a Router loss, ...)."""
        try:
            d = await asyncio.wait_for(self._call("stats", group="lane/0"), STATS_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - stats never fail for a busy or restarting Router
            d = {"router_error": type(exc).__name__}
        d["queue_depth"] = d.get("queue_depth", 0) + self.service.queue_depth
        d["gateway"] = self.service.stats.as_dict()
        return d

    async def ready(self):
        try:
            return await asyncio.wait_for(self._call("ready"), STATS_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - no live Router replica yet
            return False, {"router": {"error": type(exc).__name__}}
