#!/usr/bin/env python3
"""Tables, ratios, machine-limit fractions and the plot of one bench/compare_llamacpp.py run.

  bench/report_bench.py bench/results/latest.json [--update-docs] [--plot PNG]

Prints Markdown on stdout. --update-docs rewrites the part of docs/benchmarks.md between
'<!-- BEGIN RESULTS -->' and '<!-- END RESULTS -->' and writes the plot to docs/img/bench_tokens_per_s.png.
"""
import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "img" / "bench_tokens_per_s.png"
BEGIN, END = "<!-- BEGIN RESULTS -->", "<!-- END RESULTS -->"
ENGINES = ["qkvshare", "llama.cpp"]
MiB = 1024.0 * 1024.0


def test(run, kind, depth):
    for t in run.get("tests", []):
        if t["kind"] == kind and t["depth"] == depth:
            return t
    return None


def tps(run, kind, depth):
    t = test(run, kind, depth) if run else None
    return t["tokens_per_s"]["median"] if t else None


def spread(run, kind, depth):
    t = test(run, kind, depth) if run else None
    if not t:
        return "–"
    s = t["tokens_per_s"]
    text = f"{s['median']:.1f} ({s['min']:.1f}–{s['max']:.1f})" if len(s["samples"]) > 1 else f"{s['median']:.1f}"
    return text + (f" [{t['version']}]" if "version" in t else "")  # the faster llama.cpp: which version it was


def fmt(x, spec=".2f", suffix=""):
    return "–" if x is None else f"{x:{spec}}{suffix}"


def ratio(a, b):
    return a / b if a is not None and b else None


def mark(r, target, higher_is_better=True):
    if r is None:
        return "–"
    ok = r >= target if higher_is_better else r <= target
    return f"{r:.2f}{'' if ok else ' ✗'}"


def runs_of(model):
    return {r["engine"]: r for r in model["runs"]}


def engines_of(res):
    """qkvshare, the anchor (the faster llama.cpp when several versions ran), then each version's own run."""
    names = {r["engine"] for m in res["models"] for r in m["runs"]}
    return [e for e in ENGINES if e in names] + sorted(names - set(ENGINES))


def label(engine, res):
    return "llama.cpp (faster)" if engine == "llama.cpp" and len(res.get("llama_versions", [])) > 1 else engine


def tables(res):
    depths = res["depths"]
    deep = max(depths)
    pp = f"pp{res['n_prompt']}"
    tg = f"tg{res['n_gen']}"
    out = [f"### Tokens/s (median of {res['reps']} reps, min–max in brackets), {res['threads']} threads", "",
           f"| model | engine | prefill {pp} t/s | " + " | ".join(f"decode {tg} @ d{d} t/s" for d in depths)
           + " | peak RSS MiB |", "|---|---|---:|" + "---:|" * len(depths) + "---:|"]
    for m in res["models"]:
        rs = runs_of(m)
        for e in engines_of(res):
            r = rs.get(e)
            if not r:
                continue
            cells = [spread(r, "prefill", 0)] + [spread(r, "decode", d) for d in depths]
            rss = r.get("peak_rss_bytes")
            if "error" in r:
                cells = [f"failed: {r['error'][:60]}"] + ["–"] * len(depths)
            out.append(f"| {m['name']} | {label(e, res)} | " + " | ".join(cells) + f" | {fmt(rss and rss / MiB, '.0f')} |")
    against = "the faster llama.cpp, test by test" if len(res.get("llama_versions", [])) > 1 else "llama.cpp"
    out += ["", f"### Ratios qkvshare / {against} (targets: prefill ≥ 0.8, decode ≥ 1.0, RSS ≤ 1.0; ✗ = missed)", "",
            "| model | prefill | " + " | ".join(f"decode @ d{d}" for d in depths) + " | peak RSS |",
            "|---|---:|" + "---:|" * len(depths) + "---:|"]
    for m in res["models"]:
        rs = runs_of(m)
        q, l = rs.get("qkvshare"), rs.get("llama.cpp")
        if not q or not l or "error" in q or "error" in l:
            continue
        cells = [mark(ratio(tps(q, "prefill", 0), tps(l, "prefill", 0)), 0.8)]
        cells += [mark(ratio(tps(q, "decode", d), tps(l, "decode", d)), 1.0) for d in depths]
        cells.append(mark(ratio(q["peak_rss_bytes"], l["peak_rss_bytes"]), 1.0, higher_is_better=False))
        out.append(f"| {m['name']} | " + " | ".join(cells) + " |")
    out += limits_table(res, deep)
    return out


