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


def bits_of(d, f):
    """Every stored bit: under the handoff protocol, what the handed-off context ships (hot blocks included)."""
    return f.get("handoff_bits_per_element") or f["bits_per_element"] if d.get("protocol") == "handoff" \
        else f["bits_per_element"]


def plot(runs, path, names):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[report_eval] matplotlib missing: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for d, name in zip(runs, names):
        fs = [f for f in d["formats"] if f["format"] != "f32"]
        bits = [bits_of(d, f) for f in fs]
        for ax, key, label in [(axes[0], "ppl_delta_pct", "PPL delta vs f32 KV (%)"),
                               (axes[1], "mean_kl", "mean KL vs f32 KV (nats)")]:
            ax.scatter(bits, [f[key] for f in fs], label=name, s=14)
            for b, f in zip(bits, fs):
                ax.annotate(short_name(f["format"]), (b, f[key]), fontsize=6, xytext=(3, 3), textcoords="offset points")
            ax.set_xlabel("stored bits per element (shipped, under --protocol handoff)")
            ax.set_ylabel(label)
    axes[0].set_yscale("symlog", linthresh=0.1)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(Path(runs[0]["model"]).name + " on " + Path(runs[0]["text"]).name, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"[report_eval] wrote {path}", file=sys.stderr)


def short_name(fmt):
    """The format without its codebook path, marking a window/sink, a low precision and a budget."""
    parts = fmt.split(":")
    out = parts[0]
    for p in parts[1:]:
        if p.startswith(("lo=", "top=", "budget=")):
            out += ":" + p
        elif p.startswith(("window", "sink")) and "+w" not in out:
            out += "+w"
        elif p in ("keys=pre", "keys=block"):
            out += "+" + p[len("keys="):]
        elif p.startswith(("outliers=", "koutliers=", "voutliers=")):  # +o1%: 1% of each tile kept apart
            side, _, share = p.partition("=")
            out += f"+{side[0] if side != 'outliers' else ''}o{100 * float(share):g}%"
        elif p == "params=8":  # one-byte scales and mins
            out += "+p8"
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="eval --json files; FILE@TEXT keeps the formats whose name holds TEXT")
    ap.add_argument("--plot")
    ap.add_argument("--names", help="comma-separated series names (default: the file names)")
    a = ap.parse_args()
    runs = []
    for arg in a.json:
        path, _, keep = arg.partition("@")
        d = json.loads(Path(path).read_text())
        if keep:
            d["formats"] = [f for f in d["formats"] if keep in f["format"] or f["format"] == "f32"]
        runs.append(d)
    for d in runs:
        print("\n".join(table(d)) + "\n")
    if a.plot:
        names = a.names.split(",") if a.names else [Path(p.partition("@")[0]).stem for p in a.json]
        plot(runs, a.plot, names)


if __name__ == "__main__":
    main()
