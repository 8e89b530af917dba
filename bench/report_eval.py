#!/usr/bin/env python3
"""Markdown table (and optionally a plot) of one or more `qkvshare eval --json` results.

  bench/report_eval.py smol-512.json smol-2048.json [--plot docs/img/kv_quality.png]

Prints for each file a header line (model, text, context, windows, scored tokens) and the table
docs/kv-quality.md uses; --plot draws PPL delta and mean KL against bits per element, one series
per file.
"""
import argparse
import json
import sys
from pathlib import Path


def table(d):
    md = [f"ctx {d['ctx']}, {d['windows']} windows, {d['scored_per_format']} tokens scored per format "
          f"({d['scored_positions']}), block {d['block_tokens']} tokens, text {d['text_tokens']} tokens\n",
          "| format | bits/el | KV B/tok | PPL | delta % | mean KL | p99 KL | top-1 | prefill tok/s |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for f in d["formats"]:
        md.append(f"| `{f['format']}` | {f['bits_per_element']:.2f} | {f['kv_bytes_per_token']:.0f} | {f['ppl']:.4f} | "
                  f"{f['ppl_delta_pct']:+.3f} | {f['mean_kl']:.5f} | {f['p99_kl']:.4f} | {100 * f['top1']:.2f}% | "
                  f"{f['prefill_tokens_per_s']:.0f} |")
    return md


def plot(runs, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[report_eval] matplotlib missing: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for d in runs:
        fs = [f for f in d["formats"] if f["format"] != "f32"]
        bits = [f["bits_per_element"] for f in fs]
        for ax, key, label in [(axes[0], "ppl_delta_pct", "PPL delta vs f32 KV (%)"),
                               (axes[1], "mean_kl", "mean KL vs f32 KV (nats)")]:
            ax.scatter(bits, [f[key] for f in fs], label=f"ctx {d['ctx']}")
            for b, f in zip(bits, fs):
                ax.annotate(f["format"].split(":")[0] + ("+w" if "window" in f["format"] else ""), (b, f[key]),
                            fontsize=6, xytext=(3, 3), textcoords="offset points")
            ax.set_xlabel("stored bits per element")
            ax.set_ylabel(label)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(Path(runs[0]["model"]).name + " on " + Path(runs[0]["text"]).name, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"[report_eval] wrote {path}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+")
    ap.add_argument("--plot")
    a = ap.parse_args()
    runs = [json.loads(Path(p).read_text()) for p in a.json]
    for d in runs:
        print("\n".join(table(d)) + "\n")
    if a.plot:
        plot(runs, a.plot)


if __name__ == "__main__":
    main()
