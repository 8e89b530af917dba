#!/usr/bin/env python3
"""W1-W3 on SmolLM2-135M and the Llama-3.2-1B-shape synthetic model, every mode side by side.

  bench/run_workflows.py [--models smollm2 llama3.2-1b] [--workflows w1 w2 w3] [--threads 2]
                         [--update-docs] [--report-only bench/results/workflows-latest.json]

For each (model, workflow) runs `qkvshare run examples/wN_*.yaml -m MODEL --compare --json`, which
runs the workflow in every mode (shared-text with f32 KV as the reference, independent, shared-text,
QKVShare with f16/int8/int4/int2 KV, solo for the team overhead), each mode in a fresh child process so that its peak RSS (wait4) is its own. Collects the JSON
into bench/results/workflows-<time>.json (+ workflows-latest.json), prints Markdown tables with the
ratios against `independent` and the issue's targets, and with --update-docs rewrites the part of
docs/benchmarks.md between '<!-- BEGIN WORKFLOWS -->' and '<!-- END WORKFLOWS -->' and the plot
docs/img/workflows.png.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "img" / "workflows.png"
RESULTS = ROOT / "bench" / "results"
BEGIN, END = "<!-- BEGIN WORKFLOWS -->", "<!-- END WORKFLOWS -->"
CACHE = Path(os.environ.get("QKVSHARE_CACHE", Path.home() / ".cache" / "qkvshare"))
MiB = 1024.0 * 1024.0

# The synthetic models' tokenizer splits text into about twice as many tokens
# as SmolLM2's: their W2 reads the first half of the article (~2,000 tokens).
OVERRIDES = {("llama3.2-1b", "w2"): "examples/w2_fanout_synthetic.yaml"}

WORKFLOWS = {
    "w1": ("examples/w1_two_agents.yaml", "W1: two agents (A ~150 tokens, B continues ~200)"),
    "w2": ("examples/w2_fanout.yaml", "W2: document fan-out (~2,000-token document, 4 forks x 64, aggregator)"),
    "w3": ("examples/w3_chain.yaml", "W3: six-agent chain (~128 tokens each onto the shared transcript)"),
}


def model_path(name, cli):
    if name == "smollm2":
        p = CACHE / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if not p.exists():
            p = Path(subprocess.run([str(ROOT / "scripts" / "fetch_model.sh")], check=True,
                                    capture_output=True, text=True).stdout.strip())
        return p
    if name == "llama3.2-1b":
        p = CACHE / "synthetic" / "v2" / "llama3.2-1b-Q4_0.gguf"
        if not p.exists():
            p.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([cli, "make-model", "--shape", "llama3.2-1b", "--type", "Q4_0", "-o", str(p)], check=True)
        return p
    sys.exit(f"unknown model {name!r}: smollm2 or llama3.2-1b")


def run_all(args):
    cli = args.qkvshare
    if not Path(cli).exists():
        subprocess.run(["cmake", "-S", str(ROOT), "-B", str(ROOT / "build"), "-G", "Ninja",
                        "-DCMAKE_BUILD_TYPE=Release"], check=True)
        subprocess.run(["cmake", "--build", str(ROOT / "build"), "--target", "qkvshare"], check=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    partial = RESULTS / "workflows-partial.json"
    if args.resume and partial.exists():
        out = json.loads(partial.read_text())
    else:
        out = {"started": time.strftime("%Y%m%d-%H%M%S", time.gmtime()), "threads": args.threads,
               "loadavg_start": os.getloadavg()[0], "runs": []}
    done = {(r["model"], r["workflow"]) for r in out["runs"]}
    for m in args.models:
        path = model_path(m, cli)
        for w in args.workflows:
            if (m, w) in done:
                print(f"[workflows] {m} {w}: already in {partial.name}", file=sys.stderr)
                continue
            wf = ROOT / OVERRIDES.get((m, w), WORKFLOWS[w][0])
            js = RESULTS / f"wf-{m}-{w}.json"
            cmd = [cli, "run", str(wf), "-m", str(path), "--threads", str(args.threads), "--compare",
                   "--json", str(js)]
            print(f"[workflows] {m} {w}: $ {' '.join(cmd)}", file=sys.stderr, flush=True)
            t0 = time.time()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            print(f"[workflows] {m} {w}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
            out["runs"].append({"model": m, "model_file": str(path), "workflow": w, "command": " ".join(cmd),
                                "modes": json.loads(js.read_text())})
            js.unlink()
            partial.write_text(json.dumps(out, indent=1))  # a later failure keeps what was measured
    out["loadavg_end"] = os.getloadavg()[0]
    name = RESULTS / f"workflows-{out['started']}.json"
    name.write_text(json.dumps(out, indent=1))
    (RESULTS / "workflows-latest.json").write_text(json.dumps(out, indent=1))
    partial.unlink()
    print(f"[workflows] wrote {name}", file=sys.stderr)
    return out


def by_label(run):
    return {m["label"]: m for m in run["modes"]}


def rel_cmd(cmd):
    return cmd.replace(str(ROOT) + "/", "").replace(str(Path.home()), "~")


def consumer_prefill_seconds(mode):
    """Time the consumers (steps with an input context) spend before their first token."""
    return sum(s["ttft_seconds"] for s in mode["steps"] if s["handoff"] != "new")


def kept_kv_bytes(mode):
    """KV held if every agent kept its cache to the end of the run, as each `independent` agent's
    own engine process would: the sum of the steps' KV bytes (each measured at the end of its
    step). The run itself drops a text-mode step's cache when the step ends."""
    return sum(s["kv_bytes"] for s in mode["steps"])


