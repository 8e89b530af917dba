#!/usr/bin/env python3
"""QKVShare vs llama.cpp, side by side, on the same GGUF files, in one run.

  bench/compare_llamacpp.py                 # full comparison (tens of minutes on 2 cores)
  bench/compare_llamacpp.py --quick         # short smoke run of the whole pipeline
  bench/compare_llamacpp.py --models smollm2-135m-Q8_0 --reps 5
  bench/compare_llamacpp.py --set kquants   # SmolLM2 Q4_K_M, Qwen3-0.6B / Llama-3.2-1B / Gemma-3-1B shapes

Steps: builds llama.cpp's llama-bench from the PyPI sdists of llama-cpp-python, by default two
versions (0.3.36, the current one, and 0.3.8, March 2025: newer is not always faster here;
bench/build_llamacpp.sh, cached under ~/.cache/qkvshare/llama.cpp), builds `qkvshare`
(build-bench/), measures the machine's memory bandwidth and arithmetic peak (bench/membw.cpp),
makes the models (synthetic ones with make-model, K-quant ones by running llama-quantize on an F16
synthetic file or on the real SmolLM2 file, all cached under ~/.cache/qkvshare/synthetic), then for
each model runs every llama-bench and `qkvshare bench` in turn, qkvshare between the two llama.cpp
versions and their order swapped from one model to the next (same file, same threads, prefill 512,
decode 128 at depths 0 and 2048), each under /usr/bin/time -v for peak RSS. The anchor of every
ratio is the faster llama.cpp version, test by test (the run named "llama.cpp"; each version's own
numbers are kept beside it). Writes bench/results/compare-<time>.json (+ latest.json) and hands it
to bench/report_bench.py for the table, the ratios, the plot and (with --update-docs)
docs/benchmarks.md.
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
# Made by llama-quantize, as users make them: from the real file (requantized) or an F16 synthetic one.
KQUANT = {"smollm2-135m-instruct-Q4_K_M": ("smollm2-135m-instruct-Q4_1", "Q4_K_M"),
          **{f"{s}-{t}": (f"{s}-F16", t) for s in ("qwen3-0.6b", "llama3.2-1b", "gemma3-1b") for t in ("Q4_K_M",)}}
KQUANT_SET = ["smollm2-135m-instruct-Q4_K_M", "qwen3-0.6b-Q4_K_M", "qwen3-0.6b-Q8_0", "llama3.2-1b-Q4_K_M",
              "llama3.2-1b-Q8_0", "gemma3-1b-Q4_K_M", "gemma3-1b-Q8_0"]
ALL_MODELS = list(REAL) + [f"{s}-{t}" for s, t in SYNTH] + [m for m in KQUANT_SET if m not in REAL]
LLAMA_VERSIONS = "0.3.36,0.3.8"
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


def ensure_models(qkv, names, quantize):
    paths = {}

    def one(name):
        if name in REAL:
            if not REAL[name].exists():
                log(f"skipping {name}: {REAL[name]} is missing (scripts/fetch_model.sh fetches it)")
                return None
            return REAL[name]
        path = CACHE / "synthetic" / SYNTH_VERSION / f"{name}.gguf"
        if path.exists():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        if name in KQUANT:
            source_name, ftype = KQUANT[name]
            source = one(source_name)
            if source is None or quantize is None:
                log(f"skipping {name}: needs {source_name} and llama-quantize")
                return None
            run([quantize, "--allow-requantize", source, path, ftype], stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
            return path
        shape, typ = name.rsplit("-", 1)
        run([qkv, "make-model", "--shape", shape, "--type", typ, "--seed", 1, "-o", path])
        return path

    for name in names:
        p = one(name)
        if p is not None:
            paths[name] = p
    return paths


def faster_of(runs):
    """The anchor: test by test, the llama.cpp version with the higher median (and the lower peak RSS)."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return None
    tests, seen = [], set()
    for t in (u for r in ok for u in r["tests"]):
        if (t["kind"], t["depth"]) in seen:
            continue
        seen.add((t["kind"], t["depth"]))
        same = [u for r in ok for u in r["tests"] if u["kind"] == t["kind"] and u["depth"] == t["depth"]]
        best = max(same, key=lambda u: u["tokens_per_s"]["median"])
        version = next(r["version"] for r in ok if best in r["tests"])
        tests.append(dict(best, version=version))
    rss = [r["peak_rss_bytes"] for r in ok if r.get("peak_rss_bytes")]
    return {"engine": "llama.cpp", "faster_of": [r["version"] for r in ok], "tests": tests,
            "peak_rss_bytes": min(rss) if rss else None, "build_commit": ok[0].get("build_commit"),
            "cpu_info": ok[0].get("cpu_info"), "commands": []}


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


