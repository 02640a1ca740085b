"""In-process speculative generation (``moa generate``, ``moa bench``, tests): a proposer (or
none) and a verifier in this process, driven by the cluster's round service with local pools, so
every round runs the same code as a Router's."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import time
from dataclasses import dataclass, field

from moa_serve.drafter.proposer import MoAProposer
from moa_serve.drafter.registry import load_feature_source, load_proposer
from moa_serve.engine.events import Tracked
from moa_serve.engine.options import RoundOptions
from moa_serve.engine.pool_calls import Pools
from moa_serve.engine.round_service import RoundService
from moa_serve.engine.round_stats import ServiceStats
from moa_serve.engine.session import Session
from moa_serve.grammar import GrammarSpec
from moa_serve.model_files import load_tokenizer, resolve_model_path, stop_token_ids
from moa_serve.protocol import DraftRequest, DraftResult, VerifyRequest, VerifyResult
from moa_serve.sampling import GREEDY, SamplingParams
from moa_serve.verifier.torch.runner import RunnerOptions, TorchTargetRunner


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    mean_accepted_length: float
    elapsed_s: float
    text: str = ""
    timings: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


LOCAL_CALL_LIMIT_S = 1e9  # a local call cannot be interrupted: no time limit


def free_session(verifier: TorchTargetRunner, proposer, session_id: str) -> None:
    """Frees a session's caches in this process's verifier and proposer (if any)."""
    verifier.release(session_id)
    if proposer is not None:
        proposer.release(session_id)


class LocalPools:
    """This process's verifier and proposer as the round service's pools. The first exception a
    call raises is kept, so that the engine raises it (the service would turn it into a failed
    round or a round without drafts)."""

    def __init__(self, verifier: TorchTargetRunner, proposer):
        self.verifier, self.proposer = verifier, proposer
        self.error: BaseException | None = None

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:
            self.error = self.error or exc
            raise

    async def verify(self, group, requests: list[VerifyRequest]) -> list[VerifyResult]:
        return self._call(self.verifier.verify, requests)

    async def draft(self, group, requests: list[DraftRequest]) -> list[DraftResult]:
        return self._call(self.proposer.propose, requests)

    async def release(self, group, session_ids: list[str]) -> None:
        for sid in session_ids:
            free_session(self.verifier, self.proposer, sid)

    def raise_first_error(self) -> None:
        if self.error is not None:
            raise self.error


def _run(coro):
    """Runs ``coro`` to completion from synchronous code, also when this thread already runs an
    event loop (then on a thread of its own)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


