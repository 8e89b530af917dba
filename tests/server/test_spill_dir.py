"""`qkvshare serve --spill-dir`: contexts evicted under --cache-mib go to disk and come back exactly."""
import httpx
import openai

START = "Once upon a time, there was a little girl named Lily."


def test_spilled_context_is_restored_and_continues_exactly(make_server, tmp_path):
    spill = tmp_path / "spill"
    # f32 KV (about 1.3 KB a token on stories260K): eight replies of up to 150 tokens pass the
    # 1 MiB budget, and a continuation of one still fits the 512-token context.
    s = make_server("--kv", "f32", "--cache-mib", "1", "--spill-dir", str(spill))
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
    firsts = []
    for i in range(8):
        msg = [{"role": "user", "content": f"{START} Story {i}."}]
        r = c.chat.completions.create(model="stories260K", messages=msg, max_tokens=150, temperature=0,
                                      extra_body={"qkvshare": {"reuse": False}})
        firsts.append((msg, r))
    m = s.wait_idle()
    assert m["qkvshare_tier_spills_total"] >= 1, m
    assert m["qkvshare_tier_disk_contexts"] >= 1
    msg, first = firsts[0]  # the least recently used: spilled first
    ctx = first.model_extra["qkvshare"]["context"]["id"]
    listed = {d["id"]: d for d in httpx.get(s.url + "/v1/contexts").json()["data"]}
    assert listed[ctx]["tier"] == "disk" and listed[ctx]["format"] == "f32"
    assert (spill / f"{ctx}.qkvctx").exists()
    convo = msg + [{"role": "assistant", "content": first.choices[0].message.content},
                   {"role": "user", "content": "The next day, Lily went to the park."}]
    cont = c.chat.completions.create(model="stories260K", messages=convo, max_tokens=20, temperature=0,
                                     extra_body={"qkvshare": {"context": ctx}})
    fresh = c.chat.completions.create(model="stories260K", messages=convo, max_tokens=20, temperature=0,
                                      extra_body={"qkvshare": {"reuse": False}})
    assert cont.model_extra["qkvshare"]["reused_tokens"] > 0
    assert cont.choices[0].message.content == fresh.choices[0].message.content
    m = s.wait_idle()
    assert m["qkvshare_tier_restores_total"] >= 1
    assert m['qkvshare_tier_failures_total{op="spill"}'] == 0
    assert s.stop() == 0, s.stderr
    assert not list(spill.glob("*.qkvctx"))
