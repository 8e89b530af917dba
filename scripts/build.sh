#!/usr/bin/env bash
# Configures and builds into build/ (release) or, with BUILD_DIR and extra
# CMake flags, any other variant (e.g. BUILD_DIR=build-asan ... -DQKVSHARE_SANITIZE=ON).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build}"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" "$@" >&2
cmake --build "$BUILD_DIR" -j "$(nproc)" >&2