def has_depth(llama_bench):
    """llama-bench learnt -d (decode after a prefilled context) after March 2025: 0.3.8's has none."""
    out = subprocess.run([llama_bench, "--help"], capture_output=True, text=True)
    return "--n-depth" in out.stdout + out.stderr


def bench_llamacpp(llama_bench, model, a):
    """pp<n_prompt> at depth 0, tg<n_gen> at each depth; two invocations so pp is not repeated per depth.
    A llama-bench without -d runs depth 0 only (its deeper tests are left out of the anchor)."""
    common = ["-m", model, "-t", a.threads, "-r", a.reps, "-o", "json"]
    tests, rss, info = [], 0, {}
    if has_depth(llama_bench):
        runs = [["-p", a.n_prompt, "-n", 0, "-d", 0], ["-p", 0, "-n", a.n_gen, "-d", a.depths]]
    else:
        runs = [["-p", a.n_prompt, "-n", 0], ["-p", 0, "-n", a.n_gen]]
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
    p.add_argument("--models", nargs="+", default=None, help=f"any of: {' '.join(ALL_MODELS)}")
    p.add_argument("--set", choices=["default", "kquants"], default="default",
                   help="default: SmolLM2 Q4_1 and the Q8_0/Q4_0 shapes; kquants: " + " ".join(KQUANT_SET))
    p.add_argument("--llama-versions", default=LLAMA_VERSIONS,
                   help="llama-cpp-python sdist versions to build and run; the anchor is the faster, test by test")
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
    default_models = list(REAL) + [f"{s}-{t}" for s, t in SYNTH] if a.set == "default" else KQUANT_SET
    if a.quick:
        a.reps, a.n_prompt, a.n_gen, a.depths = 1, 64, 16, "0,256"
        if a.models is None and a.set == "default":
            a.models = ["smollm2-135m-instruct-Q4_1", "smollm2-135m-Q8_0", "smollm2-135m-Q4_0"]
    a.models = a.models or default_models
    a.llama_env = {"OMP_WAIT_POLICY": "passive"} if a.omp_wait_policy == "passive" else {}
    unknown = [m for m in a.models if m not in ALL_MODELS]
    if unknown:
        p.error(f"unknown models {unknown}; known: {ALL_MODELS}")

    ensure_time()
    llama_benches = {}  # version -> llama-bench
    if not a.skip_llamacpp:
        for version in a.llama_versions.split(","):
            llama_benches[version] = run(["bash", ROOT / "bench" / "build_llamacpp.sh"], capture_output=True, text=True,
                                         env=dict(os.environ, LLAMACPP_PY_VERSION=version)).stdout.strip().splitlines()[-1]
    qkv = a.qkvshare or build_qkvshare(a.build_dir)
    limits = machine_limits(a.threads)
    log(f"machine: {limits}")
    quantize = Path(next(iter(llama_benches.values()))).with_name("llama-quantize") if llama_benches else None
    models = ensure_models(qkv, a.models, quantize)

    a.out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    result = {"timestamp_utc": stamp, "threads": a.threads, "reps": a.reps, "n_prompt": a.n_prompt, "n_gen": a.n_gen,
              "depths": [int(d) for d in a.depths.split(",")], "quick": a.quick, "machine": limits,
              "llama_versions": list(llama_benches),
              "lscpu": lscpu, "llama_env": a.llama_env, "load_average_start": os.getloadavg(), "argv": sys.argv, "models": []}
    tmp_json = a.out_dir / f".qkvshare-{stamp}.json"
    for i, (name, path) in enumerate(models.items()):
        log(f"=== {name} ({path}) ===")
        entry = {"name": name, "path": str(path), "file_bytes": path.stat().st_size, "runs": []}
        # qkvshare between the llama.cpp versions, their order swapped from one model to the next,
        # so no engine always meets a warmer or cooler machine.
        versions = list(llama_benches) if i % 2 == 0 else list(reversed(llama_benches))
        order = [f"llama.cpp {v}" for v in versions[:1]] + ["qkvshare"] + [f"llama.cpp {v}" for v in versions[1:]]
        for engine in order:
            try:
                if engine.startswith("llama.cpp "):
                    version = engine.split(" ", 1)[1]
                    r = bench_llamacpp(llama_benches[version], path, a)
                    r.update(engine=engine, version=version)
                    entry["runs"].append(r)
                else:
                    entry["runs"].append(bench_qkvshare(qkv, path, a, tmp_json))
            except (RuntimeError, ValueError, KeyError, OSError) as e:  # record it, go on with the others
                log(f"{engine} on {name} FAILED: {e}")
                entry["runs"].append({"engine": engine, "error": str(e), "tests": [],
                                      "version": engine.split(" ", 1)[1] if engine.startswith("llama.cpp ") else None})
        anchor = faster_of([r for r in entry["runs"] if r["engine"].startswith("llama.cpp ")])
        if anchor:
            entry["runs"].append(anchor)
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
