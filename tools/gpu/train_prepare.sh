#!/usr/bin/env bash
# Run on the development machine before the GPU training call (tools/gpu/train_run.sh): puts what
# the run reads besides the staged payloads into the git-ignored folders the call carries:
# tools/gpu/models/smollm2-135m-instruct (the target's config and tokenizer files; the weights come
# staged as the gguf payload), tools/gpu/models/specbench (the held-out questions) and the gguf and
# tqdm wheels in tools/gpu/wheels (transformers reads a GGUF through gguf).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
MODELS_SRC="${MOA_MODEL_DIR:-$ROOT/../shared/models}"
SPECBENCH="${SPECBENCH:-$ROOT/../shared/data/specbench}"
mkdir -p "$HERE/models/smollm2-135m-instruct" "$HERE/models/specbench" "$HERE/wheels"
for f in config.json generation_config.json special_tokens_map.json tokenizer.json tokenizer_config.json \
         vocab.json merges.txt; do
  [ -f "$MODELS_SRC/smollm2-135m-instruct/$f" ] && cp "$MODELS_SRC/smollm2-135m-instruct/$f" "$HERE/models/smollm2-135m-instruct/"
done
cp "$SPECBENCH/question.jsonl" "$HERE/models/specbench/question.jsonl"
GGUF=$(python3 -c "import importlib.metadata as m; print(m.version('gguf'))")
TQDM=$(python3 -c "import importlib.metadata as m; print(m.version('tqdm'))")
python3 -m pip download --quiet --no-deps --dest "$HERE/wheels" --only-binary=:all: "gguf==$GGUF" "tqdm==$TQDM" \
  || echo "warning: wheel download failed; the run needs gguf and tqdm installed on the GPU machine"
du -sh "$HERE/models" "$HERE/wheels"
