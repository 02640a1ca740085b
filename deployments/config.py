"""The application config that ``build_app(args)`` validates: the ``args`` block of a
``serve run`` YAML (deployments/configs/*.yaml) and of the KubeRay ``serveConfigV2``.

Checks that need no model files (sessions a Router admits against the sessions the pools
hold) run here, in the pydantic validator; the memory fit (KV cache + weights against a
replica's memory) needs the model configs and runs in ``build_app`` (``deployments/fit.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from moa_serve.app.auth import HttpAuthConfig
from moa_serve.app.limits import HttpLimitsConfig
from moa_serve.drafter.spec import DrafterSpec, parse_branching
from moa_serve.engine.options import RoundOptions

_ROUND = RoundOptions()  # the round's defaults: RouterConfig's fields below start from them


class ConfigError(ValueError):
    """A config that cannot work; the message says what to change."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AutoscalingConfig(_Strict):
    """Ray Serve ``autoscaling_config`` (the fields we set; Ray validates the rest). The Router
    Gateway scales on ongoing HTTP requests. A Router's ongoing calls are mostly its lane links (one
    long call per lane of the Gateway), so Routers are best run at a fixed count (min = max)."""

    min_replicas: int = Field(1, ge=0, description="replicas kept running however idle (0 = scale to zero)")
    max_replicas: int = Field(1, ge=1, description="most replicas the autoscaler starts")
    initial_replicas: int | None = Field(
        None, ge=0, description="replicas at deploy time; default: min_replicas (at least 1)"
    )
    target_ongoing_requests: float = Field(2.0, gt=0, description="ongoing requests per replica the autoscaler aims at")
    upscale_delay_s: float = Field(
        10.0, ge=0, description="how long load must stay above target before a replica is added"
    )
    downscale_delay_s: float = Field(
        60.0, ge=0, description="how long load must stay below target before a replica is removed"
    )
    look_back_period_s: float | None = Field(
        None, gt=0, description="window the metrics are averaged over (Ray's default 30 s)"
    )

    @model_validator(mode="after")
    def _range(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling_config.min_replicas must be <= max_replicas")
        return self


class PoolAutoscalingConfig(AutoscalingConfig):
    """A pool scales on the sessions its replicas hold (``SessionsPolicy``), not on calls: a
    call is a whole round of a session group, so the number of calls says little about load."""

    target_ongoing_requests: None = Field(
        None, exclude=True, description="not used by pools (refused when set): they scale on sessions"
    )
    target_sessions_per_replica: float | None = Field(
        None, gt=0, description="sessions per replica the pool scales to; default 3/4 of max_sessions"
    )

    @model_validator(mode="before")
    @classmethod
    def _no_calls_target(cls, data):
        if isinstance(data, dict) and data.get("target_ongoing_requests") is not None:
            raise ValueError(
                "pools scale on sessions, not calls: use autoscaling_config.target_sessions_per_replica "
                "instead of target_ongoing_requests"
            )
        return data


class RayActorOptions(_Strict):
    num_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves for one replica")
    num_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves for one replica (fractions share a GPU)")
    memory: int | None = Field(None, ge=0, description="bytes of memory Ray reserves for one replica")
    resources: dict[str, float] | None = Field(
        None,
        description="custom Ray resources one replica needs, e.g. {verifier_node: 1}: the replica is placed only "
        "on nodes started with that resource (ray start --resources), and rescheduled onto another such node when its "
        "node dies",
    )
    runtime_env: dict | None = Field(
        None, description="Ray runtime_env of the replica (e.g. env_vars for OpenMP settings)"
    )


def drain_field(default: float, what: str):
    """``graceful_shutdown_timeout_s`` of a deployment: how long a replica being replaced (an update,
    a scale-down, its node drained) keeps serving what it has before Ray stops it."""
    return Field(
        default,
        gt=0,
        description=f"seconds a replica that is being replaced keeps serving {what} before Ray stops it "
        "(Ray Serve's graceful_shutdown_timeout_s; it stops as soon as they are done)",
    )


# A Gateway replica holds its clients' streams: an update that replaces it lets the longest stream
# finish there (max_model_len tokens at full seats, with the pools restarting under it):
# docs/benchmarks.md#resilience. A Router's sessions resume on another Router from their committed
# tokens, and a pool replica holds only calls of one round each: Ray's default drain serves them.
STREAM_DRAIN_S = 600.0
SHORT_DRAIN_S = 20.0


class PoolConfig(_Strict):
    autoscaling_config: PoolAutoscalingConfig = Field(
        PoolAutoscalingConfig(), description="replica range and the sessions per replica the pool scales to"
    )
    ray_actor_options: RayActorOptions = Field(RayActorOptions(), description="resources of one replica")
    max_ongoing_requests: int = Field(
        16, ge=1, description="calls queued at one replica (forwards + releases of its groups)"
    )
    graceful_shutdown_timeout_s: float = drain_field(SHORT_DRAIN_S, "the calls it has (each one round)")
    max_sessions: int = Field(16, ge=1, description="sessions whose caches one replica holds")
    torch_threads: int | None = Field(None, ge=1, description="default: ray_actor_options.num_cpus")
    gpu_memory_gb: float = Field(80.0, gt=0, description="GiB of one GPU (device cuda): the memory fit check")
    memory_utilization: float = Field(
        0.9, gt=0, le=1.0, description="share of the replica's memory weights + caches may take"
    )

    def threads(self) -> int:
        """Threads of one replica's forward: ``torch_threads``, default its ``num_cpus``."""
        return self.torch_threads or max(1, int(self.ray_actor_options.num_cpus or 1))

    def target_sessions(self) -> float:
        t = self.autoscaling_config.target_sessions_per_replica
        return t if t is not None else max(1, math.floor(0.75 * self.max_sessions))


class VerifierPoolConfig(PoolConfig):
    max_num_batched_tokens: int = Field(512, ge=16, description="tokens per verify forward (chunked prefill budget)")
    prefix_caching: bool = Field(
        True,
        description="a new session starts from the longest prefix of its tokens "
        "already in the replica's KV cache (backend torch: finished sessions' slots are "
        "kept until a slot is needed; backend vllm: vLLM's automatic prefix caching, the "
        "drafter features of cached blocks kept beside it)",
    )
    kv_cache_gib: float | None = Field(
        None,
        gt=0,
        description="backend vllm: GiB of paged KV cache per replica (vLLM's kv_cache_memory_bytes); "
        "default: enough for max_sessions full contexts. Fewer blocks than that is allowed: vLLM preempts and "
        "recomputes a request when its cache is full",
    )
    enforce_eager: bool = Field(
        False,
        description="backend vllm: run vLLM's forward uncompiled (vLLM's enforce_eager: "
        "no torch.compile, no CUDA graphs). Off by default: a MoA drafter's K/V are read from "
        "vLLM's paged cache after the compiled step, an EAGLE-style drafter's hidden states kept "
        "inside the compiled forward for Llama-family targets (other architectures fall back "
        "to forward hooks, which turn this on themselves). On, a replica starts in seconds "
        "where compiling takes minutes on a small CPU",
    )


class RouterConfig(_Strict):
    in_gateway: bool = Field(
        False,
        description="run the Router inside each Gateway replica instead of as replicas of "
        "its own: a first token crosses one process fewer, a shorter time to first token "
        "(docs/benchmarks.md#the-router-inside-the-gateway), but a Router failure is then its Gateway's "
        "(no standby resumes the streams), each Gateway replica batches only its own users, and "
        "autoscaling_config, ray_actor_options, max_ongoing_requests and graceful_shutdown_timeout_s below "
        "do not apply",
    )
    autoscaling_config: AutoscalingConfig = Field(
        AutoscalingConfig(),
        description="Router replica range: as many as gateway.lanes, plus standbys that take a lane over when its "
        "Router dies (min = max: Ray would scale on ongoing calls, and a lane is one long call)",
    )
    ray_actor_options: RayActorOptions = Field(
        RayActorOptions(num_cpus=0.5), description="resources of one Router replica"
    )
    max_ongoing_requests: int = Field(
        256,
        ge=1,
        description="calls one Router replica serves at once (lane links, session starts, client-server rounds)",
    )
    graceful_shutdown_timeout_s: float = drain_field(
        SHORT_DRAIN_S,
        "its lanes; their sessions then resume on another Router from their committed tokens (a lane "
        "of a Gateway that is gone never ends by itself, so a long drain would only keep the replica)",
    )
    max_queued_requests: int = Field(
        _ROUND.max_queued,
        ge=0,
        description="waiting requests beyond which new ones get 429 (the Gateway's queue; each Router's too)",
    )
    max_sessions_per_round: int = Field(
        _ROUND.max_sessions_per_round, ge=1, description="sessions one session group admits (and verifies per round)"
    )
    session_groups: int = Field(
        2, ge=1, description="round loops per Router replica; >= 2 lets one group draft while another verifies"
    )
    speculation_token_budget: int = Field(
        _ROUND.speculation_token_budget, ge=0, description="draft tokens per round of a group, over all its sessions"
    )
    decode_steps: int = Field(
        _ROUND.decode_steps,
        ge=1,
        le=32,
        description="multi-step decoding: rounds without drafts, of at most "
        "multi_step_max_sessions sessions and with nobody queued, get up to this many tokens "
        "per session from one verify call (1 = one token per round)",
    )
    multi_step_max_sessions: int = Field(
        _ROUND.multi_step_max_sessions,
        ge=1,
        description="multi-step decoding applies to rounds of at most this many sessions",
    )
    verify_row_tile: int = Field(
        _ROUND.verify_row_tile,
        ge=1,
        le=64,
        description="rows the verifier's matmuls multiply together (the CPU's packed kernels: 4, a forward of "
        "5 to 8 rows costs what one of 8 does): prompt-lookup drafts fill the rows a round's last tile holds "
        "anyway, and open a further tile only where their chances of acceptance pay for all its rows (1 = "
        "every row priced alike)",
    )
    cut_steps_for_newcomers: bool = Field(
        True,
        description="a session admitted while a multi-step verify call runs "
        "asks the verifier to end that call's steps after the forward in progress, "
        "so its prompt goes out in the next call sooner (time to first token)",
    )
    lookahead: bool = Field(
        _ROUND.lookahead,
        description="verify-call pipelining: a round without drafts (none allowed, no "
        "features, no prompt prefilling, nobody queued) sends the next round's verify call before "
        "its own returns, each session continuing from the length it is predicted to hold, so the "
        "verifier does not wait for the Router between calls; a session that stops early costs a "
        "discarded row",
    )
    speculation_governor: bool = Field(
        _ROUND.speculation_governor,
        description="speculate only in rounds where it measurably pays "
        "(moving averages of ms per token on/off per batch size, with probes)",
    )
    retry_after_s: int = Field(
        2, ge=1, description="seconds in the Retry-After header of a 429 (queue full) or a 503 (not ready yet)"
    )
    cs_session_ttl_s: float = Field(
        300.0, gt=0, description="client-server mode: a session idle this long is dropped (its client resyncs)"
    )

    def round_options(self) -> RoundOptions:
        """The options of this Router's round service (each session group's round loop)."""
        return RoundOptions(
            max_sessions_per_round=self.max_sessions_per_round,
            max_queued=self.max_queued_requests,
            speculation_token_budget=self.speculation_token_budget,
            speculation_governor=self.speculation_governor,
            decode_steps=self.decode_steps,
            multi_step_max_sessions=self.multi_step_max_sessions,
            lookahead=self.lookahead,
            verify_row_tile=self.verify_row_tile,
        )


class GatewayConfig(_Strict):
    autoscaling_config: AutoscalingConfig = Field(
        AutoscalingConfig(),
        description="Gateway replica range; it scales on ongoing HTTP requests. Each Gateway "
        "keeps its own table of which Router replica holds a client-server session: with more than one, a device's "
        "calls may reach a Router without its session and resync (409)",
    )
    ray_actor_options: RayActorOptions = Field(
        RayActorOptions(num_cpus=0.25), description="resources of one Gateway replica"
    )
    max_ongoing_requests: int = Field(
        256, ge=1, description="HTTP requests one Gateway replica serves at once (running and queued)"
    )
    graceful_shutdown_timeout_s: float = drain_field(STREAM_DRAIN_S, "its HTTP streams, to the end of each")
    lanes: int = Field(
        1,
        ge=1,
        description="Router replicas that run generations at once: each lane sticks to one "
        "Router replica, whose rounds batch all of the lane's sessions; further Router replicas stand by "
        "and take a lane over when its replica dies. Lanes beyond the Router replicas share them",
    )


class AppConfig(_Strict):
    target: str = Field(description="Hugging Face id or local path of the target LLM")
    drafter: str | None = Field(
        None,
        description="drafter checkpoint folder (MoA, EAGLE-style or independent), "
        "'lookup' (prompt lookup, no model) or 'hybrid:<checkpoint>' (lookup where the "
        "text repeats, the checkpoint's drafts elsewhere); 'lookup+outputs' / "
        "'hybrid+outputs:<checkpoint>' look the target's earlier replies up too (the packs "
        "shipped for the target, or $MOA_OUTPUTS); null = no speculation",
    )
    client_drafter: str | None = Field(
        None,
        description="client-server mode (backend torch): the drafter checkpoint whose features devices read "
        "(a device runs it, or hybrid:<it>); default: the served drafter's checkpoint. Set it beside drafter: lookup "
        "or null to serve devices a drafter this server does not draft with: the verifier computes its features for "
        "device sessions only",
    )
    load_format: Literal["auto", "dummy"] = Field(
        "auto",
        description="auto: the target's weights from its folder; dummy: a synthetic target for benchmarks (as "
        "vLLM's load_format dummy): the architecture of the target's config.json (a Hugging Face folder, or a shape "
        "shipped under moa_serve/shapes, e.g. llama-3-8b-shape), random weights drawn on the device, no checkpoint "
        "read; a word-level tokenizer where the folder has none. Its output is noise; /v1/models and the logs say it "
        "is synthetic. Drafter: null or lookup (a trained drafter borrows the target's real tensors)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="auto: float32 on CPUs without native bf16, bfloat16 otherwise"
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="where the target and the drafters run")
    backend: Literal["torch", "vllm"] = Field(
        "torch",
        description="torch: the project's PyTorch verifier, rounds batched by the Router; vllm: stock vLLM "
        "runs the target (its scheduler batches every user's steps), drafts come from the drafter pool in one call "
        "per engine step ('lookup' = vLLM's n-gram proposer); needs pip install -e '.[vllm]'",
    )
    packed_weights: Literal["auto", "off"] = Field(
        "auto",
        description="auto: a float32 CPU verifier whose target is a GGUF keeps its Q4_1/Q8_0 blocks and "
        "de-quantizes them in registers (same float32 values, 5x fewer bytes read per forward, batch-invariant "
        "logits); off: plain float32 weights",
    )
    matmul_precision: Literal["highest", "medium", "low"] = Field(
        "highest",
        description="torch backend, packed CPU target (as torch.set_float32_matmul_precision): highest "
        "multiplies in float32; medium multiplies bfloat16-rounded activations and weights with float32 sums on CPUs "
        "with AVX512-BF16 (faster matmuls, docs/benchmarks.md#kernels), highest elsewhere; low rounds each "
        "activation row to 8-bit blocks and multiplies the GGUF's Q4_1/Q8_0 integers (llama.cpp's CPU arithmetic; "
        "any AVX2 CPU, the same tokens on every one). The output is that of the target computed so, "
        "batch-invariant in all three, so speculation stays lossless against it",
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="torch backend: the verifier's KV cache dtype (as vLLM's --kv-cache-dtype; auto = the "
        "target's dtype). bfloat16 under a float32 CPU target halves the cache and the bytes attention reads; K/V are "
        "rounded once when written, still batch-invariant (lossless against that target)",
    )
    static_forward: Literal["auto", "on", "off"] = Field(
        "auto",
        description="torch backend: the verifier's forward at fixed row counts over preallocated buffers, "
        "replayed from CUDA graphs (auto: on a GPU; on: also on a CPU, without capture; off: every forward planned "
        "for its call's shapes). A call larger than max_num_batched_tokens' largest row count runs planned",
    )
    batch_invariant: Literal["auto", "off"] = Field(
        "auto",
        description="torch backend on a GPU: auto = Triton matmuls with one tile configuration per weight "
        "and per-token attention, so a session's tokens do not depend on its batch (greedy speculation lossless in "
        "bfloat16 too); off = cuBLAS and SDPA (lossless in float32 up to near-ties). CPUs always run their "
        "batch-invariant kernels",
    )
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="most draft tokens per session per round (K)")
    adaptive_speculation: bool = Field(
        True,
        description="draft lengths adapt (at most num_speculative_tokens): backend torch, per session about as many "
        "tokens as recently accepted; backend vllm, per engine step the length with the most expected tokens per "
        "second from the step's measured cost per row, the draft call's and acceptance",
    )
    branching: str = Field(
        "chain",
        description="tree drafts (backend torch, greedy sessions): candidates per "
        "draft depth, e.g. '4-2' = the drafter's top 4 at the first depth and top 2 at the second "
        "are verified (the runners-up as leaves beside the drafted chain); '8-3-2@0.05': only "
        "candidates the drafter rates at least 0.05 (dynamic); alternatives are "
        "dropped, deepest first, where a round would exceed router.speculation_token_budget. "
        "'chain' = none",
    )
    max_model_len: int = Field(
        2048, ge=16, description="longest context (prompt + output) a session may reach; sizes the KV cache"
    )
    model_name: str | None = Field(None, description="name served by /v1/models; default: the target")
    gateway: GatewayConfig = Field(
        GatewayConfig(),
        description="the HTTP ingress: routes, tokenization, streams; "
        "resumes a generation on another Router replica when its Router dies",
    )
    http_auth: HttpAuthConfig = Field(HttpAuthConfig(), description="API keys (app/auth.py, docs/security.md)")
    http_limits: HttpLimitsConfig = Field(HttpLimitsConfig(), description="request limits (app/limits.py)")
    router: RouterConfig = Field(RouterConfig(), description="sessions and round scheduling, behind the Gateway")
    verifier_pool: VerifierPoolConfig = Field(
        VerifierPoolConfig(), description="replicas that run the target and verify drafts"
    )
    drafter_pool: PoolConfig = Field(
        PoolConfig(ray_actor_options=RayActorOptions(num_cpus=0.5)),
        description="replicas that run a trained drafter (deployed only when drafter names a checkpoint)",
    )

    @model_validator(mode="after")
    def _sessions_fit(self):
        problems = session_problems(self) + backend_problems(self) + client_problems(self) + synthetic_problems(self)
        if problems:
            raise ConfigError("this config cannot work:\n  - " + "\n  - ".join(problems))
        return self

    @property
    def drafter_spec(self) -> DrafterSpec:
        """``drafter`` parsed."""
        return DrafterSpec.parse(self.drafter)

    @property
    def drafter_checkpoint(self) -> str | None:
        """The trained drafter the drafter pool serves (None: no pool; pure prompt lookup runs in
        the Router)."""
        return self.drafter_spec.checkpoint

    @property
    def feature_drafter(self) -> str | None:
        """The checkpoint whose feature head the verifier runs: the served drafter's, else
        ``client_drafter`` (None: no features at all)."""
        return self.drafter_checkpoint or self.client_drafter

    @property
    def prompt_lookup(self) -> bool:
        """The Router drafts by prompt lookup (``lookup`` / ``hybrid:<checkpoint>``, ``+outputs`` too)."""
        return self.drafter_spec.lookup

    def pools(self) -> dict[str, PoolConfig]:
        return {
            "verifier_pool": self.verifier_pool,
            **({"drafter_pool": self.drafter_pool} if self.drafter_checkpoint else {}),
        }

    @property
    def router_replicas(self) -> AutoscalingConfig:
        """How many Routers run: the Router replicas, or with ``router.in_gateway`` one per Gateway replica."""
        return self.gateway.autoscaling_config if self.router.in_gateway else self.router.autoscaling_config

    @property
    def stream_drain_s(self) -> float:
        """How long a Gateway replica, which holds the clients' streams, keeps serving them once it
        is being replaced."""
        return self.gateway.graceful_shutdown_timeout_s


