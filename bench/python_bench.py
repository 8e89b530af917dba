#!/usr/bin/env python3
"""Python package benchmarks (docs/benchmarks.md, section "Python package").

1. Per-token overhead of the Python `stream` loop against the C++ CLI: the same model,
   prompt, threads and greedy 128-token decode (--ignore-eos), run alternately
   (CLI, Python generate, Python stream) `--reps` times; medians of decode ms/token.
2. A two-agent handoff from Python: a producer reads a WikiText passage of `--ctx` tokens,
   then a consumer continues it and writes its first token.
   - qkvshare: seal + grant + pool.open (the consumer continues on the same KV blocks);
   - llama-cpp-python: producer Llama.save_state(), consumer Llama.load_state() (a copy of
     the whole state), the consumer a second Llama on the same file as two agents would be.
   Each side runs in its own child process (peak RSS is the child's ru_maxrss), alternately.

    python3 bench/python_bench.py --llama-venv ~/.cache/qkvshare/llamacpp-py-0.3.36-venv
Run with the venv where `pip install .` put qkvshare (build-python/venv).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = Path.home() / ".cache" / "qkvshare" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "The history of the printing press begins"

STREAM_CHILD = textwrap.dedent("""
    import json, sys, time
    import qkvshare as q
    model_path, threads, n, prompt, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    m = q.Model.load(model_path)
    e = q.Engine(m, threads=threads)
    s = e.session(kv="f16", capacity=1024)
    opts = dict(max_tokens=n, temperature=0, ignore_eos=True)
    if how == "generate":
        r = s.generate(prompt, **opts)
        print(json.dumps({"decode_tokens": r.decode_tokens, "decode_seconds": r.decode_seconds}))
    else:
        it = s.stream(prompt, **opts)
        t_first = None
        pieces = 0
        for piece in it:           # the loop an application writes: one text piece per step
            pieces += 1
            if t_first is None:
                t_first = time.perf_counter()
        t_end = time.perf_counter()
        r = it.result
        # Decode time as the Python caller sees it: first piece to the end of the loop.
        print(json.dumps({"decode_tokens": r.decode_tokens, "decode_seconds": r.decode_seconds,
                          "loop_seconds": t_end - t_first, "pieces": pieces}))
""")

# One process, generate and stream alternating `n` times each on fresh sessions:
# the stream loop's own cost with the process and its memory layout held equal.
INPROC_CHILD = textwrap.dedent("""
    import json, sys
    import qkvshare as q
    model_path, threads, n, prompt, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    m = q.Model.load(model_path)
    e = q.Engine(m, threads=threads)
    opts = dict(max_tokens=n, temperature=0, ignore_eos=True)
    out = {"generate": [], "stream": []}
    for _ in range(reps):
        r = e.session(kv="f16", capacity=1024).generate(prompt, **opts)
        out["generate"].append(r.decode_seconds / r.decode_tokens)
        it = e.session(kv="f16", capacity=1024).stream(prompt, **opts)
        for piece in it:
            pass
        r = it.result
        out["stream"].append(r.decode_seconds / r.decode_tokens)
    print(json.dumps(out))
