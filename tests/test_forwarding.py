"""What reaches the engine of a request's body (tests/support/proxy_rig.py):
the client's bytes as they came when nothing needs rewriting, with the
usage request appended for a stream that named no `stream_options`, a new
encoding when something else does (an alias, a "model" key written twice,
a stream whose `stream_options` said no usage)."""

from __future__ import annotations

import json

from tests.support.proxy_rig import CHAT, CLIENT_KEY, Rig

AUTH = {"Authorization": f"Bearer {CLIENT_KEY}", "Content-Type": "application/json"}


async def test_a_body_needing_no_rewrite_reaches_the_engine_byte_for_byte(rig: Rig) -> None:
    up = await rig.upstream("a")
    rig.route("small", ("a", up.url))
    # Spacing, key order and escapes json.dumps would all change.
    raw = (b'{ "messages":[{"role":"user","content":"caf\\u00e9 \xf0\x9f\x98\x80"}],\n'
           b'  "max_tokens": 8,"model":"small" }')
    r = await rig.http.post(CHAT, content=raw, headers=AUTH)
    assert r.status_code == 200, r.text
    assert up.raw == [raw]


async def test_an_alias_or_a_model_key_written_twice_is_encoded_anew(rig: Rig) -> None:
    up = await rig.upstream("a")
    rig.route("small", ("a", up.url))
    alias = b'{"model":  "tiny", "messages": [{"role": "user", "content": "hi"}]}'
    twice = b'{"model": "other", "model": "small", "messages": []}'
    for raw in (alias, twice):
        r = await rig.http.post(CHAT, content=raw, headers=AUTH)
        assert r.status_code == 200, r.text
    assert [json.loads(b) for b in up.raw] == [
        {"model": "small", "messages": [{"role": "user", "content": "hi"}]},
        {"model": "small", "messages": []}]
    assert up.raw[1].count(b'"model"') == 1  # the engine cannot read the other one


async def test_a_stream_not_asking_for_usage_gets_the_usage_request_appended(
        rig: Rig) -> None:
    up = await rig.upstream("a", "stream")
    up.release.set()
    rig.route("small", ("a", up.url))
    # Spacing, a number's form and an escape json.dumps would all change.
    raw = b'{"model": "small", "stream": true,  "temperature": 0.70, "stop": "\\u00e9",\n' \
          b'"messages": [] }\n'
    async with rig.http.stream("POST", CHAT, content=raw, headers=AUTH) as r:
        assert r.status_code == 200
        await r.aread()
    (sent,) = up.raw
    assert sent == raw[:-3] + b',"stream_options":{"include_usage":true}}'
    assert json.loads(sent) == json.loads(raw) | {"stream_options": {"include_usage": True}}


async def test_a_stream_whose_options_ask_no_usage_is_encoded_with_the_usage_request(
        rig: Rig) -> None:
    up = await rig.upstream("a", "stream")
    up.release.set()
    rig.route("small", ("a", up.url))
    for options in (b"null", b'{"include_usage": false}'):
        raw = b'{"model": "small", "stream": true, "messages": [], "stream_options": %s}' % (
            options)
        async with rig.http.stream("POST", CHAT, content=raw, headers=AUTH) as r:
            assert r.status_code == 200
            await r.aread()
    assert [json.loads(sent) for sent in up.raw] == [
        {"model": "small", "stream": True, "messages": [],
         "stream_options": {"include_usage": True}}] * 2
    assert all(sent.count(b"stream_options") == 1 for sent in up.raw)  # one key, not two
