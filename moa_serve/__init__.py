"""MoA-Serve: lossless Mixture-of-Attentions speculative decoding on Ray Serve."""

import os

# Several model processes share the cores (verifier and drafter replicas, the router, load
# generators). OpenMP's default active waiting makes a forward collapse when its threads are
# not all scheduled: measured here, one SmolLM2 decode step took 1.9 s instead of 75 ms with a
# second 2-thread process on 2 cores. Threads that sleep when idle avoid that. This must be set
# before torch initialises OpenMP; a user's explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
