#!/usr/bin/env bash
# The GPU check (tools/gpu/README.md): runs tools/gpu/bench_gpu.py within a time budget and leaves
# results.json / results.md (and the log) under $OUT. Needs no network: pure-Python packages the
# machine lacks come from tools/gpu/wheels (filled by tools/gpu/prepare.sh), stories260k from
# tools/gpu/models. Usage: OUT=/some/dir bash tools/gpu/run.sh [--toy] [more bench_gpu.py options]
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$HERE/device_env.sh"
BUDGET_S="${BUDGET_S:-540}"   # the driver's own deadline; the outer timeout below leaves it room to write

# packages the project imports at run time that the machine may lack (never Ray, vLLM, FastAPI):
# installed from the carried wheels into a private folder, the system site-packages untouched
SITE="${TMPDIR:-/tmp}/moa-gpu-site"
missing=$("$PY" - <<'PYEOF'
import importlib.util
need = {"pydantic": "pydantic", "yaml": "pyyaml", "safetensors": "safetensors", "transformers": "transformers"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
if [ -n "$missing" ]; then
  if [ -d "$HERE/wheels" ]; then
    echo "installing from tools/gpu/wheels: $missing"
    "$PY" -m pip install --quiet --no-index --find-links "$HERE/wheels" --target "$SITE" $missing \
      || echo "warning: could not install $missing from the carried wheels"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "warning: missing $missing and no tools/gpu/wheels (run tools/gpu/prepare.sh first)"
  fi
fi

export MOA_MODEL_DIR="${MOA_MODEL_DIR:-$HERE/models}"
export MOA_CACHE_DIR="${MOA_CACHE_DIR:-${TMPDIR:-/tmp}/moa-cache}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.csv" 2>&1
timeout --signal=TERM --kill-after=10 $((BUDGET_S + 45)) \
  "$PY" "$HERE/bench_gpu.py" --out "$OUT" --budget-s "$BUDGET_S" "$@" 2>&1 | tee "$OUT/log.txt"
rc=${PIPESTATUS[0]}
echo "bench_gpu.py exit status $rc; results in $OUT"
exit $rc
