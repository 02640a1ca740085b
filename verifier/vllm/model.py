"""vLLM's Llama with the drafter's features written inside the forward, so that a compiled or
CUDA-graph-captured forward still produces them (the vLLM backend's default path).

``MoALlamaForCausalLM`` subclasses vLLM's ``LlamaForCausalLM`` and is registered with vLLM's
``ModelRegistry``; ``VllmEngine`` selects it through ``hf_overrides={"architectures": [...]}``
for a target whose architecture is ``LlamaForCausalLM`` (Llama, SmolLM2, ...). It computes exactly
what the stock class computes, and also copies, in every forward:

* ``per_layer_kv`` (MoA): each layer's post-RoPE keys and its values, the tensors the layer hands
  to attention, into that layer's ``kept_k`` / ``kept_v`` rows [0, num_tokens);
* ``hidden`` (EAGLE-style): the final norm's output into the model's ``kept_hidden``.

The copies are plain in-place writes into module buffers (``kept[:n].copy_(rows)``): torch.compile
(vLLM's inductor pass on CPU, its piecewise compile on GPUs) keeps the buffer mutation and fuses
the write into the kernel that computes the rows, and a CUDA graph records it: each replay writes
the step's rows into the same buffers. The buffers hold ``max_num_batched_tokens`` rows, what one
step can carry (padding included). Every forward copies, drafts wanted or not: a decode step's
rows are a few KiB per layer, and a custom op that skipped its copy in steps without drafts cost
more than the copy, one Python dispatch per layer per forward (``docs/benchmarks.md#vllm-backend``).
What the rows mean (which request, which position) the proposer reads after the step from the
runner's own layout (``query_start_loc``, sequence lengths): nothing host-side runs inside the
forward.
"""

from __future__ import annotations

import torch

ARCHITECTURE = "MoALlamaForCausalLM"
BASE_ARCHITECTURE = "LlamaForCausalLM"
KINDS = ("per_layer_kv", "hidden")
CONFIG_KEY = "moa_kept_features"  # hf_config attribute naming the kind (set through hf_overrides)


def kind_of(features) -> str:
    """What the forward must keep for a drafter's ``FeatureSource``: the per-layer K/V it reads
    back from the cache (MoA), or the final hidden state (EAGLE-style)."""
    return "per_layer_kv" if features.from_cache else "hidden"


def overrides(kind: str) -> dict:
    """The ``hf_overrides`` that make vLLM build ``MoALlamaForCausalLM`` keeping ``kind``."""
    if kind not in KINDS:
        raise ValueError(f"unknown feature kind {kind!r}; one of {KINDS}")
    return {"architectures": [ARCHITECTURE], CONFIG_KEY: kind}


def register() -> None:
    """Registers the class with vLLM (idempotent; in the process that builds the engine)."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:{ARCHITECTURE}")


def supports(architectures: list[str] | None) -> bool:
    """Whether a target of these HF architectures can be served by the registered class."""
    return list(architectures or []) == [BASE_ARCHITECTURE]


def _keep(rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out[:n] = rows`` flattened to 2-D; n = the step's tokens (padding included)."""
    n = rows.shape[0]
    out[:n].copy_(rows.reshape(n, -1))


def _rows_buffer(rows: int, width: int) -> torch.Tensor:
    # built inside vLLM's model construction: default dtype and device are the model's
    return torch.zeros(rows, width)


def _classes():
    """The subclasses, built on first use (vLLM is an optional dependency)."""
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

    class KeepingAttention(LlamaAttention):
        """vLLM's ``LlamaAttention.forward`` with the post-RoPE K and V kept before attention."""

        def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
            qkv, _ = self.qkv_proj(hidden_states)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k = self.rotary_emb(positions, q, k)
            _keep(k, self.kept_k)
            _keep(v, self.kept_v)
            attn_output = self.attn(q, k, v)
            output, _ = self.o_proj(attn_output)
            return output

    class KeepingNorm(RMSNorm):
        """The final norm, its output kept."""

        def forward(self, x, residual=None):
            out = super().forward(x, residual)
            _keep(out[0] if isinstance(out, tuple) else out, self.kept_hidden)
            return out

    class MoALlamaForCausalLM(LlamaForCausalLM):
        def __init__(self, *, vllm_config, prefix: str = ""):
            config = vllm_config.model_config.hf_config
            kind = getattr(config, CONFIG_KEY, "per_layer_kv")
            if kind not in KINDS:
                raise ValueError(f"{CONFIG_KEY}={kind!r}; one of {KINDS}")
            rows = vllm_config.scheduler_config.max_num_batched_tokens

            class Layer(LlamaDecoderLayer):
                def __init__(self, vllm_config, prefix: str = ""):
                    attention = KeepingAttention if kind == "per_layer_kv" else LlamaAttention
                    super().__init__(vllm_config=vllm_config, prefix=prefix, attn_layer_type=attention)
                    if kind == "per_layer_kv":
                        a = self.self_attn
                        a.register_buffer("kept_k", _rows_buffer(rows, a.kv_size), persistent=False)
                        a.register_buffer("kept_v", _rows_buffer(rows, a.kv_size), persistent=False)

            super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=Layer)
            self.kept_kind = kind
            if kind == "hidden":
                if isinstance(self.model.norm, RMSNorm):  # the last pipeline rank holds it
                    self.model.norm = KeepingNorm(config.hidden_size, eps=config.rms_norm_eps)
                    self.model.norm.register_buffer(
                        "kept_hidden", _rows_buffer(rows, config.hidden_size), persistent=False
                    )

        def kept(self, num_tokens: int):
            """The last forward's kept rows [0, num_tokens): per layer (keys, values) [num_tokens,
            KVH * head_dim] each, or the final hidden states [num_tokens, hidden]. Views into the
            buffers: read them before the next forward."""
            if self.kept_kind == "hidden":
                return self.model.norm.kept_hidden[:num_tokens]
            return [
                (layer.self_attn.kept_k[:num_tokens], layer.self_attn.kept_v[:num_tokens])
                for layer in self.model.layers
            ]

    return MoALlamaForCausalLM


def __getattr__(name: str):
    if name == ARCHITECTURE:  # what ModelRegistry's "module:Class" path imports
        cls = _classes()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
