#!/usr/bin/env bash
# Run on the development machine before the served check's device calls: downloads what `serve run`
# needs beyond the GPU image (tools/gpu/serve-requirements.txt, with their dependencies, as CPython
# 3.12 x86-64 wheels), packs them with openai_load.py (the closed-loop client of the CPU
# benchmarks) as the payload `serve`, and SmolLM2-135M-Instruct's GGUF folder as the payload
# `smollm2` (tools/gpu/stage.sh, parts under .stage/), then prints which parts each device call
# carries. Usage: bash tools/gpu/prepare_served.sh [PART_SIZE, default 16M]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
SHARED="${SHARED:-$ROOT/../shared}"
MODELS_SRC="${MOA_MODEL_DIR:-$SHARED/models}"
SRC="$ROOT/.stage/src"
export PART_SIZE="${1:-${PART_SIZE:-16M}}"

mkdir -p "$SRC/serve/wheels"
python3 -m pip download --quiet --dest "$SRC/serve/wheels" --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64 \
  -r "$HERE/serve-requirements.txt"
grep -v '^#' "$HERE/serve-requirements.txt" > "$SRC/serve/wheels/requirements.txt"
cp "$SHARED/tools/openai_load.py" "$SRC/serve/openai_load.py"
bash "$HERE/stage.sh" pack serve "$SRC/serve/wheels" "$SRC/serve/openai_load.py"
bash "$HERE/stage.sh" pack smollm2 "$MODELS_SRC/smollm2-135m-instruct"
# stories260k for the toy sections and the CPU plan (git-ignored, carried as tools/gpu/models)
[ -d "$HERE/models/stories260k" ] || bash "$HERE/prepare.sh" >/dev/null
for name in serve smollm2; do bash "$HERE/stage.sh" calls "$name"; done