@dataclass(eq=False)
class SpeculativeEngine:
    verifier: TorchTargetRunner
    proposer: MoAProposer | None
    tokenizer: object = None
    stop_ids: frozenset[int] = frozenset()
    max_batch: int = 16
    # verify tokens per round that bound every session's K (round_loop.speculation_cap); 0 = no
    # bound, so that benchmarks measure the K they ask for
    speculation_token_budget: int = 0
    # cumulative seconds, for benchmarks; the rounds of the last generate / run_round call
    timings: dict = field(default_factory=lambda: {"draft_s": 0.0, "verify_s": 0.0}, init=False)
    last_stats: ServiceStats = field(default_factory=ServiceStats, init=False)
    _ids: itertools.count = field(default_factory=itertools.count, init=False, repr=False)

    @classmethod
    def load(
        cls,
        target: str,
        drafter: str | None,
        dtype="float32",
        device="cpu",
        max_sessions=16,
        max_model_len=2048,
        packed_weights: str = "auto",
        matmul_precision: str = "highest",
        kv_cache_dtype: str = "auto",
        static_forward: str = "auto",
        load_format: str = "auto",
    ) -> "SpeculativeEngine":
        path = resolve_model_path(target)
        verifier = TorchTargetRunner(
            str(path),
            dtype,
            device,
            max_sessions,
            max_model_len,
            load_feature_source(drafter),
            options=RunnerOptions(
                packed_weights=packed_weights,
                matmul_precision=matmul_precision,
                kv_cache_dtype=kv_cache_dtype,
                static_forward=static_forward,
                load_format=load_format,
            ),
        )
        proposer = None
        if drafter is not None:
            proposer = load_proposer(
                drafter,
                target=target,
                dtype=dtype,
                device=device,
                max_sessions=max_sessions,
                max_model_len=verifier.max_model_len,
                target_model=verifier.model,
            )
        tok = load_tokenizer(path, load_format)
        return cls(verifier, proposer, tok, stop_token_ids(path, tok), max_sessions)

    @property
    def max_model_len(self) -> int:
        return self.verifier.max_model_len

    def new_session(
        self,
        prompt: list[int],
        max_new_tokens: int,
        sampling: SamplingParams = GREEDY,
        num_speculative_tokens: int = 4,
        ignore_eos: bool = False,
        adaptive_speculation: bool = False,
        grammar: GrammarSpec | None = None,
    ) -> Session:
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        return Session(
            f"s{next(self._ids)}",
            list(prompt),
            max_new_tokens,
            sampling,
            num_speculative_tokens if self.proposer is not None else 0,
            frozenset() if ignore_eos else self.stop_ids,
            self.max_model_len,
            drafter_needs_features=getattr(self.proposer, "needs_features", True),
            adaptive_speculation=adaptive_speculation,
            grammar=grammar,
        )

    def _service(self, sessions: int) -> tuple[RoundService, "LocalPools"]:
        """A round service over this process's verifier and proposer: the rounds of ``moa
        generate`` and ``moa bench`` are the cluster's. No governor (benchmarks measure the K they
        ask for), no retries (a failing local call is a bug: it is raised)."""
        pools = LocalPools(self.verifier, self.proposer)
        options = RoundOptions(
            max_sessions_per_round=self.max_batch,
            max_queued=max(1, sessions),
            speculation_token_budget=self.speculation_token_budget,
            speculation_governor=False,
            decode_steps=1,  # one forward per verify call: a round's numbers are one step's
            verify_retries=0,
            verify_timeout_s=LOCAL_CALL_LIMIT_S,
            draft_timeout_s=LOCAL_CALL_LIMIT_S,
            release_timeout_s=LOCAL_CALL_LIMIT_S,
        )
        service = RoundService(
            Pools(pools.verify, pools.draft if self.proposer is not None else None, pools.release), options
        )
        return service, pools

    def run_round(self, active: list[Session]) -> None:
        """One round over ``active`` (sessions from ``new_session``), through the round loop;
        finished sessions are released."""

        async def one_round():
            service, pools = self._service(len(active))
            batch = [Tracked(s, group=0) for s in active]
            await service.rounds.run(0, batch, batch)
            pools.raise_first_error()
            await pools.release(0, [s.id for s in active if s.finished])
            self._account(service)

        _run(one_round())

    def release(self, session_id: str) -> None:
        free_session(self.verifier, self.proposer, session_id)

    def generate_sessions(self, sessions: list[Session]) -> list[GenerationResult]:
        """Runs sessions to completion, up to ``max_batch`` verified together each round."""
        return _run(self._generate(sessions))

    async def _generate(self, sessions: list[Session]) -> list[GenerationResult]:
        service, pools = self._service(len(sessions))
        ended: dict[str, float] = {}

        async def drain(t: Tracked) -> None:
            async for _ in service.stream(t):
                pass
            ended[t.session.id] = time.perf_counter()

        try:
            tracked = [service.submit(s) for s in sessions]
            await asyncio.gather(*(drain(t) for t in tracked))
            pools.raise_first_error()
        finally:
            await service.stop()
            for s in sessions:  # the service releases before a group's next round: the last ones here
                self.release(s.id)
        self._account(service)
        for t in tracked:
            if t.session.finish_reason and t.session.finish_reason.startswith("error"):
                raise RuntimeError(f"session {t.session.id}: {t.session.finish_reason}")
        return [self._result(t.session, ended[t.session.id] - t.admitted) for t in tracked]

    def _account(self, service: RoundService) -> None:
        self.last_stats = service.stats
        if self.proposer is not None:  # without one, a round's "draft" part is bookkeeping only
            self.timings["draft_s"] += service.stats.draft_s
        self.timings["verify_s"] += service.stats.verify_s

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int = 128,
        sampling: SamplingParams = GREEDY,
        num_speculative_tokens: int = 4,
        ignore_eos: bool = False,
        adaptive_speculation: bool = False,
        grammar: GrammarSpec | None = None,
    ) -> list[GenerationResult]:
        sessions = [
            self.new_session(
                p, max_new_tokens, sampling, num_speculative_tokens, ignore_eos, adaptive_speculation, grammar
            )
            for p in prompts
        ]
        return self.generate_sessions(sessions)

    def _result(self, s: Session, elapsed: float) -> GenerationResult:
        text = self.tokenizer.decode(s.generated, skip_special_tokens=True) if self.tokenizer is not None else ""
        return GenerationResult(
            s.generated,
            s.finish_reason or "length",
            s.rounds,
            s.drafted,
            s.accepted,
            s.mean_accepted_length,
            elapsed,
            text,
        )