def session_problems(cfg: AppConfig) -> list[str]:
    """Sessions the Routers admit against the sessions the pools can hold."""
    r = cfg.router
    per_router = r.session_groups * r.max_sessions_per_round
    routers = cfg.router_replicas
    total = routers.max_replicas * per_router
    out = []
    if cfg.backend == "vllm":  # vLLM queues what its batch cannot take; the drafter rule is in backend_problems
        return out
    for name, pool in cfg.pools().items():
        if r.max_sessions_per_round > pool.max_sessions:
            out.append(
                f"router.max_sessions_per_round ({r.max_sessions_per_round}) > {name}.max_sessions "
                f"({pool.max_sessions}): a session group lives on one {name} replica, which cannot hold all "
                f"of its sessions; lower router.max_sessions_per_round or raise {name}.max_sessions"
            )
        cap = pool.max_sessions * pool.autoscaling_config.max_replicas
        if total > cap:
            out.append(
                f"the Routers may admit {total} sessions ({'gateway' if r.in_gateway else 'router'} max_replicas "
                f"{routers.max_replicas}"
                f" x session_groups {r.session_groups} x max_sessions_per_round {r.max_sessions_per_round}) but "
                f"{name} holds at most {cap} ({name}.max_sessions {pool.max_sessions} x max_replicas "
                f"{pool.autoscaling_config.max_replicas}); lower the Router side or raise the pool's"
            )
    return out


