#!/usr/bin/env bash
# make-model and bench from the command line: a tiny synthetic model is written,
# loads, generates and benchmarks (JSON included); bad shapes, types and flags
# are clear errors with a non-zero exit (never a signal).
#   tests/cli/test_cli_bench.sh path/to/qkvshare
set -u
CLI="$1"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
passes=0

check() {  # check DESCRIPTION COMMAND...
  local what="$1"; shift
  if "$@" >"$tmp/out" 2>&1; then passes=$((passes+1)); else echo "FAIL: $what"; head -20 "$tmp/out"; fails=$((fails+1)); fi
}

expect_error() {  # expect_error EXPECTED_SUBSTRING -- ARGS...
  local want="$1"; shift
  local out rc
  out=$("$CLI" "$@" 2>&1 >/dev/null); rc=$?
  if [ $rc -eq 0 ] || [ $rc -ge 128 ]; then
    echo "FAIL: exit $rc for: $*"; echo "$out" | head -5; fails=$((fails+1)); return
  fi
  if ! grep -qF -- "$want" <<<"$out"; then
    echo "FAIL: message for '$*' lacks '$want':"; echo "$out" | head -5; fails=$((fails+1)); return
  fi
  passes=$((passes+1))
}

M="$tmp/tiny.gguf"
check "make-model tiny-llama" "$CLI" make-model --shape tiny-llama --type Q4_0 -o "$M" --seed 3
check "make-model tiny-qwen2 with overrides" "$CLI" make-model --shape tiny-qwen2 --type F16 --layers 1 --vocab 300 -o "$tmp/q.gguf"
check "make-model --list-shapes" "$CLI" make-model --list-shapes
check "generate on a synthetic model" "$CLI" generate -m "$M" -p "Hello world" -n 5 --temp 0
check "generate on an overridden shape" "$CLI" generate -m "$tmp/q.gguf" -p "Hi" -n 3 --ignore-eos
check "bench with JSON" "$CLI" bench -m "$M" --threads 2 -r 2 -p 16 -n 4 -d 0,32 --json "$tmp/b.json"
cp "$tmp/out" "$tmp/bench.txt"
check "bench JSON has the tests" grep -q '"name": "tg4"' "$tmp/b.json"
check "bench table on stdout" grep -q "pp16" "$tmp/bench.txt"
check "bench --batch with JSON" "$CLI" bench -m "$M" --threads 2 -r 1 -n 4 -d 0,8 --batch 1,3 --kv f16,int4 --json "$tmp/bb.json"
cp "$tmp/out" "$tmp/batch.txt"
check "bench --batch JSON has batched decode tests" grep -q '"kind": "batch_decode"' "$tmp/bb.json"
check "bench --batch table has the speed-up column" grep -q "vs batch 1" "$tmp/batch.txt"
check "bench skips depths beyond the context" "$CLI" bench -m "$M" -r 1 -p 8 -n 4 -d 0,100000

expect_error "unknown shape 'nope'" make-model --shape nope -o "$tmp/x.gguf"
expect_error "known: smollm2-135m" make-model --shape nope -o "$tmp/x.gguf"
expect_error "--type: 'Q8_K'" make-model --shape tiny-llama --type Q8_K -o "$tmp/x.gguf"
expect_error "--shape is required" make-model -o "$tmp/x.gguf"
expect_error "-o/--output is required" make-model --shape tiny-llama
expect_error "block size" make-model --shape tiny-llama --d-model 48 --heads 4 -o "$tmp/x.gguf"
expect_error "KV heads" make-model --shape tiny-llama --kv-heads 3 -o "$tmp/x.gguf"
expect_error "vocabulary" make-model --shape tiny-llama --vocab 100 -o "$tmp/x.gguf"
expect_error "cannot create" make-model --shape tiny-llama -o "$tmp/no/such/dir/x.gguf"
expect_error "missing.gguf" bench -m "$tmp/missing.gguf"
expect_error "--reps" bench -m "$M" -r 0
expect_error "context length" bench -m "$M" -p 100000
expect_error "KV format 'int9'" bench -m "$M" -r 1 -n 2 --batch 2 --kv f16,int9
expect_error "--batch" bench -m "$M" -r 1 -n 2 --batch 0
expect_error "--batch: Value 300 not in range 1 to 256" bench -m "$M" -r 1 -n 2 --batch 300
expect_error "--n-gen" bench -m "$M" -r 1 -n 0 --batch 2
[ -e "$tmp/x.gguf" ] && { echo "FAIL: a failed make-model left $tmp/x.gguf"; fails=$((fails+1)); }

for cmd in bench make-model; do
  if "$CLI" $cmd --help >/dev/null 2>&1; then passes=$((passes+1)); else echo "FAIL: '$cmd --help' failed"; fails=$((fails+1)); fi
done

echo "$passes passed, $fails failed"
[ $fails -eq 0 ]
