"""What reaches the engine of a request's body (tests/support/proxy_rig.py):
the client's bytes as they came when nothing needs rewriting, a new
encoding when something does (an alias, a stream's usage request, a "model"
key written twice)."""

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


async def test_a_stream_not_asking_for_usage_is_encoded_with_the_usage_request(
        rig: Rig) -> None:
    up = await rig.upstream("a", "stream")
    up.release.set()
    rig.route("small", ("a", up.url))
    raw = b'{"model": "small", "stream": true,  "messages": []}'
    async with rig.http.stream("POST", CHAT, content=raw, headers=AUTH) as r:
        assert r.status_code == 200
        await r.aread()
    (sent,) = up.raw
    assert json.loads(sent) == {"model": "small", "stream": True, "messages": [],
                                "stream_options": {"include_usage": True}}
