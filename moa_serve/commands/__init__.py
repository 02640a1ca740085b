"""The ``moa`` subcommands around the runtime (``bench``, ``vllm-bench``, ``fidelity``, ``regenerate``,
``cs-bench``, ``netem``): their arguments and what they print; the harnesses they run and their reports
are in ``moa_serve/measure/``. Never imported by the runtime."""
