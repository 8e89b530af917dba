#!/usr/bin/env python3
"""Plots bench_handoff's JSON: handoff cost vs prefill and KV copy, log-log.

    build/bench/bench_handoff --json handoff.json
    python3 bench/plot_handoff.py handoff.json docs/img/handoff_cost.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    with open(src) as f:
        data = json.load(f)
    rows = data["rows"]
    n = [r["tokens"] for r in rows]
    ms = lambda key: [r[key] / 1000.0 for r in rows]  # noqa: E731
    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    ax.plot(n, ms("handoff_open_us"), "o-", label="grant + open, same process")
    ax.plot(n, ms("remote_open_us"), "s-", label="open in another process")
    ax.plot(n, ms("seal_first_us"), "^:", label="seal, first (checksums kept in the background)")
    if "seal_first_hashing_at_seal_us" in rows[0]:
        ax.plot(n, ms("seal_first_hashing_at_seal_us"), "v:", color="tab:gray",
                label="seal, first, hashing at seal (background off)")
    ax.plot(n, ms("kv_copy_us"), "d-", color="tab:purple", label="copy KV bytes (state save + load)")
    measured = [(r["tokens"], r["prefill_us"] / 1000.0) for r in rows if not r["prefill_extrapolated"]]
    extra = [(r["tokens"], r["prefill_us"] / 1000.0) for r in rows if r["prefill_extrapolated"]]
    if measured:
        ax.plot(*zip(*measured), "x-", color="tab:red", label="re-encode text (prefill), measured")
    if extra:
        pts = measured[-1:] + extra
        ax.plot(*zip(*pts), "x--", color="tab:red", alpha=0.6, label="prefill, extrapolated (linear)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("time (ms)")
    ax.set_title(f"Context handoff, {data['format']} KV, shape {data['shape']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
