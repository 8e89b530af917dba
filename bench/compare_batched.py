#!/usr/bin/env python3
"""Batched decode, QKVShare vs llama.cpp's llama-batched-bench, side by side, in one run.

  bench/compare_batched.py --update-docs            # SmolLM2 and the Llama-3.2-1B shape (tens of minutes)
  bench/compare_batched.py --quick                  # pipeline smoke run

For each model and repetition the two engines run alternately (which goes first alternates too), on
the same GGUF file and threads (depth 0 is a 1-token context in both, as llama-batched-bench needs one): `llama-batched-bench -npp D -ntg N -npl 1,2,4,8` (llama.cpp built
from the llama-cpp-python sdist, ~/.cache/qkvshare/llama.cpp/build-<version>/bin) and
`qkvshare bench --batch 1,2,4,8 -d D -n N --kv ...` (B sessions, each with its own D-token context,
decode N tokens together, one forward pass per token of all B). The measured quantity is the same:
aggregate decode tokens/s = B * N / decode time (llama-batched-bench's S_TG), the context prefill
is not in it. Medians over the repetitions. Writes bench/results/batched-<time>.json (+
batched-latest.json), a plot, and with --update-docs the batched section of docs/benchmarks.md.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_llamacpp as cl  # noqa: E402  (model paths, synthetic models, logging)

ROOT = cl.ROOT
MODELS = {"smollm2-135m-instruct-Q4_1": "0,2048", "llama3.2-1b-Q4_0": "0"}
MODEL_KV = {"llama3.2-1b-Q4_0": "f16"}  # without --kv: the 1B shape decodes slowly, one format
BEGIN, END = "<!-- batched:begin -->", "<!-- batched:end -->"


def shared(depth, a):
    return depth >= a.shared_prefix_from


def llama_batched(exe, model, depth, a):
    pp = max(depth, 1)  # llama-batched-bench needs a prompt; depth 0 is a 1-token context there
    n_kv = max(a.batches) * (pp + a.n_gen) + 16
    cmd = [exe, "-m", model, "-c", n_kv, "-b", 2048, "-ub", 512, "-npp", pp, "-ntg", a.n_gen,
           "-npl", ",".join(map(str, a.batches)), "-t", a.threads, "-tb", a.threads, "--output-format", "jsonl"]
    if shared(depth, a):
        cmd.append("-pps")
    cl.log("$ " + " ".join(map(str, cmd)))
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=dict(os.environ, **a.llama_env))
    if p.returncode != 0:
        raise RuntimeError(f"llama-batched-bench failed ({p.returncode}): {p.stderr[-2000:]}")
    rows = [json.loads(l) for l in (p.stdout + p.stderr).splitlines() if l.startswith("{") and '"speed_tg"' in l]
    env = "".join(f"{k}={v} " for k, v in a.llama_env.items())
    return {int(r["pl"]): float(r["speed_tg"]) for r in rows}, env + " ".join(map(str, cmd))


def qkvshare_batch_decode(qkv, model, threads, n_gen, depth, batches, kv, tmp, shared_prefix, extra=()):
    """One `qkvshare bench --batch` run: {(kv, batch): aggregate decode tokens/s} and the command."""
    cmd = [qkv, "bench", "-m", model, "--threads", threads, "-r", 1, "-n", n_gen, "-d", max(depth, 1),
           "--batch", ",".join(map(str, batches)), "--kv", kv, "--json", tmp]
    if shared_prefix:
        cmd.append("--shared-prefix")
    cmd = [str(c) for c in [*cmd, *extra]]
    cl.log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    out = {}
    for t in json.loads(Path(tmp).read_text())["tests"]:
        if t.get("kind") == "batch_decode":
            out[(t["kv"], int(t["batch"]))] = t["aggregate_tokens_per_s"]["median"]
    return out, " ".join(cmd)


def qkvshare_batched(qkv, model, depth, kv, a, tmp):
    return qkvshare_batch_decode(qkv, model, a.threads, a.n_gen, depth, a.batches, kv, tmp, shared(depth, a))


def med(v):
    return statistics.median(v) if v else None


def report(result):
    """Markdown table per model and depth: aggregate t/s, speed-up over B=1, ratio to llama.cpp."""
    lines = []
    for m in result["models"]:
        for d in m["depths"]:
            cols = list(m["engines"])
            pps = ", one prompt shared by all sessions" if d in m.get("shared_prefix_depths", []) else ""
            lines.append(f"\n**{m['name']}, context depth {d}{pps}** (aggregate decode tokens/s, median of "
                         f"{result['reps']}; in brackets: x of the same engine's batch 1)\n")
            lines.append("| batch | " + " | ".join(cols) + " | " +
                         " | ".join(f"{c} / llama.cpp" for c in cols if c != "llama.cpp") + " |")
            lines.append("|---:|" + "---:|" * (2 * len(cols) - 1))
            for b in result["batches"]:
                cells, ratios = [], []
                ref = med(m["engines"].get("llama.cpp", {}).get(str(d), {}).get(str(b), []))
                for c in cols:
                    v = med(m["engines"][c].get(str(d), {}).get(str(b), []))
                    one = med(m["engines"][c].get(str(d), {}).get("1", []))
                    cells.append("-" if v is None else f"{v:.1f} ({v / one:.2f}x)" if one else f"{v:.1f}")
                    if c != "llama.cpp":
                        ratios.append("-" if v is None or not ref else f"{v / ref:.2f}")
                lines.append(f"| {b} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines) + "\n"


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [(m, d) for m in result["models"] for d in m["depths"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (m, d) in zip(axes[0], panels):
        for c, series in m["engines"].items():
            xs = [b for b in result["batches"] if series.get(str(d), {}).get(str(b))]
            ax.plot(xs, [med(series[str(d)][str(b)]) for b in xs], marker="o",
                    linestyle="--" if c == "llama.cpp" else "-", label=c)
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["batches"], [str(b) for b in result["batches"]])
        ax.set_title(f"{m['name']}, depth {d}", fontsize=9)
        ax.set_xlabel("sessions decoding together")
        ax.set_ylabel("aggregate decode tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def update_docs(text):
    doc = ROOT / "docs" / "benchmarks.md"
    body = doc.read_text()
    block = f"{BEGIN}\n{text}{END}"
    if BEGIN in body:
        body = body[:body.index(BEGIN)] + block + body[body.index(END) + len(END):]
    else:
        body = body.rstrip() + "\n\n" + block + "\n"
    doc.write_text(body)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), help=f"any of: {' '.join(cl.ALL_MODELS)}")
    p.add_argument("--depths", help="context depths for every model (default: 0,2048 SmolLM2, 0 the 1B shape)")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--kv", help="QKVShare KV formats (default f16,int8,int4; f16 for the 1B shape)")
    p.add_argument("--shared-prefix-from", type=int, default=1024,
                   help="from this depth on, the B sessions share one filled prompt (llama -pps, qkvshare "
                        "--shared-prefix, as a fan-out's forks do): one fill instead of B")
    p.add_argument("--n-gen", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--llama-versions", default="0.3.36", help="llama-cpp-python versions whose build to run")
    p.add_argument("--qkvshare", type=Path, default=ROOT / "build" / "src" / "cli" / "qkvshare")
    p.add_argument("--quick", action="store_true", help="1 rep, 8 tokens, depth 0, SmolLM2, batch 1,4")
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--omp-wait-policy", choices=["default", "passive"], default="default",
                   help="llama.cpp's OpenMP threads spin by default, which collapses its speed when other jobs "
                        "share the cores; 'passive' makes them sleep (use only on a busy machine, and say so)")
    p.add_argument("--update-docs", action="store_true")
    a = p.parse_args()
    a.llama_env = {"OMP_WAIT_POLICY": "passive"} if a.omp_wait_policy == "passive" else {}
    if a.quick:
        a.reps, a.n_gen, a.batches, a.models, a.depths = 1, 8, "1,4", ["smollm2-135m-instruct-Q4_1"], "0"
    a.batches = [int(b) for b in a.batches.split(",")]
    llamas = {}
    for v in a.llama_versions.split(","):
        exe = cl.CACHE / "llama.cpp" / f"build-{v}" / "bin" / "llama-batched-bench"
        if exe.exists():
            llamas[f"llama.cpp" if v == "0.3.36" else f"llama.cpp-{v}"] = exe
        else:
            cl.log(f"no {exe}: llama.cpp {v} is left out")
    # The k-quant models are made by llama-quantize from the same build.
    quantize = next((exe.with_name("llama-quantize") for exe in llamas.values()), None)
    paths = cl.ensure_models(a.qkvshare, a.models, quantize)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    a.out_dir.mkdir(parents=True, exist_ok=True)
    tmp = a.out_dir / f".batched-{stamp}.json"
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    result = {"timestamp_utc": stamp, "llama_env": a.llama_env, "threads": a.threads, "reps": a.reps, "n_gen": a.n_gen, "batches": a.batches,
              "kv": a.kv or "default", "uptime_start": uptime, "argv": sys.argv, "commands": [], "models": []}
    for mi, (name, path) in enumerate(paths.items()):
        depths = [int(d) for d in (a.depths or MODELS.get(name, "0")).split(",")]
        engines = {k: {} for k in llamas}
        kvs = a.kv or MODEL_KV.get(name, "f16,int8,int4")
        for kv in kvs.split(","):
            engines[f"qkvshare:{kv}"] = {}
        for rep in range(a.reps):
            for d in depths:
                order = ["llama", "qkvshare"] if (rep + mi) % 2 == 0 else ["qkvshare", "llama"]
                for which in order:
                    if which == "llama":
                        for label, exe in llamas.items():
                            speeds, cmd = llama_batched(exe, path, d, a)
                            for b, v in speeds.items():
                                engines[label].setdefault(str(d), {}).setdefault(str(b), []).append(v)
                    else:
                        speeds, cmd = qkvshare_batched(a.qkvshare, path, d, kvs, a, tmp)
                        for (kv, b), v in speeds.items():
                            engines[f"qkvshare:{kv}"].setdefault(str(d), {}).setdefault(str(b), []).append(v)
                    if rep == 0:
                        result["commands"].append(cmd)
                    cl.log(f"{name} d{d} rep {rep + 1}: {which} done")
        result["models"].append({"name": name, "path": str(path), "depths": depths, "engines": engines,
                                 "shared_prefix_depths": [d for d in depths if shared(d, a)]})
    tmp.unlink(missing_ok=True)
    result["uptime_end"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    out = a.out_dir / f"batched-{stamp}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    (a.out_dir / "batched-latest.json").write_text(json.dumps(result, indent=1) + "\n")
    table = report(result)
    print(table)
    png = ROOT / "docs" / "img" / "batched-decode.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(result, png)
    if a.update_docs:
        text = (f"Run {stamp} UTC, {a.threads} threads, decode {a.n_gen} tokens per session, {a.reps} "
                f"repetitions alternating the engines. Machine load at start: `{result['uptime_start']}`; "
                f"at end: `{result['uptime_end']}` (the machine was shared with other engineers' builds).\n"
                f"Commands (one repetition):\n\n" + "".join(f"    {c}\n" for c in result["commands"]) +
                "\n" + table + "\n![batched decode](img/batched-decode.png)\n")
        update_docs(text)
    cl.log(f"wrote {out}")


if __name__ == "__main__":
    main()
