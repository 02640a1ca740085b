#!/usr/bin/env bash
# The served GPU check (tools/gpu/README.md#the-served-check): serve run of
# deployments/configs/gpu-1x.yaml measured against the in-process engine, by
# tools/gpu/served_check.py within a time budget; at most 8 files under $OUT, written as it goes
# (served.json, served.md, log.txt, serve-greedy.log, serve-synthetic.log, metrics.txt,
# nvidia-smi.csv).
#
# On the GPU machine, after the staging calls (tools/gpu/prepare_served.sh prints them), it unpacks
# and installs what the image lacks: the wheels and openai_load.py (payload serve) into $STAGED,
# SmolLM2's GGUF folder (payload smollm2) into tools/gpu/models, and the project itself
# (pip install -e, no dependencies, offline). Here: DEVICE=cpu OUT=/tmp/served bash tools/gpu/served_check.sh
# (stories260k; run it under flock /tmp/ray-serve.lock on a shared machine).
# Usage: OUT=DIR [DEVICE=cuda|cpu] [BUDGET_S=540] bash tools/gpu/served_check.sh [served_check.py options]
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$HERE/device_env.sh"
BUDGET_S="${BUDGET_S:-540}"
export STAGED="${STAGED:-${TMPDIR:-/tmp}/moa-served-stage}"
exec > >(tee -a "$OUT/log.txt") 2>&1

stage() { bash "$HERE/stage.sh" "$@" || exit $?; }
if ! "$PY" -c "import ray, fastapi, pydantic, gguf" 2>/dev/null; then
  stage unpack serve "$STAGED"
  stage install "$STAGED/wheels"
fi
[ -f "$STAGED/openai_load.py" ] || { [ -f .stage/serve/serve.sha256 ] && stage unpack serve "$STAGED"; }
export MOA_MODEL_DIR="${MOA_MODEL_DIR:-$HERE/models}"
if [ "${DEVICE:-cuda}" = "cuda" ] && [ ! -d "$MOA_MODEL_DIR/smollm2-135m-instruct" ]; then
  stage unpack smollm2 "$MOA_MODEL_DIR"
fi
if ! "$PY" -c "import moa_serve.deployments.app" 2>/dev/null; then
  echo "installing the project (editable, no dependencies, offline)"
  "$PY" -m pip install --quiet --no-index --no-deps --no-build-isolation -e "$ROOT" || exit 1
fi

export MOA_CACHE_DIR="${MOA_CACHE_DIR:-${TMPDIR:-/tmp}/moa-cache}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.csv" 2>&1
timeout --signal=TERM --kill-after=15 $((BUDGET_S + 45)) \
  "$PY" -m tools.gpu.served_check --out "$OUT" --budget-s "$BUDGET_S" ${DEVICE:+--device "$DEVICE"} "$@"
rc=$?
echo "served_check.py exit status $rc; results in $OUT"
exit $rc
