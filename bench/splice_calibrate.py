#!/usr/bin/env python3
"""Calibrates the splice guard and summarizes the splice sweep.

Input: the JSON lines of `qkvshare splice-eval` (one line per real splice:
format, recompute fraction, the guard's estimate (K and V deviation), the V
deviation alone `v_dev`, KL to the f32 text re-prefill `kl`, KL to the
same-format text re-prefill `kl_text`, KL to the guard's own fallback
`kl_fallback`, TTFTs).

    python3 bench/splice_calibrate.py bench/results/splice_eval_smollm2.jsonl \
        --svg docs/img/splice_kl_vs_recompute.svg --json bench/results/splice_guard.json

A splice is *bad* when its KL to the text re-prefill it replaces (same KV
format) exceeds --bad-kl (0.02). The threshold is chosen on one half of the
cases (of the estimate thresholds whose false-accept rate stays <= 5% there,
the smallest that accepts the most good splices) and the rates are reported on
the other half, which it never saw, and on all. The halves are split by a
case's slot within its source text, so that both hold every source; a second
table calibrates on one source and reports on the other (a shift of domain).
No third-party packages: the plot is plain SVG.
"""
import argparse
import json
import statistics as st
import sys
from collections import defaultdict


def rates(rows, t, key, bad_kl, est="estimate"):
    bad = [r for r in rows if r[key] > bad_kl]
    good = [r for r in rows if r[key] <= bad_kl]
    fa = sum(r[est] <= t for r in bad) / len(bad) if bad else 0.0
    fr = sum(r[est] > t for r in good) / len(good) if good else 0.0
    return fa, fr, len(bad), len(good)


def calibrate(rows, key, bad_kl, max_fa, est="estimate"):
    # Candidate thresholds: every estimate (and 0). Among those with FA <= max_fa,
    # the smallest that lets the most good splices through: a threshold that only
    # adds bad splices gains nothing, so a format without a good splice gets 0
    # (every splice in it is recomputed up to text).
    cands = sorted({0.0} | {r[est] for r in rows})
    best, best_good = 0.0, -1
    for t in cands:
        fa, _, _, _ = rates(rows, t, key, bad_kl, est)
        good = sum(r[key] <= bad_kl and r[est] <= t for r in rows)
        if fa <= max_fa and good > best_good:
            best, best_good = t, good
    return best


def auc(rows, key, bad_kl, est):
    """P(a bad splice's estimate > a good one's): how well the estimate ranks."""
    bad = [r[est] for r in rows if r[key] > bad_kl]
    good = [r[est] for r in rows if r[key] <= bad_kl]
    if not bad or not good:
        return float("nan")
    return sum((g < b) + 0.5 * (g == b) for g in good for b in bad) / (len(bad) * len(good))