def tables(res):
    md = []
    for run in res["runs"]:
        modes = by_label(run)
        base = modes["independent"]
        title = WORKFLOWS[run["workflow"]][1]
        if (run["model"], run["workflow"]) in OVERRIDES:
            title += f" - {OVERRIDES[(run['model'], run['workflow'])]}"
        md.append(f"#### {run['model']}: {title}\n")
        md.append(f"`{rel_cmd(run['command'])}`\n")
        md.append("| mode | e2e s | vs indep. | consumer TTFT s | vs indep. | prefill computed | reused | "
                  "peak KV MiB | vs indep. | peak RSS MiB | vs indep. | KL vs ref | top-1 vs ref | team time | team RSS |")
        md.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for label, m in modes.items():
            def x(a, b):
                return f"{a / b:.2f}x" if b else "–"
            solo = label == "solo"
            quality = "– | –" if solo or "kl" not in m else f"{m['kl']:.5f} | {100 * m['top1']:.1f}%"
            team = f"{m['team_time']:.2f} | {m['team_rss']:.2f}" if m.get("team_time") else "– | –"
            md.append(f"| `{label}` | {m['total_seconds']:.2f} | {x(base['total_seconds'], m['total_seconds'])} | "
                      f"{m['consumer_ttft_seconds']:.3f} | {x(base['consumer_ttft_seconds'], m['consumer_ttft_seconds'])} | "
                      f"{m['prefill_computed']} | {m['prefill_reused']} | {m['peak_kv_bytes'] / MiB:.1f} | "
                      f"{x(base['peak_kv_bytes'], m['peak_kv_bytes'])} | {m['peak_rss_bytes'] / MiB:.0f} | "
                      f"{x(base['peak_rss_bytes'], m['peak_rss_bytes'])} | {quality} | {team} |")
        md.append("")
        md.append("(KL / top-1: along the reference's tokens (teacher forcing), over the consumer steps. `team time` / "
                  "`team RSS`: this mode's e2e time / peak RSS over `solo`'s, one agent writing the same answers in "
                  "one f16 session: the team overhead, below 1 is better.)\n")
        md.append(f"(`vs indep.`: independent's value divided by this mode's: above 1 is better. If each "
                  f"independent agent kept its cache to the end, as its own process would, independent would "
                  f"hold {kept_kv_bytes(base) / MiB:.1f} MiB of KV at the end: the sum of its steps' KV.)\n")
    return md