def backend_problems(cfg: AppConfig) -> list[str]:
    """What the vLLM backend cannot serve (and a tree shape that does not parse)."""
    try:
        tree = parse_branching(cfg.branching)
    except ValueError as exc:
        return [f"branching: {exc}"]
    if cfg.backend != "vllm":
        if cfg.verifier_pool.enforce_eager:
            return ["verifier_pool.enforce_eager is a vLLM-backend setting; backend torch: static_forward"]
        return []
    out = []
    if tree:
        out.append(f"branching {cfg.branching!r}: tree drafts need backend torch (vLLM verifies chains)")
    if cfg.matmul_precision != "highest":
        out.append(
            f"matmul_precision {cfg.matmul_precision!r} is a torch-backend setting; with backend vllm set "
            "dtype (bfloat16 multiplies in bf16)"
        )
    if cfg.kv_cache_dtype != "auto":
        out.append(
            f"kv_cache_dtype {cfg.kv_cache_dtype!r} is a torch-backend setting; with backend vllm the KV cache "
            "follows dtype"
        )
    if cfg.static_forward != "auto" or cfg.batch_invariant != "auto":
        out.append("static_forward and batch_invariant are torch-backend settings; vLLM captures its own CUDA graphs")
    if cfg.drafter_spec.outputs and cfg.drafter_checkpoint is None:
        out.append(
            f"drafter {cfg.drafter!r}: the output store is looked up in the Router's rounds (backend torch); "
            "with backend vllm use 'lookup' (vLLM's n-gram proposer)"
        )
    if cfg.drafter is not None and cfg.prompt_lookup and cfg.drafter_checkpoint is not None:
        out.append(
            f"drafter {cfg.drafter!r}: the hybrid drafter needs backend torch (its lookup runs in the Router's "
            "rounds); with backend vllm use 'lookup' (vLLM's n-gram proposer) or the checkpoint alone"
        )
    if cfg.drafter_checkpoint is not None and cfg.drafter_pool.max_sessions < cfg.verifier_pool.max_sessions:
        out.append(
            f"drafter_pool.max_sessions ({cfg.drafter_pool.max_sessions}) < verifier_pool.max_sessions "
            f"({cfg.verifier_pool.max_sessions}): with backend vllm every running request of a verifier replica "
            "drafts on one drafter replica, which must hold them all"
        )
    return out