def ladder_report(rows, summary, bad_kl, start=0.15, ladder=(0.5, 1.0)):
    """The guard as a workflow runs it: start at 15%, escalate while the estimate
    is above the format's threshold (the held-out calibration's, per format),
    and where it ends; each case's splice at the fraction it ends on."""
    th = {fmt: v["threshold"] for fmt, v in summary.get("per_format", {}).get("estimate", {}).items()
          if fmt != "pooled" and isinstance(v, dict) and "threshold" in v}
    by = defaultdict(dict)
    for r in rows:
        by[(r["format"], r["case"])][r["fraction"]] = r
    steps = (start,) + ladder
    if not th or not all(all(f in d for f in steps) for d in by.values()):
        return
    print(f"\nThe guard in use: splices start at {start:g}, the estimate above the format's threshold raises the "
          f"fraction to {', then '.join(f'{f:g}' for f in ladder)} (1 = text); where each case ends:\n")
    print("| KV | cases | ends at " + " | ends at ".join(f"{f:g}" for f in steps) +
          " | mean KL vs same-format text | max | bad (> " + f"{bad_kl:g}) | mean KL vs f32 text |")
    print("|---|---|" + "---|" * len(steps) + "---|---|---|---|")
    for fmt in sorted(th):
        ends = []
        for (f2, _), d in sorted(by.items()):
            if f2 != fmt:
                continue
            for f in steps:
                if f == 1.0 or d[f]["estimate"] <= th[fmt]:
                    ends.append((f, d[f]))
                    break
        counts = [sum(1 for f, _ in ends if f == x) for x in steps]
        kls = [r["kl_text"] for _, r in ends]
        summary.setdefault("guard_in_use", {})[fmt] = {
            "ends_at": dict(zip([str(x) for x in steps], counts)), "mean_kl_text": st.mean(kls), "max_kl_text": max(kls),
            "bad": sum(k > bad_kl for k in kls), "mean_kl": st.mean(r["kl"] for _, r in ends)}
        print(f"| {fmt} | {len(ends)} | " + " | ".join(str(c) for c in counts) +
              f" | {st.mean(kls):.4f} | {max(kls):.4f} | {sum(k > bad_kl for k in kls)} | "
              f"{st.mean(r['kl'] for _, r in ends):.4f} |")


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
    ap.add_argument("jsonl", nargs="+", help="one file per chunk length (splice-eval --chunk)")
    ap.add_argument("--bad-kl", type=float, default=0.02)
    ap.add_argument("--max-fa", type=float, default=0.05)
    ap.add_argument("--also", type=float, nargs="*", default=[0.25],
                    help="other thresholds to report rates for (0.25: the default before calibration)")
    ap.add_argument("--svg")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for i, path in enumerate(a.jsonl):
        # Only the engine's splices (the recomputed head, with the guard's probe): rows of
        # `--select deviation` measure another choice of tokens and carry no estimate.
        part = [r for r in (json.loads(line) for line in open(path) if line.strip())
                if r.get("select", "head") == "head"]
        if not part:
            sys.exit(f"{path}: no splices")
        for r in part:
            r["chunk"] = r["recomputed"] + r["reused"]
            r["case"] += 100000 * i  # files' pairs apart; even, so the halves keep their parity
        rows += part
    groups = defaultdict(list)
    for r in rows:
        groups[(r["format"], r["fraction"])].append(r)
    by_chunk = defaultdict(list)
    for r in rows:
        by_chunk[(r["format"], r["chunk"], r["fraction"])].append(r)
    chunks = sorted({r["chunk"] for r in rows})
    print(f"{len(rows)} splices, {len({r['case'] for r in rows})} producer/consumer pairs, spliced ranges of "
          f"{', '.join(str(c) for c in chunks)} tokens\n")
    print("| KV | tokens | recompute | splices | KL vs f32 text | KL vs same-format text | top-1 vs f32 | guard estimate | "
          "TTFT text / splice |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (fmt, chunk, frac), g in sorted(by_chunk.items()):
        print(f"| {fmt} | {chunk} | {frac:g} | {len(g)} | {st.mean(x['kl'] for x in g):.4f} | "
              f"{st.mean(x['kl_text'] for x in g):.4f} | {100 * st.mean(x['top1'] for x in g):.1f}% | "
              f"{st.median(x['estimate'] for x in g):.3f} | {st.median(x['ttft_text'] / x['ttft_splice'] for x in g):.2f}x |")
    floors = {}
    for fmt in sorted({r["format"] for r in rows}):
        floors[fmt] = st.mean(r["text_kl"] for r in rows if r["format"] == fmt and r["fraction"] == 0)
    # text_kl depends on the case, not on the chunk length alone: the mean over every case.
    print("\nText re-prefill in the format itself vs f32 (the format's floor): " +
          ", ".join(f"{k} {v:.4f}" for k, v in floors.items()))
    # The guard decides on the splices that reuse something.
    reused = [r for r in rows if r["reused"] > 0]
    n_sources = len({r["source"] for r in rows})
    calib = [r for r in reused if (r["case"] // n_sources) % 2 == 0]
    held = [r for r in reused if (r["case"] // n_sources) % 2 == 1]
    summary = {"splices": len(rows), "guarded_splices": len(reused), "bad_kl": a.bad_kl, "floors": floors}
    fb = [r for r in rows if "kl_fallback" in r]
    if fb:
        one = [r for r in fb if r["reused"] == 0]
        print("\nThe guard's own fallback (the consumer's prefix cached, every spliced token recomputed in one pass) "
              f"against the one-pass text re-prefill: mean KL {st.mean(r['kl_text'] for r in one):.4f} over "
              f"{len(one)} cases; splices judged bad against it / against the one-pass text: "
              f"{sum(r['kl_fallback'] > a.bad_kl for r in reused)} / {sum(r['kl_text'] > a.bad_kl for r in reused)}")
    print(f"\nGuard on {len(reused)} splices that reuse KV (bad: KL > {a.bad_kl}); calibrated on the cases of "
          "even slot in their source, held out: odd slots:\n")
    print("| target | threshold (calibration half) | set | bad / good | false accept | false reject |")
    print("|---|---|---|---|---|---|")
    for key, name in (("kl_text", "KL vs same-format text"), ("kl", "KL vs f32 text")):
        t = calibrate(calib, key, a.bad_kl, a.max_fa)
        summary[key] = {"threshold": t}
        for setname, s in (("calibration", calib), ("held out", held), ("all", reused)):
            fa, fr, nb, ng = rates(s, t, key, a.bad_kl)
            summary[key][setname] = {"false_accept": fa, "false_reject": fr, "bad": nb, "good": ng}
            print(f"| {name} | {t:.4f} | {setname} | {nb} / {ng} | {100 * fa:.1f}% | {100 * fr:.1f}% |")
        for t2 in a.also:
            fa, fr, nb, ng = rates(reused, t2, key, a.bad_kl)
            summary[key][f"all at {t2}"] = {"false_accept": fa, "false_reject": fr}
            print(f"| {name} | {t2:.4f} (fixed) | all | {nb} / {ng} | {100 * fa:.1f}% | {100 * fr:.1f}% |")
    # Per KV format: one threshold each (the guard knows the format), for the
    # guard's estimate (K and V) and for V alone (the estimate before, and what
    # the guard uses where keys are not compared).
    ests = [("estimate", "K+V (the guard)")] + ([("v_dev", "V alone")] if "v_dev" in rows[0] else [])
    for est, ename in ests:
        print(f"\nOne threshold per KV format, estimate {ename}, target KL vs same-format text:\n")
        print("| KV | threshold | bad / good (all) | ranking (AUC) | false accept (held out) | false reject (held out) | "
              "false accept (all) | false reject (all) |")
        print("|---|---|---|---|---|---|---|---|")
        tot = defaultdict(float)
        for fmt in sorted({r["format"] for r in reused}):
            c = [r for r in calib if r["format"] == fmt]
            h = [r for r in held if r["format"] == fmt]
            al = [r for r in reused if r["format"] == fmt]
            t = calibrate(c, "kl_text", a.bad_kl, a.max_fa, est)
            fa_h, fr_h, nb_h, ng_h = rates(h, t, "kl_text", a.bad_kl, est)
            fa, fr, nb, ng = rates(al, t, "kl_text", a.bad_kl, est)
            for k, v in (("fa_h", fa_h * nb_h), ("fr_h", fr_h * ng_h), ("b_h", nb_h), ("g_h", ng_h),
                         ("fa", fa * nb), ("fr", fr * ng), ("b", nb), ("g", ng)):
                tot[k] += v
            au = auc(al, "kl_text", a.bad_kl, est)
            summary.setdefault("per_format", {}).setdefault(est, {})[fmt] = {
                "threshold": t, "auc": au, "false_accept_held_out": fa_h, "false_reject_held_out": fr_h,
                "false_accept": fa, "false_reject": fr}
            print(f"| {fmt} | {t:.4f} | {nb} / {ng} | {au:.3f} | {100 * fa_h:.1f}% | {100 * fr_h:.1f}% | "
                  f"{100 * fa:.1f}% | {100 * fr:.1f}% |")
        pooled = {"false_accept_held_out": tot["fa_h"] / max(1, tot["b_h"]),
                  "false_reject_held_out": tot["fr_h"] / max(1, tot["g_h"]),
                  "false_accept": tot["fa"] / max(1, tot["b"]), "false_reject": tot["fr"] / max(1, tot["g"])}
        summary["per_format"][est]["pooled"] = pooled
        print(f"| pooled | | {int(tot['b'])} / {int(tot['g'])} | | {100 * pooled['false_accept_held_out']:.1f}% | "
              f"{100 * pooled['false_reject_held_out']:.1f}% | {100 * pooled['false_accept']:.1f}% | "
              f"{100 * pooled['false_reject']:.1f}% |")
        if len(chunks) > 1:
            # The same thresholds, held-out rates per spliced length; and thresholds calibrated on
            # one length alone, measured on the others (how far one length's calibration carries).
            th = {f: v["threshold"] for f, v in summary["per_format"][est].items() if f != "pooled"}
            print("\n| spliced tokens | bad / good (held out) | false accept (held out) | false reject (held out) | "
                  "thresholds from this length alone: false accept / reject on the other lengths |")
            print("|---|---|---|---|---|")
            for chunk in chunks:
                h = [r for r in held if r["chunk"] == chunk]
                nb = sum(r["kl_text"] > a.bad_kl for r in h)
                ng = len(h) - nb
                fa = sum(r["kl_text"] > a.bad_kl and r[est] <= th[r["format"]] for r in h)
                fr = sum(r["kl_text"] <= a.bad_kl and r[est] > th[r["format"]] for r in h)
                ofa = ofr = onb = ong = 0
                for fmt in th:
                    t1 = calibrate([r for r in calib if r["chunk"] == chunk and r["format"] == fmt], "kl_text",
                                   a.bad_kl, a.max_fa, est)
                    other = [r for r in reused if r["chunk"] != chunk and r["format"] == fmt]
                    ofa += sum(r["kl_text"] > a.bad_kl and r[est] <= t1 for r in other)
                    ofr += sum(r["kl_text"] <= a.bad_kl and r[est] > t1 for r in other)
                    onb += sum(r["kl_text"] > a.bad_kl for r in other)
                    ong += sum(r["kl_text"] <= a.bad_kl for r in other)
                summary["per_format"][est].setdefault("per_length", {})[str(chunk)] = {
                    "false_accept_held_out": fa / max(1, nb), "false_reject_held_out": fr / max(1, ng),
                    "alone_on_others": {"false_accept": ofa / max(1, onb), "false_reject": ofr / max(1, ong)}}
                print(f"| {chunk} | {nb} / {ng} | {100 * fa / max(1, nb):.1f}% | {100 * fr / max(1, ng):.1f}% | "
                      f"{100 * ofa / max(1, onb):.1f}% / {100 * ofr / max(1, ong):.1f}% |")
        if n_sources > 1:
            # Domain shift: thresholds from one source's cases, rates on the others'.
            fa_n = fr_n = nb_n = ng_n = 0
            for src in sorted({r["source"] for r in reused}):
                for fmt in sorted({r["format"] for r in reused}):
                    c = [r for r in reused if r["format"] == fmt and r["source"] == src]
                    h = [r for r in reused if r["format"] == fmt and r["source"] != src]
                    t = calibrate(c, "kl_text", a.bad_kl, a.max_fa, est)
                    fa, fr, nb, ng = rates(h, t, "kl_text", a.bad_kl, est)
                    fa_n, fr_n, nb_n, ng_n = fa_n + fa * nb, fr_n + fr * ng, nb_n + nb, ng_n + ng
            shift = {"false_accept": fa_n / max(1, nb_n), "false_reject": fr_n / max(1, ng_n)}
            summary["per_format"][est]["across_sources"] = shift
            print(f"\nCalibrated on one source, measured on the other (both ways, pooled): false accept "
                  f"{100 * shift['false_accept']:.1f}%, false reject {100 * shift['false_reject']:.1f}%")
    ladder_report(rows, summary, a.bad_kl)
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
