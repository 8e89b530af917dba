"""Bad requests, limits, tenants and handles: the right status and a message naming what is wrong."""
import base64
import concurrent.futures as cf
import json
import threading

import httpx
import openai
import pytest

MSG = [{"role": "user", "content": "Once upon a time"}]
KEYS = "key-alice-0123456789abcdef alice\nkey-bob-0123456789abcdef0 bob\n"


def post(server, path, body, key=None, raw=None):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(server.url + path, content=raw if raw is not None else json.dumps(body), headers=headers,
                      timeout=60)


def error_of(r, status, param=None, words=()):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert e["message"] and e["type"]
    if param is not None:
        assert e["param"] == param, e
    for w in words:
        assert w in e["message"], e
    return e


@pytest.mark.parametrize("body,param,words", [
    ({"messages": "hi"}, "messages", ["must be an array"]),
    ({"messages": MSG, "max_tokens": "ten"}, "max_tokens", ["integer"]),
    ({"messages": MSG, "temperature": -1}, "temperature", ["between"]),
    ({"messages": MSG, "stop": 5}, "stop", []),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", ["not supported"]),
    ({"messages": MSG, "qkvshare": {"context": "ctx-1", "colour": "red"}}, "qkvshare.colour", ["not a field"]),
    ({"messages": MSG, "qkvshare": {"context": "qkv1.AAAA"}}, "qkvshare.context", ["bytes"]),
    ({"messages": MSG, "qkvshare": {"context": "nonsense"}}, "qkvshare.context", ["neither"]),
    ({"messages": MSG, "qkvshare": {"kv": "int7"}}, "qkvshare.kv", []),
    ({"messages": MSG, "qkvshare": {"grant_to": "no spaces allowed"}}, "qkvshare.grant_to", []),
])
def test_bad_fields(server, body, param, words):
    error_of(post(server, "/v1/chat/completions", body), 400, param, words)


def test_malformed_and_wrong_shapes(server):
    error_of(post(server, "/v1/chat/completions", None, raw='{"messages": ['), 400, None, ["not valid JSON"])
    error_of(post(server, "/v1/chat/completions", None, raw="[]"), 400, None, ["JSON object"])
    error_of(post(server, "/v1/completions", {"prompt": [1, 10 ** 6]}), 400, "prompt[1]", ["'prompt[1]'", "vocabulary"])
    error_of(post(server, "/v1/chat/completions", {"model": "gpt-4", "messages": MSG}), 404, "model", ["gpt-4"])
    error_of(httpx.get(server.url + "/v1/nothing"), 404, None, ["/v1/nothing"])
    long = [{"role": "user", "content": "Once upon a time " * 400}]
    error_of(post(server, "/v1/chat/completions", {"messages": long}), 400, "messages", ["context"])
    error_of(post(server, "/v1/chat/completions", {"messages": MSG, "qkvshare": {"context": "ctx-0000000000000fff"}}),
             404, "qkvshare.context", ["ctx-0000000000000fff"])
    error_of(post(server, "/v1/chat/completions",
                  {"messages": MSG, "qkvshare": {"context": "ctx-0000000000000fff", "mode": "splice"}}),
             404, "qkvshare.context", ["ctx-0000000000000fff"])
    error_of(post(server, "/v1/chat/completions",
                  {"messages": MSG, "qkvshare": {"context": "ctx-0000000000000fff", "recompute": 0.5}}),
             400, "qkvshare.recompute", ["splice"])
    error_of(post(server, "/v1/chat/completions",
                  {"messages": MSG, "qkvshare": {"context": "ctx-0000000000000fff", "mode": "splice",
                                                 "recompute": 2}}),
             400, "qkvshare.recompute", [])


def test_huge_body_is_413(make_server):
    s = make_server("--max-body-kib", "4")
    r = post(s, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 10000}]})
    error_of(r, 413, None, ["larger", "limit of 4 KiB (--max-body-kib)"])


