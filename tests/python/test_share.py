"""Pools, sealing, grants, opening (continue, fork, text), descriptors and their errors."""
import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

import qkvshare as q

PROMPT = "Once upon a time"


@pytest.fixture()
def pool():
    with q.Pool.anonymous(bytes=32 << 20) as p:
        yield p


def produce(engine, pool, kv="int8", tokens=12):
    s = engine.session(kv=kv, pool=pool)
    s.generate(PROMPT, max_tokens=tokens, temperature=0)
    return s, s.seal("writer")


def test_continue_is_exact(engine, pool):
    # A consumer continuing the sealed context gives the tokens the producer would have given.
    ref = engine.session(kv="int8")
    ref.generate(PROMPT, max_tokens=12, temperature=0)
    want = ref.generate(" The", max_tokens=20, temperature=0).tokens
    writer, ctx = produce(engine, pool)
    assert ctx.tokens == writer.n_past == len(writer.tokens)  # the pending token was fed before sealing
    d = ctx.grant("reader")
    reader = pool.open(d, engine, agent="reader", mode="kv")
    assert reader.handoff["kv"] and reader.handoff["prefill_tokens"] == 0
    assert reader.tokens == writer.tokens and reader.kv == "int8" and reader.shared
    assert reader.generate(" The", max_tokens=20, temperature=0).tokens == want


def test_fork_shares_blocks(engine, pool):
    _, ctx = produce(engine, pool, tokens=40)
    used_before = pool.stats()["kv"]["blocks_used"]
    a = pool.open(ctx.grant("a"), engine, agent="a")
    b = pool.open(ctx.grant("b"), engine, agent="b")
    assert pool.stats()["kv"]["blocks_used"] == used_before  # opening copies no KV
    ra = a.generate(" The dog", max_tokens=10, temperature=0)
    rb = b.generate(" The cat", max_tokens=10, temperature=0)
    assert ra.tokens != rb.tokens
    assert a.tokens[: ctx.tokens] == b.tokens[: ctx.tokens]


def test_text_mode(engine, pool):
    _, ctx = produce(engine, pool)
    s = pool.open(ctx.grant("t"), engine, agent="t", mode="text")
    assert not s.handoff["kv"] and s.handoff["fallback"] == "requested"
    assert s.handoff["prefill_tokens"] == ctx.tokens
    with pytest.raises(q.InvalidArgument, match="sideways"):
        pool.open(ctx.grant("u"), engine, agent="u", mode="sideways")


def test_descriptor_value(engine, pool):
    _, ctx = produce(engine, pool)
    d = ctx.grant("reader")
    raw = bytes(d)
    assert len(raw) == 256
    assert q.Descriptor.from_bytes(raw) == d
    assert pickle.loads(pickle.dumps(d)) == d
    j = json.loads(d.json())
    assert j["grantee"] == "reader" and j["producer"] == "writer" and j["token_count"] == ctx.tokens
    assert d.token_count == ctx.tokens and d.kv == "int8" and d.context_id == ctx.id
    assert d.fingerprint == engine.model.fingerprint
    assert pool.check(d)["valid"]


def test_forged_and_foreign_descriptors(engine, pool):
    _, ctx = produce(engine, pool)
    d = ctx.grant("reader")
    raw = bytearray(bytes(d))
    raw[180] ^= 1  # the grantee's name
    with pytest.raises(q.BadDescriptor) as e:
        q.Descriptor.from_bytes(bytes(raw))
    assert e.value.code == "bad_descriptor"
    with pytest.raises(q.BadDescriptor, match="256"):
        q.Descriptor.from_bytes(b"short")
    with pytest.raises(TypeError):
        q.Descriptor.from_bytes("not bytes")
    with pytest.raises(q.BadDescriptor, match="reader"):
        pool.open(d, engine, agent="mallory")
    with q.Pool.anonymous(bytes=16 << 20) as other:
        with pytest.raises(q.BadDescriptor, match="pool"):
            other.open(d, engine, agent="reader")
    check = pool.check(q.Descriptor.from_bytes(bytes(d)))
    assert check["valid"]