""")

QKV_HANDOFF = textwrap.dedent("""
    import json, resource, sys, time
    import qkvshare as q
    model_path, threads, ids_path, kv = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    ids = json.load(open(ids_path))
    m = q.Model.load(model_path)
    e = q.Engine(m, threads=threads)
    pool = q.Pool.anonymous(bytes=256 << 20)
    producer = e.session(kv=kv, pool=pool, capacity=len(ids) + 64)
    producer.prefill(ids)
    t0 = time.perf_counter()
    ctx = producer.seal("producer")
    d = ctx.grant("consumer")
    consumer = pool.open(d, e, agent="consumer", mode="kv", capacity=len(ids) + 64)
    t1 = time.perf_counter()
    logits = consumer.prefill([ids[-1]])  # the consumer's first pass on the handed-over context
    t2 = time.perf_counter()
    print(json.dumps({"handoff_s": t1 - t0, "first_token_s": t2 - t0, "bytes_handed": len(bytes(d)),
                      "kv_bytes": pool.stats()["kv"]["bytes_used"],
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
""")

LLAMA_HANDOFF = textwrap.dedent("""
    import json, resource, sys, time
    from llama_cpp import Llama
    model_path, threads, ids_path, agents = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    ids = json.load(open(ids_path))
    kw = dict(model_path=model_path, n_ctx=len(ids) + 64, n_threads=threads, n_threads_batch=threads,
              n_batch=512, verbose=False)
    producer = Llama(**kw)
    # "two": each agent its own Llama (as two agents usually are); "one": one Llama whose
    # state is swapped between agents (LlamaRAMCache-style), so one set of weights.
    consumer = Llama(**kw) if agents == "two" else producer
    producer.eval(ids)
    t0 = time.perf_counter()
    state = producer.save_state()
    if consumer is producer:
        producer.reset()
    consumer.load_state(state)
    t1 = time.perf_counter()
    consumer.eval([ids[-1]])  # the consumer's first pass on the handed-over context
    t2 = time.perf_counter()
    print(json.dumps({"handoff_s": t1 - t0, "first_token_s": t2 - t0, "bytes_handed": state.llama_state_size,
                      "kv_bytes": state.llama_state_size,
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
""")


def run_json(cmd: list[str], timeout: int = 600) -> dict:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def stream_overhead(a) -> dict:
    per = {"cli": [], "python generate": [], "python stream": [], "python stream (loop clock)": []}
    for rep in range(a.reps):
        def cli():
            r = run_json([a.cli, "generate", "-m", a.model, "-p", PROMPT, "-n", str(a.tokens), "--temp", "0",
                          "--ignore-eos", "--threads", str(a.threads), "--ctx", "1024", "--json"])
            per["cli"].append(r["decode_seconds"] / (len(r["generated_ids"]) - 1))

        def generate():
            g = run_json([sys.executable, "-c", STREAM_CHILD, a.model, str(a.threads), str(a.tokens), PROMPT,
                          "generate"])
            per["python generate"].append(g["decode_seconds"] / g["decode_tokens"])

        def stream():
            s = run_json([sys.executable, "-c", STREAM_CHILD, a.model, str(a.threads), str(a.tokens), PROMPT,
                          "stream"])
            per["python stream"].append(s["decode_seconds"] / s["decode_tokens"])
            per["python stream (loop clock)"].append(s["loop_seconds"] / (s["pieces"] - 1))
        # The order alternates between repetitions, so a drift favours no side.
        for f in ((cli, generate, stream) if rep % 2 == 0 else (stream, generate, cli)):
            f()
        print(f"[stream] rep {rep + 1}: " + ", ".join(f"{k} {v[-1] * 1e3:.3f} ms" for k, v in per.items()),
              file=sys.stderr)
    res = {k: statistics.median(v) for k, v in per.items()} | {"samples": per}
    # Paired: each repetition's ratio to the CLI run next to it, then the median.
    res["paired_vs_cli"] = {k: statistics.median(x / c for x, c in zip(v, per["cli"]))
                            for k, v in per.items() if k != "cli"}
    inproc = run_json([sys.executable, "-c", INPROC_CHILD, a.model, str(a.threads), str(a.tokens), PROMPT,
                       str(a.reps)])
    res["in_process"] = inproc | {
        "median_generate": statistics.median(inproc["generate"]),
        "median_stream": statistics.median(inproc["stream"]),
        "paired_stream_vs_generate": statistics.median(s / g for s, g in zip(inproc["stream"], inproc["generate"]))}
    print("[stream] in one process: generate " + " ".join(f"{x * 1e3:.2f}" for x in inproc["generate"]) +
          " ms, stream " + " ".join(f"{x * 1e3:.2f}" for x in inproc["stream"]) + " ms", file=sys.stderr)
    return res


def handoff(a, ids_path: Path) -> dict:
    sides = {f"qkvshare {kv}": [sys.executable, "-c", QKV_HANDOFF, a.model, str(a.threads), str(ids_path), kv]
             for kv in ("f16", "int8")}
    if a.llama_venv:
        for agents in ("two", "one"):
            sides[f"llama-cpp-python save/load ({agents} Llama)"] = [
                str(Path(a.llama_venv) / "bin" / "python"), "-c", LLAMA_HANDOFF, a.model, str(a.threads),
                str(ids_path), agents]
    out: dict[str, list[dict]] = {k: [] for k in sides}
    for rep in range(a.reps):
        for k, cmd in sides.items():
            out[k].append(run_json(cmd))
        print(f"[handoff] rep {rep + 1}: " + ", ".join(f"{k} {v[-1]['handoff_s'] * 1e3:.2f} ms" for k, v in out.items()),
              file=sys.stderr)
    return {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--cli", default=str(ROOT / "build" / "src" / "cli" / "qkvshare"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=1024, help="tokens of the handed-over context")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--llama-venv", default=None, help="venv with llama-cpp-python (built from its PyPI sdist)")
    ap.add_argument("--text", default=str(ROOT.parent / "shared" / "data" / "wikitext-2-test.raw"))
    ap.add_argument("--out", default=None, help="write the results as JSON")
    a = ap.parse_args()

    import qkvshare as q

    load = os.getloadavg()
    model = q.Model.load(a.model)
    text = Path(a.text).read_text(encoding="utf-8", errors="replace")
    ids = model.tokenize(text[: a.ctx * 8])[: a.ctx]
    ids_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"qkv_bench_ids_{os.getpid()}.json"
    ids_path.write_text(json.dumps(ids))
    try:
        res = {"load_before": load, "threads": a.threads, "tokens": a.tokens, "ctx": len(ids), "reps": a.reps,
               "stream": stream_overhead(a), "handoff": handoff(a, ids_path), "load_after": os.getloadavg()}
    finally:
        ids_path.unlink(missing_ok=True)
    s = res["stream"]
    print(f"\nload average before {load[0]:.2f}, after {res['load_after'][0]:.2f} (machine shared with other builds)")
    print(f"decode ms/token, median of {a.reps} (SmolLM2 Q4_1, {a.threads} threads, {a.tokens} greedy tokens, f16 KV):")
    for k in ("cli", "python generate", "python stream", "python stream (loop clock)"):
        paired = "" if k == "cli" else f", paired per repetition {(s['paired_vs_cli'][k] - 1) * 100:+.1f}%"
        print(f"  {k:28s} {s[k] * 1e3:7.3f}  ({(s[k] / s['cli'] - 1) * 100:+.1f}% vs CLI{paired})")
    ip = s["in_process"]
    print(f"  in one process, alternating: generate {ip['median_generate'] * 1e3:.3f}, stream "
          f"{ip['median_stream'] * 1e3:.3f} ms/token (paired {(ip['paired_stream_vs_generate'] - 1) * 100:+.1f}%)")
    print(f"\nhandoff of a {len(ids)}-token context, median of {a.reps}:")
    print(f"  {'side':36s} {'handoff ms':>10s} {'+1st pass ms':>12s} {'bytes handed':>13s} {'peak RSS MiB':>12s}")
    for k, v in res["handoff"].items():
        print(f"  {k:36s} {v['handoff_s'] * 1e3:10.2f} {v['first_token_s'] * 1e3:12.2f} {v['bytes_handed']:13.0f} "
              f"{v['peak_rss'] / 2**20:12.1f}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
