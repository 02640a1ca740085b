"""MoA-Serve: lossless Mixture-of-Attentions speculative decoding on Ray Serve."""

__version__ = "0.1.0"
