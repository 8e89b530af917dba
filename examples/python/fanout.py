"""Fan-out: one researcher reads a brief once; three writers fork its context.

Each writer opens its own grant of the researcher's sealed context and continues
with its own instruction; their sessions share the researcher's KV blocks (a
writer copies only the partly filled tail block before appending), so the brief
is prefilled once instead of three times.

    python examples/python/fanout.py [--model M.gguf] [--kv int4]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import qkvshare as q

DEFAULT_MODEL = Path.home() / ".cache" / "qkvshare" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
BRIEF = ("The town of Millbrook is building a new library. It will have a reading garden, a maker space with "
         "3D printers, and a children's wing. Construction starts in spring and costs 4 million dollars.")
ANGLES = {"headline": "Write a one-line headline.", "kids": "Explain it to a child in one sentence.",
          "critic": "Give one concern a resident might raise."}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--kv", default="int4")
    ap.add_argument("--max-tokens", type=int, default=40)
    a = ap.parse_args()

    model = q.Model.load(a.model, a.tokenizer)
    engine = q.Engine(model)
    pool = q.Pool.anonymous(bytes=128 << 20)
    researcher = engine.session(kv=a.kv, pool=pool)
    researcher.prefill(model.chat_template([("system", "You are a helpful assistant."), ("user", BRIEF)],
                                           add_generation_prompt=False), special=True)
    context = researcher.seal("researcher")
    grants = {name: context.grant(name) for name in ANGLES}
    context.release()
    print(f"researcher: {context.tokens} tokens sealed once, {len(grants)} forks")

    for name, instruction in ANGLES.items():
        t0 = time.perf_counter()
        writer = pool.open(grants[name], engine, agent=name)
        turn = model.chat_template([("user", instruction)])
        reply = writer.generate(turn, max_tokens=a.max_tokens, temperature=0, special=True, stop=["<|im_end|>"])
        h = writer.handoff
        print(f"\n[{name}] (KV reused: {h['kv']}, {writer.n_past} tokens, {time.perf_counter() - t0:.2f} s)\n"
              f"{reply.text.strip()}")
        writer.close()
    st = pool.stats()
    print(f"\npool: {st['counters']['opens_kv']} KV opens, {st['live']['contexts']} contexts left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
