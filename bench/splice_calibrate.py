#!/usr/bin/env python3
"""Calibrates the splice guard and summarizes the splice sweep.

Input: the JSON lines of `qkvshare splice-eval` (one line per real splice:
format, recompute fraction, the guard's estimate, KL to the f32 text
re-prefill `kl`, KL to the same-format text re-prefill `kl_text`, TTFTs).

    python3 bench/splice_calibrate.py bench/results/splice_eval_smollm2.jsonl \
        --svg docs/img/splice_kl_vs_recompute.svg --json bench/results/splice_guard.json

A splice is *bad* when its KL to the text re-prefill it replaces (same KV
format: the fallback the guard would choose) exceeds --bad-kl (0.02). The
threshold is chosen on the even cases (of the estimate thresholds whose
false-accept rate stays <= 5% there, the smallest that accepts the most good
splices) and the rates are reported on the odd
cases it never saw, and on all. No third-party packages: the plot is plain SVG.
"""
import argparse
import json
import statistics as st
import sys
from collections import defaultdict


def rates(rows, t, key, bad_kl):
    bad = [r for r in rows if r[key] > bad_kl]
    good = [r for r in rows if r[key] <= bad_kl]
    fa = sum(r["estimate"] <= t for r in bad) / len(bad) if bad else 0.0
    fr = sum(r["estimate"] > t for r in good) / len(good) if good else 0.0
    return fa, fr, len(bad), len(good)


def calibrate(rows, key, bad_kl, max_fa):
    # Candidate thresholds: every estimate (and 0). Among those with FA <= max_fa,
    # the smallest that lets the most good splices through: a threshold that only
    # adds bad splices gains nothing, so a format without a good splice gets 0
    # (every splice in it is recomputed up to text).
    cands = sorted({0.0} | {r["estimate"] for r in rows})
    best, best_good = 0.0, -1
    for t in cands:
        fa, _, _, _ = rates(rows, t, key, bad_kl)
        good = sum(r[key] <= bad_kl and r["estimate"] <= t for r in rows)
        if fa <= max_fa and good > best_good:
            best, best_good = t, good
    return best


