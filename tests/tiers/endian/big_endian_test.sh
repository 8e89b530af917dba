#!/usr/bin/env bash
# The portable context format read on a big-endian machine: context_dump
# (tests/tiers/endian) is cross-compiled for s390x with Debian's
# g++-s390x-linux-gnu and run under qemu-s390x user emulation on context files
# exported from real pools; its output must equal the native build's, line
# for line, and both must re-encode every file to identical bytes.
# Usage: big_endian_test.sh SOURCE_DIR NATIVE_DUMP FILE...
set -euo pipefail
src=$1; native=$2; shift 2
CXX=${QKVSHARE_S390X_CXX:-s390x-linux-gnu-g++}
QEMU=${QKVSHARE_QEMU:-qemu-s390x}
for tool in "$CXX" "$QEMU"; do
  if ! command -v "$tool" >/dev/null; then
    echo "big_endian_test: $tool not found: install g++-s390x-linux-gnu and qemu-user (scripts/install_deps.sh)" >&2
    exit 1
  fi
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Header-only fmt and xxHash (arch-independent headers) for the cross build.
mkdir -p "$work/inc"
ln -s /usr/include/fmt "$work/inc/fmt"
ln -s /usr/include/xxhash.h "$work/inc/xxhash.h"
[ -e /usr/include/xxh3.h ] && ln -s /usr/include/xxh3.h "$work/inc/xxh3.h"
"$CXX" -std=c++20 -O1 -static -DFMT_HEADER_ONLY -DXXH_INLINE_ALL -I"$src/include" -isystem "$work/inc" \
  "$src/tests/tiers/endian/context_dump.cpp" "$src/src/tiers/context_file.cpp" "$src/src/kv/kv_format.cpp" \
  "$src/src/kv/kv_codebook.cpp" \
  "$src/src/core/error.cpp" "$src/src/core/file_io.cpp" -o "$work/context_dump.s390x"
# The cross binary really is big endian (a check of the check).
file_out=$(od -An -tx1 -j5 -N1 "$work/context_dump.s390x" | tr -d ' ')
[ "$file_out" = "02" ] || { echo "big_endian_test: cross build is not big endian (EI_DATA=$file_out)" >&2; exit 1; }
status=0
for f in "$@"; do
  "$native" "$f" > "$work/native.txt" || { echo "native dump failed on $f" >&2; cat "$work/native.txt" >&2; status=1; continue; }
  "$QEMU" "$work/context_dump.s390x" "$f" > "$work/s390x.txt" || { echo "s390x dump failed on $f" >&2; cat "$work/s390x.txt" >&2; status=1; continue; }
  if diff -u "$work/native.txt" "$work/s390x.txt"; then
    echo "ok $(basename "$f"): $(wc -l < "$work/native.txt") lines identical on x86-64 and s390x; $(tail -1 "$work/native.txt")"
  else
    echo "big_endian_test: $f reads differently on s390x" >&2
    status=1
  fi
done
exit $status
