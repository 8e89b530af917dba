#!/usr/bin/env python3
"""KV-cache quality side by side with llama.cpp: the same GGUF file, text, context and windows.

  bench/compare_kv_quality.py                         # SmolLM2-135M Q4_1, WikiText-2, ctx 2048, 6 windows
  bench/compare_kv_quality.py --chunks 2 --ctx 512    # a short run

llama.cpp side (llama-perplexity from the llama-cpp-python sdist, bench/build_llamacpp.sh; flash
attention on, as a user quantizing its cache must): one run with an f16 K/V cache saves its logits
(--kl-divergence-base), then one run per cache type (-ctk/-ctv q8_0, q4_1, q4_0) reports PPL, mean
and p99 KL against that f16 run, and top-1 agreement ("Same top p"). Its matmuls round activations
to 8 bits.

QKVShare side (`qkvshare eval`, its prefill protocol, which cuts and scores windows as
llama-perplexity does: non-overlapping windows of --ctx tokens, BOS first, the second half scored):
the same windows, KL against the f32 K/V run, once with 8-bit activations (like for like) and once
with float activations (--float-activations: what the KV format itself costs, below the 8-bit
activations' noise floor).

Writes bench/results/kv-quality-vs-llamacpp.json and prints a markdown table.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("QKVSHARE_CACHE", Path.home() / ".cache" / "qkvshare"))
MODEL = CACHE / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = ROOT.parent / "shared" / "data" / "wikitext-2-test.raw"
# Bits per element of llama.cpp's cache types (ggml block sizes: 32 values and an f16 scale, plus an f16 min for q4_1).
LLAMA_BITS = {"f16": 16.0, "q8_0": 8.5, "q4_1": 5.0, "q4_0": 4.5}
# Formats per KV block size: 4.5 bits takes 64-token blocks (a per-channel key scale and min per 64
# tokens) and 64-channel value groups.
OURS = {32: "f16,int8,int4", 64: "int4:vgroup=64"}


def log(msg):
    print(f"[kv-quality] {msg}", file=sys.stderr, flush=True)


def run(cmd, **kw):
    log("$ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def llama_bin():
    out = run([ROOT / "bench" / "build_llamacpp.sh"], stdout=subprocess.PIPE, text=True).stdout.split()
    return Path(out[-1]).parent


def parse_llama(text):
    def num(pattern):
        m = re.search(pattern, text)
        if not m:
            raise RuntimeError(f"llama-perplexity output has no '{pattern}'")
        return float(m.group(1))

    return {
        "ppl": num(r"Mean PPL\(Q\)\s*:\s*([\d.]+)"),
        "ppl_base": num(r"Mean PPL\(base\)\s*:\s*([\d.]+)"),
        "mean_kl": num(r"Mean\s+KLD:\s*([\d.]+)"),
        "p99_kl": num(r"99\.0%\s+KLD:\s*([\d.]+)"),
        "top1": num(r"Same top p:\s*([\d.]+)") / 100.0,
    }


def llama_side(args, bin_dir, work):
    base = work / "llama-f16.kld"
    common = [bin_dir / "llama-perplexity", "-m", args.model, "-f", args.text, "-c", args.ctx, "--chunks",
              args.chunks, "-t", args.threads, "-fa", "on"]
    run(common + ["-ctk", "f16", "-ctv", "f16", "--kl-divergence-base", base], stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    rows = []
    for t in ("q8_0", "q4_1", "q4_0"):
        p = run(common + ["-ctk", t, "-ctv", t, "--kl-divergence-base", base, "--kl-divergence"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        r = parse_llama(p.stdout)
        r.update(engine="llama.cpp", format=t, bits=LLAMA_BITS[t], against="its f16 K/V",
                 delta_pct=(r["ppl"] / r["ppl_base"] - 1.0) * 100.0, activations="8-bit")
        rows.append(r)
        log(f"llama.cpp {t}: PPL {r['ppl']:.4f} ({r['delta_pct']:+.2f}%), KL {r['mean_kl']:.5f}")
    return rows


def ours_side(args, work):
    cli = Path(args.qkvshare)
    rows = []
    for float_acts in (False, True):
        for block, formats in ((32, args.formats), (64, args.formats_block64)):
            if not formats:
                continue
            out = work / f"ours-{'f32' if float_acts else 'q8'}-block{block}.json"
            cmd = [cli, "eval", "-m", args.model, "--text", args.text, "--kv", formats, "--ctx", args.ctx, "--block",
                   block, "--max-tokens", args.chunks * (args.ctx // 2), "--threads", args.threads, "--json", out]
            if float_acts:
                cmd.append("--float-activations")
            run(cmd, stdout=subprocess.DEVNULL)
            j = json.loads(out.read_text())
            for f in j["formats"][1:]:
                name = f["format"] + ("" if block == 32 else f" (block {block})")
                rows.append(dict(engine="qkvshare", format=name, bits=f["bits_per_element"], against="its f32 K/V",
                                 ppl=f["ppl"], ppl_base=j["formats"][0]["ppl"], delta_pct=f["ppl_delta_pct"],
                                 mean_kl=f["mean_kl"], p99_kl=f["p99_kl"], top1=f["top1"],
                                 activations="f32" if float_acts else "8-bit"))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--text", default=str(TEXT))
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--chunks", type=int, default=6, help="windows of --ctx tokens (llama-perplexity --chunks)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--formats", default=OURS[32], help="qkvshare KV formats (eval --kv), 32-token blocks")
    ap.add_argument("--formats-block64", default=OURS[64], help="qkvshare KV formats in 64-token blocks")
    ap.add_argument("--qkvshare", default=str(ROOT / "build" / "src" / "cli" / "qkvshare"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kv-quality-vs-llamacpp.json"))
    args = ap.parse_args()
    if not Path(args.model).exists():
        sys.exit(f"model {args.model} not found (scripts/setup.sh downloads SmolLM2 from PyPI)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    # llama.cpp's saved base logits take about 50 KB per token (49k vocab): a scratch folder, not the repository.
    with tempfile.TemporaryDirectory(dir=CACHE, prefix="kv-quality-") as tmp:
        work = Path(tmp)
        rows = llama_side(args, llama_bin(), work) + ours_side(args, work)
    result = {"model": args.model, "text": args.text, "ctx": args.ctx, "windows": args.chunks,
              "scored_per_format": args.chunks * (args.ctx // 2), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("| engine | K/V | bits/el | activations | PPL | delta % (vs f16 / f32 K/V) | mean KL | p99 KL | top-1 |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['engine']} | {r['format']} | {r['bits']:.2f} | {r['activations']} | {r['ppl']:.4f} | "
              f"{r['delta_pct']:+.3f} | {r['mean_kl']:.6f} | {r['p99_kl']:.5f} | {r['top1'] * 100:.2f}% |")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
