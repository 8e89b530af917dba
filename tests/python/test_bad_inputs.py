"""Bad inputs and misuse across threads: each gets a clear qkvshare error, never a crash, a hang, a
generic nanobind/C++ message or a lost handoff. Probes that used to crash the interpreter or hang run
in a subprocess with a timeout."""
import math
import os
import subprocess
import sys
import textwrap
import threading

import pytest

import qkvshare as q

PROMPT = "Once upon a time"


def run_probe(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter: a segfault or a hang fails the test instead of the run."""
    try:
        r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code), *args],
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the probe hung for {timeout} s")
    assert r.returncode == 0, f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r


# 1. A closed session in generate_batch used to be read before the closed check (segfault).
def test_generate_batch_with_a_closed_session(stories_paths):
    r = run_probe("""
        import sys, qkvshare as q
        m = q.Model.load(sys.argv[1], sys.argv[2])
        e = q.Engine(m, threads=1)
        a, closed = e.session(), e.session()
        closed.close()
        for sessions in ([closed], [a, closed]):
            try:
                e.generate_batch(sessions, ["Once"] * len(sessions), max_tokens=1)
                print("no error")
            except q.InvalidArgument as ex:
                print("InvalidArgument:", ex)
        print("n_past", a.n_past)
    """, str(stories_paths[0]), str(stories_paths[1]))
    assert r.stdout.splitlines() == ["InvalidArgument: the session is closed"] * 2 + ["n_past 0"]


# 2. close() in one thread while another thread's call on the same session waits for the engine.
CLOSE_RACE = """
    import sys, threading, time, qkvshare as q
    m = q.Model.load(sys.argv[1])
    e = q.Engine(m, threads=1)
    pool = q.Pool.anonymous(bytes=64 << 20)
    busy, victim = e.session(), e.session(pool=pool, capacity=1024)
    victim.prefill("Once")
    # busy holds the engine's mutex for a while; close() and then the victim's call wait for it.
    threading.Thread(target=lambda: busy.prefill(list(range(100, 700)))).start()
    time.sleep(0.2)
    threading.Thread(target=victim.close).start()
    time.sleep(0.2)
    call = {"prefill": lambda: victim.prefill(list(range(200, 260))),
            "generate": lambda: victim.generate(" x", max_tokens=2),
            "seal": lambda: victim.seal("w"),
            "stream": lambda: list(victim.stream(" x", max_tokens=2))}[sys.argv[2]]
    try:
        call()
        print("ran before close")  # the mutex may go to the call first: then close() frees it after
    except q.InvalidArgument as ex:
        print("InvalidArgument:", ex)
    time.sleep(0.1)
    print("closed", victim.closed)
    try:
        victim.prefill("again")
    except q.InvalidArgument as ex:
        print("after:", ex)
"""


@pytest.mark.parametrize("call", ["prefill", "generate", "seal", "stream"])
def test_close_while_a_call_waits_for_the_engine(smollm2_path, call):
    r = run_probe(CLOSE_RACE, str(smollm2_path), call)
    lines = r.stdout.splitlines()
    assert lines[0] in ("InvalidArgument: the session is closed", "ran before close"), r.stdout
    assert lines[1:] == ["closed True", "after: the session is closed"], r.stdout


def test_close_while_generating_in_another_thread(stories):
    # close() never frees a session a request still runs on: it raises "busy" until the request ends.
    e = q.Engine(stories, threads=1)
    s = e.session()
    result = []
    t = threading.Thread(target=lambda: result.append(
        s.generate(PROMPT, max_tokens=400, temperature=0, ignore_eos=True)))
    t.start()
    while s.n_past == 0 and t.is_alive():  # until the request runs
        pass
    busy = 0
    while True:
        try:
            s.close()
            break
        except q.InvalidArgument as ex:
            assert "busy with another request" in str(ex)
            busy += 1
    t.join()
    assert busy > 0 and s.closed
    assert len(result) == 1 and len(result[0].tokens) == 400


# 3. Absurd thread counts are refused before any thread starts.
def test_engine_thread_bound(stories):
    for threads in (1025, 100000, 2**31 - 1, 2**70):
        with pytest.raises(q.InvalidArgument, match=r"threads must be <= 1024"):
            q.Engine(stories, threads=threads)
    with pytest.raises(q.InvalidArgument, match="threads must be >= 0"):
        q.Engine(stories, threads=-(2**70))
    w = q.Workflow.parse("agents:\n  a: {prompt: hi}\nsteps:\n  - {id: s1, agent: a}\n")
    with pytest.raises(q.InvalidArgument, match=r"run: threads must be <= 1024"):
        w.run(stories, threads=5000)


def test_engine_thread_creation_failure_raises(stories_paths):
    # Under an address-space limit the system refuses threads part-way: the pool stops those it
    # started and raises (it used to deadlock).
    r = run_probe("""
        import resource, sys, qkvshare as q
        m = q.Model.load(sys.argv[1], sys.argv[2])
        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), resource.RLIM_INFINITY))
        try:
            q.Engine(m, threads=1000)
            print("no error")
        except q.OutOfMemory as ex:
            print("OutOfMemory:", "cannot start 1000 threads" in str(ex))
        with open("/proc/self/status") as f:
            print([l.split()[1] for l in f if l.startswith("Threads:")][0])
    """, str(stories_paths[0]), str(stories_paths[1]), timeout=60)
    assert r.stdout.splitlines() == ["OutOfMemory: True", "1"], r.stdout


# 4. A failed splice keeps the grant: the descriptor can still be opened.
def test_failed_splice_keeps_the_grant(engine):
    with q.Pool.anonymous(bytes=16 << 20) as pool:
        prod = engine.session(pool=pool)
        prod.generate(PROMPT, max_tokens=10, temperature=0)
        d = prod.seal("writer").grant("cons")
        s = engine.session(pool=pool)
        s.prefill("Lily said:")
        before = s.tokens
        for begin, end in ((5, 2), (0, 10**6), (-1, None)):
            with pytest.raises(q.InvalidArgument, match="splice: range"):
                s.splice(pool, d, "cons", begin=begin, end=end)
            assert pool.check(d)["valid"], pool.check(d)["problem"]
        with pytest.raises(q.InvalidArgument, match="threshold"):
            s.splice(pool, d, "cons", threshold=-1.0)
        assert pool.check(d)["valid"] and s.tokens == before
        r = s.splice(pool, d, "cons", begin=1, end=5)
        assert r["tokens"] == 4
        assert "released" in pool.check(d)["problem"]  # release=True: the grant went with the success


# 5. A FIFO is refused at once instead of blocking open().
def test_model_load_fifo(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = run_probe("""
        import sys, qkvshare as q
        try:
            q.Model.load(sys.argv[1])
        except q.IOFailure as ex:
            print("IOFailure:", ex)
    """, str(fifo), timeout=30)
    assert r.stdout.strip() == f"IOFailure: {fifo}: not a regular file"


# 7. Huge token ids and non-str chat fields get the library's messages, not std::bad_cast.
def test_huge_token_ids(engine):
    s = engine.session()
    for big in (2**63, 2**70, -(2**64)):
        with pytest.raises(q.InvalidArgument, match=rf"prompt: token {big} at index 1 is outside the vocabulary"):
            s.prefill([1, big])
        with pytest.raises(q.InvalidArgument, match=rf"token {big} at index 0 is outside the vocabulary"):
            engine.generate_batch([s], [[big]], max_tokens=1)
    assert s.n_past == 0


def test_chat_fields_must_be_str(stories):
    with pytest.raises(TypeError, match=r"chat message 0: 'content' must be a str, got NoneType"):
        stories.chat_template([{"role": "user", "content": None}])
    with pytest.raises(TypeError, match=r"chat message 1: 'content' must be a str, got int"):
        stories.chat_template([("system", "hi"), ("user", 5)])
    with pytest.raises(TypeError, match=r"chat message 0: 'role' must be a str, got bytes"):
        stories.chat_template([(b"user", "hi")])
    with pytest.raises(q.InvalidArgument, match=r"chat message 0: 'content' cannot be encoded as UTF-8"):
        stories.chat_template([("user", "\ud800")])


# 9. close() from another thread while the stream is iterated: a no-op when the iterator took the end.
def test_stream_close_from_another_thread(engine):
    for _ in range(10):
        s = engine.session()
        st = s.stream(PROMPT, max_tokens=40, temperature=0, ignore_eos=True)
        errors = []

        def iterate():
            try:
                for _ in st:
                    pass
            except Exception as ex:  # noqa: BLE001 (collected for the assertion)
                errors.append(f"{type(ex).__name__}: {ex}")

        def close():
            try:
                st.close()
            except Exception as ex:  # noqa: BLE001
                errors.append(f"{type(ex).__name__}: {ex}")

        ts = [threading.Thread(target=iterate), threading.Thread(target=close)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert errors == []
        assert st.done and list(st) == []
        assert s.generate(" The", max_tokens=2, temperature=0).stop_reason == "max_tokens"  # usable again


# 10. Two threads generating on one session: the loser hears that the session is busy.
def test_concurrent_generate_on_one_session(engine):
    s = engine.session()
    s.prefill("Once")
    messages = set()

    def work():
        for _ in range(20):
            try:
                s.generate(" x", max_tokens=2)
            except q.InvalidArgument as ex:
                messages.add(str(ex))

    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert all("busy with another request" in m for m in messages), messages
    assert len(s.tokens) == s.n_past + (s.pending_token is not None)


# 11. splice's threshold must be a number >= 0 (a negative one used to mean "calibrated").
@pytest.mark.parametrize("threshold", [math.nan, -5.0, -math.inf, math.inf])
def test_splice_threshold(engine, threshold):
    with q.Pool.anonymous(bytes=16 << 20) as pool:
        prod = engine.session(pool=pool)
        prod.generate(PROMPT, max_tokens=6, temperature=0)
        d = prod.seal("w").grant("c")
        s = engine.session(pool=pool)
        with pytest.raises(q.InvalidArgument, match=r"splice: threshold must be a finite number >= 0 \(or None\)"):
            s.splice(pool, d, "c", threshold=threshold)
        assert s.splice(pool, d, "c", threshold=0.5)["tokens"] > 0


# 12. A NUL in a path used to cut the path short silently.
def test_nul_in_paths(stories_paths, tmp_path):
    model, tok = map(str, stories_paths)
    with pytest.raises(q.InvalidArgument, match="path: path contains a NUL character"):
        q.Model.load(model + "\0/does/not/exist", tok)
    with pytest.raises(q.InvalidArgument, match="tokenizer: path contains a NUL character"):
        q.Model.load(model, tok + "\0junk")
    with pytest.raises(q.InvalidArgument, match="path contains a NUL character"):
        q.Workflow.load(str(tmp_path / "w.yaml") + "\0x")
    w = q.Workflow.parse("agents:\n  a: {prompt: hi}\nsteps:\n  - {id: s1, agent: a}\n")
    with pytest.raises(q.InvalidArgument, match="run: model: path contains a NUL character"):
        w.run(model + "\0x")


# 13. Out-of-range ints and unencodable strings name the parameter.
def test_out_of_range_ints_name_the_parameter(engine, stories):
    s = engine.session()
    with pytest.raises(q.InvalidArgument, match=r"capacity 1180591620717411303424 is out of range"):
        engine.session(capacity=2**70)
    for name in ("max_tokens", "top_k", "repeat_last_n", "priority"):
        with pytest.raises(q.InvalidArgument, match=rf"{name} {2**70} is out of range"):
            s.generate(PROMPT, **{name: 2**70})
        with pytest.raises(q.InvalidArgument, match=rf"{name} -{2**40} is out of range"):
            s.stream(PROMPT, **{name: -(2**40)})
    for seed in (-1, 2**64):
        with pytest.raises(q.InvalidArgument, match=rf"seed {seed} is out of range"):
            s.generate(PROMPT, seed=seed)
        with pytest.raises(q.InvalidArgument, match=rf"seed {seed} is out of range"):
            engine.generate_batch([s], [PROMPT], seed=seed)
    for size in (-1, 2**64):
        with pytest.raises(q.InvalidArgument, match=rf"bytes {size} is out of range"):
            q.Pool.anonymous(bytes=size)
    with pytest.raises(TypeError, match="max_tokens must be an int, got float"):
        s.generate(PROMPT, max_tokens=1.5)
    with pytest.raises(q.InvalidArgument, match="text cannot be encoded as UTF-8"):
        stories.tokenize("\ud800")
    with pytest.raises(q.InvalidArgument, match="prompt cannot be encoded as UTF-8"):
        s.prefill("a\ud800b")
    assert s.n_past == 0  # nothing was written by the failed calls
    assert s.generate(PROMPT, max_tokens=1, seed=2**64 - 1).stop_reason in ("max_tokens", "end_of_generation")


def test_int_arguments_take_index_types(engine):
    np = pytest.importorskip("numpy")
    s = engine.session(capacity=np.int64(64))
    assert s.capacity == 64
    assert len(s.generate(PROMPT, max_tokens=np.int32(3), temperature=0, ignore_eos=True).tokens) == 3


# 14. bytes=0 is too small, like bytes=1 (it was reported as out of memory).
def test_pool_of_zero_bytes():
    for size in (0, 1):
        with pytest.raises(q.InvalidArgument, match="too small"):
            q.Pool.anonymous(bytes=size)
    with pytest.raises(q.InvalidArgument, match="too small"):
        q.Pool.create("pyfix-zero", bytes=0)


# 13. Reading a session's tokens, text, n_past or capacity while another thread generates on it:
# the reads wait for the engine between passes instead of copying a vector being appended to.
PROPERTY_RACE = """
    import sys, threading, qkvshare as q
    m = q.Model.load(sys.argv[1], sys.argv[2])
    e = q.Engine(m, threads=1)
    s = e.session()
    t = threading.Thread(target=lambda: s.generate("Once upon a time", max_tokens=400, temperature=0,
                                                   ignore_eos=True))
    t.start()
    seen = []
    while t.is_alive():
        tokens, n_past = s.tokens, s.n_past
        assert isinstance(s.text, str) and s.capacity >= n_past
        seen.append(tokens)
    t.join()
    final = s.tokens
    assert all(final[:len(x)] == x for x in seen), "a read saw tokens the session never held"
    print("reads", len(seen) > 0, "final", len(final))
"""


def test_properties_while_another_thread_generates(stories_paths):
    r = run_probe(PROPERTY_RACE, str(stories_paths[0]), str(stories_paths[1]))
    assert r.stdout.split()[:2] == ["reads", "True"], r.stdout
