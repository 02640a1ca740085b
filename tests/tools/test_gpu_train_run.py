"""The GPU training run (tools/gpu/train_curve.py) at its smallest on CPU: stories260k, replies
already written, two budget points a few hundred tokens apart, one held-out question. It trains MoA
and EAGLE-style in one loop, measures τ at each point, writes the curve and brings back the last
point's checkpoints in parts below 16 MiB that reassemble into loadable drafters."""

import io
import json
import tarfile
from itertools import islice

from moa_serve.drafter.checkpoint import load_drafter
from tests.conftest import SHARED

DATA = SHARED / "data" / "train"
QUESTIONS = SHARED / "data" / "specbench" / "question.jsonl"


def _replies(folder, n=16):
    """``n`` corpus conversations as if ``moa regenerate`` had answered them."""
    (folder / "self").mkdir(parents=True)
    with (DATA / "alpaca_5k.jsonl").open() as f:
        rows = [
            {"messages": json.loads(line)["messages"], "source": {"file": "alpaca_5k.jsonl", "row": i}}
            for i, line in enumerate(islice(f, n))
        ]
    (folder / "self" / "regenerated.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_train_run_measures_each_point_and_brings_back_loadable_parts(tmp_path, stories_path, monkeypatch):
    from tools.gpu import train_curve

    monkeypatch.setenv("MOA_MODEL_DIR", str(stories_path.parent))
    monkeypatch.setattr(train_curve, "PART_BYTES", 128 * 1024)  # MoA in several parts
    out, work = tmp_path / "out", tmp_path / "work"
    _replies(work / "selfdistill")
    argv = ["--cpu-smoke", "--out", str(out), "--work", str(work), "--data-dir", str(DATA)]
    argv += ["--questions", str(QUESTIONS), "--regen-minutes", "0", "--points", "300,600"]
    argv += ["--bench-limit", "1", "--bench-max-new-tokens", "4", "--budget-s", "600", "log_every=1000"]
    assert train_curve.main(argv) == 0

    curve = json.loads((out / "curve.json").read_text())
    points = curve["points"]
    assert [p["tokens_planned"] for p in points] == [300, 600] and all(p["reached"] for p in points)
    assert points[0]["tokens_trained"] < points[1]["tokens_trained"]
    for p in points:
        assert set(p["tau"]) == {"moa", "eagle"} and all(t >= 1.0 for t in p["tau"].values())
        assert all(v == 1.0 for v in p["greedy_identical"].values())  # speculation never changes the output
    assert curve["checkpoints_returned"]["tokens_trained"] == points[-1]["tokens_trained"]

    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all((out / f).stat().st_size <= 16 * 1024 * 1024 for f in files)
    for kind in ("moa", "eagle"):
        parts = sorted(out.glob(f"{kind}.tar.part-*"))
        assert len(parts) >= (2 if kind == "moa" else 1)
        with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
            tar.extractall(tmp_path / "back", filter="data")
        cfg, _ = load_drafter(str(tmp_path / "back" / f"smollm2-135m-instruct-{kind}"))
        assert cfg.kind == kind
