#!/usr/bin/env python3
"""Which spliced tokens to recompute: the head (the engine's choice) against
CacheBlend's, the tokens of largest K+V deviation at check layers, on the same
splices (`qkvshare splice-eval --select head,deviation --check-layers L`).

    python3 bench/splice_select.py bench/results/splice_select_l1_smollm2.jsonl:layer-1 \
        bench/results/splice_select_all_smollm2.jsonl:layers-1-29 --json bench/results/splice_select.json

Each argument is FILE[:LABEL]; LABEL names that file's deviation rows (its
--check-layers). Head rows may come from any of the files (they are the same
splices). Prints, per KV format and recompute fraction, the mean KL to the f32
and to the same-format text re-prefill, the bad splices (KL to the same-format
text > 0.02), top-1, and in how many cases each choice beats the head's KL.
"""
import argparse
import json
import statistics as st


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="FILE[:LABEL] (JSON lines of splice-eval --select)")
    ap.add_argument("--bad-kl", type=float, default=0.02)
    ap.add_argument("--json", help="write the table's figures here")
    a = ap.parse_args()
    rows = {}
    for arg in a.files:
        path, _, label = arg.partition(":")
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                sel = r.get("select", "head")
                name = "head" if sel == "head" else f"deviation ({label or path})"
                rows[(r["format"], r["fraction"], name, r["case"])] = r
    choices = sorted({k[2] for k in rows}, key=lambda n: (n != "head", n))
    print("| KV | recompute | choice | cases | KL vs f32 text | KL vs same-format text | bad | top-1 | "
          "beats the head (f32 / same-format KL) |")
    print("|---|---|---|---|---|---|---|---|---|")
    summary = []
    for fmt, frac in sorted({(k[0], k[1]) for k in rows}, key=lambda x: (x[0], x[1])):
        for name in choices:
            cases = sorted(k[3] for k in rows if k[:3] == (fmt, frac, name) and (fmt, frac, "head", k[3]) in rows)
            if not cases:
                continue
            g = [rows[(fmt, frac, name, c)] for c in cases]
            h = [rows[(fmt, frac, "head", c)] for c in cases]
            s = {"format": fmt, "fraction": frac, "choice": name, "cases": len(g),
                 "kl": st.mean(x["kl"] for x in g), "kl_text": st.mean(x["kl_text"] for x in g),
                 "bad": sum(x["kl_text"] > a.bad_kl for x in g), "top1": st.mean(x["top1"] for x in g),
                 "beats_head_kl": sum(x["kl"] < y["kl"] for x, y in zip(g, h)),
                 "beats_head_kl_text": sum(x["kl_text"] < y["kl_text"] for x, y in zip(g, h))}
            summary.append(s)
            beats = "-" if name == "head" else f"{s['beats_head_kl']} / {s['beats_head_kl_text']}"
            print(f"| {fmt} | {frac:g} | {name} | {s['cases']} | {s['kl']:.4f} | {s['kl_text']:.4f} | {s['bad']} | "
                  f"{100 * s['top1']:.1f}% | {beats} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
