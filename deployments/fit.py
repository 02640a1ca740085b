"""Does a pool replica fit its memory? Weights + preallocated caches, on paper.

Verifier replica:  target weights (params x dtype bytes)
                 + KV cache = layers x 2 x kv_heads x head_dim x (max_model_len + 1) x max_sessions x dtype bytes
                 + logits of one forward = max_num_batched_tokens x vocab x 4 bytes
                 + on a GPU, the CUDA graphs' pool (the largest captured forward's activations)
Drafter replica:   the target's embeddings + LM head (+ the TLI layers) + the draft head
                 + its caches (MoA: self- and cross-attention layer, + TLI layers; EAGLE-style: one
                   layer; independent: its layers) over (max_model_len + 1) positions x max_sessions
against  cuda: gpu_memory_gb x num_gpus,  cpu: ray_actor_options.memory if set, else host RAM,
times ``memory_utilization`` (the rest is left to the CUDA context / allocator / activations).

``dtype: auto`` is counted as float32 on CPU (what it resolves to without native bf16: the worst
case) and bfloat16 on GPU. Only the model *configs* are read (``resolve_model_path(weights=False)``,
the drafter checkpoint's config and safetensors header), never weights.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from moa_serve.deployments.config import AppConfig, ConfigError, PoolConfig
from moa_serve.drafter.spec import PACKAGED, DrafterSpec, checkpoint_kind
from moa_serve.model_files import read_config, resolve_model_path

log = logging.getLogger(__name__)

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str, device: str) -> int:
    if dtype == "auto":
        return 4 if device == "cpu" else 2
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class ModelShape:
    """What the arithmetic needs of a Llama-family config."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    max_positions: int
    qkv_bias: bool = False

    @classmethod
    def from_hf(cls, c) -> "ModelShape":
        heads = c.num_attention_heads
        return cls(
            vocab=c.vocab_size,
            hidden=c.hidden_size,
            layers=c.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            intermediate=c.intermediate_size,
            tied=bool(getattr(c, "tie_word_embeddings", False)),
            max_positions=getattr(c, "max_position_embeddings", 1 << 30),
            qkv_bias=getattr(c, "model_type", "") == "qwen2" or bool(getattr(c, "attention_bias", False)),
        )

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        q = self.heads * self.head_dim
        attn = self.hidden * q + 2 * self.hidden * self.kv_width + q * self.hidden
        if self.qkv_bias:
            attn += q + 2 * self.kv_width
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * self.layer_params() + self.hidden

    def kv_bytes_per_token(self, nbytes: int) -> int:
        return self.layers * 2 * self.kv_width * nbytes


@dataclass(frozen=True)
class DrafterShape:
    kind: str  # moa | eagle | independent | lookup (prompt lookup: no weights)
    head_params: int  # the draft head's own parameters (what the drafter replica loads of the checkpoint)
    kv_width_per_token: int  # sum over its cache layers of kv_heads x head_dim
    tli_layers: int
    draft_vocab: int  # 0 = full vocabulary
    estimated: bool = False


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _local_drafter(name: str) -> Path | None:
    """The drafter's folder if it is on this machine (no hub download at build time)."""
    cands = [Path(name).expanduser(), PACKAGED / name]
    if os.environ.get("MOA_MODEL_DIR"):
        base = Path(os.environ["MOA_MODEL_DIR"]).expanduser()
        cands += [base / name, base / name.rstrip("/").split("/")[-1]]
    for c in cands:
        if (c / "config.json").is_file() and (c / "model.safetensors").is_file():
            return c
    return None


def drafter_shape(name: str, target: ModelShape) -> DrafterShape:
    ckpt = DrafterSpec.parse(name).checkpoint
    if ckpt is None:  # prompt lookup: token lists only, no weights
        return DrafterShape("lookup", 0, 0, 0, 0)
    name = ckpt
    path = _local_drafter(name)
    if path is None:  # on the hub only: size it as two target decoder layers (SA + CA), no TLI
        return DrafterShape("moa", 2 * target.layer_params(), 2 * target.kv_width, 0, 0, estimated=True)
    raw = json.loads((path / "config.json").read_text())
    shapes = _safetensors_shapes(path / "model.safetensors")
    draft_vocab = _numel(shapes.get("draft_vocab_ids", [0])) if "draft_vocab_ids" in shapes else 0
    kind = checkpoint_kind(raw)
    tli = int(raw.get("target_layer_inference", 0))
    if kind == "moa":
        head = sum(_numel(s) for k, s in shapes.items() if k.startswith(("self_attention.", "cross_attention.")))
        width = sum(
            shapes.get(f"{p}.self_attn.k_proj.weight", [target.kv_width])[0]
            for p in ("self_attention", "cross_attention")
        )
        width += tli * target.kv_width
    else:
        head = sum(_numel(s) for k, s in shapes.items() if k != "draft_vocab_ids")
        kv = int(raw.get("self_attention_num_key_value_heads") or target.kv_heads) * target.head_dim
        width = kv * (1 if kind == "eagle" else int(raw.get("num_layers") or 2))
        tli = 0
    return DrafterShape(kind, head, width, tli, draft_vocab)


