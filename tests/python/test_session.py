"""Sessions: prefill, generate, stream, logits views, sampling options and their errors."""
import json
import subprocess
import threading

import numpy as np
import pytest

import qkvshare as q

PROMPT = "Once upon a time"


def test_prefill_logits_view(engine, stories):
    s = engine.session(kv="int8")
    assert s.logits is None
    logits = s.prefill(PROMPT)
    assert logits.shape == (stories.vocab_size,) and logits.dtype == np.float32
    assert not logits.flags.writeable and not logits.flags.owndata  # a view of the session's buffer
    assert np.shares_memory(logits, s.logits)  # no copy per access
    before = logits.copy()
    s.prefill(" there")
    assert np.array_equal(logits, before)  # a later pass writes a new buffer: views never change
    all_rows = engine.session(kv="int8").prefill(PROMPT, all_logits=True)
    assert all_rows.shape == (len(stories.tokenize(PROMPT)) + 1, stories.vocab_size)  # + BOS
    with pytest.raises(ValueError):
        logits[0] = 1.0


def test_logits_equal_cli(engine, stories, stories_paths, cli):
    ids = [1] + stories.tokenize(PROMPT)
    r = subprocess.run([str(cli), "logits", "-m", str(stories_paths[0]), "-t", str(stories_paths[1]),
                        "--threads", "1", "--ids", ",".join(map(str, ids))],
                       capture_output=True, timeout=120, check=True)
    want = np.array(json.loads(r.stdout)["logits"], dtype=np.float32)
    got = engine.session(kv="dense").prefill(ids, all_logits=True)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_logits_equal_cli_smollm2(smollm2_path, cli):
    model = q.Model.load(str(smollm2_path))
    eng = q.Engine(model, threads=2)
    ids = model.tokenize("The capital of France is")
    r = subprocess.run([str(cli), "logits", "-m", str(smollm2_path), "--threads", "2", "--ids",
                        ",".join(map(str, ids))], capture_output=True, timeout=300, check=True)
    want = np.array(json.loads(r.stdout)["logits"], dtype=np.float32)
    np.testing.assert_array_equal(eng.session(kv="dense").prefill(ids, all_logits=True), want)


def test_generate_equals_cli(engine, stories_paths, cli):
    r = subprocess.run([str(cli), "generate", "-m", str(stories_paths[0]), "-t", str(stories_paths[1]),
                        "--threads", "1", "-p", PROMPT, "-n", "40", "--temp", "0", "--json"],
                       capture_output=True, timeout=120, check=True)
    want = json.loads(r.stdout)
    s = engine.session(kv="dense")
    got = s.generate(PROMPT, max_tokens=40, temperature=0)
    assert got.tokens == want["generated_ids"]
    assert got.text == want["text"]
    assert got.stop_reason == want["stop_reason"]
    assert got.prefill_tokens == len(want["prompt_ids"])


def test_stream_equals_generate(engine):
    want = engine.session(kv="int8").generate(PROMPT, max_tokens=60, temperature=0.8, seed=7)
    s = engine.session(kv="int8")
    it = s.stream(PROMPT, max_tokens=60, temperature=0.8, seed=7)
    pieces = list(it)
    assert len(pieces) > 5 and all(isinstance(p, str) and p for p in pieces)
    assert "".join(pieces) == want.text
    assert it.done and it.result.tokens == want.tokens
    assert s.tokens[-len(want.tokens):] == want.tokens


def test_stream_stop_string_and_close(engine):
    full = engine.session(kv="int8").generate(PROMPT, max_tokens=40, temperature=0)
    stop = full.text[10:14]
    pieces = list(engine.session(kv="int8").stream(PROMPT, max_tokens=40, temperature=0, stop=[stop]))
    assert "".join(pieces) == full.text[: full.text.index(stop)]
    s = engine.session(kv="int8")
    it = s.stream(PROMPT, max_tokens=40, temperature=0)
    next(it)
    with pytest.raises(q.InvalidArgument, match="stream in progress"):
        s.generate("x")
    it.close()
    assert it.done and list(it) == []
    assert s.generate(" and", max_tokens=3, temperature=0).tokens  # usable again


def test_pending_token_is_fed_next(engine):
    a = engine.session(kv="f32")
    r1 = a.generate(PROMPT, max_tokens=10, temperature=0)
    assert r1.stop_reason == "max_tokens" and a.pending_token == r1.tokens[-1]
    assert a.n_past == len(a.tokens) - 1
    r2 = a.generate([], max_tokens=10, temperature=0)  # nothing new: continue from the pending token
    b = engine.session(kv="f32")
    r = b.generate(PROMPT, max_tokens=20, temperature=0)
    assert r1.tokens + r2.tokens == r.tokens


def test_generate_bad_arguments(engine):
    s = engine.session(kv="int8")
    with pytest.raises(q.InvalidArgument, match="top_p|top-p"):
        s.generate(PROMPT, top_p=7)
    with pytest.raises(q.InvalidArgument, match="max_tokens"):
        s.generate(PROMPT, max_tokens=-1)
    with pytest.raises(TypeError):
        s.generate(PROMPT, max_tokens="many")
    with pytest.raises(TypeError):
        s.generate(3.5)
    with pytest.raises(TypeError):
        s.prefill([1, "two"])
    with pytest.raises(q.InvalidArgument, match="outside the vocabulary"):
        s.prefill([1, 100000])
    with pytest.raises(q.InvalidArgument, match="no tokens"):
        s.generate([])
    assert s.n_past == 0  # nothing was written by the failed calls


