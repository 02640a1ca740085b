"""Kernels: ``cpu`` (the C kernels the CPU forward multiplies and attends with), ``packed`` (weights
packed for them), ``gpu_invariant`` (the Triton kernels with the same fixed order on a GPU)."""