@dataclass
class Fit:
    pool: str
    weights: int
    kv: int
    activations: int
    capacity: int
    capacity_of: str
    note: str = ""

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activations

    @property
    def ok(self) -> bool:
        return self.total <= self.capacity

    def describe(self) -> str:
        return (
            f"{self.pool}: weights {self.weights / GiB:.2f} GiB + KV cache {self.kv / GiB:.2f} GiB + "
            f"activations {self.activations / GiB:.2f} GiB = {self.total / GiB:.2f} GiB "
            f"{'<=' if self.ok else '>'} {self.capacity / GiB:.2f} GiB ({self.capacity_of}){self.note}"
        )


def host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def capacity(pool: PoolConfig, device: str) -> tuple[int, str]:
    a = pool.ray_actor_options
    u = pool.memory_utilization
    if device == "cuda":
        if a.num_gpus <= 0:
            raise ConfigError("device cuda but ray_actor_options.num_gpus is 0: the replica would get no GPU")
        return int(
            pool.gpu_memory_gb * GiB * a.num_gpus * u
        ), f"{u:g} x gpu_memory_gb {pool.gpu_memory_gb:g} x num_gpus {a.num_gpus:g}"
    if a.memory:
        return int(a.memory * u), f"{u:g} x ray_actor_options.memory"
    return int(host_memory() * u), f"{u:g} x host RAM"


def context_len(cfg: AppConfig, target: ModelShape) -> int:
    return min(cfg.max_model_len, target.max_positions)


def full_kv_bytes(cfg: AppConfig, target: ModelShape) -> int:
    """KV cache for max_sessions sessions at full context."""
    b = dtype_bytes(cfg.dtype if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype, cfg.device)
    return target.kv_bytes_per_token(b) * (context_len(cfg, target) + 1) * cfg.verifier_pool.max_sessions


def vllm_kv_bytes(cfg: AppConfig, target: ModelShape) -> int:
    """The paged KV cache a vLLM verifier replica allocates: ``kv_cache_gib`` or full contexts.
    vLLM refuses to start below one full-context request."""
    pool = cfg.verifier_pool
    if pool.kv_cache_gib is None:
        return full_kv_bytes(cfg, target)
    kv = int(pool.kv_cache_gib * GiB)
    one = target.kv_bytes_per_token(dtype_bytes(cfg.dtype, cfg.device)) * context_len(cfg, target)
    if kv < one:
        raise ConfigError(
            f"verifier_pool.kv_cache_gib {pool.kv_cache_gib:g} holds less than one request at "
            f"max_model_len {context_len(cfg, target)} ({one / GiB:.3f} GiB): vLLM would not start"
        )
    return kv


def graph_pool_bytes(cfg: AppConfig, target: ModelShape) -> int:
    """The CUDA graphs' memory pool of a torch verifier on a GPU (``verifier/torch/static_forward.py``):
    the largest captured forward's live activations, one layer's widest intermediates at a time
    (the fused gate/up output, its product, the fused q/k/v output, the attention output, the
    residual stream and its norm), the float32 partial sums of the widest split-K matmul
    (``gpu_invariant.tile_config``), the graph's output rows and the chunked attention's scratch
    (``gpu_invariant.attention_scratch_bytes``). 0 where nothing is captured."""
    if cfg.backend == "vllm" or cfg.device != "cuda":
        return 0
    from moa_serve.kernels.gpu_invariant import attention_scratch_bytes, tile_config
    from moa_serve.verifier.torch.static_forward import GRAPH_SIZES

    rows = max((s for s in GRAPH_SIZES if s <= cfg.verifier_pool.max_num_batched_tokens), default=0)
    b = dtype_bytes(cfg.dtype, cfg.device)
    q = target.heads * target.head_dim
    per_row = (3 * target.intermediate + (q + 2 * target.kv_width) + q + 5 * target.hidden) * b
    weights = [
        (q + 2 * target.kv_width, target.hidden),
        (target.hidden, q),
        (2 * target.intermediate, target.hidden),
        (target.hidden, target.intermediate),
    ]  # (N, K) of q/k/v, o, gate/up, down
    partials = [t.split * n for n, k in weights if (t := tile_config(n, k, b)).split > 1]
    per_row += 4 * max(partials, default=0)
    groups = target.heads // target.kv_heads
    scratch = attention_scratch_bytes(rows, target.kv_heads, groups, target.head_dim, context_len(cfg, target) + 1)
    return rows * per_row + scratch


