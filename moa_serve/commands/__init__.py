"""The ``moa`` subcommands around the runtime (``bench``, ``vllm-bench``, ``fidelity``, ``regenerate``,
``cs-bench``, ``netem``) and the in-process client-server stack ``cs-bench`` runs; never imported by
the runtime."""
