#!/usr/bin/env bash
# Builds and installs the Python package the way a user does, `pip install .`,
# into a fresh venv (build-python/venv), then checks that it imports. The
# build folder (build-python/<wheel tag>, pyproject.toml) is kept between runs,
# so a second run only rebuilds what changed. tests/python runs in this venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(realpath -m "${QKVSHARE_PY_VENV:-build-python/venv}")"
python3 -m venv --clear "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >&2
echo "[python] pip install . (scikit-build-core + nanobind; builds the library with -fPIC)" >&2
start=$(date +%s)
# QKVSHARE_PY_BUILD_DIR: build in another (kept) folder, e.g. a developer's own PIC build tree.
extra=()
[ -n "${QKVSHARE_PY_BUILD_DIR:-}" ] && extra=(-C "build-dir=$QKVSHARE_PY_BUILD_DIR")
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "${extra[@]}" . pytest >&2
echo "[python] installed in $(( $(date +%s) - start )) s" >&2
# From another folder, so that the installed package is the one imported.
(cd / && "$VENV/bin/python" -c "import qkvshare; print('[python] import qkvshare', qkvshare.__version__)") >&2
