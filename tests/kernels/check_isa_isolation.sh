#!/usr/bin/env bash
# The binary must run on any x86-64: no function outside the ISA kernel units
# may use AVX registers (ymm/zmm). Such code appears when an inline function
# of a shared header is compiled inside an ISA unit with its -m flags and the
# linker keeps that copy (src/kernels/kernel_table.hpp says why). Functions
# whose name matches ALLOWED (the ISA namespaces) are exempt.
#   tests/kernels/check_isa_isolation.sh build/src/cli/qkvshare ['regex of allowed functions']
set -euo pipefail
bin=${1:?usage: $0 BINARY [ALLOWED_REGEX]}
allowed=${2:-'kernels::detail::avx512::|kernels::detail::avx2::'}
offenders=$(objdump -d --no-show-raw-insn -C "$bin" |
  awk '/^[0-9a-f]+ <.*>:$/ {fn = $0} /%[yz]mm[0-9]/ {print fn}' | sort -u | grep -Ev -- "$allowed" || true)
if [[ -n "$offenders" ]]; then
  echo "AVX code outside the ISA kernel units of $bin:" >&2
  echo "$offenders" >&2
  exit 1
fi
echo "ok: AVX instructions only in ISA kernel functions of $bin"
