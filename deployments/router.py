"""The Router: holds the sessions and runs the RoundService, which batches the draft/verify rounds
of all its sessions; pool calls go through Ray Serve handles with session-group affinity.
``RouterCore`` is the Router itself; ``Router`` runs it as its own Ray Serve deployment behind the
Gateway (``router.in_gateway: false``), and with ``router.in_gateway: true`` each Gateway replica
runs one in its own process (``gateway.py``).

The Gateway calls it for generations (``lane``: one stream per lane carrying the commits of the
lane's sessions, ``start``, ``cancel``), for client-server sessions (``cs_*``), readiness and stats.
Its committed tokens are the source of truth for its pools; the Gateway keeps what it received, so a
stream this replica loses by dying is resumed on another Router replica.

Session groups are keyed ``"<this Router replica's id>/<i>"``: unique across Router replicas, so
the affinity router (``deployments/affinity.py``) can spread the groups of all Routers over all
pool replicas instead of every Router crowding the same ``0..n-1``."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from dataclasses import dataclass

from ray import serve
from ray.serve.handle import DeploymentHandle

from moa_serve.client_server.sessions import ClientSessions, Reply, ServerIdentity
from moa_serve.deployments import assignment
from moa_serve.deployments.config import AppConfig
from moa_serve.deployments.metrics import CallMetrics, PrometheusObserver
from moa_serve.deployments.stats import CallStats
from moa_serve.drafter.lookup import LookupTable
from moa_serve.drafter.registry import lookup_store
from moa_serve.engine.feature_policy import feature_policy
from moa_serve.engine.lanes import LaneHub
from moa_serve.engine.pool_calls import Pools
from moa_serve.engine.round_service import RoundService
from moa_serve.engine.session import Session
from moa_serve.engine.stream_service import StreamService
from moa_serve.model_files import load_tokenizer, read_config, resolve_model_path, stop_token_ids

log = logging.getLogger("ray.serve")


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return uuid.uuid4().hex[:8]


def detached(call):
    """Runs ``call`` (a ``handle.method.remote(...)``) outside the HTTP request that happens to
    be the current Serve request context. The group loops are tasks started while serving some
    request, so they inherit its context, and every pool call would carry that request's
    ``internal_request_id``. Ray's request router indexes pending requests by that id: two calls
    in flight with one id are matched to each other's replica, or one is never matched (calls
    hang until a timeout). A fresh context gives each call its own id."""
    try:
        from ray.serve.context import _RequestContext, _serve_request_context
    except ImportError:  # a Ray without these internals: nothing to detach from
        return call()

    def run():
        current = _serve_request_context.get()
        _serve_request_context.set(_RequestContext(app_name=getattr(current, "app_name", "")))
        return call()

    return contextvars.copy_context().run(run)


def router_lookup(cfg: AppConfig, max_sessions: int, max_model_len: int) -> LookupTable | None:
    """The prompt-lookup table a Router drafts with (``lookup`` / ``hybrid:``; ``+outputs``: with
    the target's earlier replies behind it), None when its drafter does not look up."""
    if not cfg.prompt_lookup:
        return None
    store, gate = lookup_store(cfg.drafter_spec, cfg.target)
    return LookupTable(max_sessions=max_sessions, max_model_len=max_model_len, store=store, store_gate=gate)


def group_keys(replica_id: str, n: int) -> list[str]:
    return [f"{replica_id}/{i}" for i in range(n)]


@dataclass
class TargetInfo:
    """What the Gateway and the Router read of the target (tokenizer and config, no weights)."""

    path: str
    tokenizer: object
    vocab_size: int
    max_model_len: int
    stop_token_ids: frozenset[int]


def load_target_info(cfg: AppConfig) -> TargetInfo:
    path = resolve_model_path(cfg.target, weights=False)  # tokenizer + config only
    tokenizer = load_tokenizer(path, cfg.load_format)
    hf_config = read_config(path)
    return TargetInfo(
        path,
        tokenizer,
        hf_config.vocab_size,
        min(cfg.max_model_len, hf_config.max_position_embeddings),
        stop_token_ids(path, tokenizer),
    )


class RouterCore:
    def __init__(self, cfg: AppConfig, verifier: DeploymentHandle, drafter: DeploymentHandle | None = None):
        self.cfg = cfg
        self.verifier = verifier
        self.drafter = drafter
        self.replica = _replica_id()
        info = load_target_info(self.cfg)
        r = self.cfg.router
        self.groups = group_keys(self.replica, r.session_groups)
        self.calls = CallStats()
        self._call_metrics = CallMetrics()
        kind = self.cfg.drafter_spec.kind
        if self.cfg.backend == "vllm":  # vLLM's scheduler batches the steps: one stream per session
            self.service = StreamService(
                self._stream, max_sessions=r.session_groups * r.max_sessions_per_round, max_queued=r.max_queued_requests
            )
        else:
            self.service = self._round_service(kind, info.max_model_len)
        # client-server mode: sessions drafted on the user's device, verified in the same rounds
        self._cs_identity_args = dict(
            model=self.cfg.model_name or self.cfg.target,
            tokenizer=info.tokenizer,
            drafter=self.cfg.feature_drafter,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            stop_token_ids=info.stop_token_ids,
        )
        self.cs = (
            ClientSessions(self.service, self._cs_identity, ttl_s=r.cs_session_ttl_s)
            if self.cfg.backend == "torch"
            else None
        )
        self.lanes = LaneHub(self.service, self.replica)

    # ------------------------------------------------------------------ the Gateway's calls
    # generations: ``group`` is the Gateway's lane (the affinity key); see engine/lanes.py
    async def lane(self, link: str, group: str | None = None):
        """A streaming call: the commits of the link's sessions, one batch per round."""
        async for batch in self.lanes.connect(link):
            yield batch

    async def start(self, session: Session, link: str, group: str | None = None) -> None:
        """Runs ``session`` in this replica's rounds, its commits sent over ``link``. Raises
        ``QueueFullError`` when the queue is full, ``LinkLost`` when the link is not here."""
        self.lanes.start(session, link)
        await asyncio.sleep(0)  # the round it woke prepares its verify call before this reply goes out

    async def cancel(self, session_id: str, group: str | None = None) -> None:
        self.lanes.cancel(session_id)

    async def cs_identity(self, group: str | None = None) -> ServerIdentity:
        return await self.cs.identity()

    async def cs_create(self, ids: list[int], group: str | None = None, **kwargs) -> tuple[str, Reply]:
        return await self.cs.create(ids, **kwargs)

    async def cs_verify(self, session_id: str, *args, group: str | None = None) -> tuple[Reply, str]:
        """A round's reply and the feature codec to frame it with."""
        reply = await self.cs.verify(session_id, *args)
        return reply, self.cs.feature_codec(session_id)

    async def cs_close(self, session_id: str, group: str | None = None) -> bool:
        return self.cs.close(session_id)

    def _round_service(self, kind: str | None, max_model_len: int) -> RoundService:
        r = self.cfg.router
        # prompt lookup runs here, on the tokens the Router holds: no call, no replica
        lookup = router_lookup(self.cfg, 2 * r.session_groups * r.max_sessions_per_round, max_model_len)
        options = r.round_options()
        # MoA features come from the verifier's K/V cache: skipped ones can be recomputed later;
        # devices of a client drafter the Router does not draft with get features all the same
        features = feature_policy(
            self.drafter is not None, recomputable=kind == "moa", remote_drafter=self.cfg.feature_drafter is not None
        )
        cut = self._cut_steps if r.decode_steps > 1 and r.cut_steps_for_newcomers else None
        return RoundService(
            Pools(self._verify, self._draft if self.drafter is not None else None, self._release, cut=cut),
            options,
            features=features,
            lookup=lookup,
            groups=self.groups,
            observer=PrometheusObserver(),
        )

    async def _cs_identity(self) -> ServerIdentity:
        """The handshake's identity; the target's fingerprint comes from a verifier replica (the
        Router holds no weights)."""
        info = await self.verifier.info.remote()
        return await asyncio.to_thread(
            ServerIdentity.build, target_fingerprint=info["target_fingerprint"], **self._cs_identity_args
        )

    async def _call(self, pool: str, method, requests, group):
        t0 = time.perf_counter()
        reply = await detached(lambda: method.remote(requests, group=group))
        call_s = time.perf_counter() - t0
        self.calls.record(pool, reply.replica, call_s, reply.compute_s, reply.queued_s)
        self._call_metrics.call(pool, call_s, reply.compute_s)
        return reply.results

    async def _stream(self, session):
        """backend vllm: one streaming call to a verifier replica for the rest of the session (its
        committed tokens are the prompt: a resumed session is re-prefilled)."""
        gen = detached(
            lambda: self.verifier.options(stream=True).generate.remote(
                list(session.tokens),
                session.max_new_tokens - session.num_generated,
                session.sampling.model_dump(),
                ignore_eos=not session.stop_token_ids,
            )
        )
        finished = False
        try:
            async for u in gen:
                if u.tokens:
                    self.calls.count("verifier", u.replica)
                finished = u.finish_reason is not None
                yield u
        finally:
            if not finished:
                gen.cancel()

    async def _verify(self, group, requests):
        return await self._call("verifier", self.verifier.verify, requests, group)

    async def _draft(self, group, requests):
        return await self._call("drafter", self.drafter.propose, requests, group)

    async def _cut_steps(self, group) -> None:
        await detached(lambda: self.verifier.cut_steps.remote(group=group))

    async def _release(self, group, session_ids: list[str]) -> None:
        calls = [detached(lambda: self.verifier.release.remote(session_ids, group=group))]
        if self.drafter is not None:
            calls.append(detached(lambda: self.drafter.release.remote(session_ids, group=group)))
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        if failed:
            raise failed[0]

    async def stats(self, group: str | None = None) -> dict:
        """This replica's rounds and sessions, work per pool replica and the round-time breakdown,
        for ``GET /v1/stats``; with backend vllm, also a verifier replica's engine and drafting
        counters."""
        d = {
            **self.service.stats.as_dict(),
            "queue_depth": self.service.queue_depth,
            "active_sessions": self.service.active_sessions,
            **self.calls.as_dict(),
        }
        d["backend"] = self.cfg.backend
        d["router_replica"] = self.replica
        try:  # one verifier replica's engine counters (torch: forwards, prefix cache; vllm: its engine)
            d["verifier_engine"] = await asyncio.wait_for(self.verifier.info.remote(), 5.0)
        except Exception as exc:  # noqa: BLE001 - stats never fail for a busy or restarting replica
            d["verifier_engine"] = {"error": type(exc).__name__}
        if self.cfg.backend == "vllm":
            return d
        d["groups"] = assignment.snapshot()
        d["speculation_governor"] = self.service.governor_snapshot()
        d["draft_gate"] = self.service.draft_gate_snapshot()
        d["client_server"] = self.cs.snapshot()
        return d

    async def ready(self, group: str | None = None):
        pools = {"verifier": self.verifier, **({"drafter": self.drafter} if self.drafter is not None else {})}
        detail = {}
        for name, handle in pools.items():
            try:
                detail[name] = await asyncio.wait_for(handle.info.remote(), 5.0)
            except Exception as exc:
                detail[name] = {"error": type(exc).__name__}
        ok = all("error" not in d for d in detail.values())
        return ok, {"pools": detail}


@serve.deployment(name="Router")
class Router(RouterCore):
    """``RouterCore`` as a Ray Serve deployment of its own: a standby replica takes a lane over
    when the lane's replica dies, and the Gateway resumes its streams there."""
