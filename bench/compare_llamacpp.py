#!/usr/bin/env python3
"""QKVShare vs llama.cpp, side by side, on the same GGUF files, in one run.

  bench/compare_llamacpp.py                 # full comparison (tens of minutes on 2 cores)
  bench/compare_llamacpp.py --quick         # short smoke run of the whole pipeline
  bench/compare_llamacpp.py --models smollm2-135m-Q8_0 --reps 5

Steps: builds llama.cpp's llama-bench from the PyPI sdist of llama-cpp-python (bench/build_llamacpp.sh,
cached under ~/.cache/qkvshare/llama.cpp), builds `qkvshare` (build-bench/), measures the machine's
memory bandwidth and arithmetic peak (bench/membw.cpp), makes the synthetic models (cached under
~/.cache/qkvshare/synthetic), then for each model runs llama-bench and `qkvshare bench` alternately
(same file, same threads, prefill 512, decode 128 at depths 0 and 2048), each under /usr/bin/time -v
for peak RSS. Writes bench/results/compare-<time>.json (+ latest.json) and hands it to
bench/report_bench.py for the table, the ratios, the plot and (with --update-docs) docs/benchmarks.md.
"""
import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("QKVSHARE_CACHE", Path.home() / ".cache" / "qkvshare"))
SYNTH = [(shape, t) for shape in ("smollm2-135m", "qwen2.5-0.5b", "llama3.2-1b") for t in ("Q8_0", "Q4_0")]
REAL = {"smollm2-135m-instruct-Q4_1": CACHE / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"}
ALL_MODELS = list(REAL) + [f"{s}-{t}" for s, t in SYNTH]
SYNTH_VERSION = "v2"  # bump when make-model's output changes, so cached files are remade


def log(msg):
    print(f"[compare] {msg}", file=sys.stderr, flush=True)


def run(cmd, **kw):
    log("$ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def ensure_time():
    if Path("/usr/bin/time").exists():
        return
    log("installing GNU time (apt-get install time) for peak RSS")
    run(["apt-get", "update", "-qq"], stdout=subprocess.DEVNULL)
    run(["apt-get", "install", "-y", "-qq", "time"], stdout=subprocess.DEVNULL)


def build_qkvshare(build_dir):
    if not (build_dir / "build.ninja").exists():
        run(["cmake", "-S", ROOT, "-B", build_dir, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release"],
            stdout=subprocess.DEVNULL)
    run(["cmake", "--build", build_dir, "--target", "qkvshare"], stdout=subprocess.DEVNULL)
    return build_dir / "src" / "cli" / "qkvshare"


def machine_limits(threads):
    exe = CACHE / "bin" / "membw"
    exe.parent.mkdir(parents=True, exist_ok=True)
    src = ROOT / "bench" / "membw.cpp"
    if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
        run(["g++", "-O3", "-march=native", "-std=gnu++20", "-pthread", src, "-o", exe])
    out = run([exe, "--threads", threads, "--mib", 1024, "--passes", 10], capture_output=True, text=True).stdout
    return json.loads(out)


def ensure_models(qkv, names):
    paths = {}
    for name in names:
        if name in REAL:
            if not REAL[name].exists():
                log(f"skipping {name}: {REAL[name]} is missing (scripts/fetch_model.sh fetches it)")
                continue
            paths[name] = REAL[name]
            continue
        shape, typ = name.rsplit("-", 1)
        path = CACHE / "synthetic" / SYNTH_VERSION / f"{name}.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            run([qkv, "make-model", "--shape", shape, "--type", typ, "--seed", 1, "-o", path])
        paths[name] = path
    return paths


def timed(cmd, env=None):
    """Runs cmd under /usr/bin/time -v; returns (stdout, peak RSS bytes)."""
    log("$ " + " ".join(str(c) for c in cmd))
    p = subprocess.run(["/usr/bin/time", "-v"] + [str(c) for c in cmd], capture_output=True, text=True,
                       env=dict(os.environ, **(env or {})))
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-4000:])
        raise RuntimeError(f"{cmd[0]} failed with exit status {p.returncode}")
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    return p.stdout, int(m.group(1)) * 1024 if m else None


def summary(samples):
    return {"samples": samples, "median": statistics.median(samples), "min": min(samples),
            "max": max(samples), "stdev": statistics.stdev(samples) if len(samples) > 1 else 0.0}


def bench_llamacpp(llama_bench, model, a):
    """pp<n_prompt> at depth 0, tg<n_gen> at each depth; two invocations so pp is not repeated per depth."""
    common = ["-m", model, "-t", a.threads, "-r", a.reps, "-o", "json"]
    tests, rss, info = [], 0, {}
    runs = [["-p", a.n_prompt, "-n", 0, "-d", 0], ["-p", 0, "-n", a.n_gen, "-d", a.depths]]
    for extra in runs:
        out, peak = timed([llama_bench] + common + extra, a.llama_env)
        rss = max(rss, peak or 0)
        for e in json.loads(out):
            kind = "prefill" if e["n_prompt"] > 0 else "decode"
            n = e["n_prompt"] if kind == "prefill" else e["n_gen"]
            tests.append({"name": ("pp" if kind == "prefill" else "tg") + str(n), "kind": kind, "n_tokens": n,
                          "depth": e.get("n_depth", 0), "tokens_per_s": summary(e["samples_ts"])})
            info = e
    return {"engine": "llama.cpp", "build_commit": info.get("build_commit"), "cpu_info": info.get("cpu_info"),
            "model_size": info.get("model_size"), "n_params": info.get("model_n_params"),
            "threads": info.get("n_threads"), "peak_rss_bytes": rss, "tests": tests,
            "env": a.llama_env,
            "commands": [" ".join([f"{k}={v}" for k, v in a.llama_env.items()] + [str(c) for c in [llama_bench] + common + r])
                         for r in runs]}


def bench_qkvshare(qkv, model, a, tmp_json):
    cmd = [qkv, "bench", "-m", model, "--threads", a.threads, "-r", a.reps, "-p", a.n_prompt, "-n", a.n_gen,
           "-d", a.depths, "--json", tmp_json]
    _, rss = timed(cmd)
    r = json.loads(Path(tmp_json).read_text())
    # Peak RSS as /usr/bin/time -v saw it, like llama.cpp's; the process's own VmHWM is kept beside it.
    r["peak_rss_bytes_self"] = r["peak_rss_bytes"]
    r["peak_rss_bytes"] = rss or r["peak_rss_bytes"]
    r["command"] = " ".join(str(c) for c in cmd)
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=ALL_MODELS, help=f"any of: {' '.join(ALL_MODELS)}")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--n-prompt", type=int, default=512)
    p.add_argument("--n-gen", type=int, default=128)
    p.add_argument("--depths", default="0,2048")
    p.add_argument("--quick", action="store_true",
                   help="pipeline smoke run: 1 rep, prefill 64, decode 16 at depths 0,256, smollm2 shapes only")
    p.add_argument("--qkvshare", type=Path, help="qkvshare binary (default: build it in build-bench/)")
    p.add_argument("--build-dir", type=Path, default=ROOT / "build-bench")
    p.add_argument("--skip-llamacpp", action="store_true", help="run only qkvshare")
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--omp-wait-policy", choices=["default", "passive"], default="default",
                   help="llama.cpp's OpenMP threads spin by default, which collapses its speed when other jobs "
                        "share the cores; 'passive' makes them sleep (use only on a busy machine, and say so)")
    p.add_argument("--update-docs", action="store_true", help="rewrite the results section of docs/benchmarks.md")
    a = p.parse_args()
    if a.quick:
        a.reps, a.n_prompt, a.n_gen, a.depths = 1, 64, 16, "0,256"
        if a.models == ALL_MODELS:
            a.models = ["smollm2-135m-instruct-Q4_1", "smollm2-135m-Q8_0", "smollm2-135m-Q4_0"]
    a.llama_env = {"OMP_WAIT_POLICY": "passive"} if a.omp_wait_policy == "passive" else {}
    unknown = [m for m in a.models if m not in ALL_MODELS]
    if unknown:
        p.error(f"unknown models {unknown}; known: {ALL_MODELS}")

    ensure_time()
    llama_bench = None
    if not a.skip_llamacpp:
        llama_bench = run(["bash", ROOT / "bench" / "build_llamacpp.sh"], capture_output=True,
                          text=True).stdout.strip().splitlines()[-1]
    qkv = a.qkvshare or build_qkvshare(a.build_dir)
    limits = machine_limits(a.threads)
    log(f"machine: {limits}")
    models = ensure_models(qkv, a.models)

    a.out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    result = {"timestamp_utc": stamp, "threads": a.threads, "reps": a.reps, "n_prompt": a.n_prompt, "n_gen": a.n_gen,
              "depths": [int(d) for d in a.depths.split(",")], "quick": a.quick, "machine": limits,
              "lscpu": lscpu, "llama_env": a.llama_env, "load_average_start": os.getloadavg(), "argv": sys.argv, "models": []}
    tmp_json = a.out_dir / f".qkvshare-{stamp}.json"
    for i, (name, path) in enumerate(models.items()):
        log(f"=== {name} ({path}) ===")
        entry = {"name": name, "path": str(path), "file_bytes": path.stat().st_size, "runs": []}
        # Alternate which engine goes first, so neither always meets a warmer or cooler machine.
        order = ["llama.cpp", "qkvshare"] if i % 2 == 0 else ["qkvshare", "llama.cpp"]
        for engine in order:
            try:
                if engine == "llama.cpp" and llama_bench:
                    entry["runs"].append(bench_llamacpp(llama_bench, path, a))
                elif engine == "qkvshare":
                    entry["runs"].append(bench_qkvshare(qkv, path, a, tmp_json))
            except (RuntimeError, ValueError, KeyError, OSError) as e:  # record it, go on with the others
                log(f"{engine} on {name} FAILED: {e}")
                entry["runs"].append({"engine": engine, "error": str(e), "tests": []})
        result["models"].append(entry)
        result["load_average_end"] = os.getloadavg()
        (a.out_dir / f"compare-{stamp}.json").write_text(json.dumps(result, indent=1) + "\n")  # after every model
    tmp_json.unlink(missing_ok=True)
    out = a.out_dir / f"compare-{stamp}.json"
    shutil.copyfile(out, a.out_dir / "latest.json")
    log(f"wrote {out} and {a.out_dir / 'latest.json'}")
    report = [sys.executable, ROOT / "bench" / "report_bench.py", out]
    if a.update_docs:
        report.append("--update-docs")
    run(report)


if __name__ == "__main__":
    main()
