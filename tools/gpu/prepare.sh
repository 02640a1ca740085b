#!/usr/bin/env bash
# Run on the development machine before the GPU call: fills the git-ignored folders the GPU run
# carries (tools/gpu/models: stories260k; tools/gpu/wheels: pure-Python packages and their
# compiled companions for CPython 3.12 / x86-64 that a bare torch + transformers image may lack),
# then prints what the run carries in all (the checkout's tracked files + these folders; the
# device call takes at most 64 MiB).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
MODELS_SRC="${MOA_MODEL_DIR:-$ROOT/../shared/models}"   # the folder that holds stories260k

mkdir -p "$HERE/models" "$HERE/wheels"
rm -rf "$HERE/models/stories260k"
mkdir -p "$HERE/models/stories260k"
# the weights, config and tokenizer (not the llama2c originals)
for f in config.json generation_config.json model.safetensors special_tokens_map.json tokenizer.json \
         tokenizer.model tokenizer_config.json; do
  [ -f "$MODELS_SRC/stories260k/$f" ] && cp "$MODELS_SRC/stories260k/$f" "$HERE/models/stories260k/"
done

# pydantic (deployments/config.py, read by deployments/fit.py) and PyYAML: the versions in use here
PYD=$(python3 -c "import pydantic; print(pydantic.VERSION)")
PYDC=$(python3 -c "import pydantic_core; print(pydantic_core.__version__)")
python3 -m pip download --quiet --dest "$HERE/wheels" --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  "pydantic==$PYD" "pydantic-core==$PYDC" annotated-types typing-inspection typing-extensions pyyaml \
  || echo "warning: wheel download failed; the GPU run reports fit.py as not run if pydantic is missing there"

cd "$ROOT"
tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
carried=$(du -cb "$HERE/models" "$HERE/wheels" | tail -1 | cut -f1)
echo "tracked files: $((tracked / 1024)) KiB; tools/gpu/models + wheels: $((carried / 1024)) KiB;" \
     "total $(((tracked + carried) / 1024)) KiB of 65536 KiB"
[ $((tracked + carried)) -lt $((60 * 1024 * 1024)) ] || { echo "too large to carry" >&2; exit 1; }