def svg_plot(series, path, title):
    w, h, l, r, t, b = 640, 400, 70, 170, 40, 50
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts if y > 0]
    import math
    ymin, ymax = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    X = lambda x: l + (w - l - r) * x / max(xs)
    Y = lambda y: t + (h - t - b) * (ymax - math.log10(max(y, 10 ** ymin))) / (ymax - ymin)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>']
    for e in range(ymin, ymax + 1):
        out.append(f'<line x1="{l}" x2="{w - r}" y1="{Y(10 ** e)}" y2="{Y(10 ** e)}" stroke="#ddd"/>')
        out.append(f'<text x="{l - 6}" y="{Y(10 ** e) + 4}" text-anchor="end">1e{e}</text>')
    for x in sorted(set(xs)):
        out.append(f'<text x="{X(x)}" y="{h - b + 18}" text-anchor="middle">{x:g}</text>')
    out.append(f'<text x="{(l + w - r) / 2}" y="{h - 10}" text-anchor="middle">recompute fraction</text>')
    out.append(f'<text x="16" y="{(t + h - b) / 2}" transform="rotate(-90 16 {(t + h - b) / 2})" text-anchor="middle">'
               'mean KL</text>')
    out.append(f'<line x1="{l}" x2="{w - r}" y1="{Y(0.02)}" y2="{Y(0.02)}" stroke="red" stroke-dasharray="4 3"/>')
    out.append(f'<text x="{w - r + 4}" y="{Y(0.02) + 4}" fill="red">target 0.02</text>')
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    for i, (name, pts) in enumerate(series.items()):
        c = colors[i % len(colors)]
        dash = ' stroke-dasharray="5 3"' if "same-format" in name else ""
        d = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in pts)
        out.append(f'<polyline points="{d}" fill="none" stroke="{c}" stroke-width="2"{dash}/>')
        for x, y in pts:
            out.append(f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="3" fill="{c}"/>')
        out.append(f'<line x1="{w - r + 8}" x2="{w - r + 28}" y1="{t + 20 + 18 * i}" y2="{t + 20 + 18 * i}" '
                   f'stroke="{c}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{w - r + 32}" y="{t + 24 + 18 * i}">{name}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("jsonl")
    ap.add_argument("--bad-kl", type=float, default=0.02)
    ap.add_argument("--max-fa", type=float, default=0.05)
    ap.add_argument("--also", type=float, nargs="*", default=[0.25],
                    help="other thresholds to report rates for (0.25: the default before calibration)")
    ap.add_argument("--svg")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = [json.loads(line) for line in open(a.jsonl) if line.strip()]
    if not rows:
        sys.exit(f"{a.jsonl}: no splices")
    groups = defaultdict(list)
    for r in rows:
        groups[(r["format"], r["fraction"])].append(r)
    print(f"{len(rows)} splices, {len({r['case'] for r in rows})} producer/consumer pairs\n")
    print("| KV | recompute | splices | KL vs f32 text | KL vs same-format text | top-1 vs f32 | guard estimate | "
          "TTFT text / splice |")
    print("|---|---|---|---|---|---|---|---|")
    for (fmt, frac), g in sorted(groups.items()):
        print(f"| {fmt} | {frac:g} | {len(g)} | {st.mean(x['kl'] for x in g):.4f} | "
              f"{st.mean(x['kl_text'] for x in g):.4f} | {100 * st.mean(x['top1'] for x in g):.1f}% | "
              f"{st.median(x['estimate'] for x in g):.3f} | {st.median(x['ttft_text'] / x['ttft_splice'] for x in g):.2f}x |")
    floors = {}
    for fmt in sorted({r["format"] for r in rows}):
        floors[fmt] = st.mean(r["text_kl"] for r in rows if r["format"] == fmt and r["fraction"] == 0)
    print("\nText re-prefill in the format itself vs f32 (the format's floor): " +
          ", ".join(f"{k} {v:.4f}" for k, v in floors.items()))
    # The guard decides on the splices that reuse something.
    reused = [r for r in rows if r["reused"] > 0]
    calib = [r for r in reused if r["case"] % 2 == 0]
    held = [r for r in reused if r["case"] % 2 == 1]
    summary = {"splices": len(rows), "guarded_splices": len(reused), "bad_kl": a.bad_kl, "floors": floors}
    print(f"\nGuard on {len(reused)} splices that reuse KV (bad: KL > {a.bad_kl}):\n")
    print("| target | threshold (from even cases) | set | bad / good | false accept | false reject |")
    print("|---|---|---|---|---|---|")
    for key, name in (("kl_text", "KL vs same-format text"), ("kl", "KL vs f32 text")):
        t = calibrate(calib, key, a.bad_kl, a.max_fa)
        summary[key] = {"threshold": t}
        for setname, s in (("even (calibration)", calib), ("odd (held out)", held), ("all", reused)):
            fa, fr, nb, ng = rates(s, t, key, a.bad_kl)
            summary[key][setname] = {"false_accept": fa, "false_reject": fr, "bad": nb, "good": ng}
            print(f"| {name} | {t:.4f} | {setname} | {nb} / {ng} | {100 * fa:.1f}% | {100 * fr:.1f}% |")
        for t2 in a.also:
            fa, fr, nb, ng = rates(reused, t2, key, a.bad_kl)
            summary[key][f"all at {t2}"] = {"false_accept": fa, "false_reject": fr}
            print(f"| {name} | {t2:.4f} (fixed) | all | {nb} / {ng} | {100 * fa:.1f}% | {100 * fr:.1f}% |")
    # Per KV format: one threshold each (the guard knows the format).
    print("\nOne threshold per KV format (target: KL vs same-format text), calibrated on the even cases:\n")
    print("| KV | threshold | bad / good (all) | false accept (odd) | false reject (odd) | false accept (all) | false reject (all) |")
    print("|---|---|---|---|---|---|---|")
    fa_n = fr_n = nbad = ngood = 0
    for fmt in sorted({r["format"] for r in reused}):
        c = [r for r in calib if r["format"] == fmt]
        h = [r for r in held if r["format"] == fmt]
        al = [r for r in reused if r["format"] == fmt]
        t = calibrate(c, "kl_text", a.bad_kl, a.max_fa)
        fa_h, fr_h, _, _ = rates(h, t, "kl_text", a.bad_kl)
        fa, fr, nb, ng = rates(al, t, "kl_text", a.bad_kl)
        fa_n += fa * nb
        fr_n += fr * ng
        nbad += nb
        ngood += ng
        summary.setdefault("per_format", {})[fmt] = {"threshold": t, "false_accept": fa, "false_reject": fr}
        print(f"| {fmt} | {t:.4f} | {nb} / {ng} | {100 * fa_h:.1f}% | {100 * fr_h:.1f}% | {100 * fa:.1f}% | {100 * fr:.1f}% |")
    print(f"| pooled | | {nbad} / {ngood} | | | {100 * fa_n / max(1, nbad):.1f}% | {100 * fr_n / max(1, ngood):.1f}% |")
    if a.svg:
        series = {}
        for fmt in sorted({r["format"] for r in rows}):
            fr = sorted({r["fraction"] for r in rows if r["format"] == fmt})
            series[f"{fmt} vs f32 text"] = [(f, st.mean(x["kl"] for x in groups[(fmt, f)])) for f in fr]
            series[f"{fmt} vs same-format"] = [(f, max(1e-5, st.mean(x["kl_text"] for x in groups[(fmt, f)])))
                                               for f in fr]
        svg_plot(series, a.svg, "Splice: KL to the text re-prefill vs recompute fraction (SmolLM2-135M)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
