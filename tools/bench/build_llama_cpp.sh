#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (the peer of the serving benchmark, docs/benchmarks.md#serving)
# from the llama.cpp source vendored in the llama-cpp-python sdist on PyPI: no network beyond the
# package registry. Cached outside the repository; prints the binary's path.
#   bash tools/bench/build_llama_cpp.sh                  # minutes the first time, then instant
#   LLAMA_CPU=avx2 bash tools/bench/build_llama_cpp.sh   # AVX2 + FMA + F16C only (no AVX-512): the
#       build an AVX2-only CPU runs, to compare against on a machine that has more
#   LLAMA_TARGET=llama-bench bash tools/bench/build_llama_cpp.sh   # its step benchmark instead
set -euo pipefail
CACHE="${MOA_CACHE:-$HOME/.cache/moa-serve}/llama.cpp"
CPU="${LLAMA_CPU:-native}"
TARGET="${LLAMA_TARGET:-llama-server}"
case "$CPU" in
  native) BUILD=build; FLAGS=(-DGGML_NATIVE=ON) ;;
  avx2) BUILD=build-avx2; FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                                 -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF) ;;
  *) echo "LLAMA_CPU must be native or avx2, not $CPU" >&2; exit 2 ;;
esac
BIN="$CACHE/src/vendor/llama.cpp/$BUILD/bin/$TARGET"
if [[ -x "$BIN" ]]; then echo "$BIN"; exit 0; fi
mkdir -p "$CACHE"
cd "$CACHE"
if [[ ! -d src ]]; then
  # the sdist only (its build dependencies as wheels: `--no-binary :all:` would build them from source too)
  ls sdist/llama_cpp_python-*.tar.gz >/dev/null 2>&1 ||
    python3 -m pip download --no-deps --no-binary llama-cpp-python --dest sdist llama-cpp-python >&2
  mkdir -p src && tar -xzf sdist/llama_cpp_python-*.tar.gz -C src --strip-components 1
fi
cd src/vendor/llama.cpp
cmake -B "$BUILD" -DLLAMA_CURL=OFF "${FLAGS[@]}" -DCMAKE_BUILD_TYPE=Release >&2
cmake --build "$BUILD" -j"$(nproc)" --target "$TARGET" >&2
echo "$BIN"