def synthetic_problems(cfg: AppConfig) -> list[str]:
    """What a synthetic target (``load_format: dummy``) cannot be served with."""
    if cfg.load_format != "dummy":
        return []
    out = []
    if cfg.backend != "torch":
        out.append("load_format dummy: the synthetic target runs on backend torch")
    if cfg.feature_drafter is not None:
        out.append(
            f"load_format dummy with drafter {cfg.feature_drafter!r}: a trained drafter borrows the target's "
            "embeddings and LM head, which a synthetic target draws at random; use drafter: null or lookup"
        )
    return out


def client_problems(cfg: AppConfig) -> list[str]:
    """What ``client_drafter`` cannot be: the verifier runs one drafter's feature head."""
    if cfg.client_drafter is None:
        return []
    out = []
    client = DrafterSpec.parse(cfg.client_drafter)
    checkpoint = client.checkpoint
    if client.lookup:
        out.append(
            f"client_drafter {cfg.client_drafter!r}: name the trained checkpoint devices draft with (a device "
            "puts prompt lookup in front of it itself: moa client generate --drafter hybrid:<checkpoint>)"
        )
    if cfg.backend != "torch":
        out.append("client_drafter: client-server mode needs backend torch")
    if cfg.drafter_checkpoint is not None and checkpoint is not None and checkpoint != cfg.drafter_checkpoint:
        out.append(
            f"client_drafter {cfg.client_drafter!r} is not the served drafter's checkpoint "
            f"{cfg.drafter_checkpoint!r}: the verifier computes one drafter's features; leave client_drafter "
            "unset (devices then read the served drafter's) or serve drafter: lookup"
        )
    return out


