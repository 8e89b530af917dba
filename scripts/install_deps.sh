#!/usr/bin/env bash
# Installs the Debian packages and the Python test helpers QKVShare needs.
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libgtest-dev libgmock-dev libbenchmark-dev  # tests and benchmarks
  nlohmann-json3-dev libcli11-dev libfmt-dev  # JSON, command line, formatting
  libpcre2-dev                                # Unicode regexes of the BPE pre-tokenizers
  libxxhash-dev libyaml-cpp-dev               # descriptor checksums, workflow files
  libcpp-httplib-dev curl                     # `qkvshare serve` (HTTP server), its curl tests
  clang libclang-rt-dev                       # libFuzzer targets of the parsers (tests/fuzz)
  libsodium-dev                               # tiers: XChaCha20-Poly1305 of spilled and remote blocks
  libhiredis-dev redis-server                 # tiers: the remote tier's client, and the server its tests start
  g++-s390x-linux-gnu qemu-user               # tiers: the portable context format read on big-endian s390x
  python3 python3-venv python3-pip
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[setup] installing Debian packages: ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

# ARM64 stage (scripts/test_aarch64.sh): Debian's cross compiler, qemu-user
# to run the tests, and the arm64 builds of the libraries (multiarch). Only
# packages that install beside the amd64 ones: libyaml-cpp-dev is not
# co-installable (the cross build uses the runtime library and the host's
# headers), and --no-remove makes apt refuse rather than replace any amd64
# package. QKVSHARE_SKIP_ARM64=1 skips this part.
ARM64_PACKAGES=(
  g++-aarch64-linux-gnu qemu-user file
  libc6:arm64 libstdc++6:arm64 libfmt-dev:arm64 libgtest-dev:arm64
  libpcre2-dev:arm64 libxxhash-dev:arm64 libyaml-cpp0.7:arm64
  libsodium-dev:arm64 libhiredis-dev:arm64 libcpp-httplib-dev:arm64  # tiers and server layers (the CLI links them)
)
if [ "${QKVSHARE_SKIP_ARM64:-0}" != 1 ] && [ "$(dpkg --print-architecture)" = amd64 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    $SUDO dpkg --add-architecture arm64
    $SUDO apt-get update -qq
  fi
  missing=()
  for p in "${ARM64_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "[setup] installing the ARM64 cross toolchain and libraries: ${missing[*]}" >&2
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends --no-remove "${missing[@]}" >&2
  fi
fi

# Python helpers for the independent reference tests live in a project venv.
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv for the Python reference tests" >&2
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import numpy, gguf, tokenizers, pytest" 2>/dev/null; then
  echo "[setup] installing Python packages from tests/reference/requirements.txt" >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check -r tests/reference/requirements.txt >&2
fi
if ! .venv/bin/python -c "import openai, langgraph, langchain_openai" 2>/dev/null; then
  echo "[setup] installing Python packages from tests/server/requirements.txt" >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check -r tests/server/requirements.txt >&2
fi
# The benchmark scripts' plots (bench/*.py); README lists it.
if ! .venv/bin/python -c "import matplotlib" 2>/dev/null; then
  echo "[setup] installing matplotlib for the benchmark plots" >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check matplotlib==3.11.2 >&2
fi
