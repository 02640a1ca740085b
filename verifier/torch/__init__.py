"""The torch verifier backend: ``runner`` (verify calls over the per-session K/V slots and prefix
cache), ``static_forward`` and ``static_features`` (the fixed-shape forward a CUDA graph replays)."""
