"""The served GPU check (tools/gpu/README.md#the-served-check): ``serve run`` of the one-GPU config
(deployments/configs/gpu-1x.yaml) measured against the project's own engine in the same run.

1. ``greedy``: the config's target and drafter served; greedy token ids over HTTP (``/v1/generate``),
   8 prompts one user at a time and 8 users at once, against ``moa generate --drafter none`` (the
   command, called in this process) for each prompt; the config ready time and whether ``serve run``
   left processes behind after Ctrl-C; ``/v1/stats`` and one Prometheus scrape.
2. ``synthetic``: the same config with a synthetic target (``load_format: dummy``, the
   Llama-3-8B shape on a GPU) and ``drafter: null``: the in-process engine's plain decoding at
   1 / 8 / 32 sessions, then closed-loop load at 1 / 8 / 32 users (openai_load.py, the client of
   the CPU benchmarks), each level with the Ray overhead per round and per verify call from the
   ``/v1/stats`` counters before and after it.

Results are written after every step (``served.json``, ``served.md``); the ``serve run`` logs and
the metrics scrape beside them. ``--device cpu`` runs the same steps on a CPU at toy size
(stories260k, a random MoA drafter), which is how it is exercised without a GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gc
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import httpx
import torch
import yaml

from moa_serve import cli
from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.loadtest import runner
from tools.gpu.harness import ResultFiles
from tools.prompts import STORY_PROMPTS

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deployments" / "configs" / "gpu-1x.yaml"
PROMPTS = STORY_PROMPTS[:8]
# per device: the served target and drafter, the synthetic target, new tokens, load seconds per level
PLANS = {
    "cuda": dict(
        target="HuggingFaceTB/SmolLM2-135M-Instruct",
        drafter="smollm2-135m-instruct-moa",
        synthetic="llama-3-8b-shape",
        dtype="bfloat16",
        greedy_tokens=64,
        load_tokens=128,
        load_s=20.0,
        max_model_len=2048,
    ),
    "cpu": dict(
        target="stories260k",
        drafter=None,  # a random MoA drafter for stories260k, written at the start
        synthetic=None,  # stories260k's config.json alone, written at the start (the word tokenizer)
        dtype="float32",
        greedy_tokens=24,
        load_tokens=24,
        load_s=10.0,
        max_model_len=256,
    ),
}
LEVELS = (1, 8, 32)


def log(msg: str) -> None:
    print(f"[served-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Results(ResultFiles):
    def __init__(self, out: Path, budget_s: float):
        super().__init__(out, "served", markdown, 1)
        self.budget_s = budget_s

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)


# ---------------------------------------------------------------------------------- serving


def derived_config(args, target: str, drafter: str | None, load_format: str, max_sessions: int, path: Path) -> Path:
    """gpu-1x.yaml with this run's target, drafter and device (on a CPU: no GPUs reserved, no
    CPUs either, so that it starts on any machine)."""
    cfg = yaml.safe_load(CONFIG.read_text())
    a = cfg["applications"][0]["args"]
    a.update(target=target, drafter=drafter, load_format=load_format, device=args.device, dtype=args.plan["dtype"])
    a["max_model_len"] = args.plan["max_model_len"]
    r = a["router"]
    r["max_sessions_per_round"] = max_sessions // r["session_groups"]
    for pool in ("verifier_pool", "drafter_pool"):
        a[pool]["max_sessions"] = max_sessions
    if args.device == "cpu":
        for part in ("router", "gateway", "verifier_pool", "drafter_pool"):
            a[part]["ray_actor_options"] = {"num_cpus": 0}
        a["verifier_pool"]["torch_threads"] = a["drafter_pool"]["torch_threads"] = 1
    path.write_text(
        f"# derived by tools/gpu/served_check.py from {CONFIG.name}\n" + yaml.safe_dump(cfg, sort_keys=False)
    )
    return path


@contextlib.contextmanager
def served(args, res: Results, sec: dict, config: Path, log_name: str):
    """``serve run CONFIG`` (its own Ray), ready within the time left; stopped with Ctrl-C after,
    recording how long it took to be ready and what it left running."""
    url_cfg, url = runner.derived_config(config, False, args.port, Path(tempfile.mkdtemp()))
    cluster = runner.Cluster(url_cfg, url, res.out / log_name, ready_timeout=max(30.0, min(240.0, res.left() - 30)))
    t = time.monotonic()
    try:
        cluster.start()
        sec["ready_s"] = round(time.monotonic() - t, 1)
        res.save()
        yield url
    finally:
        sid = cluster.proc.pid if cluster.proc is not None else None
        t = time.monotonic()
        cluster.stop()
        sec["stop_s"] = round(time.monotonic() - t, 1)
        if sid is not None:
            sec["left_running_after_stop"] = len(runner._session_pids(sid))
        res.save()


def generate_http(url: str, prompt: str, n: int) -> list[int]:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/generate", json=body, timeout=300)
    r.raise_for_status()
    return r.json()["token_ids"]


def stats(url: str) -> dict:
    return httpx.get(url + "/v1/stats", timeout=30).json()


def overhead(before: dict, after: dict) -> dict:
    """Ray's share between two ``/v1/stats`` snapshots: per verify / draft call, the call's wall time
    minus the pool's compute; per round, the round's wall time minus the pools' compute."""

    def total(d: dict, key: str) -> float:
        t = d.get("round_time_ms", {})
        pool = key.split("_")[0]
        return t.get(key, 0.0) * t.get(f"{pool}_calls", 0)

    out = {}
    for pool in ("verify", "draft"):
        calls = after.get("round_time_ms", {}).get(f"{pool}_calls", 0) - before.get("round_time_ms", {}).get(
            f"{pool}_calls", 0
        )
        out[f"{pool}_calls"] = calls
        if calls:
            call = total(after, f"{pool}_call_ms") - total(before, f"{pool}_call_ms")
            compute = total(after, f"{pool}_compute_ms") - total(before, f"{pool}_compute_ms")
            out[f"{pool}_call_ms"] = round(call / calls, 3)
            out[f"{pool}_compute_ms"] = round(compute / calls, 3)
            out[f"{pool}_overhead_ms"] = round((call - compute) / calls, 3)
    rounds = after.get("rounds", 0) - before.get("rounds", 0)
    out["rounds"] = rounds
    if rounds:
        round_ms = (after.get("round_s", 0.0) - before.get("round_s", 0.0)) * 1e3
        compute = sum(total(after, f"{p}_compute_ms") - total(before, f"{p}_compute_ms") for p in ("verify", "draft"))
        out["round_ms"] = round(round_ms / rounds, 3)
        out["pools_compute_ms_per_round"] = round(compute / rounds, 3)
        out["ray_overhead_ms_per_round"] = round((round_ms - compute) / rounds, 3)
        out["sessions_per_round"] = round(
            (after.get("sessions_in_rounds", 0) - before.get("sessions_in_rounds", 0)) / rounds, 2
        )
    return out


