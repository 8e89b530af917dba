#!/usr/bin/env bash
# Builds llama.cpp's llama-bench (and llama-tokenize) from the llama.cpp sources vendored in the PyPI
# sdist of llama-cpp-python. Nothing of llama.cpp is committed to this repository: the sources
# come from PyPI at run time and the build is cached under $QKVSHARE_CACHE/llama.cpp
# (default ~/.cache/qkvshare/llama.cpp), so a second run only checks that the binary is there.
#
#   bench/build_llamacpp.sh            # prints the path of llama-bench on its last line
#   LLAMACPP_PY_VERSION=0.3.36 bench/build_llamacpp.sh
set -euo pipefail

VERSION="${LLAMACPP_PY_VERSION:-0.3.36}"
CACHE="${QKVSHARE_CACHE:-$HOME/.cache/qkvshare}/llama.cpp"
SRC="$CACHE/llama-cpp-python-$VERSION"
BUILD="$CACHE/build-$VERSION"
BIN="$BUILD/bin/llama-bench"
JOBS="${JOBS:-$(nproc)}"

log() { echo "[build_llamacpp] $*" >&2; }

if [[ -x "$BIN" && -x "$BUILD/bin/llama-tokenize" ]]; then
  log "cached: $BIN"
  echo "$BIN"
  exit 0
fi
mkdir -p "$CACHE"

if [[ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]]; then
  tarball="$CACHE/llama_cpp_python-$VERSION.tar.gz"
  if [[ ! -f "$tarball" ]]; then
    log "downloading the llama-cpp-python==$VERSION sdist from PyPI (a few minutes)"
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    pip download --no-deps --no-binary :all: --no-build-isolation "llama-cpp-python==$VERSION" -d "$tmp" >&2 \
      || pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp" >&2
    mv "$tmp"/llama_cpp_python-*.tar.gz "$tarball"
  fi
  log "unpacking $tarball"
  rm -rf "$SRC.tmp" && mkdir -p "$SRC.tmp"
  tar xzf "$tarball" -C "$SRC.tmp" --strip-components=1
  rm -rf "$SRC" && mv "$SRC.tmp" "$SRC"
fi

log "configuring llama.cpp (GGML_NATIVE, OpenMP, CPU only)"
cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >&2
log "building llama-bench and llama-tokenize with $JOBS jobs (10+ minutes on 2 cores)"
cmake --build "$BUILD" --target llama-bench llama-tokenize -j "$JOBS" >&2
log "built: $BIN"
echo "$BIN"
