"""The GPU check of MoA-Serve's torch backend, in one time-boxed run (``tools/gpu/run.sh``).

Sections (each with a deadline; results are written after every measurement, so a run cut short
still leaves what it measured):

* ``correctness``: stories260k (a real checkpoint), greedy speculative decoding (a random MoA
  drafter on the device, and a replaying drafter with corrupted drafts) against plain decoding,
  one session at a time and 16 at a time, float32 and bfloat16.
* ``invariance``: bfloat16 batch invariance of the device's ops (linear, LM head, RMSNorm, the
  packed attention, a whole forward): is a row's result bitwise the same alone and in a batch?
* ``production``: a Llama-3-8B-shaped target with random bf16 weights made on the device and a
  paper-sized MoA drafter (SA + CA layers of the target's shape, LSA feature head): verify latency
  for B sessions x K+1 tokens, drafting latency per K, one engine round's wall time against the
  device's busy time (the host overhead).
* ``fit``: peak memory of the verifier and drafter at ``deployments/configs/gpu.yaml``'s session
  shape next to ``deployments/fit.py``'s arithmetic for it.
* ``e2e``: the in-process engine with a replaying proposer at controlled acceptance
  (tau ~ 1.5 / 2.5 / 3.5 / 4.5) against the same engine without speculation, B = 1 / 8 / 32 / 64.
* ``attention``: the per-token and the chunked attention kernels side by side at long contexts
  (last: a kernel fault ends the process).

``--toy`` runs every section at toy size (a tiny random Llama instead of the 8B shape, short
lists of B and K) so that it runs on a CPU in about a minute (the CI test does).

Outputs under ``--out``: ``results.json`` (everything, machine-readable) and ``results.md``
(the tables).

This file is the command line and the plan of sections (each one's share of the budget); the
sections are in ``correctness.py`` (``env``, ``correctness``, the invariance probe),
``production.py`` (``production``, ``attention``), ``memory_fit.py`` (``fit``) and ``e2e.py``, what
they share in ``harness.py``, the tables in ``report.py``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _import_project() -> None:
    """Makes ``moa_serve.<part>`` importable from this checkout when the project is not installed
    (the GPU machine runs the checkout as it is): the package-dir mapping of pyproject.toml. The
    packages ``run.sh`` installed from the carried wheels are found too, so the other scripts of
    this folder run after it in the same device call."""
    site = Path(os.environ.get("TMPDIR", "/tmp")) / "moa-gpu-site"
    if importlib.util.find_spec("pydantic") is None and site.is_dir():
        sys.path.insert(0, str(site))
    try:
        importlib.import_module("moa_serve.model.target")
        return
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("moa_serve"):
            raise
    import tomllib

    sys.path.insert(0, str(ROOT))
    moa_serve = importlib.import_module("moa_serve")

    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in dirs.items():
        if name == "moa_serve" or name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(
            name, ROOT / folder / "__init__.py", submodule_search_locations=[str(ROOT / folder)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        setattr(moa_serve, name.rsplit(".", 1)[1], module)


_import_project()
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tools.gpu.correctness import correctness_section, env_section  # noqa: E402
from tools.gpu.e2e import e2e_section  # noqa: E402
from tools.gpu.harness import LLAMA3_8B, TOY_LLAMA, Run, free, random_moa, random_target  # noqa: E402
from tools.gpu.memory_fit import fit_section  # noqa: E402
from tools.gpu.production import attention_section, production_section  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--toy", action="store_true", help="tiny shapes and lists (runs on a CPU in about a minute)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--budget-s", type=float, default=None, help="whole run (default 540, toy 150)")
    ap.add_argument("--sections", default="correctness,production,fit,e2e,attention")
    a = ap.parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    a.out.mkdir(parents=True, exist_ok=True)
    run = Run(a.out, a.budget_s or (150 if a.toy else 540), device, a.toy)
    run.results["meta"].update(argv=sys.argv[1:], budget_s=run.budget_s)
    if device.type == "cpu" and a.toy:
        # a toy run on a shared CI CPU: one thread (OpenMP workers spinning against other processes
        # slow a 16-session decode of stories260k down more with 2 threads than it gains)
        torch.set_num_threads(1)
    torch.manual_seed(0)
    env_section(run)
    run.save()
    wanted = a.sections.split(",")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = TOY_LLAMA if a.toy else LLAMA3_8B
    models = None
    plan = [
        ("correctness", 0.13, lambda: correctness_section(run, ["float32", "bfloat16"])),
        ("production", 0.52, None),
        ("fit", 0.62, None),
        ("e2e", 0.9, None),
        ("attention", 0.97, None),  # last: a kernel fault there ends the process
    ]
    for name, until, fn in plan:
        if name not in wanted:
            continue
        run.until(until)
        try:
            if name == "correctness":
                fn()
            elif name == "production":
                models = production_section(run, shape, dtype)
            else:
                if models is None:
                    models = {"target": random_target(shape, dtype, device)}
                    models["moa"] = random_moa(models["target"], dtype, device)
                if name == "fit":
                    fit_section(run, models)
                elif name == "e2e":
                    e2e_section(run, models, dtype)
                else:
                    attention_section(run, models["target"].arch, dtype)
        except Exception:  # noqa: BLE001 - one section's failure is a result; the others still run
            sec = run.section(name)
            sec["status"] = "failed"
            sec["error"] = traceback.format_exc()[-4000:]
            print(sec["error"], file=sys.stderr)
            free(device)
        run.save()
        print(f"[{time.monotonic() - run.t0:6.1f}s] {name}: {run.section(name).get('status')}", flush=True)
    run.results["meta"]["finished"] = True
    run.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