def limits_table(res, deep):
    mach = res["machine"]
    bw = mach["read_gb_per_s"] * 1e9
    peak_name, peak = ("int8 VNNI", mach["int8_vnni_gops"] * 1e9) if mach.get("int8_vnni_gops") else \
        ("f32 FMA", mach["f32_fma_gflops"] * 1e9)
    out = ["", f"### Against this machine's limits ({mach['read_gb_per_s']:.1f} GB/s read with {mach['threads']} "
               f"threads; {peak_name} peak {peak / 1e9:.0f} G ops/s; f32 FMA peak {mach['f32_fma_gflops']:.0f} GFLOP/s)",
           "",
           "Bytes per decoded token = weight bytes (+ the K/V of the context at 2 bytes per element for the deep "
           "column); FLOPs per token = 2 × weight parameters (+ 4 × layers × q_dim × depth for attention). "
           "`bw limit` is bandwidth / bytes per token.", "",
           f"| model | MiB/token | bw limit d0 t/s | qkvshare d0 % of bw | llama.cpp d0 % of bw | "
           f"qkvshare d{deep} % of bw | llama.cpp d{deep} % of bw | qkvshare prefill % of {peak_name} | "
           f"llama.cpp prefill % of {peak_name} | binds (decode) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for m in res["models"]:
        rs = runs_of(m)
        q, l = rs.get("qkvshare"), rs.get("llama.cpp")
        if not q or "error" in q:
            continue
        kv_bytes = 2 * q["n_layers"] * q["n_kv_heads"] * q["head_dim"] * 2 * deep
        q_dim = q["n_heads"] * q["head_dim"]
        bytes0, bytesd = q["weight_bytes"], q["weight_bytes"] + kv_bytes
        flops0 = 2 * q["weight_params"]
        n = res["n_prompt"]
        flops_pp = 2 * q["weight_params"] * n + 4 * q["n_layers"] * q_dim * n * (n + 1) / 2

        def bw_frac(r, depth, nbytes):
            t = tps(r, "decode", depth) if r else None
            return None if t is None else 100 * t / (bw / nbytes)

        def pp_frac(r):
            t = tps(r, "prefill", 0) if r else None
            return None if t is None else 100 * (t / n) * flops_pp / peak

        binds = "bandwidth" if bytes0 / bw > flops0 / peak else "compute"
        out.append(f"| {m['name']} | {bytes0 / MiB:.0f} | {bw / bytes0:.1f} | {fmt(bw_frac(q, 0, bytes0), '.0f', '%')} | "
                   f"{fmt(bw_frac(l, 0, bytes0), '.0f', '%')} | {fmt(bw_frac(q, deep, bytesd), '.0f', '%')} | "
                   f"{fmt(bw_frac(l, deep, bytesd), '.0f', '%')} | {fmt(pp_frac(q), '.0f', '%')} | "
                   f"{fmt(pp_frac(l), '.0f', '%')} | {binds} |")
    return out


def busy(res):
    la = [x[0] for x in (res.get("load_average_start"), res.get("load_average_end")) if x]
    return bool(la) and max(la) > res["threads"] + 0.5


def machine_section(res):
    keep = ("Model name", "CPU(s):", "Thread(s) per core", "L2 cache", "L3 cache", "Flags")
    lines = [ln for ln in res["lscpu"].splitlines() if ln.startswith(keep)]
    lines = [ln if not ln.startswith("Flags") else "Flags (SIMD): " + " ".join(
        f for f in ln.split() if f.startswith(("avx", "fma", "amx", "f16c"))) for ln in lines]
    la0, la1 = res.get("load_average_start"), res.get("load_average_end")
    out = ["", "### Machine and run", "", "```"] + lines + [
        f"run {res['timestamp_utc']} UTC; load average at start {la0[0]:.1f}, at end {la1[0]:.1f}"
        + (" (BUSY: other jobs were running, numbers are noisy)" if busy(res) else ""),
        "```"] + ([f"\nllama.cpp ran with {' '.join(f'{k}={v}' for k, v in res['llama_env'].items())} (its OpenMP threads sleep instead of spinning: "
                   "fairer on a busy machine, slower on a quiet one)."] if res.get("llama_env") else []) + [
        "", "Commands of this run (per model; the model path varies):", "", "```"]
    seen = set()
    for m in res["models"][:1]:
        for r in m["runs"]:
            for c in r.get("commands", [r.get("command")]):
                c = re.sub(r"--json \S+", "--json out.json", c) if c else c
                if c and c not in seen:
                    out.append(c)
                    seen.add(c)
    out.append("```")
    llama = next((r for m in res["models"] for r in m["runs"] if r["engine"] == "llama.cpp"), None)
    if llama:
        out.append(f"\nllama.cpp build {llama.get('build_commit')} (from the llama-cpp-python sdist), "
                   f"CPU: {llama.get('cpu_info')}.")
    return out


def plot(res, path):
    try:
        import matplotlib
    except ImportError:
        print("[report] matplotlib missing: installing it with pip", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "matplotlib"], check=False)
        try:
            import matplotlib
        except ImportError:
            print("[report] no matplotlib: plot skipped", file=sys.stderr)
            return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    deep = max(res["depths"])
    panels = [("prefill", 0, f"prefill pp{res['n_prompt']}"), ("decode", 0, f"decode tg{res['n_gen']} @ d0"),
              ("decode", deep, f"decode tg{res['n_gen']} @ d{deep}")]
    names = [m["name"] for m in res["models"]]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 1.3 * len(names) + 2), 10), sharex=True)
    width = 0.38
    for ax, (kind, depth, title) in zip(axes, panels):
        for k, engine in enumerate(ENGINES):
            vals = [tps(runs_of(m).get(engine), kind, depth) or 0 for m in res["models"]]
            xs = [i + (k - 0.5) * width for i in range(len(names))]
            bars = ax.bar(xs, vals, width, label=engine, color=["#1f77b4", "#ff7f0e"][k])
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_title(title)
        ax.set_ylabel("tokens/s")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    axes[-1].set_xticks(range(len(names)), names, rotation=25, ha="right")
    fig.suptitle(f"QKVShare vs llama.cpp, {res['threads']} threads, run {res['timestamp_utc']}"
                 + (" (quick)" if res.get("quick") else "")
                 + (" — BUSY machine, preliminary" if busy(res) else ""))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"[report] wrote {path}", file=sys.stderr)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path)
    p.add_argument("--update-docs", action="store_true")
    p.add_argument("--plot", type=Path, help=f"write the plot here (default with --update-docs: {PLOT})")
    a = p.parse_args()
    res = json.loads(a.results.read_text())
    md = tables(res) + machine_section(res)
    short = res["n_prompt"] != 512 or res["n_gen"] != 128 or res["reps"] < 3
    if busy(res) or short:
        md = [f"> **Preliminary run**: {'busy machine' if busy(res) else 'quiet machine'}"
              f"{', shortened tests' if short else ''}. Not the final comparison.", ""] + md
    md.append(f"\nRaw results: `bench/results/{a.results.name}`.")
    print("\n".join(md))
    plot_path = a.plot or (PLOT if a.update_docs else None)
    if plot_path:
        plot(res, plot_path)
    if a.update_docs:
        text = DOC.read_text()
        if BEGIN not in text or END not in text:
            sys.exit(f"{DOC}: markers {BEGIN} / {END} not found")
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        DOC.write_text(head + BEGIN + "\n" + "\n".join(md) + "\n" + END + tail)
        print(f"[report] updated {DOC}", file=sys.stderr)


if __name__ == "__main__":
    main()
