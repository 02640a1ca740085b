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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script(path, source: str):
    """An executable Python script at ``path``."""
    path.write_text(f"#!{sys.executable}\n" + source)
    path.chmod(0o755)
    return path


def test_a_whole_run_starts_measures_and_stops_each_side(tmp_path):
    server = _script(tmp_path / "llama-server", FAKE_SERVER)
    client = tmp_path / "client.py"
    client.write_text(FAKE_CLIENT)
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"turns": ["q"], "category": "qa"}) + "\n")
    port = _free_port()
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


FAKE_SERVE = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
import yaml

cfg = yaml.safe_load(open(sys.argv[-1]))
routes = [app["route_prefix"] for app in cfg["applications"]]

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _json(self, body):
        known = any(self.path.startswith(r + "/") for r in routes)
        self.send_response(200 if known else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())

    def do_GET(self):
        self._json({"data": [{"id": "m"}]} if self.path.endswith("/v1/models") else {"rounds": 1})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._json({"choices": [{"message": {"content": "hi"}}]})

HTTPServer(("127.0.0.1", cfg["http_options"]["port"]), Handler).serve_forever()
"""
# the "def" application answers twice as fast as "off", and the client notes every slice's base URL
FAKE_SLICE_CLIENT = """
import json, sys
base, users = sys.argv[sys.argv.index("--base") + 1], int(sys.argv[sys.argv.index("--users") + 1])
name = base.rsplit("/", 1)[1] if base.endswith(("/def", "/off")) else "peer"
open(sys.argv[0] + ".order", "a").write(name + "\\n")
tokens = (20 if base.endswith("/def") else 10) * users
print(json.dumps({"users": users, "tok_per_s": tokens / 2.0, "completion_tokens": tokens, "wall_s": 2.0,
                  "requests": 1, "failures": 0}))
"""


def _together_args(repo, tmp_path, *extra):
    config = repo / "deployments" / "configs" / "local-cpu.yaml"
    return ["--together", "--ours-off", f"off={config}", "--ours", f"def={config}", "--out", str(tmp_path), *extra]


def test_together_serves_every_side_as_one_application_that_reserves_no_cpu(tmp_path):
    import yaml

    from tools.side_by_side import together

    repo = sides.repo_root()
    a = cli.build_parser(repo).parse_args(_together_args(repo, tmp_path, "--port", "8123"))
    built = sides.build_sides(a, repo, tmp_path)
    path = together.combined_config(built, "127.0.0.1", 8123, tmp_path / "together.yaml")
    cfg = yaml.safe_load(path.read_text())
    apps = {app["name"]: app for app in cfg["applications"]}
    assert set(apps) == {"def", "off"} and apps["off"]["route_prefix"] == "/off"
    assert apps["off"]["args"]["drafter"] is None and apps["def"]["args"]["drafter"] == "lookup+outputs"
    assert cfg["http_options"]["port"] == 8123 and cfg["http_options"]["host"] == "127.0.0.1"
    reservations = [
        pool["ray_actor_options"]["num_cpus"]
        for app in apps.values()
        for pool in app["args"].values()
        if isinstance(pool, dict) and "ray_actor_options" in pool
    ]
    assert len(reservations) == 6 and set(reservations) == {0}
    assert [s["url"] for s in built] == ["http://127.0.0.1:8123/def", "http://127.0.0.1:8123/off"]


def test_together_refuses_what_one_process_cannot_serve(tmp_path):
    from tools.side_by_side import together

    repo = sides.repo_root()
    config = repo / "deployments" / "configs" / "local-cpu.yaml"
    parse = cli.build_parser(repo).parse_args
    assert together.check_arguments(parse(_together_args(repo, tmp_path))) is None
    assert "two" in together.check_arguments(parse(["--together", "--ours", str(config)]))
    assert "--ours-env" in together.check_arguments(parse([*_together_args(repo, tmp_path), "--ours-env", "def:A=1"]))
    assert "--slices" in together.check_arguments(parse([*_together_args(repo, tmp_path), "--slices", "0"]))
    assert cli.main([*_together_args(repo, tmp_path), "--slices", "0"]) == 2


def test_a_together_run_serves_every_side_at_once_and_moves_the_load_in_passes(tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "python").symlink_to(sys.executable)
    _script(fake_bin / "serve", FAKE_SERVE)
    client = tmp_path / "client.py"
    client.write_text(FAKE_SLICE_CLIENT)
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"turns": ["q"], "category": "qa"}) + "\n")
    llama = _script(tmp_path / "llama-server", FAKE_SERVER)
    ports = port, llama_port = _free_port(), _free_port()
    repo, out = sides.repo_root(), tmp_path / "out"
    argv = _together_args(repo, out, "--port", str(port), "--ours-python", str(fake_bin / "python"), "--slices", "3")
    argv += ["--llama-server", str(llama), "--llama-gguf", "G.gguf", "--llama-port", str(llama_port)]
    argv += ["--client", str(client), "--questions", str(questions), "--users", "1,4", "--duration", "1"]
    assert cli.main([*argv, "--ttft-duration", "0", "--ready-timeout", "60", "--ray-stop", "never"]) == 0
    order = (tmp_path / "client.py.order").read_text().split()
    # per level: 3 passes, reversed every other; the peer served beside ours, in the same passes
    assert order == ["def", "off", "peer", "peer", "off", "def", "def", "off", "peer"] * 2
    res = json.loads((out / "results.json").read_text())
    by_label = {s["label"]: s for s in res["sides"]}
    assert [lv["pass"] for lv in by_label["ours/off"]["levels"]] == [0, 1, 2, 0, 1, 2]
    assert all("rounds" in lv["server_stats"] for lv in by_label["ours/def"]["levels"])
    md = (out / "results.md").read_text()
    # the ratios are to the --ours-off side, the peer's too
    assert "| 1 | 10.00 (2.00×, 2.00–2.00) | 5.00 | 5.00 (1.00×, 1.00–1.00) |\n" in md
    assert "| 4 | 40.00 (2.00×, 2.00–2.00) | 20.00 | 20.00 (1.00×, 1.00–1.00) |\n" in md
    for p in ports:  # both stopped: the ports are free again
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", p)) != 0


def test_steal_is_the_share_of_the_machines_ticks_the_hypervisor_took():
    from moa_serve.measure.cpu_steal import cpu_ticks, steal_percent

    assert steal_percent((1000, 10), (2000, 260)) == 25.0
    assert steal_percent((1000, 10), (1000, 10)) is None and steal_percent(None, (1, 0)) is None
    total, steal = cpu_ticks()  # this machine's, since boot
    assert total > 0 and 0 <= steal <= total
