#!/usr/bin/env bash
# Every bad input to the CLI ends with a clear message and a non-zero exit,
# never a crash (exit codes >= 128 are signals).
set -u
CLI="$1"
SHARED="$2"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
passes=0

# expect_error EXPECTED_SUBSTRING -- ARGS...
expect_error() {
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

S="$SHARED/models/stories260K.bin"
TESTDATA_CTX="$(dirname "$0")/../data/contexts/f16.qkvctx"
T="$SHARED/models/tok512.bin"
printf 'GGUF\x03\x00\x00\x00' > "$tmp/short.gguf"
head -c 1000 "$S" > "$tmp/truncated.bin"
printf 'hello' > "$tmp/tiny.bin"
head -c 100 "$T" > "$tmp/truncated_tok.bin"

expect_error "missing.gguf" generate -m "$tmp/missing.gguf" -p hi
expect_error "short.gguf" generate -m "$tmp/short.gguf" -p hi
expect_error "truncated.bin" generate -m "$tmp/truncated.bin" -t "$T" -p hi
expect_error "tiny.bin" generate -m "$tmp/tiny.bin" -p hi
expect_error "-t TOKENIZER" generate -m "$S" -p hi
expect_error "truncated_tok.bin" generate -m "$S" -t "$tmp/truncated_tok.bin" -p hi
expect_error "top-p" generate -m "$S" -t "$T" -p hi --top-p 2
expect_error "temperature" generate -m "$S" -t "$T" -p hi --temp -1
expect_error "chat template 'vicuna' is not one of chatml" generate -m "$S" -t "$T" -p hi --chat-template vicuna
expect_error "chat template 'vicuna' is not one of chatml" serve -m "$S" -t "$T" --port 0 --chat-template vicuna
expect_error "--demote int9" serve -m "$S" -t "$T" --port 0 --spill-dir "$tmp/spill" --demote int9
expect_error "give a format of one precision" serve -m "$S" -t "$T" --port 0 --demote int8:lo=int2:top=0.5
expect_error "give --spill-dir too" serve -m "$S" -t "$T" --port 0 --key "$tmp/no-such.key"
expect_error "--key $tmp/no-such.key" serve -m "$S" -t "$T" --port 0 --spill-dir "$tmp/spill" --key "$tmp/no-such.key"
expect_error "cannot create the spill folder" serve -m "$S" -t "$T" --port 0 --spill-dir "$tmp/short.gguf/spill"
expect_error "not a weight type make-model writes" make-model --shape tiny-llama --type Q8_K -o "$tmp/x.gguf"
expect_error "context length" generate -m "$S" -t "$T" -p "Once upon a time there was a girl" --ctx 4
# Portable context files and key files (tiers).
printf 'QKVCTX\0\0garbage' > "$tmp/bad.qkvctx"
printf 'abc' > "$tmp/short.key"
expect_error "bad.qkvctx" context import "$tmp/bad.qkvctx" --pool none --agent A --grant B -o "$tmp/x.desc"
expect_error "missing.qkvctx" context import "$tmp/missing.qkvctx" --pool none --agent A --grant B -o "$tmp/x.desc"
expect_error "short.key" context import "$TESTDATA_CTX" --pool none --agent A --grant B -o "$tmp/x.desc" --key "$tmp/short.key"
expect_error "--kv-budget" run "$(dirname "$0")/../../examples/w1_two_agents.yaml" -m "$S" -t "$T" --kv-budget lots
expect_error "need --kv-budget" run "$(dirname "$0")/../../examples/w1_two_agents.yaml" -m "$S" -t "$T" --no-prefetch
expect_error "need --kv-budget" run "$(dirname "$0")/../../examples/w1_two_agents.yaml" -m "$S" -t "$T" --demote int4
expect_error "--demote int8:lo=int2:top=0.5: give a format of one precision" run "$(dirname "$0")/../../examples/w1_two_agents.yaml" -m "$S" -t "$T" --kv-budget 1M --demote int8:lo=int2:top=0.5
expect_error "int9" run "$(dirname "$0")/../../examples/w1_two_agents.yaml" -m "$S" -t "$T" --kv-budget 1M --demote int9
# splice-eval's token choice.
SRC="$SHARED/data/tinystories-valid-sample.txt"
expect_error "--select: 'middle' is not head or deviation" splice-eval -m "$S" -t "$T" --source "$SRC" --select middle
expect_error "--check-layers: 'x' is not a layer number" splice-eval -m "$S" -t "$T" --source "$SRC" --select deviation --check-layers x
expect_error "--check-layers: layer 7 is not in [0, 5)" splice-eval -m "$S" -t "$T" --source "$SRC" --select deviation --check-layers 7
printf '{"format":"other"}' > "$tmp/bad.ref"
expect_error "bad.ref" context pull "$tmp/bad.ref" --pool none --agent A --grant B -o "$tmp/x.desc"
expect_error "missing.ref" context pull "$tmp/missing.ref" --pool none --agent A --grant B -o "$tmp/x.desc"
expect_error "is not HOST:PORT" context push "$tmp/x.desc" --pool none --agent A --name n -o "$tmp/r.ref" --redis nohost
# Leases (pool serve, run) and the grant listing.
expect_error "--lease" pool serve --name qkvshare-cli-lease-test --lease 0
expect_error "--lease" pool serve --name qkvshare-cli-lease-test --lease soon
expect_error "--lease" run "$(dirname "$0")/../../examples/w1_two_agents.yaml" -m "$S" -t "$T" --lease 0
expect_error "pool 'qkvshare-no-such-pool' does not exist" pool ls --name qkvshare-no-such-pool
expect_error "pool name" pool ls --name "bad/name"
printf '0%.0s' $(seq 64) > "$tmp/k.key"
expect_error "cannot create key file" context keygen -o "$tmp/k.key"
expect_error "--ids" logits -m "$S" -t "$T" --ids 1,x,3
expect_error "outside the vocabulary" logits -m "$S" -t "$T" --ids 1,99999
expect_error "prompt" generate -m "$S" -t "$T"
expect_error "new-tokens" generate -m "$S" -t "$T" -p hi -n -5
expect_error "subcommand" nosuchcommand
expect_error "nonexistent" generate -m "$S" -t "$T" -p hi --nonexistent-flag

printf 'agents: {a: {prompt: go}}\nsteps:\n  - {id: x, agent: a, inputs: [y]}\n  - {id: y, agent: a, inputs: [x]}\n' > "$tmp/cycle.yaml"
printf 'agents: [\n' > "$tmp/syntax.yaml"
expect_error "cycle" run "$tmp/cycle.yaml" -m "$S" -t "$T"
expect_error "syntax.yaml:" run "$tmp/syntax.yaml" -m "$S" -t "$T"
expect_error "missing.yaml" run "$tmp/missing.yaml" -m "$S" -t "$T"
expect_error "--mode" run "$(dirname "$0")/../../examples/w1_two_agents.yaml" -m "$S" -t "$T" --mode sideways
expect_error "a comparison runs every mode" run "$(dirname "$0")/../../examples/w1_two_agents.yaml" -m "$S" -t "$T" --compare --mode qkvshare
expect_error "qkvshare:int4 is not among --modes" run "$(dirname "$0")/../../examples/w1_two_agents.yaml" -m "$S" -t "$T" --compare --kv int4 --modes shared-text:f32,qkvshare:int8
expect_error "model not found" demo -m "$tmp/none.gguf"

# Directories where a file is expected name the file, and output paths are
# checked before the work (nothing half-written, no grant without a descriptor).
mkdir -p "$tmp/adir"
expect_error "tokenizer file '$tmp/adir': is a directory" generate -m "$S" -t "$tmp/adir" -p hi
expect_error "PQ codebook '$tmp/adir': is a directory" eval -m "$S" -t "$T" --text "$SRC" --kv "pq4:book=$tmp/adir" --ctx 64 --max-tokens 64
expect_error "--text '$tmp/adir': is a directory" eval -m "$S" -t "$T" --text "$tmp/adir" --kv int8
expect_error "--source '$tmp/adir': is a directory" splice-eval -m "$S" -t "$T" --source "$tmp/adir"
expect_error "workflow file '$tmp/adir': is a directory" run "$tmp/adir" -m "$S" -t "$T"
expect_error "-o '$tmp/adir': is a directory" calibrate -m "$S" -t "$T" --text "$SRC" --tokens 512 --ctx 128 --iterations 1 --sub 2 -o "$tmp/adir"
[ -z "$(ls "$tmp" | grep -F '.part.')" ] && passes=$((passes+1)) || { echo "FAIL: a part file was left in $tmp"; fails=$((fails+1)); }
expect_error "--guard-threshold: 'nan' is not a finite number >= 0" run "$(dirname "$0")/../../examples/w1_two_agents.yaml" -m "$S" -t "$T" --guard-threshold nan
expect_error "--guard-threshold: '-1' is not a finite number >= 0" run "$(dirname "$0")/../../examples/w1_two_agents.yaml" -m "$S" -t "$T" --guard-threshold -1
expect_error "--kv: empty item in 'int4,,int8'" splice-eval -m "$S" -t "$T" --source "$SRC" --kv int4,,int8
expect_error "--fractions: empty item in '0.1,'" splice-eval -m "$S" -t "$T" --source "$SRC" --fractions 0.1,
expect_error "outliers must be a share from 0.001 to 0.127" eval -m "$S" -t "$T" --text "$SRC" --kv int2:outliers=0.5 --ctx 64 --max-tokens 64
expect_error "outliers needs integer codes" eval -m "$S" -t "$T" --text "$SRC" --kv f16:outliers=0.01 --ctx 64 --max-tokens 64
expect_error "params must be 8 (one-byte scales and mins) or 16" eval -m "$S" -t "$T" --text "$SRC" --kv int4:params=4 --ctx 64 --max-tokens 64
expect_error "params=8 needs integer codes" eval -m "$S" -t "$T" --text "$SRC" --kv f16:params=8 --ctx 64 --max-tokens 64
expect_error "tail must be hot or cold, got 'warm'" eval -m "$S" -t "$T" --text "$SRC" --kv int4:tail=warm --ctx 64 --max-tokens 64
expect_error "codes its last block when a context is handed off: evaluate it with --protocol handoff" eval -m "$S" -t "$T" --text "$SRC" --kv int4:tail=cold --ctx 64 --max-tokens 64
expect_error "--kv: the list is empty" splice-eval -m "$S" -t "$T" --source "$SRC" --kv ""
expect_error "nothing to measure" bench -m "$S" -t "$T" -n 4 -r 1 --batch 2 -d 1000
expect_error "nothing was measured" bench -m "$S" -t "$T" -n 4 -p 0 -r 1 -d 1000
expect_error "--publish '$tmp/adir': is a directory" generate -m "$S" -t "$T" -p hi -n 2 --pool none --publish "$tmp/adir" --agent A --grant B
expect_error "--grant: 'B' is named twice" generate -m "$S" -t "$T" -p hi -n 2 --pool none --publish "$tmp/d.desc" --agent A --grant B --grant B
cat > "$tmp/nondep.yaml" <<'YAML'
agents:
  a: {prompt: "Once"}
steps:
  - {id: s1, agent: a}
  - {id: s2, agent: a, prompt: "see {output:s1}"}
YAML
expect_error "nondep.yaml:5: step 's2' uses '{output:s1}' but does not read step 's1'" run "$tmp/nondep.yaml" -m "$S" -t "$T"

expect_error "--pool-format requires --pool" generate -m "$S" -t "$T" -p hi -n 2 --pool-format int4:vgroup=7
expect_error "w1_two_agents.yaml:15: step 'intro': context length exceeded" run "$(dirname "$0")/../../examples/w1_two_agents.yaml" -m "$S" -t "$T" --ctx 16

# A pool that live processes use keeps its name, and a server that stops
# removes its own pool's name only, never a newer pool given the same name.
PN=qkvshare-cli-unlink-test-$$
start_pool() { "$CLI" pool serve --name "$PN" --bytes 16M > "$tmp/$1.log" 2>&1 & echo $! > "$tmp/$1.pid";
  for _ in $(seq 50); do grep -q ready "$tmp/$1.log" && return; sleep 0.1; done; }
stop_pool() { kill -TERM "$(cat "$tmp/$1.pid")"; wait "$(cat "$tmp/$1.pid")" 2>/dev/null; }
start_pool first
expect_error "pool '$PN' is in use by 1 live process" pool unlink --name "$PN"
"$CLI" pool unlink --name "$PN" --force && passes=$((passes+1)) || { echo "FAIL: unlink --force"; fails=$((fails+1)); }
start_pool second
stop_pool first
grep -q "no longer refers to this pool" "$tmp/first.log" && "$CLI" pool stat --name "$PN" >/dev/null 2>&1 \
  && passes=$((passes+1)) || { echo "FAIL: stopping the first server removed the second pool"; cat "$tmp/first.log"; fails=$((fails+1)); }
stop_pool second
expect_error "pool '$PN' does not exist" pool unlink --name "$PN"

expect_error "--chunk sets the consumer's pass under --protocol handoff" eval -m "$S" -t "$T" --text "$SRC" --chunk 8
# A GGUF carries its own tokenizer: a -t beside it is named as unused.
"$CLI" make-model --shape tiny-llama -o "$tmp/tiny.gguf" >/dev/null 2>&1
if "$CLI" tokenize -m "$tmp/tiny.gguf" -t "$T" -p hi 2>&1 >/dev/null | grep -qF -- "-t/--tokenizer $T is not used"; then
  passes=$((passes+1)); else echo "FAIL: -t beside a GGUF was not named as unused"; fails=$((fails+1)); fi

# The default spill folder: a killed run's folder is removed by the next run,
# and a run removes its own when it ends.
sh -c 'exit 0' & dead=$!; wait $dead
mkdir -p "$tmp/qkvshare-spill.$dead" && echo half > "$tmp/qkvshare-spill.$dead/1.qkvctx"
if TMPDIR="$tmp" "$CLI" run "$(dirname "$0")/../../examples/w1_two_agents.yaml" -m "$S" -t "$T" --kv-budget 1M -q >/dev/null 2>&1 \
   && ! compgen -G "$tmp/qkvshare-spill.*" >/dev/null; then passes=$((passes+1))
else echo "FAIL: spill folders left in $tmp:"; ls "$tmp"; fails=$((fails+1)); fi

# --help works on every command.
for cmd in "" generate tokenize logits run demo; do
  if ! "$CLI" $cmd --help >/dev/null 2>&1; then echo "FAIL: '$cmd --help' failed"; fails=$((fails+1)); else passes=$((passes+1)); fi
done

echo "$passes passed, $fails failed"
[ $fails -eq 0 ]