def test_stale_descriptors(engine, pool):
    _, ctx = produce(engine, pool)
    d = ctx.grant("reader")
    pool.open(d, engine, agent="reader")  # release=True: the grant ends once opened
    with pytest.raises(q.BadDescriptor, match="stale"):
        pool.open(d, engine, agent="reader")
    d2 = ctx.grant("reader")
    pool.release(d2, "reader")
    with pytest.raises(q.BadDescriptor, match="stale"):
        pool.open(d2, engine, agent="reader")
    d3 = ctx.grant("reader")
    ctx.revoke()
    assert not pool.check(d3)["valid"]
    with pytest.raises(q.BadDescriptor, match="stale"):
        pool.open(d3, engine, agent="reader")


def test_released_context(engine, pool):
    _, ctx = produce(engine, pool)
    d = ctx.grant("reader")
    ctx.release()
    assert ctx.released
    with pytest.raises(q.InvalidArgument, match="released"):
        ctx.grant("late")
    with pytest.raises(q.InvalidArgument, match="released"):
        ctx.release()
    s = pool.open(d, engine, agent="reader")  # the grant kept it alive
    assert s.handoff["kv"]
    assert pool.stats()["live"]["contexts"] == 0  # last grant opened and released: the record went
    assert s.generate(" and", max_tokens=5, temperature=0).tokens  # the session holds its blocks


def test_closed_pool(engine):
    p = q.Pool.anonymous(bytes=16 << 20)
    s, ctx = produce(engine, p)
    d = ctx.grant("reader")
    p.close()
    assert p.closed
    for call in (lambda: p.stats(), lambda: p.open(d, engine, agent="reader"), lambda: p.id,
                 lambda: engine.session(pool=p), lambda: p.release(d, "reader")):
        with pytest.raises(q.InvalidArgument, match="closed"):
            call()
    assert s.generate(" more", max_tokens=4, temperature=0).tokens  # the session keeps the mapping
    assert ctx.grant("other").grantee == "other"


def test_private_session_cannot_seal(engine):
    s = engine.session(kv="int8")
    s.prefill(PROMPT)
    with pytest.raises(q.InvalidArgument, match="pool"):
        s.seal("writer")
    with q.Pool.anonymous(bytes=16 << 20) as p:
        with pytest.raises(q.InvalidArgument, match="dense"):
            engine.session(kv="dense", pool=p)
        s = engine.session(pool=p)
        s.prefill(PROMPT)
        with pytest.raises(q.InvalidArgument, match="agent"):
            s.seal("bad name!")
        with pytest.raises(q.InvalidArgument):
            s.seal("w").grant("")


def test_pool_arguments_and_names():
    with pytest.raises(q.Error):
        q.Pool.anonymous(bytes=1024)
    with pytest.raises(q.InvalidArgument, match="name"):
        q.Pool.create("bad/name")
    with pytest.raises(q.IOFailure, match="nosuchpool"):
        q.Pool.attach("nosuchpool-%d" % os.getpid())
    name = "pytest-names-%d" % os.getpid()
    with q.Pool.create(name, bytes=16 << 20) as p:
        assert p.name == name
        with pytest.raises(q.IOFailure):
            q.Pool.create(name, bytes=16 << 20)
        attached = q.Pool.attach(name)
        assert attached.id == p.id
        attached.close()
    with pytest.raises(q.IOFailure):
        q.Pool.attach(name)  # unlinked when the creator closed


def test_stats(engine, pool):
    _, ctx = produce(engine, pool)
    pool.open(ctx.grant("r"), engine, agent="r")
    st = pool.stats()
    assert st["counters"]["seals"] == 1 and st["counters"]["opens_kv"] == 1
    assert st["live"]["contexts"] == 1 and st["kv"]["blocks_used"] > 0


CONSUMER = textwrap.dedent("""
    import json, sys
    import qkvshare as q
    name, model, tok, path = sys.argv[1:5]
    m = q.Model.load(model, tok)
    e = q.Engine(m, threads=1)
    pool = q.Pool.attach(name)
    d = q.Descriptor.from_bytes(open(path, "rb").read())
    s = pool.open(d, e, agent="consumer", mode="kv")
    r = s.generate(" The", max_tokens=20, temperature=0)
    print(json.dumps({"kv": s.handoff["kv"], "tokens": s.tokens, "ids": r.tokens}))
    try:
        pool.open(d, e, agent="consumer")
    except q.BadDescriptor as ex:
        print(json.dumps({"second_open": ex.code}))
""")


