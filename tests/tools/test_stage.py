"""tools/gpu/stage.sh: a payload packed into parts here comes back byte for byte on the device, and
a call that lacks a part says which and stops."""

import hashlib
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STAGE = REPO / "tools" / "gpu" / "stage.sh"


def stage(env, *args):
    return subprocess.run(["bash", str(STAGE), *args], env=env, capture_output=True, text=True, timeout=30)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_pack_then_unpack_gives_the_same_files_and_a_missing_part_stops_it(tmp_path):
    src = tmp_path / "src"
    (src / "wheels").mkdir(parents=True)
    files = {src / "model.gguf": os.urandom(70_000), src / "wheels" / "a-1.0-py3-none-any.whl": os.urandom(9_000)}
    for f, data in files.items():
        f.write_bytes(data)
    env = dict(os.environ, STAGE_DIR=str(tmp_path / "stage"))
    packed = stage(env, "pack", "payload", "--part-size", "16K", str(src / "model.gguf"), str(src / "wheels"))
    assert packed.returncode == 0, packed.stderr
    parts = sorted((tmp_path / "stage" / "payload").glob("part-*"))
    assert len(parts) == 5 and all(p.stat().st_size <= 16 * 1024 for p in parts)
    manifest = (tmp_path / "stage" / "payload" / "payload.sha256").read_text().splitlines()
    assert manifest[0].endswith("  payload.tar") and [line.split()[1] for line in manifest[1:]] == [
        p.name for p in parts
    ]

    out = stage(env, "unpack", "payload", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    assert digest(tmp_path / "out" / "model.gguf") == digest(src / "model.gguf")
    assert digest(tmp_path / "out" / "wheels" / "a-1.0-py3-none-any.whl") == digest(
        src / "wheels" / "a-1.0-py3-none-any.whl"
    )

    parts[3].unlink()
    missing = stage(env, "unpack", "payload", str(tmp_path / "again"))
    assert missing.returncode == 3 and "missing part-03 of 5 part(s)" in missing.stderr
    assert not (tmp_path / "again").exists()  # nothing extracted

    parts[2].write_bytes(b"x" + parts[2].read_bytes()[1:])  # a corrupted part
    parts[3].write_bytes(b"")
    bad = stage(env, "unpack", "payload", str(tmp_path / "again"))
    assert bad.returncode == 4 and "sha256" in bad.stderr
