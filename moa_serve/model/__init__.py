"""The Llama-family model code the target and the MoA drafter share: ``layers``, ``target`` (the
target model), ``kv_cache`` (its per-session K/V), ``cuda_graphs`` (capturing a fixed-shape step)."""