def session_warnings(cfg: AppConfig) -> list[str]:
    """Configs that work but waste replicas or start below their load."""
    r = cfg.router
    routers = cfg.router_replicas
    groups_max = routers.max_replicas * r.session_groups
    start_routers = routers.initial_replicas or max(1, routers.min_replicas)
    out = []
    for name, pool in cfg.pools().items():
        a = pool.autoscaling_config
        if a.max_replicas > groups_max:
            out.append(
                f"{name}.max_replicas ({a.max_replicas}) > session groups of all Routers ({groups_max}): "
                f"a group lives on one replica, so replicas beyond {groups_max} never get work"
            )
        start = a.initial_replicas if a.initial_replicas is not None else max(1, a.min_replicas)
        admitted = start_routers * r.session_groups * r.max_sessions_per_round
        if admitted > start * pool.max_sessions:
            out.append(
                f"at start the Routers admit {admitted} sessions but {start} {name} replica(s) hold "
                f"{start * pool.max_sessions}: sessions are evicted and re-prefilled until the pool scales up"
            )
    return out


# Ray Serve's HAProxy ingress (RAY_SERVE_ENABLE_HA_PROXY=1) reloads on every change of replicas; a
# reloaded HAProxy's old process keeps its connections at most this long (Ray's default, seconds)
HAPROXY_HARD_STOP_ENV, HAPROXY_HARD_STOP_DEFAULT_S = "RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S", 120