def scrape_metrics(out: Path) -> dict:
    """One scrape of the Ray node's Prometheus endpoint (the app's moa_* metrics and Serve's own):
    the lines that name moa_ or serve_ go to metrics.txt."""
    discovery = (
        Path(os.environ.get("RAY_TMPDIR", "/tmp/ray")) / "session_latest" / "prom_metrics_service_discovery.json"
    )
    targets = [t for group in json.loads(discovery.read_text()) for t in group.get("targets", [])]
    lines, names = [], set()
    for target in targets:
        text = httpx.get(f"http://{target}/metrics", timeout=10).text
        for line in text.splitlines():
            if "moa_" in line or "serve_" in line:
                lines.append(line)
                if not line.startswith("#"):
                    names.add(line.split("{")[0].split(" ")[0])
    (out / "metrics.txt").write_text("\n".join(lines) + "\n")
    return {
        "targets": targets,
        "series": len([x for x in lines if not x.startswith("#")]),
        "moa_metrics": sorted(n for n in names if "moa_" in n),
    }


# ---------------------------------------------------------------------------------- sections


def cli_greedy(args, prompt: str, n: int) -> dict:
    """``moa generate --drafter none --json`` for one prompt, called in this process."""
    argv = ["generate", "--target", args.plan["target"], "--drafter", "none", "--device", args.device]
    argv += ["--dtype", args.plan["dtype"], "--max-new-tokens", str(n), "--ignore-eos", "--json", "--prompt", prompt]
    argv += ["--max-model-len", str(args.plan["max_model_len"])]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(argv)
    if rc != 0:
        raise RuntimeError(f"moa {' '.join(argv)} exited {rc}")
    return json.loads(buf.getvalue().strip().splitlines()[-1])


