"""vLLM's Llama with the final norm's output kept inside the forward, for an EAGLE-style drafter,
so that a compiled or CUDA-graph-captured forward still produces it.

A MoA drafter's features — every layer's post-RoPE keys and values — need no model class: the
forward writes them into vLLM's paged KV cache, and the proposer gathers them from there after
the step (:mod:`moa_serve.verifier.vllm.paged_kv`). The final norm's output (``hidden``) is in
no cache. ``MoALlamaForCausalLM`` subclasses vLLM's ``LlamaForCausalLM`` and is registered with
vLLM's ``ModelRegistry``; ``VllmEngine`` selects it through ``hf_overrides={"architectures":
[...]}`` for an EAGLE-style drafter on a target whose architecture is ``LlamaForCausalLM``
(Llama, SmolLM2, ...). It computes exactly what the stock class computes, and also copies, in
every forward, the final norm's output into the model's ``kept_hidden`` rows [0, num_tokens).

The copy is a plain in-place write into a module buffer (``kept[:n].copy_(rows)``): torch.compile
(vLLM's inductor pass on CPU, its piecewise compile on GPUs) keeps the buffer mutation and fuses
the write into the kernel that computes the rows, and a CUDA graph records it: each replay writes
the step's rows into the same buffer. The buffer holds ``max_num_batched_tokens`` rows, what one
step can carry (padding included). What the rows mean (which request, which position) the
proposer reads after the step from the runner's own layout (``query_start_loc``, sequence
lengths): nothing host-side runs inside the forward.
"""

from __future__ import annotations

import torch

ARCHITECTURE = "MoALlamaForCausalLM"
BASE_ARCHITECTURE = "LlamaForCausalLM"
KINDS = ("per_layer_kv", "hidden")  # what a drafter reads; the registered class keeps "hidden"
CONFIG_KEY = "moa_kept_features"  # hf_config attribute naming the kind (set through hf_overrides)


def kind_of(features) -> str:
    """What a drafter's ``FeatureSource`` reads of the target: the per-layer K/V (MoA; from vLLM's
    paged cache), or the final hidden state (EAGLE-style; kept by the registered class)."""
    return "per_layer_kv" if features.from_cache else "hidden"


def overrides(kind: str) -> dict:
    """The ``hf_overrides`` that make vLLM build ``MoALlamaForCausalLM`` keeping ``kind``."""
    if kind != "hidden":
        raise ValueError(f"the registered class keeps the final hidden states, not {kind!r}")
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
    """The subclass, built on first use (vLLM is an optional dependency)."""
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.models.llama import LlamaForCausalLM

    class KeepingNorm(RMSNorm):
        """The final norm, its output kept."""

        def forward(self, x, residual=None):
            out = super().forward(x, residual)
            _keep(out[0] if isinstance(out, tuple) else out, self.kept_hidden)
            return out

    class MoALlamaForCausalLM(LlamaForCausalLM):
        def __init__(self, *, vllm_config, prefix: str = ""):
            config = vllm_config.model_config.hf_config
            kind = getattr(config, CONFIG_KEY, "hidden")
            if kind != "hidden":
                raise ValueError(f"{CONFIG_KEY}={kind!r}: the class keeps the final hidden states only")
            rows = vllm_config.scheduler_config.max_num_batched_tokens
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self.kept_kind = kind
            if isinstance(self.model.norm, RMSNorm):  # the last pipeline rank holds it
                self.model.norm = KeepingNorm(config.hidden_size, eps=config.rms_norm_eps)
                self.model.norm.register_buffer("kept_hidden", _rows_buffer(rows, config.hidden_size), persistent=False)

        def kept(self, num_tokens: int) -> torch.Tensor:
            """The last forward's final hidden states [num_tokens, hidden]: a view into the buffer
            (read it before the next forward)."""
            return self.model.norm.kept_hidden[:num_tokens]

    return MoALlamaForCausalLM


def __getattr__(name: str):
    if name == ARCHITECTURE:  # what ModelRegistry's "module:Class" path imports
        cls = _classes()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
