"""The GPU training run (``tools/gpu/train_run.sh``): self-distillation, MoA and EAGLE-style
drafters trained in one loop on the same data with the same seeds, and the budget curve (held-out
τ against tokens trained), within one time budget.

1. **Data**: the shipped packs of the target's replies are unpacked (``--packs``; a pack a
   previous run brought back, ``--pack-in``, too), then ``moa regenerate`` answers more of the
   corpus, every conversation and every turn, batched on the device, for ``--regen-minutes``
   (resumable: what it writes is packed into ``$OUT`` for the next run).
2. **Training**: ``drafter/configs/smollm2-135m-gpu.yaml`` (``key=value`` overrides) with its
   schedule set to the largest budget point; at each point (tokens trained) the two drafters are
   exported and measured with ``moa bench`` (13 Spec-Bench categories, one question each, their
   second turns included, ``--max-new-tokens`` 64, K = 5).
3. **Stops on time**: training to the next point stops where the budget would leave no time to
   measure it; the state then reached is measured as the last point (``"reached": false``).
   ``curve.json`` is written after every point, so a run cut short keeps what it measured.

Outputs under ``--out`` (at most 8 files of at most 16 MiB): ``curve.json``, the last point's
checkpoints as ``<kind>.tar.part-NN`` (``cat <kind>.tar.part-* | tar x``) and
``selfdistill.jsonl.gz`` (every reply written so far, for ``--pack-in`` next time);
``train_run.sh`` adds ``log.txt`` and ``nvidia-smi.csv``.

``--cpu-smoke`` runs all of it on a CPU with stories260k at a tiny size (a few minutes at most).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_PACKS = [
    ROOT / "drafter/selfdistill/smollm2-135m-instruct-first-turns.jsonl.gz",
    ROOT / "drafter/selfdistill/smollm2-135m-instruct-all-turns.jsonl.gz",
]
PART_BYTES = 15 * 1024 * 1024  # below $OUT's 16 MiB per file
KINDS = ("moa", "eagle")
# the smoke run's training sizes (before the command line's key=value overrides)
SMOKE_OVERRIDES = [
    "batch_size=4",
    "max_len=96",
    "max_prompt=32",
    "draft_vocab_size=256",
    "value_readout_layers=2",  # stories260k has 5 layers
    "amp=float32",
    "target_dtype=float32",
    "loader_workers=0",
    "lr=3e-3",
    "warmup_steps=2",
    "log_every=10",
]


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.gpu.train_curve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the folder that comes back ($OUT)")
    ap.add_argument(
        "--work", default=None, help="scratch folder, kept for a rerun to go on from (default: <out>/../moa-train-work)"
    )
    ap.add_argument("--budget-s", type=float, default=510.0, help="the whole run's wall-clock budget")
    ap.add_argument("--target", default="HuggingFaceTB/SmolLM2-135M-Instruct", help="model folder or name")
    ap.add_argument("--data-dir", default="../shared/data/train", help="the corpus (conversations, JSONL)")
    ap.add_argument("--questions", default="../shared/data/specbench/question.jsonl", help="Spec-Bench questions")
    ap.add_argument("--config", default=str(ROOT / "drafter/configs/smollm2-135m-gpu.yaml"))
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--points", default="1e6,3e6,1e7,3e7,1e8", help="tokens trained at which τ is measured")
    ap.add_argument("--packs", default="shipped", help="packs of replies to start from: shipped, none, or files")
    ap.add_argument("--pack-in", default=None, help="a selfdistill.jsonl.gz a previous run brought back")
    ap.add_argument("--regen-minutes", type=float, default=2.0, help="time for moa regenerate (0: none)")
    ap.add_argument("--regen-batch", type=int, default=256)
    ap.add_argument("--regen-max-new-tokens", type=int, default=256)
    ap.add_argument("--regen-dtype", default="bfloat16")
    ap.add_argument("--system-prompt-share", type=float, default=0.5, help="as the shipped all-turns pack")
    ap.add_argument("--bench-max-new-tokens", type=int, default=64)
    ap.add_argument("--bench-per-category", type=int, default=1)
    ap.add_argument("--bench-limit", type=int, default=0, help="at most this many questions (0: one per category)")
    ap.add_argument("--bench-max-model-len", type=int, default=2048)
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--bench-dtype", default="float32", help="float32: greedy identity is exact")
    ap.add_argument("--bench-reserve-s", type=float, default=90.0, help="time kept for one τ measurement")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--cpu-smoke", action="store_true", help="the whole run on a CPU, stories260k, tiny")
    ap.add_argument("overrides", nargs="*", default=[], help="key=value overrides of the training config")
    if "--cpu-smoke" in argv:  # the smoke run's sizes; options given on the command line still win
        ap.set_defaults(**smoke_defaults())
    return ap.parse_args(argv)


def smoke_defaults() -> dict:
    model_dir = Path(os.environ.get("MOA_MODEL_DIR", ROOT.parent / "shared" / "models"))
    return dict(
        target=str(model_dir / "stories260k"),
        device="cpu",
        packs="none",
        system_prompt_share=0.0,  # stories260k has no chat template
        regen_dtype="float32",
        threads=2,
        points="1500,3000",
        regen_minutes=0.01,  # one chunk
        regen_batch=4,
        regen_max_new_tokens=24,
        bench_max_new_tokens=8,
        bench_limit=2,
        bench_max_model_len=512,
        bench_reserve_s=30.0,
        budget_s=170.0,
    )


class Run:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.t0 = time.monotonic()
        self.deadline = self.t0 + a.budget_s
        self.out = Path(a.out)
        self.work = Path(a.work) if a.work else self.out.resolve().parent / "moa-train-work"
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.curve = {
            "target": a.target,
            "device": a.device,
            "device_name": _device_name(a.device),
            "config": a.config,
            "overrides": (SMOKE_OVERRIDES if a.cpu_smoke else []) + a.overrides,
            "points_planned": _points(a.points),
            "bench": {
                "questions": a.questions,
                "per_category": a.bench_per_category,
                "limit": a.bench_limit,
                "max_new_tokens": a.bench_max_new_tokens,
                "k": a.k,
                "dtype": a.bench_dtype,
            },
            "budget_s": a.budget_s,
            "phases": {},
            "points": [],
        }

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, **event) -> None:
        print(json.dumps({"t": round(time.monotonic() - self.t0, 1), **event}), flush=True)

    def write_curve(self) -> None:
        tmp = self.out / "curve.json.tmp"
        tmp.write_text(json.dumps(self.curve, indent=2) + "\n")
        os.replace(tmp, self.out / "curve.json")

    # ------------------------------------------------------------------ 1. data
    def data(self) -> Path:
        from moa_serve.measure.regenerate_replies import pack, regenerate, unpack

        a, root = self.a, self.work / "selfdistill"
        t = time.monotonic()
        packs = [] if a.packs == "none" else SHIPPED_PACKS if a.packs == "shipped" else a.packs.split(",")
        if a.pack_in:
            packs.append(a.pack_in)
        if not (root / "self").is_dir():  # a rerun on the same machine goes on from what is there
            for p in packs:
                unpack(str(p), a.data_dir, str(root))
        # regeneration leaves time to train and measure at least one point (0 minutes: none at all)
        minutes = min(a.regen_minutes, max(0.0, (self.left() - 3 * a.bench_reserve_s) / 60))
        if minutes > 0:
            regenerate(
                a.target,
                a.data_dir,
                str(root),
                per_file=0,
                max_new_tokens=a.regen_max_new_tokens,
                batch=a.regen_batch,
                dtype=a.regen_dtype,
                device=a.device,
                all_turns=True,
                system_prompt_share=a.system_prompt_share,
                max_minutes=minutes,
            )
        self.release_device_memory()
        n = pack(str(root), str(self.out / "selfdistill.jsonl.gz"))
        if (self.out / "selfdistill.jsonl.gz").stat().st_size > 16 * 1024 * 1024:
            (self.out / "selfdistill.jsonl.gz").unlink()  # too large to come back: the run goes on without it
            n = -n
        self.curve["phases"]["data"] = {"conversations": abs(n), "packed_to_out": n > 0, "s": _since(t)}
        self.write_curve()
        return root / "self"

    def release_device_memory(self) -> None:
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ 2. training + curve
    def train_and_measure(self, data_dir: Path) -> None:
        from moa_serve.drafter.training.train import Trainer, load_config

        a = self.a
        points = _points(a.points)
        overrides = (SMOKE_OVERRIDES if a.cpu_smoke else []) + a.overrides
        cfg = load_config(a.config, overrides)
        cfg.update(
            target=a.target,
            data_dir=str(data_dir),
            device=a.device,
            drafters=list(KINDS),
            max_tokens=max(points),
            out_dir=str(self.work / "train"),
            export_dir=str(self.work / "export"),
            save_every_min=1e9,  # a single run: the state is saved where it stops
        )
        if a.threads:
            cfg["threads"] = a.threads
        t = time.monotonic()
        tr = Trainer(cfg)
        if tr.resume():
            self.log(event="resumed", step=tr.step, tokens_seen=tr.tokens_seen)
        self.curve["phases"]["train_setup"] = {"examples": len(tr.examples), "s": _since(t)}
        self.curve["train_config"] = {k: v for k, v in cfg.items() if k not in ("data_files",)}
        reserve = a.bench_reserve_s
        for point in points:
            if tr.tokens_seen >= point:
                continue
            t = time.monotonic()
            tokens_before = tr.tokens_seen
            tr.train(progress_bar=True, until_tokens=point, deadline=self.deadline - reserve - 10)
            train_s = _since(t)
            if tr.tokens_seen == tokens_before or self.left() < reserve:
                self.log(event="out_of_time", tokens_seen=tr.tokens_seen, left_s=round(self.left(), 1))
                break
            folder = self.work / "points" / f"{tr.tokens_seen}"
            tr.export(folder)
            t = time.monotonic()
            bench = self.bench(folder, cfg["export_prefix"])
            bench_s = _since(t)
            reserve = max(reserve, 1.2 * bench_s)
            recent = tr.history[-20:]
            self.curve["points"].append(
                {
                    "tokens_planned": point,
                    "tokens_trained": tr.tokens_seen,
                    "reached": tr.tokens_seen >= point,
                    "steps": tr.step,
                    "train_s": round(tr.elapsed, 1),
                    "train_tokens_per_s": round(tr.tokens_seen / max(tr.elapsed, 1e-9), 1),
                    "train_tokens_per_s_last20": round(sum(h["tok_s"] for h in recent) / max(len(recent), 1), 1),
                    "loss_last20": {k: tr.summary(k)["final_losses_last20"] for k in KINDS},
                    "tau": {k: bench[k]["mean_accepted_length"] for k in KINDS},
                    "tau_per_category": {
                        k: {c: v["mean_accepted_length"] for c, v in bench[k]["per_category"].items()} for k in KINDS
                    },
                    "speedup": {k: bench[k].get("speedup") for k in KINDS},
                    "greedy_identical": {k: bench[k].get("greedy_identical_fraction") for k in KINDS},
                    "bench_s": bench_s,
                    "segment_train_s": train_s,
                    "checkpoints": str(folder),
                }
            )
            self.write_curve()
            self.bring_back(folder, cfg["export_prefix"])  # a run killed later still returns this point's drafters
            self.log(event="point", **{k: self.curve["points"][-1][k] for k in ("tokens_trained", "tau", "bench_s")})
            if tr.tokens_seen < point:
                break

    def bench(self, folder: Path, prefix: str) -> dict:
        from moa_serve.commands.bench import register
        from moa_serve.measure.spec_bench_run import run_bench

        a = self.a
        ap = argparse.ArgumentParser()
        register(ap.add_subparsers())
        drafters = ",".join(str(folder / f"{prefix}-{k}") for k in KINDS)
        argv = ["bench", "--target", a.target, "--drafter", drafters, "--questions", a.questions]
        argv += ["--per-category", str(a.bench_per_category), "--max-new-tokens", str(a.bench_max_new_tokens)]
        argv += ["-k", str(a.k), "--dtype", a.bench_dtype, "--device", a.device, "--threads", str(a.threads)]
        argv += ["--limit", str(a.bench_limit), "--max-model-len", str(a.bench_max_model_len)]
        argv += ["--out", str(folder / "bench.json")]
        result = run_bench(ap.parse_args(argv))
        self.release_device_memory()
        runs = {r["method"]: r for r in result["runs"]}
        return {k: next(r for name, r in runs.items() if name.startswith(f"{prefix}-{k}@")) for k in KINDS}

    # ------------------------------------------------------------------ 3. what comes back
    def bring_back(self, folder: Path, prefix: str) -> None:
        """A measured point's checkpoints in ``--out``, each as a tar split into parts below 16 MiB
        (in place of an earlier point's)."""
        for kind in KINDS:
            for old in self.out.glob(f"{kind}.tar.part-*"):
                old.unlink()
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                tar.add(folder / f"{prefix}-{kind}", arcname=f"{prefix}-{kind}")
            data = buf.getvalue()
            for i in range(0, len(data), PART_BYTES):
                (self.out / f"{kind}.tar.part-{i // PART_BYTES:02d}").write_bytes(data[i : i + PART_BYTES])
        self.curve["checkpoints_returned"] = {"tokens_trained": self.curve["points"][-1]["tokens_trained"]}
        self.write_curve()


def _points(spec: str) -> list[int]:
    return sorted({int(float(x)) for x in spec.split(",") if x.strip()})


def _since(t: float) -> float:
    return round(time.monotonic() - t, 1)


def _device_name(device: str) -> str:
    import platform

    import torch

    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    run = Run(a)
    run.log(event="start", budget_s=a.budget_s, device=a.device, target=a.target)
    try:
        data_dir = run.data()
        run.train_and_measure(data_dir)
    finally:
        run.curve["wall_s"] = _since(run.t0)
        run.write_curve()
    run.log(event="done", points=len(run.curve["points"]), files=sorted(p.name for p in run.out.iterdir()))
    return 0 if run.curve["points"] else 1


if __name__ == "__main__":
    sys.exit(main())