def drain_warnings(cfg: AppConfig, env: dict[str, str]) -> list[str]:
    """A stream outlives its replica's drain only if the ingress keeps its connection as long."""
    drain = cfg.stream_drain_s
    if env.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        return []
    hard_stop = int(env.get(HAPROXY_HARD_STOP_ENV) or HAPROXY_HARD_STOP_DEFAULT_S)
    if hard_stop >= drain:
        return []
    return [
        f"{HAPROXY_HARD_STOP_ENV}={hard_stop} s is shorter than the streams' drain ({drain:g} s): a stream "
        f"that runs through an update is cut by the HAProxy reload after {hard_stop} s; set it to at least "
        f"{drain:g} where Ray starts (serve run, the Ray containers)"
    ]


# ---------------------------------------------------------------------------------------
# placement: the replicas' CPU and GPU reservations against the cluster's nodes

RESOURCES = ("CPU", "GPU")


@dataclass(frozen=True)
class Reservation:
    """What one deployment reserves: ``start`` replicas at deploy time (at least one: the first
    request scales a deployment at zero up), up to ``most``; ``cpus`` / ``gpus`` per replica."""

    deployment: str
    start: int
    most: int
    cpus: float
    gpus: float

    def per_replica(self, resource: str) -> float:
        return self.cpus if resource == "CPU" else self.gpus