def test_user_strings_in_messages_keep_what_follows_a_nul(server):
    # The message quotes them with control characters escaped, and goes on after them.
    nul = "\\u0000"
    error_of(post(server, "/v1/chat/completions", {"messages": MSG, "qkvshare": {"context": "ctx-\x00" + "1" * 15}}),
             400, "qkvshare.context", [f"'ctx-{nul}111111111111111'", "is not a context id"])
    error_of(post(server, "/v1/chat/completions", {"messages": MSG, "qkvshare": {"kv": "int\x008"}}),
             400, "qkvshare.kv", [f"'int{nul}8'", "control character"])
    error_of(post(server, "/v1/chat/completions", {"model": "a\x00b", "messages": MSG}),
             404, "model", [f"'a{nul}b'", "does not exist"])
    error_of(post(server, "/v1/chat/completions", {"messages": [{"role": "wiz\x00ard", "content": "Hi"}]}),
             400, "messages[0].role", [f"'wiz{nul}ard'"])
    error_of(httpx.get(server.url + "/v1/contexts/ctx-%00123"), 400, "id", [f"'ctx-{nul}123'", "is not a context id"])


def test_out_of_range_integers_and_null_content(server):
    error_of(post(server, "/v1/chat/completions", None,
                  raw='{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 18446744073709551616}'),
             400, "max_tokens", ["out of range"])
    error_of(post(server, "/v1/chat/completions", {"messages": MSG, "seed": 10 ** 30}), 400, "seed", ["out of range"])
    error_of(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}),
             400, "messages[0].content", ["'messages[0].content' must not be null"])


def test_queue_full_is_429(make_server):
    s = make_server("--parallel", "1", "--queue", "0", "--max-tokens", "400", "--ctx", "512")
    results = []
    def call():
        results.append(post(s, "/v1/completions", {"prompt": "Once", "max_tokens": 400, "temperature": 0,
                                                   "qkvshare": {"reuse": False}}))
    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    codes = sorted(r.status_code for r in results)
    assert 200 in codes and 429 in codes, codes
    error_of(next(r for r in results if r.status_code == 429), 429, None, ["queue is full"])


def test_pool_exhausted_is_503(make_server):
    # A 2 MiB pool: eight live choices of 500 f32 tokens (6.4 MB of KV) cannot
    # get their blocks, and nothing cached is left to evict.
    s = make_server("--pool-mib", "2", "--max-contexts", "8", "--kv", "f32", "--ctx", "512")
    r = post(s, "/v1/completions", {"prompt": "Once", "max_tokens": 500, "n": 8, "temperature": 1})
    error_of(r, 503, None, ["exhausted"])
    m = s.wait_idle()
    assert m["qkvshare_pool_exhausted_total"] >= 1
    assert m['qkvshare_pool_blocks{state="used"}'] == 0  # the failed request gave its blocks back
    ok = post(s, "/v1/completions", {"prompt": "Once", "max_tokens": 20})
    assert ok.status_code == 200, ok.text


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    from conftest import Server
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(KEYS)
    s = Server("--api-key-file", str(path))
    yield s
    s.stop()


def test_api_keys(keyed):
    error_of(post(keyed, "/v1/chat/completions", {"messages": MSG}), 401, None, ["API key"])
    error_of(post(keyed, "/v1/chat/completions", {"messages": MSG}, key="key-alice-0123456789abcdeX"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert post(keyed, "/v1/chat/completions", {"messages": MSG, "max_tokens": 2}, key="key-alice-0123456789abcdef").status_code == 200


def test_tenants_are_isolated(keyed):
    alice, bob = "key-alice-0123456789abcdef", "key-bob-0123456789abcdef0"
    prompt = "Once upon a time, there was a little girl named Lily. She loved to play outside."
    a = post(keyed, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0}, key=alice).json()
    ctx = a["qkvshare"]["context"]
    # Bob's identical prompt does not reuse Alice's KV, cannot see, open or delete her context.
    b = post(keyed, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0}, key=bob).json()
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert ctx["id"] not in [c["id"] for c in httpx.get(keyed.url + "/v1/contexts", headers={"Authorization": f"Bearer {bob}"}).json()["data"]]
    for ref in (ctx["id"], ctx["handle"]):
        error_of(post(keyed, "/v1/completions", {"prompt": " more", "qkvshare": {"context": ref}}, key=bob), 404)
        error_of(httpx.get(keyed.url + f"/v1/contexts/{ref}", headers={"Authorization": f"Bearer {bob}"}), 404)
        error_of(httpx.delete(keyed.url + f"/v1/contexts/{ref}", headers={"Authorization": f"Bearer {bob}"}), 404)
    # An edited handle (one capability byte flipped) is refused even for its tenant
    # (its self checksum catches it; a recomputed checksum meets the HMAC check).
    raw = bytearray(base64.urlsafe_b64decode(ctx["handle"][5:] + "=="))
    raw[210] ^= 1
    forged = "qkv1." + base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")
    error_of(post(keyed, "/v1/completions", {"prompt": " more", "qkvshare": {"context": forged}}, key=alice), 400,
             "qkvshare.context", ["checksum"])
    # Granted to bob, it opens for bob (and only through his handle).
    g = post(keyed, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                         "qkvshare": {"grant_to": ["bob"]}}, key=alice).json()
    bob_handle = g["qkvshare"]["context"]["grants"]["bob"]
    r = post(keyed, "/v1/completions", {"prompt": " Then", "max_tokens": 4, "temperature": 0,
                                         "qkvshare": {"context": bob_handle, "mode": "fork"}}, key=bob).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == g["qkvshare"]["context"]["tokens"]
    assert r["qkvshare"]["reuse"] == {"mode": "fork", "from": g["qkvshare"]["context"]["id"], "automatic": False}


