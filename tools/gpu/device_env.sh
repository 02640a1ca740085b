# Sourced by the device scripts (run.sh, served_check.sh, train_run.sh) once HERE is set: ROOT (the
# checkout), OUT (the output folder, default gpu-out/, created) and PY ($PYTHON, default python3);
# the working directory becomes ROOT.
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${OUT:-$ROOT/gpu-out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
cd "$ROOT"
