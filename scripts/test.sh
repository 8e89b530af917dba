#!/usr/bin/env bash
# The README's second command, and what CI runs: install, build, fetch the
# default model, run the whole suite, then the ASan+UBSan build of the C++ tests.
#
# The release build (build/) is the developers' own tree and compiles file by
# file. The trees only CI builds from scratch (ARM64, ASan, TSan) are
# unity builds (CMAKE_UNITY_BUILD: a layer's sources compiled 8 to a
# translation unit, which parses the shared headers once per 8 files): they
# compile several times faster (README, "What each stage costs"). Their one
# rule: names in anonymous namespaces must not repeat within a layer's sources
# or within a layer's tests. (The fuzz targets compile a few sources of
# several layers each: small, and file by file.)
set -euo pipefail
cd "$(dirname "$0")/.."
# Each stage line carries the UTC time, so a CI log shows what each build and each run cost.
stage() { echo "[test] $(date -u +%H:%M:%S) $*" >&2; }
stage "install and release build"
scripts/install_deps.sh
scripts/build.sh
if model=$(scripts/fetch_model.sh); then
  export QKVSHARE_MODEL="$model"
else
  echo "*** WARNING: the default model could not be fetched; SmolLM2 tests will be SKIPPED. ***" >&2
fi
stage "Python package: pip install . into a fresh venv (build-python/venv)"
scripts/python_package.sh
stage "release build: full suite"
ctest --test-dir build --output-on-failure -j "$(nproc)"
stage "ARM64: cross build, the emulation-labelled C++ tests under qemu-user"
scripts/test_aarch64.sh
stage "ASan+UBSan build: C++ tests (the server's HTTP tests run in the release build only)"
BUILD_DIR=build-asan BUILD_TYPE=Debug scripts/build.sh -DQKVSHARE_SANITIZE=ON -DQKVSHARE_BUILD_BENCH=OFF -DCMAKE_UNITY_BUILD=ON
stage "ASan+UBSan: tests"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$(nproc)" -LE "reference|slow|server|python"
stage "ThreadSanitizer build: the concurrent parts (thread pool, KV pool, share layer, batched passes and scheduler, tiers' prefetch, the server's threads)"
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DQKVSHARE_TSAN=ON -DQKVSHARE_BUILD_BENCH=OFF \
  -DCMAKE_UNITY_BUILD=ON >&2
cmake --build build-tsan -j "$(nproc)" --target test_core test_kv test_share test_engine test_tiers >&2
stage "ThreadSanitizer: tests"
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
build-tsan/tests/test_core --gtest_filter='ThreadPool.*'
build-tsan/tests/test_kv --gtest_filter='KvPool.*'
build-tsan/tests/test_share
build-tsan/tests/test_engine --gtest_filter='SchedulerTest.*:BatchTest.MixedBatchMatchesEachAloneToRounding*'
build-tsan/tests/test_tiers --gtest_filter='Tiers.*'
# The server's threads (HTTP workers, the batched scheduler, the context store) under TSan: the
# HTTP tests against a TSan build of the CLI; any report fails the stage (tests/server/tsan.supp:
# only reports from inside the uninstrumented cpp-httplib library are suppressed).
cmake --build build-tsan -j "$(nproc)" --target qkvshare >&2
rm -rf build-tsan/tsan-server && mkdir -p build-tsan/tsan-server
TSAN_OPTIONS="suppressions=$PWD/tests/server/tsan.supp:log_path=$PWD/build-tsan/tsan-server/report" \
  QKVSHARE_CLI="$PWD/build-tsan/src/cli/qkvshare" QKVSHARE_SHARED="$(cd .. && pwd)/shared" QKVSHARE_SOURCE="$PWD" \
  .venv/bin/python -m pytest -q -x -p no:cacheprovider tests/server -k "not langgraph"
if compgen -G "build-tsan/tsan-server/report*" >/dev/null; then
  cat build-tsan/tsan-server/report* >&2
  echo "[test] ThreadSanitizer reported on the server's threads" >&2
  exit 1
fi
stage "libFuzzer: the GGUF and descriptor parsers 45 s each, the server's HTTP request path, the PQ codebook, the context file, the workflow file and the tokenizer readers 30 s each, KV format names 20 s"
CXX=clang++ CC=clang cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DQKVSHARE_FUZZ=ON \
  -DQKVSHARE_BUILD_TESTS=OFF -DQKVSHARE_BUILD_BENCH=OFF >&2
cmake --build build-fuzz -j "$(nproc)" --target fuzz_gguf fuzz_descriptor fuzz_http fuzz_codebook fuzz_context fuzz_workflow fuzz_tokenizer fuzz_kv_format >&2
stage "libFuzzer: runs"
for f in fuzz_gguf fuzz_descriptor fuzz_http fuzz_codebook fuzz_context fuzz_workflow fuzz_tokenizer fuzz_kv_format; do
  mkdir -p "build-fuzz/corpus-$f"
  seconds=45 seeds=()
  [ "$f" = fuzz_http ] && seconds=30 seeds=(tests/fuzz/corpus_http)
  [ "$f" = fuzz_codebook ] && seconds=30 seeds=(tests/fuzz/corpus_codebook)
  [ "$f" = fuzz_context ] && seconds=30 seeds=(tests/data/contexts)
  [ "$f" = fuzz_workflow ] && seconds=30 seeds=(examples)
  [ "$f" = fuzz_kv_format ] && seconds=20 seeds=(tests/fuzz/corpus_kv_format)
  # Its seeds (llama2.c and GGUF tokenizers with a text) are written by the fuzzer itself.
  [ "$f" = fuzz_tokenizer ] && seconds=30 && QKVSHARE_FUZZ_SEED_DIR="build-fuzz/corpus-$f" "build-fuzz/tests/fuzz/$f" -runs=0 >/dev/null 2>&1
  "build-fuzz/tests/fuzz/$f" -max_total_time=$seconds -seed=1 -print_final_stats=1 "build-fuzz/corpus-$f" "${seeds[@]}" 2>&1 | tail -5
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "[test] $f found a crash" >&2; exit 1; }
done
