"""Single-process speculative generation: a proposer (or none) and a verifier in one process,
sessions batched round by round."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from moa_serve.drafter.proposer import MoAProposer
from moa_serve.engine import rounds
from moa_serve.sampling import GREEDY, SamplingParams
from moa_serve.engine.session import Session
from moa_serve.model_files import load_tokenizer, resolve_model_path
from moa_serve.verifier.torch_runner import TorchTargetRunner


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


def load_feature_head(drafter: str | None):
    """The verifier-side half of a drafter checkpoint (LSA + Ekv2E), or None."""
    if drafter is None:
        return None
    from moa_serve.drafter.checkpoint import DRAFT_VOCAB_KEY, load_drafter, model_checkpoint
    from moa_serve.drafter.model import MoADrafter

    drafter = model_checkpoint(drafter)  # prompt lookup needs no features
    if drafter is None:
        return None
    cfg, state = load_drafter(drafter)
    if cfg.kind != "moa":  # baselines: EAGLE-style reads the target's hidden states, independent nothing
        from moa_serve.drafter.baselines import HiddenFeatures

        return HiddenFeatures() if cfg.kind == "eagle" else None
    moa = MoADrafter(cfg)
    moa.load_flat_state_dict({k: v for k, v in state.items() if k != DRAFT_VOCAB_KEY})
    head = moa.feature_head
    # the drafter's CA reads only the freshest verified feature: the verifier computes no other one
    head.latest_only = bool(cfg.cross_attention_latest_only)
    return head


def stop_token_ids(path, tokenizer) -> frozenset[int]:
    ids = set()
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(str(path)).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class SpeculativeEngine:
    def __init__(self, verifier: TorchTargetRunner, proposer: MoAProposer | None, tokenizer=None,
                 stop_ids: frozenset[int] = frozenset(), max_batch: int = 16, speculation_token_budget: int = 0):
        self.verifier = verifier
        self.proposer = proposer
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        self.max_batch = max_batch
        # verify tokens per round that bound every session's K (rounds.speculation_cap); 0 = no
        # bound, so that benchmarks measure the K they ask for
        self.speculation_token_budget = speculation_token_budget
        self._ids = itertools.count()
        self.timings = {"draft_s": 0.0, "verify_s": 0.0}  # cumulative seconds, for benchmarks

    @classmethod
    def load(cls, target: str, drafter: str | None, dtype="float32", device="cpu", max_sessions=16,
             max_model_len=2048, packed_weights: str = "auto",
             matmul_precision: str = "highest", kv_cache_dtype: str = "auto") -> "SpeculativeEngine":
        path = resolve_model_path(target)
        verifier = TorchTargetRunner(str(path), dtype, device, max_sessions, max_model_len,
                                     load_feature_head(drafter), packed_weights=packed_weights,
                                     matmul_precision=matmul_precision, kv_cache_dtype=kv_cache_dtype)
        proposer = None
        if drafter is not None:
            from moa_serve.drafter.baselines import load_proposer  # picks MoA / EAGLE / independent by kind

            proposer = load_proposer(drafter, target=target, dtype=dtype, device=device, max_sessions=max_sessions,
                                        max_model_len=verifier.max_model_len, target_model=verifier.model)
        tok = load_tokenizer(path)
        return cls(verifier, proposer, tok, stop_token_ids(path, tok), max_sessions)

    @property
    def max_model_len(self) -> int:
        return self.verifier.max_model_len

    def new_session(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams = GREEDY,
                    num_speculative_tokens: int = 4, ignore_eos: bool = False,
                    adaptive_speculation: bool = False) -> Session:
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        return Session(f"s{next(self._ids)}", list(prompt), max_new_tokens, sampling,
                       num_speculative_tokens if self.proposer is not None else 0,
                       frozenset() if ignore_eos else self.stop_ids, self.max_model_len,
                       drafter_needs_features=getattr(self.proposer, "needs_features", True),
                       adaptive_speculation=adaptive_speculation)

    def run_round(self, active: list[Session]) -> list[rounds.Committed]:
        """One draft/verify/commit round with the same functions and delta protocol as the
        cluster's RoundService: a session the verifier no longer holds (``resync``) is verified
        again, whole, in the same round."""
        by_id = {s.id: s for s in active}
        drafts = {}
        t0 = time.perf_counter()
        if self.proposer is not None:
            cap = rounds.speculation_cap(self.speculation_token_budget, len(active))
            reqs = rounds.draft_requests(active, cap)
            if reqs:
                drafts = rounds.drafts_delivered(by_id, reqs, self.proposer.propose(reqs))
        t1 = time.perf_counter()
        want = self.proposer is not None
        results = rounds.by_session(by_id, self.verifier.verify(rounds.verify_requests(active, drafts, want)))
        again = rounds.resynced(by_id, results)
        if again:
            more = self.verifier.verify(rounds.verify_requests(again, drafts, want))
            results.update(rounds.by_session({s.id: s for s in again}, more))
        self.timings["draft_s"] += t1 - t0
        self.timings["verify_s"] += time.perf_counter() - t1
        done = rounds.commit(by_id, results, drafts)
        for s in active:
            if s.finished:
                self.release(s.id)
        return done

    def release(self, session_id: str) -> None:
        self.verifier.release(session_id)
        if self.proposer is not None:
            self.proposer.release(session_id)

    def generate_sessions(self, sessions: list[Session]) -> list[GenerationResult]:
        """Runs sessions to completion, up to ``max_batch`` verified together each round."""
        waiting = list(sessions)
        active: list[Session] = []
        started: dict[str, float] = {}
        ended: dict[str, float] = {}
        try:
            while waiting or active:
                while waiting and len(active) < self.max_batch:
                    s = waiting.pop(0)
                    started[s.id] = time.perf_counter()
                    active.append(s)
                self.run_round(active)
                for s in active:
                    if s.finished:
                        ended[s.id] = time.perf_counter()
                active = [s for s in active if not s.finished]
        finally:
            for s in active:
                self.release(s.id)
        return [self._result(s, ended[s.id] - started[s.id]) for s in sessions]

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 128, sampling: SamplingParams = GREEDY,
                 num_speculative_tokens: int = 4, ignore_eos: bool = False,
                 adaptive_speculation: bool = False) -> list[GenerationResult]:
        sessions = [self.new_session(p, max_new_tokens, sampling, num_speculative_tokens, ignore_eos,
                                     adaptive_speculation)
                    for p in prompts]
        return self.generate_sessions(sessions)

    def _result(self, s: Session, elapsed: float) -> GenerationResult:
        text = self.tokenizer.decode(s.generated, skip_special_tokens=True) if self.tokenizer is not None else ""
        return GenerationResult(s.generated, s.finish_reason or "length", s.rounds, s.drafted, s.accepted,
                                s.mean_accepted_length, elapsed, text)
