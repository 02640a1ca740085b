"""Capturing a fixed-shape step as a CUDA graph, the one way the verifier's forward
(``verifier/torch/static_forward.py``) and the drafters' steps (``drafter/static_steps.py``) do it."""

from __future__ import annotations

from typing import Callable

import torch


def capture(body: Callable[[], torch.Tensor], device: torch.device, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Runs ``body`` once for real on a side stream (Triton compiles, cuBLAS and the allocator warm
    up; whatever it writes is the current inputs' own), then captures it into a graph on ``pool``.
    Returns (graph, its output tensor); replaying the graph recomputes that output from the same
    input buffers. Raises RuntimeError where an op cannot be captured."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = body()
    return graph, out