def kept_feature_bytes(cfg: AppConfig, target: ModelShape) -> int:
    """Backend vllm with an EAGLE-style drafter: the buffer in which the registered model class
    (``verifier/vllm/model.py``) keeps the final hidden states inside the forward, one step's
    tokens (``max_num_batched_tokens``). A MoA drafter's per-layer K/V are read from vLLM's paged
    cache after the step: nothing is kept for it."""
    if cfg.backend != "vllm" or cfg.drafter_checkpoint is None:
        return 0
    if drafter_shape(cfg.drafter_checkpoint, target).kind != "eagle":
        return 0
    return cfg.verifier_pool.max_num_batched_tokens * target.hidden * dtype_bytes(cfg.dtype, cfg.device)


def verifier_fit(cfg: AppConfig, target: ModelShape) -> Fit:
    b = dtype_bytes(cfg.dtype, cfg.device)
    pool = cfg.verifier_pool
    vllm = cfg.backend == "vllm"
    kv = vllm_kv_bytes(cfg, target) if vllm else full_kv_bytes(cfg, target)
    activations = (
        pool.max_num_batched_tokens * target.vocab * 4 + graph_pool_bytes(cfg, target) + kept_feature_bytes(cfg, target)
    )
    cap, of = capacity(pool, cfg.device)
    return Fit("verifier_pool", target.params() * b, kv, activations, cap, of, " [vLLM paged KV cache]" if vllm else "")


def drafter_fit(cfg: AppConfig, target: ModelShape, drafter: DrafterShape) -> Fit:
    b = dtype_bytes(cfg.dtype, cfg.device)
    pool = cfg.drafter_pool
    borrowed = target.vocab * target.hidden * (1 if target.tied else 2) + drafter.tli_layers * target.layer_params()
    restricted_head = drafter.draft_vocab * target.hidden
    weights = (borrowed + drafter.head_params + restricted_head) * b
    kv = 2 * drafter.kv_width_per_token * b * (context_len(cfg, target) + 1) * pool.max_sessions
    draft_vocab = drafter.draft_vocab or target.vocab
    logits = pool.max_sessions * draft_vocab * 4 * 2  # one drafting step's logits (+ probabilities when sampling)
    cap, of = capacity(pool, cfg.device)
    note = " [draft head estimated: checkpoint not on this machine]" if drafter.estimated else ""
    return Fit("drafter_pool", weights, kv, logits, cap, of, note)


def target_shape(cfg: AppConfig) -> ModelShape:
    return ModelShape.from_hf(read_config(resolve_model_path(cfg.target, weights=False)))


def fits(cfg: AppConfig, target: ModelShape | None = None, drafter: DrafterShape | None = None) -> list[Fit]:
    target = target or target_shape(cfg)
    out = [verifier_fit(cfg, target)]
    if cfg.drafter_checkpoint is not None:
        out.append(drafter_fit(cfg, target, drafter or drafter_shape(cfg.drafter, target)))
    return out


def misfit(results: list[Fit]) -> str | None:
    """What to say of the replicas that do not fit their memory (None: all fit)."""
    bad = [f for f in results if not f.ok]
    if not bad:
        return None
    return (
        "this config cannot work: a replica's weights and caches do not fit its memory\n  - "
        + "\n  - ".join(f.describe() for f in bad)
        + "\n  lower max_sessions or max_model_len, or give the replica more memory "
        "(gpu_memory_gb / num_gpus / ray_actor_options.memory)"
    )


def host_warnings(cfg: AppConfig, results: list[Fit]) -> list[str]:
    """A CPU config without ``ray_actor_options.memory`` is sized against this host's RAM, replica by
    replica: whether all replicas at ``max_replicas`` together fit it too (one machine, not a cluster)."""
    if cfg.device != "cpu" or any(p.ray_actor_options.memory is not None for p in cfg.pools().values()):
        return []
    pools = cfg.pools()
    need = sum(f.total * pools[f.pool].autoscaling_config.max_replicas for f in results)
    if need <= host_memory():
        return []
    return [
        f"all pool replicas together need {need / GiB:.1f} GiB, more than this host's "
        f"{host_memory() / GiB:.1f} GiB: fine on a multi-node cluster, not on one machine"
    ]


def check_fit(cfg: AppConfig, target: ModelShape | None = None, drafter: DrafterShape | None = None) -> list[Fit]:
    """Raises ConfigError naming every replica that does not fit; returns the arithmetic."""
    results = fits(cfg, target, drafter)
    message = misfit(results)
    if message:
        raise ConfigError(message)
    return results