def targets(res):
    md = ["| model | target | measured | met |", "|---|---|---|---|"]
    for run in res["runs"]:
        modes, w, m = by_label(run), run["workflow"], run["model"]
        base = modes["independent"]
        i8, i4 = modes.get("qkvshare:int8"), modes.get("qkvshare:int4")

        def row(target, value, ok):
            md.append(f"| {m} | {w.upper()}: {target} | {value} | {'yes' if ok else '**no**'} |")
        if w == "w1" and i8:
            r = base["consumer_ttft_seconds"] / i8["consumer_ttft_seconds"]
            row("consumer TTFT >= 10x lower (int8)", f"{r:.1f}x", r >= 10)
            saved = base["total_seconds"] - i8["total_seconds"]
            reprefill = consumer_prefill_seconds(base) - consumer_prefill_seconds(i8)
            row("e2e lower by >= the baseline's re-prefill (int8)",
                f"saved {saved:.2f} s of {base['total_seconds']:.2f} s; re-prefill {reprefill:.2f} s "
                f"({100 * reprefill / base['total_seconds']:.0f}% of the baseline)", saved >= reprefill)
            r = 1 - i8["peak_rss_bytes"] / base["peak_rss_bytes"]
            row("peak memory -50% or better (int8)", f"{-100 * r:+.0f}%", r >= 0.5)
        if w == "w2" and i4:
            r = base["total_seconds"] / i4["total_seconds"]
            row("e2e >= 4x lower (int4; issue 10, the forks decoding together)", f"{r:.2f}x", r >= 4)
            if i4.get("team_time"):
                row("team overhead <= 0.7 in time (int4)", f"{i4['team_time']:.2f}", i4["team_time"] <= 0.7)
                row("team overhead <= 0.5 in memory (int4, peak RSS)",
                    f"{i4['team_rss']:.2f} (peak KV alone: {i4.get('team_kv', 0):.2f})", i4["team_rss"] <= 0.5)
            r = base["peak_kv_bytes"] / i4["peak_kv_bytes"]
            row("KV memory >= 10x lower (int4), independent agents dropping their caches after their step",
                f"{r:.1f}x", r >= 10)
            r = kept_kv_bytes(base) / i4["peak_kv_bytes"]
            row("KV memory >= 10x lower (int4), independent agents keeping their caches (own processes)",
                f"{r:.1f}x ({kept_kv_bytes(base) / MiB:.0f} MiB vs {i4['peak_kv_bytes'] / MiB:.1f} MiB)", r >= 10)
        if i8 and "top1" in i8:
            row("int8 top-1 agreement >= 95% vs the f32 reference (teacher forced)", f"{100 * i8['top1']:.1f}%",
                i8["top1"] >= 0.95)
    return md


def plot(res, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[workflows] matplotlib missing: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    runs = res["runs"]
    fig, axes = plt.subplots(2, len(runs), figsize=(3.2 * len(runs), 6.5), squeeze=False)
    for j, run in enumerate(runs):
        modes = by_label(run)
        labels = list(modes)
        short = [l.replace("qkvshare:", "qkv ") for l in labels]
        colors = ["#999999" if l in ("independent", "shared-text") else "#2a7ab9" for l in labels]
        for i, (key, scale, title) in enumerate([("total_seconds", 1.0, "end-to-end s"),
                                                 ("peak_rss_bytes", MiB, "peak RSS MiB")]):
            ax = axes[i][j]
            ax.bar(range(len(labels)), [modes[l][key] / scale for l in labels], color=colors)
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(short, rotation=60, ha="right", fontsize=7)
            ax.set_title(f"{run['model']} {run['workflow'].upper()}: {title}", fontsize=8)
            ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def report(res, update_docs):
    md = [f"Run {res['started']} UTC, {res['threads']} threads; load average {res['loadavg_start']:.1f} at start, "
          f"{res['loadavg_end']:.1f} at end.\n",
          "Peak RSS: each mode runs in a fresh child process; its `ru_maxrss` from wait4. `independent` "
          "loads a private copy of the weights per agent (as separate processes would), the other modes "
          "share one mapping. peak KV: the largest KV bytes held at once (pool blocks in use, or the sum "
          "of the independent agents' f16 caches).\n",
          "### Targets (vs independent, same run)\n"] + targets(res) + ["", "### Per workflow\n"] + tables(res)
    print("\n".join(md))
    if update_docs:
        if plot(res, PLOT):
            md.append(f"![end-to-end latency and peak RSS per mode](img/{PLOT.name})\n")
        text = DOC.read_text()
        if BEGIN not in text or END not in text:
            sys.exit(f"{DOC}: markers {BEGIN} / {END} not found")
        head, rest = text.split(BEGIN, 1)
        DOC.write_text(head + BEGIN + "\n" + "\n".join(md) + "\n" + END + rest.split(END, 1)[1])
        print(f"[workflows] updated {DOC}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2", "llama3.2-1b"])
    ap.add_argument("--workflows", nargs="+", default=list(WORKFLOWS), choices=list(WORKFLOWS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--qkvshare", default=str(ROOT / "build" / "src" / "cli" / "qkvshare"))
    ap.add_argument("--update-docs", action="store_true")
    ap.add_argument("--resume", action="store_true", help="keep the runs of an interrupted run (workflows-partial.json)")
    ap.add_argument("--report-only", metavar="JSON", help="tables (and docs) from a saved run")
    args = ap.parse_args()
    res = json.loads(Path(args.report_only).read_text()) if args.report_only else run_all(args)
    report(res, args.update_docs)


if __name__ == "__main__":
    main()