def reservations(cfg: AppConfig) -> list[Reservation]:
    """Every deployment ``build_app`` deploys, by its Serve name, with its replicas' reservation."""

    def one(name: str, scaling: AutoscalingConfig, actor: RayActorOptions) -> Reservation:
        start = scaling.initial_replicas if scaling.initial_replicas is not None else scaling.min_replicas
        return Reservation(name, max(1, start), max(1, start, scaling.max_replicas), actor.num_cpus, actor.num_gpus)

    out = [one("Gateway", cfg.gateway.autoscaling_config, cfg.gateway.ray_actor_options)]
    if not cfg.router.in_gateway:
        out.append(one("Router", cfg.router.autoscaling_config, cfg.router.ray_actor_options))
    verifier = cfg.verifier_pool
    out.append(
        one(
            "VllmVerifier" if cfg.backend == "vllm" else "VerifierPool",
            verifier.autoscaling_config,
            verifier.ray_actor_options,
        )
    )
    if cfg.drafter_checkpoint is not None:
        out.append(one("DrafterPool", cfg.drafter_pool.autoscaling_config, cfg.drafter_pool.ray_actor_options))
    return out


_EPS = 1e-6  # Ray counts resources in units of 1e-4


def _fmt(x: float) -> str:
    return f"{x:g}"