def greedy_section(args, res: Results) -> None:
    sec = res.section("greedy")
    p = args.plan
    n = p["greedy_tokens"]
    sec.update(target=p["target"], drafter=p["drafter"], new_tokens=n, prompts=len(PROMPTS))
    refs = []
    for prompt in PROMPTS:
        refs.append(cli_greedy(args, prompt, n)["token_ids"])
    sec["reference"] = "moa generate --drafter none (one process, one session)"
    free()
    res.save()
    config = derived_config(args, p["target"], p["drafter"], "auto", 64, args.tmp / "greedy.yaml")
    with served(args, res, sec, config, "serve-greedy.log") as url:
        for users in (1, 8):
            t = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(users) as pool:
                got = list(pool.map(lambda q: generate_http(url, q, n), PROMPTS))
            same = [g == r for g, r in zip(got, refs)]
            first = next((i for i, s in enumerate(same) if not s), None)
            row = {"users": users, "identical": sum(same), "of": len(same), "s": round(time.perf_counter() - t, 2)}
            if first is not None:
                g, r = got[first], refs[first]
                row["first_divergence"] = {
                    "prompt": first,
                    "position": next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r))),
                }
            sec.setdefault("rows", []).append(row)
            res.save()
        s = stats(url)
        sec["stats"] = {
            k: s.get(k)
            for k in ("rounds", "mean_sessions_per_round", "mean_round_ms", "round_time_ms", "speculative", "replicas")
        }
        sec["stats"]["mean_accepted_length"] = s.get("mean_accepted_length")
        try:
            sec["metrics"] = scrape_metrics(res.out)
        except Exception as exc:  # noqa: BLE001 - the scrape is reported, the rest stands
            sec["metrics"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        res.save()
    sec["all_identical"] = all(r["identical"] == r["of"] for r in sec.get("rows", []))


def synthetic_section(args, res: Results) -> None:
    sec = res.section("synthetic")
    p = args.plan
    n, levels = p["load_tokens"], args.levels
    sec.update(target=p["synthetic"], load_format="dummy", drafter=None, max_tokens=n, load_s=args.load_s)
    # the in-process engine's plain decoding at each level's sessions, over the same prompts (on a
    # CPU with the verifier replica's threads)
    if args.device == "cpu":
        torch.set_num_threads(1)
    engine = SpeculativeEngine.load(
        p["synthetic"],
        None,
        p["dtype"],
        args.device,
        max_sessions=max(levels),
        max_model_len=p["max_model_len"],
        load_format="dummy",
    )
    prompts = [engine.tokenizer.encode(q) for q in PROMPTS]
    engine.generate(prompts[:1], 4, ignore_eos=True)  # warm-up (graph capture on a GPU)
    for b in levels:
        engine.max_batch = b
        batch = [prompts[i % len(prompts)] for i in range(b)]
        sync(args.device)
        t = time.perf_counter()
        engine.generate(batch, n, ignore_eos=True)
        sync(args.device)
        s = time.perf_counter() - t
        sec.setdefault("in_process", []).append({"sessions": b, "tokens_per_s": round(b * n / s, 1), "s": round(s, 2)})
        res.save()
    del engine
    free()
    questions = args.tmp / "questions.jsonl"
    questions.write_text("".join(json.dumps({"turns": [q]}) + "\n" for q in PROMPTS))
    config = derived_config(args, p["synthetic"], None, "dummy", max(levels), args.tmp / "synthetic.yaml")
    with served(args, res, sec, config, "serve-synthetic.log") as url:
        models = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
        sec["v1_models"] = models
        model = models["id"]
        generate_http(url, PROMPTS[0], 8)  # warm-up
        by_users = {r["sessions"]: r["tokens_per_s"] for r in sec["in_process"]}
        for users in levels:
            if res.left() < args.load_s + 20:
                sec.setdefault("served", []).append({"users": users, "skipped": "out of time"})
                continue
            before = stats(url)
            cmd = [sys.executable, str(args.client), "--base", url, "--model", model, "--questions", str(questions)]
            cmd += ["--users", str(users), "--duration", str(args.load_s), "--max-tokens", str(n)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.load_s + 300)
            after = stats(url)
            level = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {}
            row = {
                "users": users,
                **{k: level.get(k) for k in ("requests", "failures", "completion_tokens", "tok_per_s")},
            }
            if proc.returncode != 0:
                row["client_error"] = proc.stderr[-500:]
            if row.get("tok_per_s") and by_users.get(users):
                row["vs_in_process"] = round(row["tok_per_s"] / by_users[users], 3)
            row["ray"] = overhead(before, after)
            sec.setdefault("served", []).append(row)
            res.save()
            if not row.get("requests"):
                raise RuntimeError(f"no request succeeded at {users} user(s): {level.get('errors') or row}")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------- report


def lifecycle(sec: dict) -> str:
    return (
        f"ready {sec.get('ready_s')} s after serve run; Ctrl-C stopped it in {sec.get('stop_s')} s, "
        f"{sec.get('left_running_after_stop')} process(es) left running"
    )


def markdown(data: dict) -> str:
    m, s = data["meta"], data["sections"]
    out = [f"# Served check ({m.get('device', '?')}: {m.get('device_name', '?')})", ""]
    out.append(f"elapsed {m.get('elapsed_s')} s; torch {m.get('torch')}, ray {m.get('ray')}")
    g = s.get("greedy", {})
    if g:
        out += ["", f"## Greedy over HTTP vs `moa generate --drafter none` ({g.get('target')})", ""]
        out += [f"drafter {g.get('drafter')}; {lifecycle(g)}", ""]
        out += ["| users | identical | of | s |", "| ---: | ---: | ---: | ---: |"]
        out += [f"| {r['users']} | {r['identical']} | {r['of']} | {r['s']} |" for r in g.get("rows", [])]
        if "metrics" in g:
            out += ["", f"Prometheus: {json.dumps(g['metrics'])[:400]}"]
    y = s.get("synthetic", {})
    if y:
        out += ["", f"## Synthetic target {y.get('target')} (load_format dummy, drafter null)", ""]
        out += [f"{y.get('max_tokens')} tokens a request, {y.get('load_s')} s a level; {lifecycle(y)}", ""]
        ip = {r["sessions"]: r["tokens_per_s"] for r in y.get("in_process", [])}
        out += [
            "| users | served tok/s | in-process tok/s | served ÷ in-process | Ray ms per round "
            "| verify call overhead ms | sessions per round | failures |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in y.get("served", []):
            ray = r.get("ray", {})
            cells = [r["users"], r.get("tok_per_s", r.get("skipped")), ip.get(r["users"]), r.get("vs_in_process")]
            cells += [
                ray.get("ray_overhead_ms_per_round"),
                ray.get("verify_overhead_ms"),
                ray.get("sessions_per_round"),
            ]
            out.append("| " + " | ".join(str(c) for c in cells + [r.get("failures")]) + " |")
    for name, sec in s.items():
        if sec.get("error"):
            out += ["", f"**{name} failed**: {sec['error'].strip().splitlines()[-1][:300]}"]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--load-s", type=float, default=None, help="seconds of load per level (default: per device)")
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrent users of the synthetic load")
    ap.add_argument("--client", default=None, help="openai_load.py (default: ../shared/tools/ or $STAGED)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--sections", default="greedy,synthetic")
    args = ap.parse_args()
    args.plan = dict(PLANS[args.device])
    args.load_s = args.load_s or args.plan["load_s"]
    args.levels = [int(x) for x in args.levels.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.tmp = Path(tempfile.mkdtemp(prefix="served-check-"))
    candidates = [
        args.client,
        os.environ.get("STAGED", "") + "/openai_load.py",
        ROOT.parent / "shared/tools/openai_load.py",
    ]
    args.client = next((Path(c) for c in candidates if c and Path(c).is_file()), None)
    res = Results(out, args.budget_s)
    res.results["meta"].update(
        device=args.device,
        device_name=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        torch=torch.__version__,
        ray=__import__("ray").__version__,
        config=str(CONFIG.relative_to(ROOT)),
        client=str(args.client),
    )
    if args.device == "cpu":  # a random MoA drafter for stories260k; its shape alone as the synthetic target
        from moa_serve.drafter.checkpoint import init_drafter
        from moa_serve.model_files import resolve_model_path

        args.plan["drafter"] = str(init_drafter(args.plan["target"], args.tmp / "drafter", seed=0))
        shape = args.tmp / "stories260k-shape"
        shape.mkdir()
        (shape / "config.json").write_text((resolve_model_path(args.plan["target"]) / "config.json").read_text())
        args.plan["synthetic"] = str(shape)
    res.save()
    failed = False
    for name, fn in (("greedy", greedy_section), ("synthetic", synthetic_section)):
        if name not in args.sections.split(","):
            continue
        log(f"section {name} ({res.left():.0f} s left)")
        try:
            if name == "synthetic" and args.client is None:
                raise FileNotFoundError("no openai_load.py: pass --client or stage it (tools/gpu/prepare_served.sh)")
            fn(args, res)
            res.section(name)["status"] = "done"
        except Exception:  # noqa: BLE001 - reported; the next section still runs
            failed = True
            res.section(name).update(status="failed", error=traceback.format_exc()[-3000:])
            log(f"section {name} failed:\n{traceback.format_exc()}")
        res.save()
    res.results["meta"]["finished"] = True
    res.save()
    print((out / "served.md").read_text())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
