#!/usr/bin/env bash
# The GPU training run (docs/training.md#training-on-a-gpu): unpacks the staged payloads (gguf: the
# SmolLM2-135M-Instruct GGUF; corpus: the training corpus) with tools/gpu/stage.sh, then runs
# tools/gpu/train_curve.py within BUDGET_S seconds: moa regenerate on the GPU, MoA and EAGLE-style
# trained in one loop, held-out τ at each budget point. $OUT gets curve.json, the last point's
# checkpoints (<kind>.tar.part-NN), selfdistill.jsonl.gz, log.txt, nvidia-smi.csv (at most 8 files).
# Before the device call: bash tools/gpu/prepare.sh && bash tools/gpu/train_prepare.sh, and carry
# tools/gpu/models and tools/gpu/wheels.
# Usage: OUT=/some/dir bash tools/gpu/train_run.sh [--cpu-smoke] [train_curve.py options] [key=value ...]
#        MOA_TRAIN_SMOKE=1 has the effect of --cpu-smoke (stories260k on the CPU, a few minutes).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$HERE/device_env.sh"
WORK="${WORK:-${TMPDIR:-/tmp}/moa-train}"
smoke=0
for arg in "$@"; do [ "$arg" = "--cpu-smoke" ] && smoke=1; done
if [ "${MOA_TRAIN_SMOKE:-0}" = "1" ] && [ $smoke = 0 ]; then smoke=1; set -- --cpu-smoke "$@"; fi
# BUDGET_S counts from this script's start (staging included); the run is killed 20 s after it
if [ $smoke = 1 ]; then BUDGET_S="${BUDGET_S:-170}"; else BUDGET_S="${BUDGET_S:-510}"; fi
mkdir -p "$WORK"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export MOA_CACHE_DIR="${MOA_CACHE_DIR:-$WORK/cache}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

if [ $smoke = 1 ]; then
  export MOA_MODEL_DIR="${MOA_MODEL_DIR:-$ROOT/../shared/models}"
  args=(--data-dir "${CORPUS_DIR:-$ROOT/../shared/data/train}"
        --questions "${QUESTIONS:-$ROOT/../shared/data/specbench/question.jsonl}")
else
  # packages the run imports that a bare torch image may lack, from the carried wheels
  SITE="${TMPDIR:-/tmp}/moa-gpu-site"
  missing=$("$PY" - <<'PYEOF'
import importlib.util
need = {"pydantic": "pydantic", "yaml": "pyyaml", "safetensors": "safetensors", "transformers": "transformers",
        "gguf": "gguf", "tqdm": "tqdm"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
  if [ -n "$missing" ]; then
    echo "installing from tools/gpu/wheels: $missing"
    "$PY" -m pip install --quiet --no-index --find-links "$HERE/wheels" --target "$SITE" $missing \
      || { echo "error: could not install $missing from tools/gpu/wheels (run tools/gpu/train_prepare.sh)" >&2; exit 3; }
    export PYTHONPATH="$PYTHONPATH:$SITE"
  fi
  [ -x "$HERE/stage.sh" ] || [ -f "$HERE/stage.sh" ] || { echo "error: tools/gpu/stage.sh is missing" >&2; exit 3; }
  MODEL="$WORK/models/smollm2-135m-instruct"
  bash "$HERE/stage.sh" unpack gguf "$MODEL" || { echo "error: payload gguf: not staged (see above)" >&2; exit 4; }
  bash "$HERE/stage.sh" unpack corpus "$WORK/corpus" || { echo "error: payload corpus: not staged (see above)" >&2; exit 4; }
  # the folder that holds the GGUF; its config and tokenizer come from tools/gpu/train_prepare.sh if the payload lacks them
  gguf=$(find "$MODEL" -name '*.gguf' | head -1)
  [ -n "$gguf" ] || { echo "error: payload gguf holds no .gguf file" >&2; exit 4; }
  MODEL="$(dirname "$gguf")"
  for f in "$HERE/models/smollm2-135m-instruct/"*; do
    [ -e "$MODEL/$(basename "$f")" ] || cp "$f" "$MODEL/"
  done
  [ -f "$MODEL/config.json" ] || { echo "error: no config.json for $MODEL (run tools/gpu/train_prepare.sh)" >&2; exit 4; }
  corpus=$(dirname "$(find "$WORK/corpus" -name '*.jsonl' | head -1)")
  [ -n "$corpus" ] && [ "$corpus" != "." ] || { echo "error: payload corpus holds no .jsonl file" >&2; exit 4; }
  args=(--target "$MODEL" --data-dir "$corpus" --questions "$HERE/models/specbench/question.jsonl" --device cuda)
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.csv" 2>&1
fi

left=$((BUDGET_S - SECONDS))
[ $left -gt 60 ] || { echo "error: staging left $left s of BUDGET_S=$BUDGET_S" >&2; exit 5; }
timeout --signal=TERM --kill-after=5 $((left + 15)) \
  "$PY" -m tools.gpu.train_curve --out "$OUT" --work "$WORK/run" --budget-s "$left" "${args[@]}" "$@" 2>&1 \
  | stdbuf -oL tr '\r' '\n' | grep --line-buffered -v '^\s*$' | tee "$OUT/log.txt.tmp"
rc=${PIPESTATUS[0]}
tail -c 4000000 "$OUT/log.txt.tmp" > "$OUT/log.txt"; rm -f "$OUT/log.txt.tmp"   # below 16 MiB
echo "train_curve exit status $rc; results in $OUT"
exit $rc
