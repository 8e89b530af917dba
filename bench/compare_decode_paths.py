#!/usr/bin/env python3
"""Two ways of the engine's batched decode, A/B on the same work, alternating, in one run.

  bench/compare_decode_paths.py reads        # shared block reads vs --kv-private-reads (depth 2048, forks)
  bench/compare_decode_paths.py quantize     # background quantization vs --kv-quantize-in-pass
  bench/compare_decode_paths.py reads --reps 5 --kv f16,int8 --batch 1,4

Each repetition runs `qkvshare bench --batch ...` once per KV format with the default path and once
with the earlier path's flag, which goes first alternating, on the same model file, threads, depth
and token counts (the tokens decoded are the same: the flags change how, not what, is computed; the
engine's tests check the bits). The figure is the aggregate decode tokens/s (B x N / decode time);
medians over the repetitions, and the ratio new / earlier per cell. Writes
bench/results/decode-paths-<which>-<time>.json and prints a Markdown table.
"""
import argparse
import collections
import datetime
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_batched as cb  # noqa: E402  (one `qkvshare bench --batch` run)
import compare_llamacpp as cl  # noqa: E402  (model paths, logging)

ROOT = cl.ROOT
DecodePath = collections.namedtuple("DecodePath", "label earlier_flag earlier_label depth shared_prefix")
PATHS = {
    "reads": DecodePath("shared block reads", "--kv-private-reads", "private reads", 2048, True),
    "quantize": DecodePath("background quantization", "--kv-quantize-in-pass", "quantized in the pass", 1, False),
}


def run_once(a, kv, earlier, tmp):
    """The default path, or with `earlier` the earlier path's flag: {batch: aggregate decode tokens/s}."""
    path = PATHS[a.which]
    got, cmd = cb.qkvshare_batch_decode(a.qkvshare, a.model, a.threads, a.n_gen, a.depth, a.batches, kv, tmp,
                                        path.shared_prefix, [path.earlier_flag] if earlier else [])
    return {b: v for (_, b), v in got.items()}, cmd


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", choices=sorted(PATHS))
    p.add_argument("--model", default=None, help="GGUF file (default: the default model, SmolLM2-135M Q4_1)")
    p.add_argument("--qkvshare", default=str(ROOT / "build" / "src" / "cli" / "qkvshare"))
    p.add_argument("--kv", default="f16,int8,int4")
    p.add_argument("--batch", default="1,2,4,8")
    p.add_argument("--depth", type=int, default=None, help="context depth (default: 2048 for reads, 1 for quantize)")
    p.add_argument("--n-gen", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    if a.model is None:
        a.model = str(cl.REAL["smollm2-135m-instruct-Q4_1"])
    if a.depth is None:
        a.depth = PATHS[a.which].depth
    if a.reps < 1 or a.n_gen < 1 or a.depth < 1:
        p.error("--reps, --n-gen and --depth must be at least 1")
    a.batches = [int(b) for b in a.batch.split(",")]
    formats = a.kv.split(",")
    label_new, label_old = PATHS[a.which].label, PATHS[a.which].earlier_label
    samples = {(kv, mode): {b: [] for b in a.batches} for kv in formats for mode in ("new", "old")}
    commands = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            for kv in formats:
                order = ("new", "old") if (rep % 2 == 0) else ("old", "new")
                for mode in order:
                    cl.log(f"[{a.which}] rep {rep + 1}/{a.reps} kv {kv}: {label_new if mode == 'new' else label_old}")
                    got, cmd = run_once(a, kv, mode == "old", str(Path(tmp) / "r.json"))
                    commands[mode] = cmd
                    for b, v in got.items():
                        samples[(kv, mode)][b].append(v)
    rows = []
    for kv in formats:
        for b in a.batches:
            new = statistics.median(samples[(kv, "new")][b])
            old = statistics.median(samples[(kv, "old")][b])
            rows.append({"kv": kv, "batch": b, "new": new, "old": old, "ratio": new / old,
                         "new_samples": samples[(kv, "new")][b], "old_samples": samples[(kv, "old")][b]})
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    result = {"which": a.which, "time_utc": stamp, "model": a.model, "threads": a.threads, "depth": a.depth,
              "n_gen": a.n_gen, "reps": a.reps, "new": label_new, "old": label_old, "commands": commands,
              "rows": rows}
    out = ROOT / "bench" / "results" / f"decode-paths-{a.which}-{stamp}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"\n{a.which}: depth {a.depth}, {a.n_gen} tokens per session, {a.threads} threads, median of {a.reps} "
          f"(aggregate decode tokens/s)\n")
    print(f"| KV | batch | {label_new} | {label_old} | ratio |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kv']} | {r['batch']} | {r['new']:.1f} | {r['old']:.1f} | {r['ratio']:.2f}x |")
    print(f"\nraw: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
