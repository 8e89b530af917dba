#!/usr/bin/env bash
# Builds llama.cpp's tools from the llama.cpp sources vendored in a PyPI sdist of llama-cpp-python.
# Nothing of llama.cpp is committed to this repository: the sources come from PyPI at run time and
# the build is cached under $QKVSHARE_CACHE/llama.cpp/build-<version> (default ~/.cache/qkvshare),
# so a second run only checks that the binaries are there (and the READY stamp the build writes).
#
#   bench/build_llamacpp.sh                               # 0.3.36; prints the path of llama-bench last
#   LLAMACPP_PY_VERSION=0.3.8 bench/build_llamacpp.sh     # the early-2025 llama.cpp (March 2025)
#
# Tools: llama-bench, llama-tokenize, llama-batched-bench, llama-perplexity, llama-quantize,
# llama-server (all in the same bin/ folder as llama-bench).
#
# AMX: some VMs report AMX in cpuid but cannot execute it (ggml's AMX matmul dies with SIGILL in
# `tilezero`). A small probe runs one AMX instruction; when the CPU reports AMX and the probe fails,
# llama.cpp is built without GGML_NATIVE, with the CPU's other x86 extensions enabled one by one
# and AMX off, and the script says so. Elsewhere it builds with GGML_NATIVE as a user would.
set -euo pipefail

VERSION="${LLAMACPP_PY_VERSION:-0.3.36}"
CACHE="${QKVSHARE_CACHE:-$HOME/.cache/qkvshare}/llama.cpp"
SRC="$CACHE/llama-cpp-python-$VERSION"
BUILD="$CACHE/build-$VERSION"
BIN="$BUILD/bin"
JOBS="${JOBS:-$(nproc)}"
TOOLS=(llama-bench llama-tokenize llama-batched-bench llama-perplexity llama-quantize llama-server)
HERE="$(cd "$(dirname "$0")" && pwd)"

log() { echo "[build_llamacpp $VERSION] $*" >&2; }

all_built() {
  [[ -f "$BUILD/READY" ]] || return 1
  for t in "${TOOLS[@]}"; do [[ -x "$BIN/$t" ]] || return 1; done
}

if all_built; then
  log "cached: $BIN ($(cat "$BUILD/READY"))"
  echo "$BIN/llama-bench"
  exit 0
fi
mkdir -p "$CACHE"
# One build per version at a time: a second caller waits for the first and then finds it cached.
exec 9>"$CACHE/.lock-$VERSION"
flock 9
if all_built; then echo "$BIN/llama-bench"; exit 0; fi

if [[ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]]; then
  tarball="$CACHE/llama_cpp_python-$VERSION.tar.gz"
  if [[ ! -f "$tarball" ]]; then
    log "downloading the llama-cpp-python==$VERSION sdist from PyPI (a few minutes)"
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp" >&2
    mv "$tmp"/llama_cpp_python-*.tar.gz "$tarball"
  fi
  log "unpacking $tarball"
  rm -rf "$SRC.tmp" && mkdir -p "$SRC.tmp"
  tar xzf "$tarball" -C "$SRC.tmp" --strip-components=1
  rm -rf "$SRC" && mv "$SRC.tmp" "$SRC"
fi

# Which ISA flags: native, unless the CPU reports AMX that cannot run here.
isa_flags=(-DGGML_NATIVE=ON)
isa_note="GGML_NATIVE"
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  mkdir -p "$BUILD"
  if cc -O1 -mamx-tile "$HERE/amx_probe.c" -o "$BUILD/amx_probe" 2>/dev/null && ( "$BUILD/amx_probe" ) >/dev/null 2>&1; then
    log "the CPU reports AMX and it executes: native build"
  else
    flags="$(grep -m1 '^flags' /proc/cpuinfo)"
    has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
    isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)"
               -DGGML_F16C="$(has f16c)" -DGGML_BMI2="$(has bmi2)" -DGGML_AVX_VNNI="$(has avx_vnni)"
               -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VBMI="$(has avx512vbmi)"
               -DGGML_AVX512_VNNI="$(has avx512_vnni)" -DGGML_AVX512_BF16="$(has avx512_bf16)"
               -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    isa_note="AMX reported but not executable here: GGML_NATIVE=OFF, AMX off, ${isa_flags[*]:1:11}"
    log "$isa_note"
  fi
fi

log "configuring llama.cpp (OpenMP, CPU only)"
cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release "${isa_flags[@]}" \
  -DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >&2
log "building ${TOOLS[*]} with $JOBS jobs (15+ minutes on 2 cores)"
cmake --build "$BUILD" --target "${TOOLS[@]}" -j "$JOBS" >&2
for t in "${TOOLS[@]}"; do [[ -x "$BIN/$t" ]] || { log "error: $BIN/$t was not built"; exit 1; }; done
echo "llama-cpp-python $VERSION; $isa_note" > "$BUILD/READY"
log "built: $BIN"
echo "$BIN/llama-bench"
