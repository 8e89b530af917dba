#!/usr/bin/env bash
# The README's first command: install everything, build, fetch the default
# model and run the main job on it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
model=$(scripts/fetch_model.sh)
echo "[quickstart] running: qkvshare demo on $model" >&2
./build/src/cli/qkvshare demo -m "$model"
