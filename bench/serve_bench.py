#!/usr/bin/env python3
"""`qkvshare serve` side by side with llama.cpp's llama-server, through the OpenAI API with one client script.

  bench/serve_bench.py [--engines qkvshare llamacpp] [--agents 4] [--repeats 2] [--threads 2] [--update-docs]

Both servers get the same model file, threads and requests; runs alternate engine by engine and are
repeated; medians are reported. llama-server runs with --parallel 4 and prompt caching (f16 KV);
qkvshare serve with int8 KV and automatic reuse. Jobs (temperature 0, max_tokens fixed, and
`ignore_eos` on both servers, so that every reply runs to max_tokens and both generate the same
number of tokens: equal work; greedy replies of the two engines otherwise end at different lengths):
  W2 (fan-out): a reader summarizes a ~1,000-token document, then N agents ask their own question
     about it concurrently (each resends system + document + summary + question), then an aggregator
     combines the answers;
  W4 (team rounds): N agents share one transcript (system + document); each of 3 rounds, all agents
     answer it concurrently and their answers are appended to it;
  TTFT: 16 concurrent streaming clients x 4 requests (document + a distinct question each).
Measured per run: end-to-end seconds, prompt tokens computed by the server (qkvshare: prompt_tokens -
cached_tokens; llama-server: timings.prompt_n), generated tokens, peak RSS of the server process
(VmHWM), p50/p99 time to the first streamed token.
"""
import argparse
import concurrent.futures as cf
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("QKVSHARE_CACHE", Path.home() / ".cache" / "qkvshare"))
MODEL = CACHE / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA_SERVER = CACHE / "llama.cpp" / "build-0.3.36" / "bin" / "llama-server"
DOC = ROOT / "examples" / "data" / "robert_boulter_first_half.txt"
RESULTS = ROOT / "bench" / "results"
BEGIN, END = "<!-- BEGIN SERVE -->", "<!-- END SERVE -->"
SYSTEM = "You are one agent of a small research team. Answer briefly and factually."
QUESTIONS = ["Who is the article about?", "Which plays did he act in?", "Which television shows did he appear in?",
             "What happened in 2000?", "Who directed his stage work?", "Where did he perform?",
             "What was the critics' view?", "Summarize his early career."]


class Engine:
    def __init__(self, name, args, port):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        if name == "qkvshare":
            cmd = [str(ROOT / "build/src/cli/qkvshare"), "serve", "-m", str(args.model), "--port", str(port),
                   "--threads", str(args.threads), "--parallel", "16", "--queue", "64", "--kv", args.kv,
                   "--ctx", "4096", "--quiet"]
        else:
            cmd = [str(LLAMA_SERVER), "-m", str(args.model), "--port", str(port), "-t", str(args.threads),
                   "--parallel", "4", "--cache-prompt", "-c", str(4 * 4096), "--no-webui"]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.log.seek(0)
        raise RuntimeError(f"{name} did not start: {self.log.read()[-2000:]!r}")

    def peak_rss_mib(self):
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
        return float("nan")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def chat(engine, messages, max_tokens):
    body = {"model": "x" if engine.name == "llamacpp" else None, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    j = r.json()
    prompt = j["usage"]["prompt_tokens"]
    if engine.name == "qkvshare":
        computed = prompt - j["usage"]["prompt_tokens_details"]["cached_tokens"]
    else:
        computed = j["timings"]["prompt_n"]
    return j["choices"][0]["message"]["content"], computed, j["usage"]["completion_tokens"]


class Tally:
    def __init__(self):
        self.computed = self.generated = 0

    def add(self, result):
        text, computed, generated = result
        self.computed += computed
        self.generated += generated
        return text


def job_w2(engine, doc, agents, max_tokens):
    t, base = Tally(), [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Document:\n{doc}"}]
    summary = t.add(chat(engine, base + [{"role": "user", "content": "Summarize the document in two sentences."}], max_tokens))
    shared = base + [{"role": "user", "content": "Summarize the document in two sentences."},
                     {"role": "assistant", "content": summary}]
    with cf.ThreadPoolExecutor(agents) as ex:
        answers = [t.add(r) for r in ex.map(lambda q: chat(engine, shared + [{"role": "user", "content": q}], max_tokens),
                                             QUESTIONS[:agents])]
    joined = "\n".join(f"- {a}" for a in answers)
    t.add(chat(engine, shared + [{"role": "user", "content": f"Answers of the team:\n{joined}\nCombine them."}], max_tokens))
    return t


def job_w4(engine, doc, agents, max_tokens, rounds=3):
    t = Tally()
    transcript = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Document:\n{doc}\nDiscuss it."}]
    for _ in range(rounds):
        def turn(i):
            return chat(engine, transcript + [{"role": "user", "content": f"Agent {i}: {QUESTIONS[i % len(QUESTIONS)]}"}], max_tokens)
        with cf.ThreadPoolExecutor(agents) as ex:
            answers = [t.add(r) for r in ex.map(turn, range(agents))]
        for i, a in enumerate(answers):
            transcript += [{"role": "user", "content": f"Agent {i}: {QUESTIONS[i % len(QUESTIONS)]}"},
                           {"role": "assistant", "content": a}]
    return t


def ttft(engine, doc, clients=16, per_client=4):
    def one(k):
        body = {"messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": f"Document:\n{doc[:1500]}\nQuestion {k}: {QUESTIONS[k % 8]}"}],
                "max_tokens": 16, "temperature": 0, "stream": True}
        if engine.name == "llamacpp":
            body["model"] = "x"
        t0 = time.perf_counter()
        with httpx.stream("POST", engine.url + "/v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    ch = json.loads(line[6:])
                    if ch.get("choices") and (ch["choices"][0].get("delta") or {}).get("content"):
                        return time.perf_counter() - t0
        return time.perf_counter() - t0
    with cf.ThreadPoolExecutor(clients) as ex:
        times = sorted(ex.map(one, range(clients * per_client)))
    return times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.99))]


