#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (the peer of the serving benchmark, docs/benchmarks.md#serving)
# from the llama.cpp source vendored in the llama-cpp-python sdist on PyPI: no network beyond the
# package registry. Cached outside the repository; prints the binary's path.
#   bash tools/bench/build_llama_cpp.sh            # ~7 min on 2 cores, then instant
set -euo pipefail
CACHE="${MOA_CACHE:-$HOME/.cache/moa-serve}/llama.cpp"
BIN="$CACHE/src/vendor/llama.cpp/build/bin/llama-server"
if [[ -x "$BIN" ]]; then echo "$BIN"; exit 0; fi
mkdir -p "$CACHE"
cd "$CACHE"
if [[ ! -d src ]]; then
  python3 -m pip download --no-deps --no-binary :all: --dest sdist llama-cpp-python >&2
  mkdir -p src && tar -xzf sdist/llama_cpp_python-*.tar.gz -C src --strip-components 1
fi
cd src/vendor/llama.cpp
cmake -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release >&2
cmake --build build -j"$(nproc)" --target llama-server >&2
echo "$BIN"
