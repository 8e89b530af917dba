"""Disconnects, graceful shutdown, and handles shared with other processes on the same pool."""
import base64
import json
import os
import signal
import socket
import subprocess
import threading
import time

import httpx
import openai

from conftest import CLI, STORIES


def stream_request(port, body):
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return s


def test_disconnect_mid_stream_frees_the_session(make_server):
    s = make_server("--parallel", "2", "--kv", "f16")
    # Eight choices of 500 tokens: seconds of work, so the server is still writing when the client leaves.
    sock = stream_request(s.port, {"prompt": "Once", "max_tokens": 500, "n": 8, "stream": True, "temperature": 1,
                                   "seed": 1})
    got = b""
    while b"data: " not in got:
        got += sock.recv(4096)
    sock.close()  # gone mid-stream
    deadline = time.time() + 20
    while time.time() < deadline:
        m = s.metrics()
        if m.get("qkvshare_requests_cancelled_total", 0) >= 1 and m["qkvshare_sessions_active"] == 0:
            break
        time.sleep(0.05)
    assert m["qkvshare_requests_cancelled_total"] >= 1, m
    assert m["qkvshare_sessions_active"] == 0
    assert m['qkvshare_pool_blocks{state="used"}'] == 0, m  # nothing sealed, nothing held
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200


def test_graceful_shutdown_finishes_running_requests(make_server):
    s = make_server("--parallel", "1", "--queue", "4")
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
    out = {}

    def run():
        out["r"] = c.completions.create(model="stories260K", prompt="Once", max_tokens=400, temperature=0)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.time() + 20
    while s.metrics()["qkvshare_sessions_active"] < 1 and time.time() < deadline:
        time.sleep(0.01)
    s.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert s.proc.wait(timeout=30) == 0
    assert out["r"].usage.completion_tokens > 0
    assert out["r"].choices[0].finish_reason in ("stop", "length")
    log = s.read_log()
    assert '"event":"shutdown"' in log and '"event":"stopped"' in log


def test_handles_cross_processes_on_a_named_pool(make_server, tmp_path):
    name = f"qkvsrv{os.getpid()}"
    s = make_server("--pool", name, "--kv", "f16")
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 12,
                                                        "temperature": 0}, timeout=30).json()
        # The handle is a descriptor: another process opens it with the CLI ...
        raw = base64.urlsafe_b64decode(r["qkvshare"]["context"]["handle"][5:] + "==")
        (tmp_path / "a.desc").write_bytes(raw)
        gen = subprocess.run([CLI, "generate", "-m", *STORIES, "-p", " The end", "-n", "6", "--temp", "0", "--json",
                              "--pool", name, "--from", str(tmp_path / "a.desc"), "--agent", "default",
                              "--publish", str(tmp_path / "b.desc"), "--grant", "default", "--keep"],
                             capture_output=True, text=True, timeout=60)
        assert gen.returncode == 0, gen.stderr
        assert "on its KV" in gen.stderr
        # ... and what that process published comes back into the server as a handle.
        back = "qkv1." + base64.urlsafe_b64encode((tmp_path / "b.desc").read_bytes()).decode().rstrip("=")
        cont = httpx.post(s.url + "/v1/completions", json={"prompt": " Then", "max_tokens": 4, "temperature": 0,
                                                           "qkvshare": {"context": back}}, timeout=30).json()
        produced = json.loads(gen.stdout)
        assert cont["usage"]["prompt_tokens_details"]["cached_tokens"] > r["qkvshare"]["context"]["tokens"], (cont, produced)
        assert cont["qkvshare"]["reuse"]["mode"] == "continue"
    finally:
        s.stop()
    assert not os.path.exists(f"/dev/shm/{name}")  # the server created the pool and removed it