def test_context_handles_endpoints(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    r = c.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=10, temperature=0)
    ctx = r.model_extra["qkvshare"]["context"]
    listed = httpx.get(server.url + "/v1/contexts").json()
    assert ctx["id"] in [x["id"] for x in listed["data"]]
    info = httpx.get(server.url + f"/v1/contexts/{ctx['id']}").json()
    assert info["tokens"] == ctx["tokens"] and info["format"] == "int8" and info["descriptor"]["token_count"] == ctx["tokens"]
    assert httpx.get(server.url + f"/v1/contexts/{ctx['handle']}").json()["id"] == ctx["id"]
    # fork via the endpoint, then continue the fork explicitly: its tokens are all reused.
    f = httpx.post(server.url + f"/v1/contexts/{ctx['id']}/fork", json={"grant_to": ["reviewer"]}).json()
    assert f["id"] != ctx["id"] and f["tokens"] == ctx["tokens"] and "reviewer" in f["grants"]
    cont = c.completions.create(model="stories260K", prompt=" The end.", max_tokens=6, temperature=0,
                                extra_body={"qkvshare": {"context": f["handle"], "mode": "continue"}})
    assert cont.usage.prompt_tokens_details.cached_tokens == f["tokens"]
    assert cont.model_extra["qkvshare"]["reuse"]["mode"] == "continue"
    # continue replaced the fork: its handle is gone; the original is still there.
    assert httpx.get(server.url + f"/v1/contexts/{f['id']}").status_code == 404
    assert httpx.delete(server.url + f"/v1/contexts/{ctx['id']}").json()["deleted"] is True
    error_of(httpx.get(server.url + f"/v1/contexts/{ctx['id']}"), 404)
    error_of(httpx.get(server.url + "/v1/contexts/ctx-zz"), 400, "id")
    error_of(httpx.post(server.url + f"/v1/contexts/{cont.model_extra['qkvshare']['context']['id']}/fork",
                        content='{"grant": 1}'), 400, "grant")


def test_sixteen_clients_and_the_pool_returns_to_empty(make_server):
    s = make_server("--parallel", "8", "--queue", "64")
    def client_run(i):
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        out = []
        for j in range(20):
            kw = dict(model="stories260K", max_tokens=6, temperature=0.8, seed=i * 100 + j)
            if j % 2:
                r = c.chat.completions.create(messages=[{"role": "user", "content": f"Lily and Ben {i} {j}"}], stream=(j % 4 == 1), **kw)
                out.append(list(r) if j % 4 == 1 else r)
            else:
                out.append(c.completions.create(prompt=f"Once upon a time {i}", **kw))
        return out
    with cf.ThreadPoolExecutor(16) as ex:
        results = list(ex.map(client_run, range(16)))
    assert sum(len(r) for r in results) == 320
    m = s.wait_idle()
    assert m['qkvshare_requests_total{route="/v1/completions",status="200"}'] + \
        m['qkvshare_requests_total{route="/v1/chat/completions",status="200"}'] == 320
    for ctx in httpx.get(s.url + "/v1/contexts").json()["data"]:
        assert httpx.delete(s.url + f"/v1/contexts/{ctx['id']}").status_code == 200
    m = s.metrics()
    assert m['qkvshare_pool_blocks{state="used"}'] == 0, m
    assert httpx.get(s.url + "/v1/contexts").json()["data"] == []
