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

# Python helpers for the independent reference tests live in a project venv.
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv for the Python reference tests" >&2
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import numpy, gguf, tokenizers, pytest" 2>/dev/null; then
  echo "[setup] installing Python packages from tests/reference/requirements.txt" >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check -r tests/reference/requirements.txt >&2
fi
# The benchmark scripts' plots (bench/*.py); README lists it.
if ! .venv/bin/python -c "import matplotlib" 2>/dev/null; then
  echo "[setup] installing matplotlib for the benchmark plots" >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check matplotlib==3.11.2 >&2
fi