def _unplaced(replicas: list[tuple[str, float, float]], nodes: list[dict[str, float]]) -> list[str]:
    """First fit, largest replicas first: the deployments of the replicas no node has room left for."""
    free = [{r: float(n.get(r, 0.0)) for r in RESOURCES} for n in nodes]
    left = []
    for name, cpu, gpu in sorted(replicas, key=lambda x: (x[2], x[1]), reverse=True):
        node = next((f for f in free if f["CPU"] + _EPS >= cpu and f["GPU"] + _EPS >= gpu), None)
        if node is None:
            left.append(name)
            continue
        node["CPU"] -= cpu
        node["GPU"] -= gpu
    return list(dict.fromkeys(left))


def placement_report(
    demands: list[Reservation], nodes: list[dict[str, float]], may_grow: bool = False
) -> tuple[list[str], list[str]]:
    """(problems, warnings) of placing ``demands`` on ``nodes`` (each node's total ``CPU`` /
    ``GPU``, as ``ray.nodes()`` reports them). A problem: the replicas at start do not all fit,
    so some would wait to be scheduled forever; with ``may_grow`` (a cluster whose autoscaler adds
    nodes) it is a warning naming the deployment that waits. A warning too: autoscaling up to
    ``max_replicas`` would reserve more than the cluster has. Custom resources are not checked."""
    problems, warnings, short = [], [], False
    start = [(d.deployment, d.cpus, d.gpus) for d in demands for _ in range(d.start)]
    for resource in RESOURCES:
        have = sum(float(n.get(resource, 0.0)) for n in nodes)
        used = [d for d in demands if d.per_replica(resource) > 0]
        need = sum(d.start * d.per_replica(resource) for d in used)
        if need > have + _EPS:
            short = True
            terms = " + ".join(f"{d.deployment} {d.start} x {_fmt(d.per_replica(resource))}" for d in used)
            # which replicas are left over, this resource alone counted
            waits = _unplaced(
                [(n, c if resource == "CPU" else 0.0, g if resource == "GPU" else 0.0) for n, c, g in start], nodes
            )
            text = (
                f"the replicas at start reserve {_fmt(need)} {resource}s ({terms}) but the cluster has "
                f"{_fmt(have)}: {', '.join(waits) or 'a replica'} would wait to be scheduled"
            )
            if may_grow:
                warnings.append(f"{text} until the cluster adds nodes")
            else:
                problems.append(
                    f"{text} forever; lower ray_actor_options.num_{resource.lower()}s (a deployment "
                    f"that computes little, such as the Gateway, may reserve 0) or start fewer replicas"
                )
        top = sum(d.most * d.per_replica(resource) for d in used)
        if need <= have + _EPS and top > have + _EPS:
            growing = [d for d in used if d.most > d.start]
            terms = " + ".join(f"{d.deployment} {d.most} x {_fmt(d.per_replica(resource))}" for d in used)
            warnings.append(
                f"at max_replicas the replicas reserve {_fmt(top)} {resource}s ({terms}), more than the "
                f"cluster's {_fmt(have)}: new {', '.join(d.deployment for d in growing)} replicas wait "
                f"for {resource}s{' until the cluster adds nodes' if may_grow else ''}"
            )
    if not short:  # the sums fit: does every replica fit on a node (several nodes)?
        waits = _unplaced(start, nodes)
        if waits:
            sizes = ", ".join(f"{_fmt(n.get('CPU', 0.0))} CPU / {_fmt(n.get('GPU', 0.0))} GPU" for n in nodes)
            text = (
                f"the replicas at start fit the cluster's totals but not its nodes ({sizes}): "
                f"{', '.join(waits)} would wait to be scheduled"
            )
            (warnings if may_grow else problems).append(text + (" until the cluster adds nodes" if may_grow else ""))
    return problems, warnings
