#!/usr/bin/env bash
# CTest's python_package: tests/python in the venv where scripts/python_package.sh
# installed the package with `pip install .`. Without that venv the test is
# skipped with a loud message (exit 77), except in CI, where it fails.
set -uo pipefail
src="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${QKVSHARE_PY_VENV:-$src/build-python/venv}"
if ! (cd / && "$venv/bin/python" -c "import qkvshare" 2>/dev/null); then
  echo "*** python_package: no installed qkvshare in $venv: run scripts/python_package.sh first ***" >&2
  [ "${CI:-}" = "true" ] && exit 1
  exit 77
fi
cd "$src"
exec "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider tests/python
