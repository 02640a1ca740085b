"""tools/side_by_side's own logic, and one whole run against a stand-in server and client."""

from __future__ import annotations

import json
import socket
import sys

import pytest

from tools.side_by_side import cli, sides


def test_categories_keep_only_their_questions_in_order(tmp_path):
    src = tmp_path / "q.jsonl"
    rows = [
        {"question_id": i, "category": c, "turns": [f"q{i}"]}
        for i, c in enumerate(["writing", "rag", "qa", "summarization", "rag"])
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dst = sides.questions_of(src, ["rag", "summarization"], tmp_path / "out.jsonl")
    assert [json.loads(ln)["question_id"] for ln in dst.read_text().splitlines()] == [1, 3, 4]
    with pytest.raises(ValueError, match="no question"):
        sides.questions_of(src, ["coding"], tmp_path / "none.jsonl")


def test_an_environment_variable_goes_to_the_side_it_names(tmp_path):
    repo = sides.repo_root()
    config = repo / "deployments" / "configs" / "local-cpu.yaml"
    a = cli.build_parser(repo).parse_args(
        [
            "--ours",
            f"fast={config}",
            "--ours",
            f"plain={config}",
            "--ours-env",
            "fast:RAY_SERVE_THROUGHPUT_OPTIMIZED=1",
            "--ours-env",
            "fast:A=b=c",
            "--out",
            str(tmp_path),
        ]
    )
    built = {s["label"]: s for s in sides.build_sides(a, repo, tmp_path)}
    assert built["ours/fast"]["env"]["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert built["ours/fast"]["env_shown"]["A"] == "b=c"
    assert "A" not in built["ours/plain"]["env_shown"]
    for bad in ("fast", "fast:X", ":X=1"):
        with pytest.raises(SystemExit):
            cli.build_parser(repo).parse_args(["--ours-env", bad])


FAKE_SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _json(self, body):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())

    def do_GET(self):
        self._json({"data": [{"id": "m"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._json({"choices": [{"message": {"content": "hi"}}]})

HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Handler).serve_forever()
"""
FAKE_CLIENT = """
import json, sys
users = int(sys.argv[sys.argv.index("--users") + 1])
print("a line that is not JSON")
print(json.dumps({"users": users, "tok_per_s": 10.0 * users, "latency_p50_s": 0.5, "requests": 3, "failures": 0}))
"""


def test_a_whole_run_starts_measures_and_stops_each_side(tmp_path):
    server = tmp_path / "llama-server"
    server.write_text(f"#!{sys.executable}\n" + FAKE_SERVER)
    server.chmod(0o755)
    client = tmp_path / "client.py"
    client.write_text(FAKE_CLIENT)
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"turns": ["q"], "category": "qa"}) + "\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    argv = ["--llama-server", str(server), "--llama-gguf", "G.gguf", "--llama-port", str(port)]
    argv += ["--client", str(client), "--questions", str(questions), "--users", "1,4", "--duration", "1"]
    assert cli.main([*argv, "--ttft-duration", "0", "--ready-timeout", "60", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    (side,) = res["sides"]
    assert side["label"] == "llama.cpp" and side["error"] is None and side["warmup"].startswith("HTTP 200")
    assert [lv["summary"]["tok_per_s"] for lv in side["levels"]] == [10.0, 40.0]
    assert res["meta"]["finished"] and "| llama.cpp | 4 | 40.00 |" in (out / "results.md").read_text()
    with socket.socket() as s:  # stopped: the port is free again
        assert s.connect_ex(("127.0.0.1", port)) != 0
