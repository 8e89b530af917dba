#!/usr/bin/env bash
# ARM64 stage of CI: cross-compiles with Debian's aarch64 toolchain against
# the multiarch arm64 libraries (scripts/install_deps.sh installs both) and
# runs the C++ tests labelled `emulation` under qemu-user: the kernel tests
# (every level qemu's CPU offers: portable, neon, neon_dot, each compared with
# the scalar references), the KV tests and the engine tests on stories260K.
# Speed under emulation means nothing; this checks that the code builds and
# computes the same results on ARM64.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build-aarch64}"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DQKVSHARE_BUILD_BENCH=OFF -DCMAKE_UNITY_BUILD=ON >&2
cmake --build "$BUILD_DIR" -j "$(nproc)" --target qkvshare test_core test_kernels test_kv test_engine >&2
file "$BUILD_DIR/src/cli/qkvshare" | grep -q 'ARM aarch64' || { echo "[aarch64] not an ARM64 binary" >&2; exit 1; }
# A test that hangs under the emulator gets 300 s and one more try: once (2026-12-02), with the
# stage's two tests at a time, ThreadPool.ManyShortCallsAsInDecoding stopped with both threads in
# futex waits under qemu-user and no load; alone it passed 20 of 20 times, natively and under TSan it
# never did. A second failure still fails the stage.
# QKVSHARE_EMULATED: the tests that fork a child to provoke the OS into
# refusing (an address-space limit, a FIFO) skip themselves, since qemu-user's
# own mappings and syscall translation are what they would measure.
QKVSHARE_EMULATED=1 ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)" -L emulation --timeout 300 --repeat until-pass:2
