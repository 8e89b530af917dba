#!/usr/bin/env bash
# Instruction mix of the ARM64 kernel levels, per kernel, from the
# cross-built objects (scripts/test_aarch64.sh builds them): how many of the
# instructions that do the work each entry point and its inlined body hold.
# Speed on ARM cannot be measured here; this shows what the compiler made.
#   bench/arm64_instruction_mix.sh [build-aarch64]
set -euo pipefail
dir="${1:-build-aarch64}/src/CMakeFiles/qkvshare_kernels.dir/kernels"
ops='sdot|smull|smull2|sadalp|fmla|fmul|fadd|faddp|fcvtl|fcvtl2|ushl|ushll|and|scvtf|ucvtf|frintn|fdiv|ld1|ldr|ldp'
printf '| unit | function | %s |\n' "$(echo "$ops" | sed 's/|/ | /g')"
printf '|---|---|%s\n' "$(echo "$ops" | sed 's/[^|]*/---/g; s/$/|/')"
for unit in isa_neon isa_neon_dot; do
  aarch64-linux-gnu-objdump -d --no-show-raw-insn -C "$dir/$unit.cpp.o" |
    awk -v unit="$unit" -v ops="$ops" '
      BEGIN { n = split(ops, op, "|") }
      /^[0-9a-f]+ <.*>:$/ { fn = substr($0, index($0, "<") + 1); sub(/>:$/, "", fn); order[++nf] = fn; next }
      /^ +[0-9a-f]+:/ { m = $2; sub(/\..*/, "", m); count[fn, m]++ }
      END {
        for (i = 1; i <= nf; i++) {
          f = order[i]
          # entry points of the level (kernel_table.hpp names), not helpers
          # entry points of the level (kernel_table.hpp names) and the KV decode
          # bodies (one per code width), which are not inlined into their entry
          if (f ~ /^qkvshare::kernels::detail::neon(_dot)?::(gemm_|tile_|silu_mul)/) {
            short = f; sub(/^qkvshare::kernels::detail::/, "", short); sub(/\(.*/, "", short)
          } else if (f ~ /tile_decode_codes<qkvshare::kernels::detail::neon::/) {
            short = f; sub(/.*, /, "", short); sub(/>.*/, "", short); short = "tile_decode_codes<" short " bits>"
          } else continue
          line = "| " unit " | `" short "` |"; total = 0
          for (k = 1; k <= n; k++) { line = line " " (count[f, op[k]] + 0) " |"; total += count[f, op[k]] }
          if (total > 0) print line
          else print "| " unit " | `" short "` | (calls the neon level) |"
        }
      }'
done