def test_context_full(engine):
    s = engine.session(kv="int8", capacity=8)
    with pytest.raises(q.ContextFull) as e:
        s.prefill(list(range(1, 20)))
    assert e.value.code == "context_full" and s.n_past == 0
    r = s.generate(PROMPT, max_tokens=50, temperature=0)
    assert r.stop_reason == "context_full"


def test_session_arguments(engine):
    with pytest.raises(q.InvalidArgument, match="int9"):
        engine.session(kv="int9")
    with pytest.raises(q.InvalidArgument, match="capacity"):
        engine.session(capacity=-1)
    with pytest.raises(q.InvalidArgument, match="capacity"):
        engine.session(capacity=10**7)
    with pytest.raises(TypeError):
        engine.session(pool="not a pool")


def test_closed_session(engine):
    s = engine.session(kv="int4")
    s.prefill(PROMPT)
    s.close()
    assert s.closed
    with pytest.raises(q.InvalidArgument, match="closed"):
        s.generate(PROMPT)
    with pytest.raises(q.InvalidArgument, match="closed"):
        s.tokens


def test_every_kv_format_generates(engine):
    for kv in ("f32", "f16", "int8", "int4", "int2", "k8v4", "dense"):
        r = engine.session(kv=kv).generate(PROMPT, max_tokens=8, temperature=0)
        assert len(r.tokens) == 8, kv


def test_gil_released_while_generating(stories):
    eng = q.Engine(stories, threads=1)
    s = eng.session(kv="int8")
    t = threading.Thread(target=lambda: s.generate(PROMPT, max_tokens=400, temperature=0, ignore_eos=True))
    spins = 0
    t.start()
    while t.is_alive():
        spins += 1
    t.join()
    # With the GIL held for the whole call this loop could not run while the model did.
    assert spins > 1000


def test_threads_share_one_engine(engine):
    # The engine's passes are serialised; sessions on threads give the tokens they give alone.
    want = engine.session(kv="int8").generate(PROMPT, max_tokens=30, temperature=0).tokens
    out = [None] * 3

    def run(i):
        out[i] = engine.session(kv="int8").generate(PROMPT, max_tokens=30, temperature=0).tokens

    ts = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert out == [want] * 3


def test_interleaved_streams(engine):
    a = engine.session(kv="int8").stream(PROMPT, max_tokens=30, temperature=0)
    b = engine.session(kv="int8").stream("The cat", max_tokens=30, temperature=0)
    pa, pb = [], []
    for x, y in zip(a, b):
        pa.append(x)
        pb.append(y)
    pa += list(a)
    pb += list(b)
    assert "".join(pa) == engine.session(kv="int8").generate(PROMPT, max_tokens=30, temperature=0).text
    assert "".join(pb) == engine.session(kv="int8").generate("The cat", max_tokens=30, temperature=0).text


def test_generate_batch_equals_alone(engine):
    prompts = [PROMPT, "The cat", [1, 5, 9, 33]]
    want = [engine.session(kv="int8").generate(p, max_tokens=20, temperature=0).tokens for p in prompts]
    sessions = [engine.session(kv="int8") for _ in prompts]
    got = engine.generate_batch(sessions, prompts, max_tokens=20, temperature=0)
    assert [r.tokens for r in got] == want
    assert all(s.pending_token == r.tokens[-1] for s, r in zip(sessions, got))
    with pytest.raises(q.InvalidArgument, match="also session"):
        engine.generate_batch([sessions[0], sessions[0]], ["a", "b"])
    with pytest.raises(q.InvalidArgument, match="prompts"):
        engine.generate_batch(sessions, ["a"])
    other = q.Engine(engine.model, threads=1)
    with pytest.raises(q.InvalidArgument, match="another engine"):
        other.generate_batch([sessions[0]], ["a"])
    full = engine.session(kv="int8", capacity=8)
    with pytest.raises(q.ContextFull):
        engine.generate_batch([sessions[1], full], [" more", list(range(1, 20))])
    assert sessions[1].generate(" and", max_tokens=2, temperature=0).tokens  # nothing left running


def test_priorities_and_scheduler_limits(stories):
    # One request per pass: the higher priority runs every pass until it is done, so the other's
    # prompt only starts after it; outputs are each session's own either way.
    e = q.Engine(stories, threads=1, max_sessions=1)
    want = [e.session(kv="int8").generate(p, max_tokens=12, temperature=0, ignore_eos=True).tokens
            for p in (PROMPT, "The cat")]
    low, high = e.session(kv="int8"), e.session(kv="int8")
    got = e.generate_batch([low, high], [PROMPT, "The cat"], max_tokens=12, temperature=0, ignore_eos=True,
                           priorities=[0, 5])
    assert [r.tokens for r in got] == want
    first_high = got[1].prefill_seconds + got[1].decode_seconds
    assert got[0].prefill_seconds >= first_high  # low's prompt waited for all of high
    again = e.session(kv="int8")
    assert again.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True, priority=3).tokens == want[0]
    assert "".join(again.stream(" and", max_tokens=3, temperature=0, priority=-1))
    with pytest.raises(q.InvalidArgument, match="priorities"):
        e.generate_batch([low, high], ["a", "b"], priorities=[1])
    with pytest.raises(q.InvalidArgument, match="token_budget"):
        q.Engine(stories, threads=1, max_batch=8, token_budget=9)
    with pytest.raises(q.InvalidArgument, match="max_sessions"):
        q.Engine(stories, threads=1, max_sessions=-1)
    with pytest.raises(TypeError):
        low.generate("x", priority="high")
    # A small token budget chunks a long prompt and gives the same tokens.
    small = q.Engine(stories, threads=1, token_budget=4)
    assert small.session(kv="int8").generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True).tokens == want[0]
