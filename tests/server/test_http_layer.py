"""The HTTP layer under the routes, over raw sockets: framing answered from the headers at once,
the library's own errors explained, slow clients not holding up the others, no byte ranges of JSON."""
import json
import socket
import time

import httpx

BODY = b'{"messages":[{"role":"user","content":"Once upon a time"}],"max_tokens":4}'


def exchange(server, raw, timeout=20):
    """Sends `raw`, returns (status, headers, parsed JSON body, seconds until the answer)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        t = time.time()
        s.sendall(raw)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            assert chunk, f"closed without an answer: {data!r}"
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(body) < length:
            chunk = s.recv(65536)
            assert chunk, "closed in the middle of the body"
            body += chunk
        return int(lines[0].split()[1]), headers, json.loads(body[:length]) if length else None, time.time() - t


def post_head(length_line):
    return b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + length_line + b"\r\n"


def message(body):
    return body["error"]["message"]


def test_framing_is_answered_from_the_headers_at_once(server):
    # The body is never sent: each answer must come from the headers alone, with the connection closed.
    status, headers, body, took = exchange(server, post_head(b"Content-Length: 1000000000000\r\n"))
    assert status == 413 and took < 5, (status, took)
    assert "limit of 8192 KiB (--max-body-kib)" in message(body), body
    assert headers.get("connection") == "close"
    status, headers, body, took = exchange(server, post_head(b"Content-Length: -5\r\n"))
    assert status == 400 and took < 5 and "invalid Content-Length '-5'" in message(body), body
    status, headers, body, took = exchange(server, post_head(b"") + BODY)
    assert status == 411 and took < 5, (status, took)
    assert "POST needs Content-Length or Transfer-Encoding: chunked" in message(body), body
    assert headers.get("connection") == "close"
    status, _, body, took = exchange(server, post_head(b"Transfer-Encoding: gzip\r\n"))
    assert status == 501 and took < 5 and "'gzip'" in message(body), body
    form = b"POST /v1/chat/completions HTTP/1.1\r\nContent-Type: multipart/form-data; boundary=x\r\nContent-Length: 5\r\n\r\n"
    status, _, body, took = exchange(server, form)
    assert status == 415 and took < 5 and "multipart" in message(body), body
    # Expect: 100-continue gets the refusal instead of the go-ahead.
    status, _, body, took = exchange(server, post_head(b"Content-Length: 1000000000000\r\nExpect: 100-continue\r\n"))
    assert status == 413 and took < 5, (status, took)


def test_the_413_names_the_flag_and_the_limit(make_server):
    s = make_server("--max-body-kib", "4")
    # Chunked: no length up front, so the library counts and refuses it.
    chunk = b"x" * 5000
    raw = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
           + b"%x\r\n" % len(chunk) + chunk + b"\r\n0\r\n\r\n")
    status, headers, body, _ = exchange(s, raw)
    assert status == 413 and "limit of 4 KiB (--max-body-kib)" in message(body), body
    assert headers.get("connection") == "close"
    # Under the limit, chunked bodies are served.
    raw = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
           + b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\n\r\n")
    status, _, body, _ = exchange(s, raw)
    assert status == 200 and body["choices"], body


def test_the_librarys_own_errors_say_what_is_wrong(server):
    cases = [
        (b"FOO /health HTTP/1.1\r\nHost: x\r\n\r\n", 400, "unsupported method 'FOO'"),
        (b"TRACE /health HTTP/1.1\r\nHost: x\r\n\r\n", 400, "unsupported method 'TRACE'"),
        (b"GET /health\r\nHost: x\r\n\r\n", 400, "malformed request line"),
        (b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", 400, "unsupported HTTP version 'HTTP/9.9'"),
        (b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "longer than the limit of 8192 bytes"),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400,
         "malformed request"),
        (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nRange: bytes=5-2\r\n\r\n", 416, "does not serve byte ranges"),
    ]
    for raw, status, words in cases:
        got, _, body, _ = exchange(server, raw)
        assert got == status and words in message(body), (raw[:40], got, body)
    status, _, body, _ = exchange(server, b"GET /nothing%00here HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 404 and message(body) == "no route for GET '/nothing\\u0000here'", body


def test_ranges_are_not_applied_to_json(server):
    r = httpx.get(server.url + "/v1/models", headers={"Range": "bytes=0-1,2-3"})
    assert r.status_code == 200 and r.json()["object"] == "list"
    assert "content-range" not in r.headers


def test_slow_clients_do_not_hold_up_the_others(server):
    # Far more half-sent requests than --parallel + --queue + 8: each holds a thread of its own.
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(120)]
    try:
        for s in held:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        t = time.time()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        assert time.time() - t < 3
        r = httpx.post(server.url + "/v1/chat/completions", content=BODY, timeout=30)
        assert r.status_code == 200 and time.time() - t < 10
    finally:
        for s in held:
            s.close()


def test_a_stalled_request_is_cut_off(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=40) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        t = time.time()
        data = b""
        while b"\r\n\r\n" not in data and (chunk := s.recv(65536)):
            data += chunk
        took = time.time() - t
    # The read timeout (10 s between packets), not the 30 s it was.
    assert 5 < took < 20, took
    assert data.startswith(b"HTTP/1.1 400"), data[:80]
