"""Two agents in two OS processes hand a context over a shared pool.

The producer (this process) creates a named pool, writes a story opening with the
default model, seals its context and grants it to the consumer; the consumer (a
second Python process started with multiprocessing's "spawn", so it shares nothing
but the pool's name and the 256-byte descriptor) attaches the pool, opens the
descriptor and continues on the producer's KV blocks without re-reading them.

    python examples/python/two_agents.py [--model M.gguf] [--tokenizer T] [--kv int8]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import sys
from pathlib import Path

import qkvshare as q

DEFAULT_MODEL = Path.home() / ".cache" / "qkvshare" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def consumer(pool_name: str, model_path: str, tokenizer: str | None, descriptor: bytes, out) -> None:
    model = q.Model.load(model_path, tokenizer)
    engine = q.Engine(model, threads=1)
    pool = q.Pool.attach(pool_name)
    d = pickle.loads(descriptor)  # a Descriptor pickles as its 256 bytes, validated on load
    session = pool.open(d, engine, agent="reviewer", mode="kv")  # kv: the producer's blocks or an error
    reply = session.generate(" Then", max_tokens=24, temperature=0)
    out.put({"pid": os.getpid(), "handoff": session.handoff, "tokens_before": session.n_past - len(reply.tokens),
             "text": reply.text, "ids": reply.tokens})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--tokenizer", default=None, help="llama2.c tokenizer (tok512.bin) for llama2.c checkpoints")
    ap.add_argument("--kv", default="int8")
    ap.add_argument("--prompt", default="Once upon a time")
    a = ap.parse_args()

    model = q.Model.load(a.model, a.tokenizer)
    engine = q.Engine(model, threads=1)
    name = f"two-agents-{os.getpid()}"
    with q.Pool.create(name, bytes=128 << 20) as pool:  # the name goes when this block ends
        writer = engine.session(kv=a.kv, pool=pool)
        opening = writer.generate(a.prompt, max_tokens=24, temperature=0)
        context = writer.seal("writer")
        descriptor = context.grant("reviewer")
        context.release()  # the grant alone keeps the context alive until the reviewer opens it
        print(f"[writer pid {os.getpid()}] {a.prompt}{opening.text}")
        print(f"[writer] sealed {descriptor.token_count} tokens as {len(bytes(descriptor))}-byte descriptor "
              f"({descriptor.kv} KV) for {descriptor.grantee}")

        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        p = ctx.Process(target=consumer, args=(name, a.model, a.tokenizer, pickle.dumps(descriptor), out))
        p.start()
        result = out.get(timeout=300)
        p.join(timeout=60)
        if p.exitcode != 0:
            print(f"consumer exited with {p.exitcode}", file=sys.stderr)
            return 1
        h = result["handoff"]
        print(f"[reviewer pid {result['pid']}] continued on the writer's KV: {h['kv']} "
              f"(fallback {h['fallback']}, {result['tokens_before']} tokens reused, "
              f"{h['prefill_tokens']} re-encoded, open took {h['seconds'] * 1e3:.2f} ms)")
        print(f"[reviewer] ...{result['text']}")
        stats = pool.stats()
        print(f"[pool] seals {stats['counters']['seals']}, KV opens {stats['counters']['opens_kv']}, "
              f"contexts live {stats['live']['contexts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