def run_once(name, args, doc, port):
    e = Engine(name, args, port)
    try:
        out = {}
        for job, fn in (("w2", job_w2), ("w4", job_w4)):
            t0 = time.perf_counter()
            tally = fn(e, doc, args.agents, args.max_tokens)
            out[job] = {"seconds": time.perf_counter() - t0, "computed": tally.computed, "generated": tally.generated}
        out["ttft_p50"], out["ttft_p99"] = ttft(e, doc)
        out["rss_mib"] = e.peak_rss_mib()
        return out
    finally:
        e.stop()


def median(runs, *keys):
    vals = []
    for r in runs:
        v = r
        for k in keys:
            v = v[k]
        vals.append(v)
    return statistics.median(vals)


def report(results, meta):
    engines = [e for e in ("qkvshare", "llamacpp") if results.get(e)]
    lines = [f"Command: `python3 bench/serve_bench.py --agents {meta['agents']} --repeats {meta['repeats']} "
             f"--threads {meta['threads']}`; model {Path(meta['model']).name}, {meta['max_tokens']} tokens per reply, "
             f"temperature 0; medians of {meta['repeats']} alternating runs; load average before: {meta['load']}.",
             "", "| | " + " | ".join(engines) + (" | ratio (llama-server / qkvshare) |" if len(engines) == 2 else " |"),
             "|---|" + "---|" * (len(engines) + (1 if len(engines) == 2 else 0))]
    rows = [("W2 end-to-end (s)", ("w2", "seconds")), ("W2 prompt tokens computed", ("w2", "computed")),
            ("W2 tokens generated", ("w2", "generated")), ("W4 end-to-end (s)", ("w4", "seconds")),
            ("W4 prompt tokens computed", ("w4", "computed")), ("W4 tokens generated", ("w4", "generated")),
            ("TTFT p50, 16 clients (s)", ("ttft_p50",)), ("TTFT p99, 16 clients (s)", ("ttft_p99",)),
            ("peak RSS (MiB)", ("rss_mib",))]
    for label, keys in rows:
        vals = [median(results[e], *keys) for e in engines]
        cells = [f"{v:.2f}" if isinstance(v, float) else str(v) for v in vals]
        if len(vals) == 2:
            cells.append(f"{vals[1] / vals[0]:.2f}x" if vals[0] else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", nargs="+", default=["qkvshare", "llamacpp"])
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--kv", default="int8")
    ap.add_argument("--port", type=int, default=18700)
    ap.add_argument("--update-docs", action="store_true")
    args = ap.parse_args()
    if "llamacpp" in args.engines and not LLAMA_SERVER.exists():
        print(f"*** {LLAMA_SERVER} is missing (bench/build_llamacpp.sh): llama-server is left out ***", file=sys.stderr)
        args.engines = [e for e in args.engines if e != "llamacpp"]
    doc = DOC.read_text()
    meta = {"agents": args.agents, "repeats": args.repeats, "threads": args.threads, "model": args.model,
            "max_tokens": args.max_tokens, "load": os.getloadavg()[0]}
    results = {e: [] for e in args.engines}
    for rep in range(args.repeats):
        for i, name in enumerate(args.engines):
            r = run_once(name, args, doc, args.port + 10 * rep + i)
            print(name, json.dumps(r), flush=True)
            results[name].append(r)
    meta["load_after"] = os.getloadavg()[0]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "serve-latest.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    table = report(results, meta)
    print(table)
    if args.update_docs:
        doc_path = ROOT / "docs" / "benchmarks.md"
        text = doc_path.read_text()
        if BEGIN in text:
            text = text[:text.index(BEGIN) + len(BEGIN)] + "\n" + table + "\n" + text[text.index(END):]
            doc_path.write_text(text)


if __name__ == "__main__":
    main()