def test_two_process_handoff(engine, stories_paths, tmp_path):
    name = "pytest-2p-%d" % os.getpid()
    with q.Pool.create(name, bytes=32 << 20) as pool:
        writer, ctx = produce(engine, pool, kv="int4", tokens=30)
        path = tmp_path / "ctx.desc"
        path.write_bytes(bytes(ctx.grant("consumer")))
        local = pool.open(ctx.grant("local"), engine, agent="local")
        want = local.generate(" The", max_tokens=20, temperature=0).tokens
        r = subprocess.run([sys.executable, "-c", CONSUMER, name, str(stories_paths[0]), str(stories_paths[1]),
                            str(path)], capture_output=True, timeout=120, text=True)
        assert r.returncode == 0, r.stderr
        lines = [json.loads(x) for x in r.stdout.splitlines()]
        assert lines[0]["kv"] and lines[0]["tokens"][: ctx.tokens] == writer.tokens
        assert lines[0]["ids"] == want  # the other process continued on the same blocks, exactly
        assert lines[1] == {"second_open": "bad_descriptor"}


def test_two_agents_example(repo_root, stories_paths):
    r = subprocess.run([sys.executable, str(repo_root / "examples" / "python" / "two_agents.py"), "--model",
                        str(stories_paths[0]), "--tokenizer", str(stories_paths[1])],
                       capture_output=True, timeout=180, text=True)
    assert r.returncode == 0, r.stderr
    assert "continued on the writer's KV: True (fallback none" in r.stdout
    assert "contexts live 0" in r.stdout


def test_fanout_example(repo_root, stories_paths):
    r = subprocess.run([sys.executable, str(repo_root / "examples" / "python" / "fanout.py"), "--model",
                        str(stories_paths[0]), "--tokenizer", str(stories_paths[1]), "--max-tokens", "8"],
                       capture_output=True, timeout=180, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("KV reused: True") == 3 and "0 contexts left" in r.stdout


def test_splice_keeps_own_prefix_and_reuses_the_kv(engine, pool):
    # The reviewer keeps its own role (prefix) and splices the writer's context after it.
    writer, ctx = produce(engine, pool, kv="f32")
    d = ctx.grant("reviewer")
    reviewer = engine.session(kv="f32", pool=pool)
    reviewer.prefill("A reviewer reads:")
    own = reviewer.n_past
    r = reviewer.splice(pool, d, agent="reviewer", recompute=0.25, guard=False)
    assert r["tokens"] == ctx.tokens and r["recomputed"] + r["reused"] == ctx.tokens
    assert r["reused"] > 0 and not r["text"]
    assert reviewer.n_past == own + ctx.tokens
    assert reviewer.tokens[own:] == writer.tokens
    # With everything recomputed the splice is the text re-read: the same tokens as a plain prefill.
    d2 = ctx.grant("reviewer2")
    full = engine.session(kv="f32", pool=pool)
    full.prefill("A reviewer reads:")
    r2 = full.splice(pool, d2, agent="reviewer2", recompute=1.0, guard=False)
    assert r2["reused"] == 0
    ref = engine.session(kv="f32")
    ref.prefill("A reviewer reads:")
    ref.prefill(writer.tokens)
    assert full.generate(" The", max_tokens=8, temperature=0).tokens == \
        ref.generate(" The", max_tokens=8, temperature=0).tokens
    # The grant went with the splice (release=True): the descriptor is stale now.
    with pytest.raises(q.BadDescriptor):
        reviewer.splice(pool, d, agent="reviewer")


def test_splice_bad_arguments(engine, pool):
    writer, ctx = produce(engine, pool)
    d = ctx.grant("x")
    private = engine.session(kv="int8")
    with pytest.raises(q.InvalidArgument, match="pool"):
        private.splice(pool, d, agent="x")
    s = engine.session(kv="int8", pool=pool)
    with pytest.raises(q.InvalidArgument, match="recompute"):
        s.splice(pool, d, agent="x", recompute=1.5)
    with pytest.raises(q.InvalidArgument, match="range"):
        s.splice(pool, d, agent="x", begin=5, end=3, release=False)
    with pytest.raises(TypeError):
        s.splice(pool, "not a descriptor", agent="x")
    with pytest.raises(q.BadDescriptor):
        s.splice(pool, d, agent="somebody else")
    r = s.splice(pool, d, agent="x", begin=2, end=6)
    assert r["tokens"] == 4 and s.tokens == writer.tokens[2:6]
